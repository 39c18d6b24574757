"""Host side of the wire: channels to sandboxes, deadlines, retries, recovery and fallbacks.

``Replica`` owns one sandbox and talks to it: a synchronous channel for control (health, Load, Describe) and an
asyncio channel per event loop for Score (TRL awaits rewards on its own daemon loop; the CLI on another).
``RewardClient`` scores a batch for one reward across its replicas: each replica's share is one Score RPC with a
deadline; transient failures (unavailable, deadline exceeded, resource exhausted) recover the replica (restart it
if it died, reload the functions) and retry only the samples that have no score yet, with exponential backoff
and jitter, moving to the next replica on each attempt. Samples that never scored get the reward's
``default_score`` with status ``unavailable``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from sandbox_image.pb import reward_pb2 as pb
from sandbox_image.pb import reward_pb2_grpc as pb_grpc
from sandbox_image.pools import HARD_TIMEOUT_MARGIN_S
from sandbox_image.server import GRPC_OPTIONS, SERVICE_NAME

from .backends.base import Sandbox
from .errors import BackendError, RewardLoadError
from .spec import RewardSpec, SandboxSettings

log = logging.getLogger("rewardbox")

# gRPC waits 1 s before reconnecting after a failed connect; a sandbox that is starting (or restarting) is up
# well before that, so reconnect quickly.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
TRANSIENT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
STATUS_NAMES = {
    pb.STATUS_OK: "ok",
    pb.STATUS_ERROR: "error",
    pb.STATUS_TIMEOUT: "timeout",
    pb.STATUS_CRASH: "crash",
    pb.STATUS_INVALID: "invalid",
    pb.STATUS_UNAVAILABLE: "unavailable",
}
STATUSES = tuple(STATUS_NAMES.values())  # "ok" first, then every status that falls back


class TransientSandboxError(Exception):
    """One attempt failed in a way a retry may fix; carries the gRPC code (or None for a failed recovery)."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


def function_source(reward: RewardSpec, path: Path) -> pb.FunctionSource:
    """The Load message for a reward, reading its source file now."""
    return pb.FunctionSource(
        name=reward.name,
        filename=str(path),
        source=path.read_text(),
        function=reward.function_name,
        style=pb.STYLE_BATCH if reward.style == "batch" else pb.STYLE_SAMPLE,
        workers=reward.workers,
        concurrency=reward.concurrency,
        max_log_bytes=reward.max_log_bytes,
    )


def _with_sibling_hint(message: str, functions: Sequence[pb.FunctionSource]) -> str:
    """A missing module that is a file beside the reward on the host is not a package: say so."""
    for name in re.findall(r"No module named '([\w.]+)'", message):
        top = name.split(".")[0]
        for f in functions:
            folder = Path(f.filename).parent
            if (folder / f"{top}.py").exists() or (folder / top / "__init__.py").exists():
                message += (f"\n{top!r} is a module beside {f.filename} on the host, but a sandbox receives only "
                            "the reward's own file: inline what it needs, or make it a package (a folder with a "
                            "pyproject.toml) and list that folder in `packages`, e.g. `packages: [./my_helpers]`.")
                break
    return message


