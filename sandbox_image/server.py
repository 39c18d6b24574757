"""The reward sandbox gRPC server: ``python -m rewardbox.sandbox.server --listen unix:///run/rewardbox/grpc.sock``.

The same server runs inside a Docker container (docker backend) and as a plain subprocess (local backend).
User code never runs in this process: it runs in worker processes (see :mod:`rewardbox.sandbox.pools`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import platform
import signal
import sys
import time
from importlib import metadata
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ..wire import GRPC_OPTIONS, SERVICE_NAME, Status, trainer_state_from_wire
from ..wire.pb import reward_pb2 as pb
from ..wire.pb import reward_pb2_grpc as pb_grpc
from . import __version__, worker
from .pools import FunctionPool
from .records import SampleBatch

log = logging.getLogger("rewardbox.sandbox")

_STYLE_NAMES = {pb.STYLE_SAMPLE: "sample", pb.STYLE_BATCH: "batch"}


def _info(fp: FunctionPool) -> pb.FunctionInfo:
    return pb.FunctionInfo(
        name=fp.name,
        filename=fp.filename,
        function=fp.function,
        style=pb.STYLE_BATCH if fp.style == "batch" else pb.STYLE_SAMPLE,
        is_async=fp.info.is_async,
        signature=fp.info.signature,
        source_sha256=fp.source_sha256,
        accepted_keywords=list(fp.info.accepted_keywords),
        accepts_var_keywords=fp.info.accepts_var_keywords,
    )


class RewardSandboxServicer(pb_grpc.RewardSandboxServicer):
    """Holds the loaded functions; all process handling lives in FunctionPool."""

    def __init__(self) -> None:
        self.functions: dict[str, FunctionPool] = {}
        self._load_lock = asyncio.Lock()

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        async with self._load_lock:
            started: list[FunctionPool] = []
            errors: list[str] = []
            for fn in request.functions:
                if fn.style not in _STYLE_NAMES:
                    errors.append(f"{fn.filename}: reward {fn.name!r} has no style")
                    continue
                fp = FunctionPool.start(
                    name=fn.name,
                    filename=fn.filename,
                    source=fn.source,
                    function=fn.function or fn.name,
                    style=_STYLE_NAMES[fn.style],
                    workers=fn.workers,
                    concurrency=fn.concurrency,
                    max_log_bytes=fn.max_log_bytes,
                )
                started.append(fp)
            # Importing may take as long as the caller's deadline allows (a model loaded at module level).
            remaining = context.time_remaining()
            budget = max(1.0, remaining - 1.0) if remaining is not None else 60.0
            try:
                described = await asyncio.gather(*(fp.describe(budget) for fp in started), return_exceptions=True)
            except BaseException:  # the caller went away (cancelled): these pools will never serve
                for fp in started:
                    fp.close(wait=False)
                raise
            for fp, outcome in zip(started, described):
                if isinstance(outcome, BaseException):
                    errors.append(str(outcome) if isinstance(outcome, worker.LoadError) else repr(outcome))
            if errors:
                for fp in started:
                    fp.close(wait=False)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "\n".join(errors))
            for fp in started:
                old = self.functions.get(fp.name)
                self.functions[fp.name] = fp
                if old is not None:
                    old.retire()
                log.info("loaded %s from %s (%s)", fp.name, fp.filename, fp.source_sha256[:12])
            return pb.LoadResponse(functions=[_info(fp) for fp in started])

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        fp = self.functions.get(request.function)
        if fp is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reward {request.function!r} is not loaded here (loaded: {', '.join(self.functions) or 'none'})",
            )
        if request.timeout_s <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be positive")
        started = time.monotonic()
        samples = request.samples
        batch = SampleBatch(
            prompts=[s.prompt for s in samples],
            completions=[s.completion for s in samples],
            examples=[dict(s.example) for s in samples],
            prompt_messages_json=[s.prompt_messages_json for s in samples],
            completion_messages_json=[s.completion_messages_json for s in samples],
        )
        state = trainer_state_from_wire(request.trainer_state) if request.has_trainer_state else None
        result = await fp.score(batch, request.timeout_s, state)
        scores = [
            pb.Score(value=value, status=status.wire, error=error)
            if value is not None and status == Status.OK
            else pb.Score(status=status.wire, error=error)
            for value, status, error in zip(result.values, result.statuses, result.errors)
        ]
        logs = result.logs
        if result.dropped:
            logs += f"\n[rewardbox: {result.dropped} more characters of output dropped]\n"
        return pb.ScoreResponse(
            scores=scores,
            logs=logs,
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
            server_version=__version__,
            python_version=platform.python_version(),
            platform=f"{sys.platform}-{platform.machine()}",
            functions=[_info(fp) for fp in self.functions.values()],
            packages=packages,
        )

    def close(self) -> None:
        for fp in self.functions.values():
            fp.close(wait=False)


async def serve(listen: str, parent_pid: Optional[int] = None, grace_s: float = 2.0) -> None:
    """Serves until SIGTERM/SIGINT, or until ``parent_pid`` exits (local backend: never outlive the trainer)."""
    if listen.startswith("unix://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen[len("unix://") :])
    server = grpc.aio.server(options=GRPC_OPTIONS)
    servicer = RewardSandboxServicer()
    pb_grpc.add_RewardSandboxServicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    server.add_insecure_port(listen)
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("rewardbox sandbox %s serving on %s", __version__, listen)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_parent() -> None:
        while parent_pid and os.getppid() == parent_pid:
            await asyncio.sleep(0.5)
        if parent_pid:
            log.warning("parent process %d is gone; shutting down", parent_pid)
            stop.set()

    watcher = asyncio.ensure_future(watch_parent())
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        await health.enter_graceful_shutdown()
        await server.stop(grace_s)
        servicer.close()


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rewardbox.sandbox.server", description=__doc__)
    parser.add_argument("--listen", required=True, help="unix:///path/to.sock or host:port")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.parent_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
