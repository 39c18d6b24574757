"""The reward sandbox gRPC server (started by ``python -m rewardbox.sandbox``, see :mod:`..__main__`).

The same server runs inside a Docker container (docker backend) and as a plain subprocess (local backend). It runs
no reward code: templates import the reward modules and slot processes call them (:mod:`.pools`,
:mod:`..processes.template`, :mod:`..processes.slot`); the supervisor, its child, starts templates. It trusts nothing a
slot process sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from importlib import metadata
from typing import Callable, Iterator, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ...wire import (DEFAULT_CONCURRENCY, DEFAULT_MAX_LOG_BYTES, DEFAULT_WARM, DEFAULT_WORKERS, GRPC_OPTIONS,
                     CALL_STYLES, SERVICE_NAME, STYLE_NAMES, VERSION, Outcome, Status, sandbox_slots,
                     trainer_state_from_wire)
from ...wire.pb import reward_pb2 as pb
from ...wire.pb import reward_pb2_grpc as pb_grpc
from ..protocol.channel import recv, send
from ..protocol.records import SampleBatch, WorkerConfig
from .pools import FunctionPool, LoadError, PoolUnavailable

log = logging.getLogger("rewardbox.sandbox")

_ISOLATION_NAMES = {pb.ISOLATION_UNSPECIFIED: "sample", pb.ISOLATION_SAMPLE: "sample", pb.ISOLATION_WORKER: "worker",
                    pb.ISOLATION_PROCESS: "process"}


def _info(fp: FunctionPool) -> pb.FunctionInfo:
    return pb.FunctionInfo(
        name=fp.name,
        filename=fp.filename,
        function=fp.function,
        style=pb.Style.Value(f"STYLE_{fp.style.upper()}"),
        is_async=fp.info.is_async,
        signature=fp.info.signature,
        source_sha256=hashlib.sha256(fp.config.source.encode()).hexdigest(),
        accepted_keywords=list(fp.info.accepted_keywords),
        accepts_var_keywords=fp.info.accepts_var_keywords,
        required_keywords=list(fp.info.required_keywords),
    )


def _results(result, tool: bool) -> None:
    """Checks, in place, that a call's answers carry a tool's result (text in the value's place:
    :mod:`..protocol.codec`) exactly where they must: each ok answer of a tool, no answer of a reward. Either way round
    is the sample's ``invalid`` (the worker is hostile: it may answer anything the format allows)."""
    for i, (value, status) in enumerate(zip(result.values, result.statuses)):
        if status is not Status.OK or isinstance(value, str) == tool:
            continue
        failed = Outcome.failed(Status.INVALID, "the worker answered a tool's result for a reward" if not tool
                                else "the worker answered a score for a tool")
        result.values[i], result.statuses[i], result.errors[i] = failed


def _config(fn: pb.FunctionSource, default_warm: int) -> WorkerConfig:
    return WorkerConfig(
        name=fn.name,
        filename=fn.filename,
        source=fn.source,
        function=fn.function or fn.name,
        style=STYLE_NAMES[fn.style],
        isolation=_isolation(fn),
        workers=fn.workers or DEFAULT_WORKERS,
        concurrency=fn.concurrency or DEFAULT_CONCURRENCY,
        max_log_bytes=fn.max_log_bytes or DEFAULT_MAX_LOG_BYTES,
        warm=fn.warm or default_warm,
        args_json=fn.args_json,
    )


def _isolation(fn: pb.FunctionSource) -> str:
    """How the template runs the function: an environment's slot process holds one episode and serves its calls
    (then it is ended: template.py); a tool's call (but under isolation: worker) takes a slot process prepared
    ahead for it alone, ended after its answer ("call"); a reward's as its isolation says."""
    if fn.style == pb.STYLE_ENVIRONMENT:
        return "worker"
    isolation = _ISOLATION_NAMES.get(fn.isolation, "sample")
    return "call" if fn.style == pb.STYLE_TOOL and isolation != "worker" else isolation