class Replica:
    """One sandbox and the channels to it."""

    def __init__(self, sandbox: Sandbox, functions: Sequence[pb.FunctionSource], start_timeout_s: float = 60.0):
        self.sandbox = sandbox
        self.functions = list(functions)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._control: Optional[grpc.Channel] = None
        self._aio: dict[asyncio.AbstractEventLoop, tuple[grpc.aio.Channel, pb_grpc.RewardSandboxStub]] = {}
        self._recover_lock = threading.Lock()
        self._generation = 0  # bumps on every recovery, so concurrent failures recover once

    @property
    def name(self) -> str:
        return self.sandbox.name

    def _control_stub(self) -> pb_grpc.RewardSandboxStub:
        if self._control is None:
            self._control = grpc.insecure_channel(self.sandbox.address, options=CHANNEL_OPTIONS)
        return pb_grpc.RewardSandboxStub(self._control)

    def stub(self) -> pb_grpc.RewardSandboxStub:
        """The asyncio stub for the running loop."""
        loop = asyncio.get_running_loop()
        entry = self._aio.get(loop)
        if entry is None:
            for old in [k for k in self._aio if k.is_closed()]:
                del self._aio[old]
            channel = grpc.aio.insecure_channel(self.sandbox.address, options=CHANNEL_OPTIONS)
            entry = self._aio[loop] = (channel, pb_grpc.RewardSandboxStub(channel))
        return entry[1]

    def healthy(self, timeout_s: float = 2.0) -> bool:
        if not self.sandbox.alive():
            return False
        try:
            self._control_stub()  # make sure the channel exists
            reply = health_pb2_grpc.HealthStub(self._control).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
            )
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_healthy(self) -> None:
        """Blocks until the server answers health checks.

        Raises:
            BackendError: it exited, or is not healthy within start_timeout_s; carries its last log lines.
        """
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.sandbox.alive():
                raise BackendError(f"sandbox {self.name} exited during start-up. Its last output:\n"
                                   f"{self.sandbox.logs()}")
            if self.healthy(timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
            time.sleep(0.05)
        raise BackendError(f"sandbox {self.name} did not become healthy within {self.start_timeout_s:g}s "
                           f"(sandbox.start_timeout_s). Its last output:\n{self.sandbox.logs()}")

    def load(self, functions: Optional[Sequence[pb.FunctionSource]] = None) -> pb.LoadResponse:
        """Loads (or reloads) functions; remembers them for recovery.

        Raises:
            RewardLoadError: a function cannot be used (message names file and line).
            BackendError: the sandbox did not answer.
        """
        functions = list(functions) if functions is not None else self.functions
        try:
            reply = self._control_stub().Load(pb.LoadRequest(functions=functions), timeout=self.start_timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RewardLoadError(_with_sibling_hint(e.details(), functions)) from None
            raise BackendError(f"sandbox {self.name}: Load failed: {e.code().name}: {e.details()}") from e
        by_name = {f.name: f for f in self.functions}
        by_name.update({f.name: f for f in functions})
        self.functions = list(by_name.values())
        return reply

    def describe(self, timeout_s: float = 10.0) -> pb.DescribeResponse:
        return self._control_stub().Describe(pb.DescribeRequest(), timeout=timeout_s)

    def start(self) -> None:
        """Starts the sandbox, waits for health and loads the functions; stops it again if any step fails."""
        self.sandbox.start()
        try:
            self.wait_healthy()
            self.load()
        except BaseException:
            self.stop()
            raise

    def recover(self, seen_generation: int, reload: bool = False) -> None:
        """Brings the sandbox back after a transient failure: restart it (and load the functions) if it is not
        healthy; only reload when asked (the server said a function is not loaded). A healthy server that was
        merely slow is left alone.

        Several callers may fail at once; only the first (by generation) acts.
        """
        with self._recover_lock:
            if self._generation != seen_generation:
                return
            self._generation += 1
            if not self.healthy():
                log.warning("sandbox %s is not healthy; restarting it. Last output:\n%s", self.name,
                            self.sandbox.logs(tail=10))
                self._close_channels()
                self.restarts += 1
                self.sandbox.restart()
                self.wait_healthy()
                reload = True
            if reload:
                self.load()

    @property
    def generation(self) -> int:
        return self._generation

    def _close_channels(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        # aio channels belong to their loops; dropping them lets grpc reconnect on the next call.
        self._aio.clear()

    def stop(self) -> None:
        self._close_channels()
        self.sandbox.stop()


@dataclass
class ScoreReport:
    """What one batch produced for one reward: one entry per sample, in order."""

    name: str
    values: list  # float | None, after fallbacks
    statuses: list  # str
    errors: list  # str | None
    logs: str = ""
    latency_s: float = 0.0
    attempts: int = 0
    restarts: int = 0
    workers_replaced: int = 0

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses if s == status)

    @property
    def fallbacks(self) -> int:
        return sum(1 for s in self.statuses if s != "ok")


@dataclass
class _Pending:
    samples: list
    indices: list
    outcomes: dict = field(default_factory=dict)  # index -> (value, status, error)
    logs: list = field(default_factory=list)
    attempts: int = 0
    workers_replaced: int = 0
    last_error: str = ""


class RewardClient:
    """Scores batches for one reward over its replicas. ``sleep`` is injectable so tests do not wait."""

    def __init__(
        self,
        reward: RewardSpec,
        replicas: Sequence[Replica],
        settings: SandboxSettings,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if not replicas:
            raise ValueError(f"reward {reward.name!r} has no replicas")
        self.reward = reward
        self.replicas = list(replicas)
        self.settings = settings
        self._sleep = sleep
        self._rotation = itertools.count()

    def deadline_s(self, n: int) -> float:
        """Per-attempt deadline for n samples on one replica: the worst case the server allows, plus grace."""
        r = self.reward
        if r.style == "batch":
            serial = 1
        else:
            serial = math.ceil(n / r.workers)
        # A chunk that crashes or hangs is re-run one sample per task, so allow twice the serial time.
        return 2 * serial * (r.timeout_s + HARD_TIMEOUT_MARGIN_S) + self.settings.rpc_grace_s

    async def score(self, samples: Sequence[pb.Sample], trainer_state: Optional[pb.TrainerState] = None) -> ScoreReport:
        """Scores samples; never raises for sandbox or user-code failures.

        Returns:
            A ScoreReport with one value per sample: the real score, or the default_score fallback.
        """
        started = time.monotonic()
        n = len(samples)
        # Sample-style batches are split across replicas; a batch-style call goes whole to the next replica.
        k = 1 if self.reward.style == "batch" else (min(len(self.replicas), n) or 1)
        bounds = [round(i * n / k) for i in range(k + 1)]
        shares = [_Pending(list(samples[a:b]), list(range(a, b))) for a, b in zip(bounds, bounds[1:])]
        first = next(self._rotation)
        await asyncio.gather(
            *(self._score_share(first + i, share, trainer_state) for i, share in enumerate(shares))
        )

        values, statuses, errors = [None] * n, ["unavailable"] * n, [None] * n
        logs, attempts, replaced = [], 0, 0
        for share in shares:
            logs.extend(share.logs)
            attempts = max(attempts, share.attempts)
            replaced += share.workers_replaced
            for i in share.indices:
                value, status, error = share.outcomes.get(
                    i, (None, "unavailable", share.last_error or "sandbox unavailable")
                )
                statuses[i] = status
                errors[i] = error or None
                values[i] = value if status == "ok" else self.reward.default_score
        return ScoreReport(
            name=self.reward.name,
            values=values,
            statuses=statuses,
            errors=errors,
            logs="".join(logs),
            latency_s=time.monotonic() - started,
            attempts=attempts,
            restarts=sum(r.restarts for r in self.replicas),
            workers_replaced=replaced,
        )

    async def _score_share(self, first: int, share: _Pending, trainer_state: Optional[pb.TrainerState]) -> None:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.reward.retries + 1),
            wait=wait_random_exponential(multiplier=self.settings.backoff_initial_s, max=self.settings.backoff_max_s),
            retry=retry_if_exception(lambda e: isinstance(e, TransientSandboxError)),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    replica = self.replicas[(first + share.attempts) % len(self.replicas)]
                    share.attempts += 1
                    await self._attempt(replica, share, trainer_state)
        except Exception as e:  # noqa: BLE001 - training must get a score for every sample, whatever happened
            share.last_error = f"sandbox unavailable after {share.attempts} attempt(s): {e}"
            log.warning("reward %s: %d samples fall back to default_score=%r: %s", self.reward.name,
                        len(share.indices) - len(share.outcomes), self.reward.default_score, share.last_error)

    async def _attempt(self, replica: Replica, share: _Pending, trainer_state: Optional[pb.TrainerState]) -> None:
        todo = [(i, s) for i, s in zip(share.indices, share.samples) if i not in share.outcomes]
        if not todo:
            return
        request = pb.ScoreRequest(
            function=self.reward.name,
            samples=[s for _, s in todo],
            timeout_s=self.reward.timeout_s,
        )
        if trainer_state is not None:
            request.trainer_state.CopyFrom(trainer_state)
            request.has_trainer_state = True
        generation = replica.generation
        try:
            reply = await replica.stub().Score(request, timeout=self.deadline_s(len(todo)))
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in TRANSIENT_CODES or code == grpc.StatusCode.FAILED_PRECONDITION:
                await self._recover(replica, generation, reload=code == grpc.StatusCode.FAILED_PRECONDITION)
                raise TransientSandboxError(f"{replica.name}: {code.name}: {e.details()}", code) from None
            raise BackendError(f"reward {self.reward.name!r}: sandbox {replica.name} refused the request: "
                               f"{code.name}: {e.details()}") from e
        if len(reply.scores) != len(todo):
            raise BackendError(f"sandbox {replica.name} returned {len(reply.scores)} scores for {len(todo)} samples")
        for (i, _), score in zip(todo, reply.scores):
            value = score.value if score.HasField("value") else None
            share.outcomes[i] = (value, STATUS_NAMES.get(score.status, "error"), score.error)
        share.logs.append(reply.logs)
        share.workers_replaced += reply.metrics.workers_replaced

    async def _recover(self, replica: Replica, generation: int, reload: bool) -> None:
        try:
            await asyncio.to_thread(replica.recover, generation, reload)
        except Exception as e:  # noqa: BLE001 - a failed recovery is one more transient failure to retry
            log.warning("reward %s: recovering sandbox %s failed: %s", self.reward.name, replica.name, e)
