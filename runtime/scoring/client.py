"""``RewardClient``: scores a batch for one reward across its replicas, with deadlines, retries and fallbacks.

Each replica's share of a batch is one Score RPC with a deadline. Transient failures (unavailable, deadline
exceeded, resource exhausted) recover the replica (restart it if it died, reload the functions) and retry only the
samples that have no score yet, with exponential backoff and jitter, moving to the next replica on each attempt.
Samples that never scored get the reward's ``default_score`` with status ``unavailable``. Whatever comes back is
checked again here: the host trusts no value it did not validate.

One mechanism waits and tries again (:meth:`RewardClient._backoff`, tenacity's, with full jitter): a retry after a
transient failure, and a wait while a shared service's ``max_in_flight`` budget is full (which uses up no retry).
Each retry of a sample-style share also sends its samples in more parts (:meth:`RewardClient._attempt`): that is how
one attempt is laid out, not a retry of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from ..errors import BackendError, TransportError
from ..spec import RewardSpec, SandboxSettings
from ..wire import CALL_STYLES, HARD_TIMEOUT_MARGIN_S, MAX_MESSAGE_BYTES, Outcome, Status
from ..wire.pb import reward_pb2 as pb
from .replica import Replica

log = logging.getLogger("rewardbox")

_OK, _INVALID = Status.OK, Status.INVALID  # enum attribute lookups cost more than the rest of a sample's check
_OK_WIRE, _UNAVAILABLE_WIRE = Status.OK.wire, Status.UNAVAILABLE.wire
SPLIT = 4  # each retry of a sample-style share sends its unscored samples in this many times more parts
# One call carries samples of at most this share of its sandbox's memory. The sandbox holds a call's samples several
# times over while it scores them (the message, its decoded text, each slot's request), on top of its own processes
# (about 110 MiB with 32 warm ones): a call of 160 MB (40 completions of 4 MB, each of which fits) made a 256 MiB
# sandbox kill its template on every attempt; calls of 16 MiB (1/16) grew its server by up to 100 MiB, and the
# memory guard stopped it in 1 of 9 runs; of 8 MiB, in none of 12.
CALL_MEMORY_FRACTION = 32
MIN_CALL_BYTES = 1 << 20
MAX_CALL_BYTES = MAX_MESSAGE_BYTES // 2  # the sandbox's gRPC limit, with room for what a call adds to its samples


def call_bytes(spec: RewardSpec) -> int:
    """The most bytes of samples one call of ``spec`` carries (CALL_MEMORY_FRACTION of its sandbox's memory)."""
    return min(MAX_CALL_BYTES, max(MIN_CALL_BYTES, spec.memory_bytes // CALL_MEMORY_FRACTION))


def too_much(spec: RewardSpec, size: int, what: str) -> str:
    """The error of a call whose samples (``what``: "this sample is", ...) take ``size`` bytes, past call_bytes."""
    kind = spec.style if spec.style in CALL_STYLES else "reward"
    return (f"{what} {size / (1 << 20):.1f} MiB, more than one call to {kind} {spec.name!r} may carry "
            f"({call_bytes(spec) / (1 << 20):.1f} MiB, 1/{CALL_MEMORY_FRACTION} of its `memory: {spec.memory}`: its "
            f"sandbox holds a call several times over); raise `memory:` of the {kind}")
# CANCELLED reaches the client only when the server ended the call (an overloaded service sheds it): our own
# cancellations end the coroutine instead.
# UNKNOWN: the sandbox server raised what it did not expect (a bug of ours, not the reward's): the call is tried again
# like any other failure of the sandbox, not given up (a broken pipe while a request was written lost whole batches
# after one attempt: red team).
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
                             grpc.StatusCode.UNKNOWN})


class TransientSandboxError(Exception):
    """One attempt failed in a way a retry may fix (``recovered``: the replica was brought back, or needed
    nothing)."""

    def __init__(self, message: str, recovered: bool = True):
        super().__init__(message)
        self.recovered = recovered


class _Deferred(Exception):
    """A shared service deferred some of a call's samples while its max_in_flight budget was full: they are sent
    again after a backoff, which uses up no retry."""


@dataclass
class ScoreReport:
    """What one batch produced for one reward: one entry per sample, in order."""

    name: str
    values: list  # float | None, after fallbacks
    statuses: list  # Status
    errors: list  # str | None
    logs: str = ""
    latency_s: float = 0.0
    # per sample: what the function printed while it scored that sample alone (isolation: sample or process,
    # sample style), else "" (its output is in ``logs`` only)
    sample_logs: list = field(default_factory=list)
    # per sample: how long the function took on it, as its sandbox measured (None: unknown; see pb.Score.seconds)
    sample_seconds: list = field(default_factory=list)
    attempts: int = 0
    restarts: int = 0
    workers_replaced: int = 0

    def count(self, status: Status) -> int:
        return sum(1 for s in self.statuses if s == status)

    @property
    def fallbacks(self) -> int:
        return sum(1 for s in self.statuses if s != Status.OK)


@dataclass
class _Share:
    """One replica's part of a batch, across attempts."""

    samples: list
    indices: list
    details: bool = False  # ask for each sample's own output and time
    outcomes: dict = field(default_factory=dict)  # index -> Outcome
    sample_logs: dict = field(default_factory=dict)  # index -> its own output
    sample_seconds: dict = field(default_factory=dict)  # index -> how long it took
    logs: list = field(default_factory=list)
    attempts: int = 0
    workers_replaced: int = 0
    last_error: str = ""


def checked(score: pb.Score, tool: bool = False) -> Outcome:
    """A sandbox's answer for one sample, re-validated: a value only with status ok, and only a finite float; for a
    ``tool``, its result's text (``Score.result_json``) instead, and only for a tool."""
    if score.status == _OK_WIRE:
        if tool or score.result_json:
            if tool and score.result_json[:1] in ("j", "s"):
                return Outcome(score.result_json, _OK)
            return Outcome(None, _INVALID, "the sandbox answered a tool's result for a reward" if not tool else
                           "the sandbox answered a tool call without its result")
        if not score.HasField("value"):
            return Outcome(None, _OK)
        value = score.value
        if math.isfinite(value):
            return Outcome(value, _OK)
        return Outcome(None, _INVALID, f"the sandbox answered {value} with status ok; expected a finite float or None")
    if score.status == _UNAVAILABLE_WIRE:  # host-only status: no sandbox may claim it
        return Outcome(None, _INVALID, "the sandbox answered status unavailable, which only the host sets")
    return Outcome(None, Status.from_wire(score.status), score.error)


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
        serial = 1 if r.style == "batch" else math.ceil(n / r.workers)
        # A chunk that crashes or hangs is re-run one sample per task, so allow twice the serial time. That also
        # covers a forked sample whose deadline moved by what it waited for a CPU (at most timeout_s + the margin).
        return 2 * serial * (r.timeout_s + HARD_TIMEOUT_MARGIN_S) + self.settings.rpc_grace_s

    async def score(self, samples: Sequence[pb.Sample], trainer_state: Optional[pb.TrainerState] = None,
                    details: bool = False) -> ScoreReport:
        """Scores samples; never raises for sandbox or user-code failures. ``details``: also each sample's own
        output and time, where the sandbox has them (``sample_logs``, ``sample_seconds``).

        Returns:
            A ScoreReport with one value per sample: the real score, or the default_score fallback.
        """
        started = time.monotonic()
        n = len(samples)
        # Sample-style batches are split across replicas; a batch-style call goes whole to the next replica.
        k = 1 if self.reward.style == "batch" else (min(len(self._usable()), n) or 1)
        bounds = [round(i * n / k) for i in range(k + 1)]
        shares = [_Share(list(samples[a:b]), list(range(a, b)), details) for a, b in zip(bounds, bounds[1:])]
        first = next(self._rotation)
        await asyncio.gather(*(self._score_share(first + i, share, trainer_state) for i, share in enumerate(shares)))

        values: list[Optional[float]] = [None] * n
        errors: list[Optional[str]] = [None] * n
        statuses, own_logs = [Status.UNAVAILABLE] * n, [""] * n
        times: list = [None] * n
        logs, attempts, replaced = [], 0, 0
        for share in shares:
            logs.extend(share.logs)
            attempts = max(attempts, share.attempts)
            replaced += share.workers_replaced
            lost = Outcome.failed(Status.UNAVAILABLE, share.last_error or "sandbox unavailable")
            default = self.reward.default_score
            for i in share.indices:
                value, status, error = share.outcomes.get(i, lost)
                statuses[i] = status
                errors[i] = error or None
                values[i] = value if status is _OK else default
                own_logs[i] = share.sample_logs.get(i, "")
                times[i] = share.sample_seconds.get(i)
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
            sample_logs=own_logs,
            sample_seconds=times,
        )

    def _backoff(self, retry: type, stop: Callable[[RetryCallState], bool]) -> AsyncRetrying:
        """The client's one way to wait and try again: exponential backoff from ``backoff_initial_s`` up to
        ``backoff_max_s`` with full jitter (so that ranks that failed together do not come back together), after an
        exception of type ``retry``, until ``stop`` says so; then the last exception is raised."""
        return AsyncRetrying(
            stop=stop,
            wait=wait_random_exponential(multiplier=self.settings.backoff_initial_s, max=self.settings.backoff_max_s),
            retry=retry_if_exception_type(retry),
            sleep=self._sleep,
            reraise=True,
        )

    async def _score_share(self, first: int, share: _Share, trainer_state: Optional[pb.TrainerState]) -> None:
        retrying = self._backoff(TransientSandboxError, stop_after_attempt(self.reward.retries + 1))
        try:
            async for attempt in retrying:
                with attempt:
                    share.attempts += 1
                    await self._attempt(first, share, trainer_state)
        except Exception as e:  # noqa: BLE001 - training must get a score for every sample, whatever happened
            share.last_error = f"sandbox unavailable after {share.attempts} attempt(s): {e}"
            if self.reward.style in CALL_STYLES:
                log.warning("tool %s: a call could not reach its sandbox: %s", self.reward.name, share.last_error)
            else:
                log.warning("reward %s: %d samples fall back to default_score=%r: %s", self.reward.name,
                            len(share.indices) - len(share.outcomes), self.reward.default_score, share.last_error)

    async def _attempt(self, first: int, share: _Share, trainer_state: Optional[pb.TrainerState]) -> None:
        """One attempt at the share's unscored samples. Each retry of a sample-style share sends them in SPLIT times
        more parts than the last (4, 16, 64), over the replicas, so that samples that keep taking their sandbox down
        end up alone: with the default three retries, any four among 16 samples, or one among 64, and the others keep
        their scores. Parts on the same replica go one after another: a sandbox that restarts ends every request in
        flight there, and would take the other parts with it. (Four such samples spread through 16 used to end all
        16 UNAVAILABLE: the same four parts each attempt; red team.)

        Raises:
            TransientSandboxError: some part failed in a way a retry may fix (the parts that scored keep it).
        """
        todo = [(i, s) for i, s in zip(share.indices, share.samples) if i not in share.outcomes]
        if not todo:
            return
        retries = share.attempts - 1
        k = 1 if self.reward.style == "batch" or not retries else min(SPLIT ** retries, len(todo))
        bounds = [round(j * len(todo) / k) for j in range(k + 1)]
        parts = self._fitted([todo[a:b] for a, b in zip(bounds, bounds[1:])], share)
        usable = self._usable()
        lanes: dict = {}  # replica -> its parts, in order
        for j, part in enumerate(parts):
            lanes.setdefault(usable[(first + share.attempts - 1 + j) % len(usable)], []).append(part)

        async def lane(replica: Replica, its_parts: list) -> list:
            failed = []
            for part in its_parts:
                try:
                    await self._request(replica, part, share, trainer_state)
                except TransientSandboxError as e:
                    failed.append(e)
                    if not e.recovered:  # the replica stays down: its other parts wait for the next attempt
                        break
            return failed

        results = await asyncio.gather(*(lane(r, p) for r, p in lanes.items()), return_exceptions=True)
        fatal = [f for f in results if isinstance(f, BaseException)]
        if fatal:
            raise fatal[0]
        transient = [e for failed in results if not isinstance(failed, BaseException) for e in failed]
        if transient:
            raise transient[0]

    def call_bytes(self) -> int:
        """The most bytes of samples one call carries (CALL_MEMORY_FRACTION of the sandbox's memory)."""
        return call_bytes(self.reward)

    def _fitted(self, parts: list, share: _Share) -> list:
        """``parts`` of (index, sample), split further so that no call carries more than :meth:`call_bytes`. A
        sample that alone carries more (or a batch-style call) gets its error here instead: the sandbox would run
        out of memory for it, on every attempt, with the other samples of its call."""
        limit = self.call_bytes()
        fitted = []
        for part in parts:
            sizes = [sample.ByteSize() for _, sample in part]
            total = sum(sizes)
            if total <= limit:
                fitted.append(part)
                continue
            if self.reward.style == "batch":
                failed = Outcome.failed(Status.ERROR, self._too_much(total, "the batch's samples are"))
                for i, _ in part:
                    share.outcomes[i] = failed
                continue
            current: list = []
            held = 0
            for item, size in zip(part, sizes):
                if size > limit:
                    what = "this call's arguments are" if self.reward.style in CALL_STYLES else "this sample is"
                    share.outcomes[item[0]] = Outcome.failed(Status.ERROR, self._too_much(size, what))
                    continue
                if current and held + size > limit:
                    fitted.append(current)
                    current, held = [], 0
                current.append(item)
                held += size
            if current:
                fitted.append(current)
        return fitted

    def _too_much(self, size: int, what: str) -> str:
        return too_much(self.reward, size, what)

    def _usable(self) -> list:
        """The replicas to send to: all but shared services set aside after failing health (all, if none is left)."""
        return [r for r in self.replicas if r.usable()] or self.replicas

    def service_deadline_s(self, n: int) -> float:
        """Deadline of a Score call to a shared service, which retries on its own sandboxes first."""
        r = self.reward
        return (r.retries + 1) * self.deadline_s(n) + r.retries * self.settings.backoff_max_s

    async def _request(self, replica: Replica, todo: list, share: _Share,
                       trainer_state: Optional[pb.TrainerState]) -> None:
        """One Score call for ``todo``, sent again after a backoff for what a shared service deferred while its
        max_in_flight budget was full (waiting for the budget is not a failure and uses up no retry), until that
        wait passes :meth:`max_wait_s`: what is still deferred then ends ``unavailable``.

        Raises:
            TransientSandboxError: the call failed, or a shared service could not score some samples.
        """
        if not replica.shared:  # only a shared service defers samples (see _record): one call, no waiting loop
            await self._call(replica, todo, share, trainer_state)
            return
        max_wait_s = self.max_wait_s(replica)
        waiting = self._backoff(_Deferred, lambda state: state.idle_for >= max_wait_s)
        try:
            async for attempt in waiting:
                with attempt:
                    todo = await self._call(replica, todo, share, trainer_state)
                    if todo:
                        raise _Deferred()
        except _Deferred:
            message = f"{replica.name}: max_in_flight stayed full for {max_wait_s:.0f}s"
            for i, _ in todo:
                share.outcomes[i] = Outcome.failed(Status.UNAVAILABLE, message)

    async def _call(self, replica: Replica, todo: list, share: _Share,
                    trainer_state: Optional[pb.TrainerState]) -> list:
        """One Score call for ``todo``. Returns what a shared service deferred (its budget was full).

        Raises:
            TransientSandboxError: the call failed, or a shared service could not score some samples.
        """
        request = pb.ScoreRequest(function=self.reward.name, samples=[s for _, s in todo],
                                  timeout_s=self.reward.timeout_s, sample_details=share.details)
        if trainer_state is not None:
            request.trainer_state.CopyFrom(trainer_state)
            request.has_trainer_state = True
        generation = replica.generation
        deadline = self.service_deadline_s(len(todo)) if replica.shared else self.deadline_s(len(todo))
        try:
            reply = await replica.score(request, timeout_s=deadline)
        except TransportError as e:
            if replica.shared and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and _over_message_limit(e):
                await self._too_large(replica, todo, share, trainer_state, e)
                return []
            if replica.shared and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return todo
            if e.code in TRANSIENT_CODES or e.code == grpc.StatusCode.FAILED_PRECONDITION:
                log.info("reward %s: attempt %d on sandbox %s failed (%s); recovering and retrying",
                         self.reward.name, share.attempts, replica.name, e)
                recovered = await self._recover(replica, generation,
                                                reload=e.code == grpc.StatusCode.FAILED_PRECONDITION)
                raise TransientSandboxError(f"{replica.name}: {e}", recovered=recovered) from None
            raise BackendError(f"reward {self.reward.name!r}: sandbox {replica.name} refused the request: {e}") from e
        deferred, unscored = self._record(replica, todo, reply, share)
        if unscored:
            raise TransientSandboxError(f"{replica.name}: {unscored} sample(s) unavailable there: {share.last_error}")
        return deferred

    async def _too_large(self, replica: Replica, todo: list, share: _Share,
                         trainer_state: Optional[pb.TrainerState], error: TransportError) -> None:
        """A request larger than the service accepts (``rewardbox serve --max-message-mb``) is sent again in halves
        (a batch-style call cannot be split); a single sample that is still too large gets the error, naming it."""
        if len(todo) > 1 and self.reward.style != "batch":
            half = len(todo) // 2
            await self._request(replica, todo[:half], share, trainer_state)
            await self._request(replica, todo[half:], share, trainer_state)
            return
        message = (f"{replica.name} refused the request as too large ({error.details}): raise `rewardbox serve "
                   "--max-message-mb` there")
        for i, _ in todo:
            share.outcomes[i] = Outcome.failed(Status.ERROR, message)

    def max_wait_s(self, replica: Replica) -> float:
        return float(getattr(replica.sandbox, "max_wait_s", 0.0))

    def _record(self, replica: Replica, todo: list, reply: pb.ScoreResponse, share: _Share) -> tuple[list, int]:
        """Keeps the scores of a reply. Returns the samples a shared service deferred, and how many it could not
        score (left for a retry elsewhere)."""
        if len(reply.scores) != len(todo):
            raise BackendError(f"sandbox {replica.name} returned {len(reply.scores)} scores for {len(todo)} samples")
        outcomes, isfinite, shared = share.outcomes, math.isfinite, replica.shared
        tool = self.reward.style in CALL_STYLES
        deferred, unscored = [], 0
        if share.details:
            for item, score in zip(todo, reply.scores):
                if score.logs:
                    share.sample_logs[item[0]] = score.logs
                if score.HasField("seconds") and math.isfinite(score.seconds):
                    share.sample_seconds[item[0]] = score.seconds
        for item, score in zip(todo, reply.scores):
            # Nearly every sample: status ok with a finite value. checked() handles the rest the same way.
            if score.status == _OK_WIRE and score.HasField("value") and isfinite(score.value) and not tool:
                outcomes[item[0]] = Outcome(score.value, _OK)
            elif shared and score.status == _UNAVAILABLE_WIRE:
                if score.deferred:
                    deferred.append(item)
                else:
                    unscored += 1
                    share.last_error = score.error
            else:
                outcomes[item[0]] = checked(score, tool)
        if reply.logs_in_scores:
            share.logs.extend(score.logs for score in reply.scores if score.logs)
        share.logs.append(reply.logs)
        share.workers_replaced += reply.metrics.workers_replaced
        return deferred, unscored

    async def _recover(self, replica: Replica, generation: int, reload: bool) -> bool:
        """Restarts or reloads the replica where it needs it. Returns whether that worked."""
        try:
            await asyncio.to_thread(replica.recover, generation, reload)
        except Exception as e:  # noqa: BLE001 - a failed recovery is one more transient failure to retry
            log.warning("reward %s: recovering sandbox %s failed: %s", self.reward.name, replica.name, e)
            return False
        return True


def _over_message_limit(error: TransportError) -> bool:
    """gRPC's refusal of a message over the receiver's limit (RESOURCE_EXHAUSTED, as a full budget is)."""
    return "larger than max" in (error.details or "")