class Supervisor:
    """The server's handle on its supervisor process: it starts templates (which the server cannot: it holds no
    right to switch uids)."""

    def __init__(self, pid: int, sock: socket.socket, nproc: Optional[int] = None, memory: Optional[int] = None):
        """``nproc``: RLIMIT_NPROC of each slot uid (None on the local backend, where slots share the trainer's
        uid and the limit would count all of its processes); ``memory``: RLIMIT_AS of each slot process."""
        self.pid, self.sock = pid, sock
        self.nproc, self.memory = nproc, memory
        self.alive = True
        self._lock = asyncio.Lock()
        self._sending = threading.Lock()  # a spawn's request (from a thread) and tell()'s are written whole

    def tell(self, message: dict) -> None:
        """Sends the supervisor a message it answers nothing to (see _Activity)."""
        with self._sending:
            with contextlib.suppress(OSError):
                send(self.sock, message)

    def _spawn_blocking(self, config: WorkerConfig, slots: int) -> tuple[socket.socket, int]:
        with self._sending:
            send(self.sock, {"op": "template", "config": asdict(config), "slots": slots, "nproc": self.nproc,
                             "memory": self.memory})
        reply, fds = recv(self.sock)
        if "error" in reply or not fds:
            raise PoolUnavailable(f"reward {config.name!r}: the supervisor could not start it: "
                                  f"{reply.get('error', 'no socket')}")
        return socket.socket(fileno=fds[0]), int(reply["slots"])

    async def spawn(self, config: WorkerConfig) -> tuple[socket.socket, int]:
        if not self.alive:
            raise PoolUnavailable("the sandbox's supervisor process is gone")
        async with self._lock:
            try:
                return await asyncio.to_thread(self._spawn_blocking, config,
                                               sandbox_slots(config.isolation, config.workers, config.warm,
                                                             config.style))
            except (OSError, ValueError) as e:
                raise PoolUnavailable(f"the sandbox's supervisor process is gone ({e})") from None


QUIET_AFTER_S = 0.2  # no call in flight for this long: the sandbox is quiet (see _Activity)


class _Activity:
    """Tells the supervisor's memory guard when the sandbox has had no call in flight (a load, a score, a tool's or
    an episode's call) for QUIET_AFTER_S, and when the next one starts: its reads cost several file reads each
    (under gVisor, at its usual pace, about 4 % of a CPU per idle sandbox), and between calls nothing of a sample
    runs (:meth:`..memory.memory_guard.Guard.quiet`). Calls back to back send nothing. A sandbox with an
    environment is never quiet: its episodes' processes live, and may run, between their calls."""

    def __init__(self, supervisor: Supervisor, held_open: Callable[[], bool]):
        self.supervisor, self.held_open = supervisor, held_open
        self.in_flight = 0
        self.quiet = False
        self._timer: Optional[asyncio.TimerHandle] = None

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.quiet:
            self.quiet = False
            self.supervisor.tell({"op": "quiet", "quiet": False})
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._timer = asyncio.get_running_loop().call_later(QUIET_AFTER_S, self._settle)

    def _settle(self) -> None:
        self._timer = None
        if not self.in_flight and not self.quiet and not self.held_open():
            self.quiet = True
            self.supervisor.tell({"op": "quiet", "quiet": True})


class RewardSandboxServicer(pb_grpc.RewardSandboxServicer):
    """Holds the loaded functions; the processes behind them live in FunctionPool."""

    def __init__(self, supervisor: Supervisor, default_warm: int = DEFAULT_WARM,
                 health: Optional[HealthServicer] = None) -> None:
        self.supervisor = supervisor
        self.default_warm = default_warm
        self.health = health
        self.functions: dict[str, FunctionPool] = {}
        self.activity = _Activity(supervisor, lambda: any(fp.style == "environment"
                                                          for fp in self.functions.values()))
        self._load_lock = asyncio.Lock()
        # Done with NOT_SERVING: requests in flight end UNAVAILABLE (see Score). A future every request waits on
        # beside its work, where an Event's wait() would start a task per request.
        self.gone: asyncio.Future = asyncio.get_running_loop().create_future()

    async def _start(self, config: WorkerConfig, budget_s: float) -> FunctionPool:
        loop = asyncio.get_running_loop()

        def on_broken(why: str) -> None:
            loop.create_task(self.broken(why))

        try:
            return await FunctionPool.start(config, self.supervisor.spawn, budget_s, on_broken=on_broken)
        except PoolUnavailable as e:
            await self.broken(str(e))
            raise

    async def broken(self, why: str) -> None:
        """This sandbox cannot run its rewards any more: NOT_SERVING, so the host replaces it."""
        log.error("reporting NOT_SERVING: %s", why)
        if not self.gone.done():
            self.gone.set_result(None)
        if self.health is not None:
            for service in ("", SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        with self.activity.call():
            return await self._load(request, context)

    async def _load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        async with self._load_lock:
            errors: list[str] = []
            configs = []
            for fn in request.functions:
                if fn.style not in STYLE_NAMES:
                    errors.append(f"{fn.filename}: reward {fn.name!r} has no style")
                else:
                    configs.append(_config(fn, self.default_warm))
            # Importing may take as long as the caller's deadline allows (a model loaded at module level).
            remaining = context.time_remaining()
            budget = max(1.0, remaining - 1.0) if remaining is not None else 60.0
            outcomes = await asyncio.gather(*(self._start(c, budget) for c in configs), return_exceptions=True)
            started = [o for o in outcomes if isinstance(o, FunctionPool)]
            unavailable = [o for o in outcomes if isinstance(o, PoolUnavailable)]
            errors += [str(o) if isinstance(o, LoadError) else repr(o) for o in outcomes
                       if isinstance(o, BaseException) and not isinstance(o, PoolUnavailable)]
            if errors or unavailable:
                for fp in started:
                    fp.close()
                if errors:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "\n".join(errors))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "\n".join(map(str, unavailable)))
            for fp in started:
                old = self.functions.get(fp.name)
                self.functions[fp.name] = fp
                if old is not None:
                    old.retire()
                log.info("loaded %s from %s (isolation: %s)", fp.name, fp.filename, fp.config.isolation)
            return pb.LoadResponse(functions=[_info(fp) for fp in started])

    async def _pool(self, name: str, context: grpc.aio.ServicerContext) -> FunctionPool:
        """The function's pool; one whose template died is started again (the same version)."""
        fp = self.functions.get(name)
        if fp is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reward {name!r} is not loaded here (loaded: {', '.join(self.functions) or 'none'})",
            )
        assert fp is not None  # context.abort raised
        if fp.dead is not None:
            async with self._load_lock:
                if self.functions.get(name) is fp:
                    log.warning("reward %s: %s; starting it again", name, fp.dead)
                    try:
                        fresh = await self._start(fp.config, 60.0)
                    except (LoadError, PoolUnavailable) as e:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"reward {name!r} cannot run here: {e}")
                    self.functions[name] = fresh
                fp = self.functions[name]
        return fp

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        with self.activity.call():
            return await self._score(request, context)

    async def _score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        if request.timeout_s <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be positive")
        fp = await self._pool(request.function, context)
        started = time.monotonic()
        samples = request.samples
        batch = SampleBatch(
            prompts=[s.prompt for s in samples],
            completions=[s.completion for s in samples],
            columns_json=[s.columns_json for s in samples],
            prompt_messages_json=[s.prompt_messages_json for s in samples],
            completion_messages_json=[s.completion_messages_json for s in samples],
            # Token ids only for a function that takes them: they are the largest part of a request otherwise.
            completion_ids=[list(s.completion_ids) if s.has_completion_ids else None for s in samples]
            if "completion_ids" in fp.info.accepted_keywords and any(s.has_completion_ids for s in samples)
            else None,
        )
        state = trainer_state_from_wire(request.trainer_state) if request.has_trainer_state else None
        # A sandbox that stops (its supervisor ended: the memory guard stopped every sample's processes, or it
        # died) answers what is in flight UNAVAILABLE, which the host scores again elsewhere, rather than waiting
        # for processes that will not run again, or reporting their end as the samples' own crash.
        if fp.style == "environment":
            # The instance's last episode ends first: nothing of it may live beside the one it starts (its template
            # starts no episode before the ended process is gone and found to have left nothing).
            if request.episode_end:
                fp.end_episode(request.episode_end)
            if not samples:  # only the end of an episode
                return pb.ScoreResponse()
            if len(samples) != 1 or not request.episode:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an environment's request is one call of one "
                                                                      "episode")
            work = fp.call_episode(batch, request.timeout_s, request.episode, request.episode_start)
        else:
            work = fp.score(batch, request.timeout_s, state)
        scoring = asyncio.ensure_future(work)
        try:
            await asyncio.wait({scoring, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller went away: as an awaited fp.score would be, it is cancelled
            scoring.cancel()
            raise
        if not scoring.done():
            scoring.cancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this sandbox stopped (its log says why); the host "
                                                             "replaces it")
        try:
            result = scoring.result()
        except PoolUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        in_scores = False
        _results(result, fp.style in CALL_STYLES)
        if request.sample_details:
            n = len(result.values)
            own = len(result.sample_logs) == n and fp.style != "batch"  # each sample's output is its own
            in_scores = own and not result.shared_logs
            alone = result.sample_logs if own else [""] * n
            times = result.sample_seconds if len(result.sample_seconds) == n else [None] * n
            scores = [
                pb.Score(result_json=value, status=status.wire, logs=own, seconds=took) if isinstance(value, str)
                else pb.Score(value=value, status=status.wire, error=error, logs=own, seconds=took)
                if value is not None and status == Status.OK
                else pb.Score(status=status.wire, error=error, logs=own, seconds=took)
                for value, status, error, own, took in zip(result.values, result.statuses, result.errors, alone,
                                                           times)
            ]
        else:
            scores = [
                pb.Score(result_json=value, status=status.wire) if isinstance(value, str)
                else pb.Score(value=value, status=status.wire, error=error)
                if value is not None and status == Status.OK
                else pb.Score(status=status.wire, error=error)
                for value, status, error in zip(result.values, result.statuses, result.errors)
            ]
        if in_scores:  # the call's output is the samples' own, in order: not sent twice (see ScoreResponse)
            result.log_parts = []
        if result.dropped:
            result.log_parts.append(f"\n[rewardbox: {result.dropped} more characters of output dropped]\n")
        return pb.ScoreResponse(
            scores=scores,
            logs=result.logs,
            logs_in_scores=in_scores,
            logs_truncated=result.dropped > 0,
            metrics=pb.Metrics(
                elapsed_ms=(time.monotonic() - started) * 1000,
                workers_replaced=result.workers_replaced,
                isolated_reruns=result.isolated_reruns,
            ),
        )

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"])
        return pb.DescribeResponse(
            server_version=VERSION,
            python_version=platform.python_version(),
            platform=f"{sys.platform}-{platform.machine()}",
            functions=[_info(fp) for fp in self.functions.values()],
            packages=packages,
        )

    def close(self) -> None:
        for fp in self.functions.values():
            fp.close()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
LARGE_BLOCK_BYTES = 256 << 10


def _return_large_blocks() -> None:
    """Every block of LARGE_BLOCK_BYTES or more that the server allocates (a call's completions, as received, parsed,
    decoded and sent on) is a mapping of its own, given back to the kernel when freed. glibc's default raises that
    threshold to the largest block freed so far (up to 32 MiB): the next call's blocks then came from a heap that
    grew and was not given back, and a 256 MiB sandbox's server stayed 130 MiB larger after a few calls of 16 MiB,
    until the memory guard stopped the sandbox."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):  # glibc (the sandbox image); not musl
        libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * LARGE_BLOCK_BYTES)


async def serve(listen: str, supervisor: Supervisor, parent_pid: Optional[int] = None, grace_s: float = 2.0,
                default_warm: Optional[int] = None) -> None:
    """Serves until SIGTERM/SIGINT, or until ``parent_pid`` exits (local backend: never outlive the trainer).
    Health turns NOT_SERVING when the supervisor is gone, so the host replaces the sandbox."""
    if listen.startswith("unix://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen[len("unix://") :])
    supervisor.sock.setblocking(True)
    _return_large_blocks()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health = HealthServicer()
    servicer = RewardSandboxServicer(supervisor, default_warm or DEFAULT_WARM, health)
    pb_grpc.add_RewardSandboxServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    # Only this uid may connect: a socket created 0600 (its directory is the server's alone, too).
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(listen)
        await server.start()
    finally:
        os.umask(old_umask)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("rewardbox sandbox %s serving on %s", VERSION, listen)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch() -> None:
        while True:
            if parent_pid and os.getppid() != parent_pid:
                log.warning("parent process %d is gone; shutting down", parent_pid)
                stop.set()
                return
            if supervisor.alive:
                try:
                    pid, _ = os.waitpid(supervisor.pid, os.WNOHANG)
                except ChildProcessError:
                    pid = supervisor.pid
                if pid == supervisor.pid:
                    supervisor.alive = False
                    await servicer.broken("the supervisor process is gone")
            await asyncio.sleep(0.5)

    watcher = asyncio.ensure_future(watch())
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        await health.enter_graceful_shutdown()
        await server.stop(grace_s)
        servicer.close()

