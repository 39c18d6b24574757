"""The server's side of one loaded function version: its template process and the requests that run on it.

Each request carries some samples to one slot process over a socket pair of its own (:mod:`..protocol.codec`): the
worker writes a start byte when it takes the request, then its answer. The server starts the request's deadline at that
byte, reads at most the answer's bound, and parses it strictly; a worker that runs past its deadline is killed by
the template, one that dies without answering is ``crash`` with the exit status the template reports.

- ``isolation: sample``: each sample (a batch-style call: the whole batch) runs in a process of its own, forked from
  a slot process that runs no reward code on data (:mod:`..processes.forked`), so each starts from the reward module's
  state after import; a request carries many samples. Where slot processes cannot fork (gVisor, the local backend) and
  under ``isolation: process``, every sample is a request of its own, in a fresh slot process. ``workers`` requests
  run at once (``workers * concurrency`` for async functions), on processes forked ahead.
- ``isolation: worker``: a batch is cut into one chunk per worker; a chunk whose worker crashed or hung is re-run
  one sample per request, so only the guilty sample gets ``crash`` or ``timeout``.
- Batch style, either way: a call that crashed or hung is re-run one sample at a time to find the guilty samples;
  the innocent ones are then scored together, as one batch, without them.
- A sample (streamed: sample or process isolation) whose process died while the kernel's OOM killer acted in the
  sandbox is scored once more, after the call's other samples, one such sample at a time (:func:`oom_kills`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from ...wire import HARD_TIMEOUT_MARGIN_S, Outcome, Status, TrainerState
from ..memory import memory_use
from ..processes import cpu_wait
from ..protocol import codec, stream
from ..protocol.channel import ChannelClosed, recv, send
from ..protocol.records import BatchResult, ChunkResult, FunctionInfo, SampleBatch, WorkerConfig

log = logging.getLogger("rewardbox.sandbox")

_READ_CHUNK = 1 << 16


class PoolUnavailable(Exception):
    """The function's processes cannot take requests (its template is gone, or no slot could be prepared)."""


class LoadError(Exception):
    """The module or function cannot be used; the message names the file, line and fix."""


@dataclass
class _Exit:
    status: str
    event: asyncio.Event = field(default_factory=asyncio.Event)


# Isolations whose slot processes answer a request whole (:func:`..processes.slot._handle`), not streamed: "worker",
# and a tool's "call" (a process prepared for one call, which its template ends after it: server._isolation).
WORKER_ANSWERS = ("worker", "call")


def _hung_or_crashed(done: Optional[ChunkResult], failed: Optional[Outcome]):
    """A batch-style call whose answer times out every sample hung (its own soft timeout answered): the same as a
    worker killed at its deadline. One whose answer is a crash for every sample died (a forked call's child: its
    slot process answers for it, :mod:`..processes.forked`): the same as a worker that died."""
    if done is not None and done.statuses:
        for status in (Status.TIMEOUT, Status.CRASH):
            if all(s == status for s in done.statuses):
                return None, Outcome.failed(status, done.errors[0])
    return done, failed


MAX_CHUNK = 4096  # samples in one forked request
WAITED_SLACK_S = 0.002  # a forked unit's deadline moves in whole milliseconds, rounded up (stream.waited)
OOM_TWICE = ("the kernel's OOM killer acted in this sandbox while it ran, in both of its attempts: the sandbox's "
             "memory ran out (this sample's processes, or other samples' beside it, filled it faster than the memory "
             "guard reads); raise `memory:` or lower `workers:` of the reward")


def _crashed(outcome) -> bool:
    """Whether a unit's outcome (a one-sample ChunkResult, or an Outcome) is a crash."""
    if isinstance(outcome, ChunkResult):
        return outcome.statuses[:1] == [Status.CRASH]
    return outcome.status is Status.CRASH


def _error(outcome) -> str:
    return (outcome.errors[0] if isinstance(outcome, ChunkResult) else outcome.error) or "crash"


def _killed_twice(outcome) -> Outcome:
    """The final outcome of a sample whose process died while the kernel's OOM killer acted, in its second attempt
    too (the first is scored again: see oom_kills)."""
    return Outcome.failed(Status.CRASH, f"{_error(outcome)}; {OOM_TWICE}")


@functools.cache
def _usage() -> Optional[memory_use.Usage]:
    """The sandbox's memory cgroup (:func:`..memory.memory_use.find_usage`), found once."""
    return memory_use.find_usage()


# What the server keeps of one call's output and error texts (samples of isolation: sample and process are answered
# one by one, each with up to max_log_bytes of output and 8 KiB of error): this share of the sandbox's memory,
# counted as each answer arrives (_OutputBudget). While it replies the server holds them about four times over (the
# texts, joined, in the reply, serialized: 1,200 samples printing 64 KiB with a 16 MiB budget grew it 61 MiB).
# 2,600 such samples, with none of this, took the server to 326 MiB, and the memory guard killed a 300 MiB innocent
# for it (red team); the guard now counts the server's growth as no sample's (memory_guard.Guard._grown).
OUTPUT_BUDGET_FRACTION = 128
MIN_OUTPUT_BUDGET = 4 << 20
UNLIMITED_OUTPUT_BUDGET = 64 << 20  # where the sandbox has no memory limit
KEPT_ERROR_CHARS = 1000  # of each error text once the budget is spent (its end: a traceback's last lines)


def output_budget() -> int:
    """Bytes of a call's output and error texts (as the server holds them) that the server keeps."""
    usage = _usage()
    if usage is None:
        return UNLIMITED_OUTPUT_BUDGET
    return max(MIN_OUTPUT_BUDGET, usage.limit // OUTPUT_BUDGET_FRACTION)


def _text_bytes(answer: ChunkResult) -> int:
    return sys.getsizeof(answer.logs) + sum(sys.getsizeof(e) for e in answer.errors if e)


class _OutputBudget:
    """What the server keeps of one call's output and error texts, counted as each answer arrives: kept until the
    request ends, a request's answers grew the server by all its samples' output (1,200 samples printing 64 KiB:
    76 MiB, where the call kept 16)."""

    def __init__(self, budget: int):
        self.budget, self.kept = budget, 0

    def keep(self, answer: ChunkResult) -> ChunkResult:
        if not (answer.logs or any(answer.errors)):
            return answer
        size = _text_bytes(answer)
        if self.kept + size > self.budget:
            answer = _over_budget(answer, self.budget)
            size = _text_bytes(answer)
        self.kept += size
        return answer


def _over_budget(answer: ChunkResult, budget: int) -> ChunkResult:
    """``answer`` without its output, and with the end of its error texts only: the call's samples printed more
    than the server keeps of one call."""
    note = (f"[rewardbox dropped this sample's output ({len(answer.logs)} characters): the call's samples printed "
            f"more than the {budget >> 20} MiB a sandbox keeps of one call]\n") if answer.logs else ""
    errors = [e[-KEPT_ERROR_CHARS:] if e else e for e in answer.errors]
    return ChunkResult(answer.values, answer.statuses, errors, note, answer.dropped + len(answer.logs),
                       answer.seconds)


def oom_kills() -> Optional[int]:
    """How many processes the kernel's OOM killer killed in this sandbox so far (None: it does not say: gVisor,
    where the host's OOM killer takes the whole sandbox and the host scores its samples again, or no limit).

    The memory guard kills the sample whose processes hold the most before the limit, but a burst can outrun its
    reads; the kernel then kills the largest process, which may be an innocent beside a sample that spread its
    memory over many small forks (red team: 32 forks of 20 MiB at once beside a 380 MiB sample, 1 batch of 6). A
    sample whose process died while the kernel's OOM killer acted is scored again, once, after the call's others."""
    usage = _usage()
    try:
        return usage.oom_kills() if usage is not None else None
    except (OSError, ValueError):
        return None


class _Ended(Exception):
    """The worker closed its end of the request's socket (or it was reset)."""


class _Receiver:
    """What arrives on a request's socket, read within a deadline."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.sock, self.loop = sock, loop

    async def __call__(self, end: float, most: int = _READ_CHUNK) -> bytes:
        """At least one byte and at most ``most``, by ``end`` (the loop's clock).

        Raises: _Ended (end of stream), asyncio.TimeoutError."""
        while True:
            try:
                chunk = self.sock.recv(most)
            except (BlockingIOError, InterruptedError):
                await self._readable(end)
                continue
            except OSError:  # reset by a dying worker
                raise _Ended() from None
            if not chunk:
                raise _Ended()
            return chunk

    async def _readable(self, end: float) -> None:
        """Waits until the socket is readable, by ``end``. Forked, every sample's answer is waited for alone: this
        costs a reader and a timer, where ``wait_for(sock_recv(...))`` would start a task as well (a worker's start
        byte and answer are read the same way, for the same reason).

        Raises: asyncio.TimeoutError."""
        ready = self.loop.create_future()

        def settle(readable: bool) -> None:
            if not ready.done():
                ready.set_result(readable)

        fd = self.sock.fileno()
        self.loop.add_reader(fd, settle, True)
        timer = self.loop.call_at(end, settle, False)
        try:
            if not await ready:
                raise asyncio.TimeoutError()
        finally:
            timer.cancel()
            self.loop.remove_reader(fd)


@dataclass
class _Streamed:
    """What a streamed request settled: answers of its first units, in order; the status of the unit after them
    when it failed; whether the process that served it must be retired."""

    answered: list = field(default_factory=list)
    failed: Optional[Outcome] = None
    retired: bool = False
    texts: Optional[_OutputBudget] = None  # the call's, applied to each answer as it arrives

    def add(self, answer: ChunkResult) -> None:
        self.answered.append(answer if self.texts is None else self.texts.keep(answer))


class FunctionPool:
    """A loaded function version: its template process and the requests that run on it."""

    def __init__(self, config: WorkerConfig, sock: socket.socket, slots: int,
                 on_broken: Optional[Callable[[str], None]] = None):
        self.config = config
        self.name, self.filename, self.function, self.style = config.name, config.filename, config.function, \
            config.style
        self.sock = sock
        self.slots = slots
        self.info = FunctionInfo(is_async=False)
        self.in_flight = 0
        self.retiring = False
        self.dead: Optional[str] = None  # why the template is gone
        self.broken_slots: set = set()
        self._ids = itertools.count(1)
        self._exits: dict[int, _Exit] = {}
        self._live: set = set()  # requests sent and not yet answered
        self._loaded: Optional[asyncio.Future] = None
        self._gate: Optional[asyncio.Semaphore] = None
        self._runners = 1  # requests running at once
        self._on_broken = on_broken

    @classmethod
    async def start(cls, config: WorkerConfig, spawn: Callable, timeout_s: float,
                    on_broken: Optional[Callable[[str], None]] = None) -> "FunctionPool":
        """Asks the supervisor for a template and waits until it imported the module.

        Raises:
            LoadError: the module or function cannot be used, or importing outlasted timeout_s.
            PoolUnavailable: no template could be started.
        """
        sock, slots = await spawn(config)
        pool = cls(config, sock, slots, on_broken)
        loop = asyncio.get_running_loop()
        pool._loaded = loop.create_future()
        sock.setblocking(True)  # messages are small and whole: a readable socket is read at once
        loop.add_reader(sock.fileno(), pool._on_message)
        try:
            info = await asyncio.wait_for(asyncio.shield(pool._loaded), timeout_s)
        except asyncio.TimeoutError:
            pool.close()
            raise LoadError(f"{config.filename}: importing took longer than {timeout_s:.0f}s; a slow import needs "
                            "a larger sandbox.start_timeout_s") from None
        except BaseException:
            pool.close()
            raise
        pool.info = info
        running = config.workers * (config.concurrency if info.is_async else 1)
        pool._runners = max(1, min(running, slots)) if config.isolation != "worker" else max(1, config.workers)
        pool._gate = asyncio.Semaphore(pool._runners)
        return pool

    # -- messages from the template ------------------------------------------------------------------------------
    def _on_message(self) -> None:
        try:
            message, _ = recv(self.sock)
        except (ChannelClosed, OSError, ValueError):
            self._gone("its template process exited")
            return
        op = message.get("op")
        if op == "loaded" and self._loaded is not None and not self._loaded.done():
            info = message["info"]
            self._loaded.set_result(FunctionInfo(bool(info["is_async"]), tuple(info["accepted_keywords"]),
                                                 bool(info["accepts_var_keywords"]), str(info["signature"]),
                                                 tuple(info["required_keywords"]), bool(message.get("forks"))))
        elif op == "load_error" and self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(LoadError(message["message"]))
        elif op == "exited" and int(message["req"]) in self._live:  # a late one is for a request already answered
            exit_ = self._exits.setdefault(int(message["req"]), _Exit(str(message["status"])))
            exit_.status = str(message["status"])
            exit_.event.set()
        elif op == "slot_failed":
            self.broken_slots.add(message["slot"])
            log.error("reward %s: slot %s cannot be prepared: %s", self.name, message["slot"], message["reason"])
            if len(self.broken_slots) >= self.slots:
                why = f"no slot process could be prepared ({message['reason']})"
                self._gone(why)
                self.close()  # the template exits and its uids return to the supervisor
                if self._on_broken is not None:  # the sandbox cannot heal this: have the host replace it
                    self._on_broken(self.dead or why)

    def _gone(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            log.error("reward %s: %s", self.name, why)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.sock.fileno())
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(LoadError(f"{self.filename}: the process importing it died (os._exit, a "
                                                 "crash, or the memory limit at import time)"))

    # -- scoring -------------------------------------------------------------------------------------------------
    async def score(self, batch: SampleBatch, timeout_s: float, state: Optional[TrainerState]) -> BatchResult:
        """One outcome per sample, in order. Never raises for reward-code failures.

        Raises:
            PoolUnavailable: the function's processes are gone; the caller retries elsewhere.
        """
        if not len(batch):
            return BatchResult()
        with self._busy():
            state_dict = None if state is None else dict(vars(state))
            if self.style == "batch":
                return await self._score_call(batch, timeout_s, state_dict)
            if self.config.isolation not in WORKER_ANSWERS:
                return await self._score_streamed(batch, timeout_s, state_dict)
            else:
                # "call": each call in a process of its own (a request each); "worker": a chunk per worker
                k = len(batch) if self.config.isolation == "call" else min(self.config.workers, len(batch))
                bounds = [round(i * len(batch) / k) for i in range(k + 1)]
                parts = [batch.slice(a, b) for a, b in zip(bounds, bounds[1:])]
            merged = BatchResult()
            victims: list = []  # see _score_part
            for part in await asyncio.gather(*(self._score_part(p, timeout_s, state_dict, victims, a)
                                               for p, a in zip(parts, bounds))):
                merged.add(part)
            for i in victims:  # once the call's others are done (the sample that filled the sandbox among them)
                done, failed = await self._again(batch, i, timeout_s, state_dict)
                merged.put(i, done if done is not None else failed)
            return merged
    async def call_episode(self, batch: SampleBatch, timeout_s: float, episode: str, start: bool) -> BatchResult:
        """One call of an episode (style environment), in the slot process that holds the episode (a fresh one when
        ``start``): the template routes it (:meth:`..processes.template.Template._slot_for`). A call to an episode whose
        process is gone answers a crash.

        Raises:
            PoolUnavailable: the function's processes are gone.
        """
        with self._busy():
            done, failed = await self._send(batch, timeout_s, None, self._exchange,
                                            route={"episode": episode, "start": start})
        result = BatchResult()
        if done is not None:
            result.add(done)
        else:
            result.add_failed(failed)
        return result

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """A call in flight: a retiring version closes once its last one is done."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.retiring and self.in_flight == 0:
                self.close()

    def end_episode(self, episode: str) -> None:
        """The host is done with ``episode``: the template ends the process that holds it (and prepares another)."""
        try:
            send(self.sock, {"op": "end", "episode": episode})
        except OSError:
            pass

    async def _score_streamed(self, batch: SampleBatch, timeout_s: float, state: Optional[dict]) -> BatchResult:
        """isolation: sample and process (sample style): forked, requests of several samples, each sample answered as
        soon as it is scored; otherwise a request per sample. What a request leaves unscored (after a sample that
        crashed or hung, or one after which its slot process retired) goes back to the queue for another process.
        Every request settles at least one sample."""
        outcomes: list = [None] * len(batch)  # per sample: a one-sample ChunkResult or an Outcome
        pending = collections.deque(range(len(batch)))
        replaced = 0
        idle = min(self._runners, len(batch))  # this call's request loops not waiting on a request
        # Samples whose process died while the kernel's OOM killer acted here, to be scored again once the call's
        # others are done (see oom_kills); and those scored again so.
        victims: list = []
        again: set = set()
        texts = _OutputBudget(output_budget())  # see OUTPUT_BUDGET_FRACTION

        def settle(i: int, outcome, oom: bool) -> None:
            if oom and _crashed(outcome):
                if i not in again:
                    victims.append(i)
                    again.add(i)
                    return
                outcome = _killed_twice(outcome)
            outcomes[i] = outcome

        async def run_requests() -> None:
            nonlocal replaced, idle
            while pending:
                size = self._chunk_size(len(pending), idle) if self._forks() and not alone else 1
                taken = [pending.popleft() for _ in range(min(size, len(pending)))]
                idle -= 1
                kills = oom_kills()
                try:
                    streamed = await self._request_streamed(batch.take(taken), timeout_s, state, texts=texts)
                finally:
                    idle += 1
                oom = kills is not None and oom_kills() != kills  # the kernel killed a process while it ran
                for k, answer in enumerate(streamed.answered):
                    settle(taken[k], answer, oom)
                settled = len(streamed.answered)
                if streamed.failed is not None and settled < len(taken):
                    settle(taken[settled], streamed.failed, oom)
                    settled += 1
                    replaced += 1
                pending.extendleft(reversed(taken[settled:]))

        alone = False  # scoring victims again: one request of one sample at a time
        while pending or victims:
            alone = not pending
            if alone:
                log.info("reward %s: %d sample(s) whose process died while the kernel's OOM killer acted in this "
                         "sandbox are scored again, one at a time", self.name, len(victims))
                pending.extend(victims)
                victims.clear()
            # Victims one at a time: scored again together, the sample that filled the sandbox fills it again beside
            # the innocent, and the kernel took the innocent in both attempts (CI, runc: 15 forks filling socket
            # buffers at 5 GB/s, which the guard's two reads of their 7,500 sockets, 12 ms each, could not outrun).
            idle = 1 if alone else min(self._runners, len(pending))
            await asyncio.gather(*(run_requests() for _ in range(idle)))
        result = BatchResult(workers_replaced=replaced)
        for outcome in outcomes:
            if isinstance(outcome, ChunkResult):
                result.add(outcome)
            else:
                result.add_failed(outcome)
        return result

    @staticmethod
    def _chunk_size(pending: int, idle: int) -> int:
        """Samples for the next forked request: an even share of what is left among the request loops free to take
        some (one request each, in the order they queued for the gate: a call's samples are not spread thin over
        requests that queue behind other calls'), up to MAX_CHUNK."""
        return max(1, min(MAX_CHUNK, -(-pending // max(1, idle))))

    async def _score_part(self, part: SampleBatch, timeout_s: float, state: Optional[dict], victims: list,
                          offset: int) -> BatchResult:
        """isolation: worker: ``part`` (the samples from ``offset`` of the call's) in one request; after a crash or
        hang, each sample alone. A sample whose process crashed alone while the kernel's OOM killer acted is added to
        ``victims`` (its index in the call), to be scored again once the call's others are done (see oom_kills)."""
        result = BatchResult()
        (done, failed, oom), = await self._requests(part, [None], timeout_s, state)
        if done is not None:
            result.add(done)
            return result
        result.workers_replaced = 1
        if len(part) == 1:
            if oom and _crashed(failed):
                victims.append(offset)
            result.add_failed(failed)
            return result
        # A reused worker crashed or hung on this chunk: one sample per request finds the guilty one.
        result.isolated_reruns = len(part)
        for i, (single_done, single_failed, oom) in enumerate(await self._requests(part, range(len(part)),
                                                                                     timeout_s, state)):
            if single_done is not None:
                result.add(single_done)
                continue
            if oom and _crashed(single_failed):
                victims.append(offset + i)
            result.add_failed(single_failed)
            result.workers_replaced += 1
        return result

    async def _requests(self, batch: SampleBatch, indices, timeout_s: float, state: Optional[dict]) -> list:
        """A request for each sample of ``indices`` alone (None: the whole ``batch``), all at once: per request,
        (ChunkResult or None, Outcome or None, whether the kernel's OOM killer acted in this sandbox while it ran)."""
        async def one(i: Optional[int]) -> tuple:
            kills = oom_kills()
            done, failed = await self._request(batch if i is None else batch.slice(i, i + 1), timeout_s, state)
            return done, failed, kills is not None and oom_kills() != kills

        if len(indices) == 1:  # the common case (a worker's chunk): no task of its own
            return [await one(indices[0])]
        return list(await asyncio.gather(*(one(i) for i in indices)))

    async def _again(self, batch: SampleBatch, i: int, timeout_s: float, state: Optional[dict]) -> tuple:
        """Sample ``i`` of ``batch``, whose process died alone while the kernel's OOM killer acted (see oom_kills),
        scored again, once: (ChunkResult, None) or (None, Outcome). A second such death is final and says so."""
        log.info("reward %s: a sample whose process died while the kernel's OOM killer acted in this sandbox is "
                 "scored again, in a fresh process", self.name)
        (done, failed, oom), = await self._requests(batch, [i], timeout_s, state)
        if failed is not None and oom and _crashed(failed):
            failed = _killed_twice(failed)
        return done, failed

    async def _score_call(self, batch: SampleBatch, timeout_s: float, state: Optional[dict]) -> BatchResult:
        """A batch-style call; after a crash or hang, the guilty samples alone and the innocent ones together. A sample
        whose call alone died while the kernel's OOM killer acted in this sandbox is scored again, once, after the
        others (see oom_kills)."""
        (done, failed, oom), = await self._requests(batch, [None], timeout_s, state)
        done, failed = _hung_or_crashed(done, failed)
        if len(batch) == 1 and oom and failed is not None and _crashed(failed):
            done, failed = _hung_or_crashed(*await self._again(batch, 0, timeout_s, state))
        result = BatchResult()
        if done is not None:
            result.add(done)
            return result
        if len(batch) == 1:
            result.add_failed(failed)
            result.workers_replaced = 1
            return result
        first: list[tuple[Optional[ChunkResult], Optional[Outcome], bool]] = []  # (answer, failure, OOM victim)
        for i, (single_done, single_failed, oom) in enumerate(
                await self._requests(batch, range(len(batch)), timeout_s, state)):
            single_done, single_failed = _hung_or_crashed(single_done, single_failed)
            first.append((single_done, single_failed,
                          bool(oom) and single_failed is not None and _crashed(single_failed)))
        # once the others are done (the sample that filled the sandbox among them): see oom_kills
        singles = [_hung_or_crashed(*await self._again(batch, i, timeout_s, state)) if victim else (d, f)
                   for i, (d, f, victim) in enumerate(first)]
        innocent = [i for i, (single_done, _) in enumerate(singles) if single_done is not None]
        together: Optional[ChunkResult] = None
        again: Optional[Outcome] = failed
        if innocent:
            subset = batch.take(innocent)
            together, again = _hung_or_crashed(*await self._request(subset, timeout_s, state))
        position = {i: k for k, i in enumerate(innocent)}
        for i, (_, single_failed) in enumerate(singles):
            if single_failed is not None:
                result.add_failed(single_failed)
            elif together is not None:
                k = position[i]
                result.add(ChunkResult([together.values[k]], [together.statuses[k]], [together.errors[k]]))
            else:  # the innocent samples failed together as well: they share that failure
                assert again is not None  # _hung_or_crashed gives an answer or a failure
                result.add_failed(Outcome.failed(again.status, f"{again.error} (scored together with the other "
                                                               "samples that pass alone)"))
        result.logs = together.logs if together is not None else ""
        result.workers_replaced = 1 + sum(1 for _, f in singles if f is not None)
        result.isolated_reruns = len(batch)
        return result

    def _hard_timeout(self, n: int, timeout_s: float) -> float:
        if self.style == "batch":
            per_call = 1
        elif self.info.is_async:
            per_call = -(-n // max(1, self.config.concurrency))
        else:
            per_call = n
        return per_call * timeout_s + HARD_TIMEOUT_MARGIN_S

    async def _request(self, batch: SampleBatch, timeout_s: float, state: Optional[dict]):
        """(ChunkResult, None) when a worker answered well-formed, else (None, the Outcome the samples share): the
        whole batch as one unit (a batch-style call, or a worker's chunk).

        Raises:
            PoolUnavailable: the template is gone (nothing started), so the caller can retry elsewhere.
        """
        if self.config.isolation in WORKER_ANSWERS:
            return await self._send(batch, timeout_s, state, self._exchange)
        streamed = await self._request_streamed(batch, timeout_s, state, units=1)
        return (streamed.answered[0], None) if streamed.answered else (None, streamed.failed)

    async def _request_streamed(self, batch: SampleBatch, timeout_s: float, state: Optional[dict],
                                units: Optional[int] = None, texts: Optional[_OutputBudget] = None) -> "_Streamed":
        """A streamed request (isolation: sample and process) of ``units`` units (default: one per sample); each
        answer's texts within ``texts``, if given."""
        return await self._send(batch, timeout_s, state, functools.partial(self._stream, units=units, texts=texts))

    async def _send(self, batch: SampleBatch, timeout_s: float, state: Optional[dict], exchange: Callable,
                    route: Optional[dict] = None):
        """Sends a request to the template with a socket of its own and runs ``exchange`` on that socket. Tells the
        template when it is done (and whether the process that served it must be retired).

        Raises:
            PoolUnavailable: the template is gone (nothing started), so the caller can retry elsewhere.
        """
        gate = self._gate
        assert gate is not None  # made by start(), before any request
        async with gate:
            if self.dead is not None:
                raise PoolUnavailable(f"reward {self.name!r}: {self.dead}")
            request = next(self._ids)
            ours, theirs = socket.socketpair()
            try:
                send(self.sock, {"op": "run", "req": request, **(route or {})}, fds=[theirs.fileno()])
            except OSError as e:
                ours.close()
                raise PoolUnavailable(f"reward {self.name!r}: its template is gone ({e})") from None
            finally:
                theirs.close()
            self._live.add(request)
            retire = True
            try:
                answer = await exchange(ours, request, batch, timeout_s, state)
                # A "call" process is ended by its template once its call is done (unless retired: at once)
                retire = getattr(answer, "retired", self.config.isolation not in WORKER_ANSWERS)
                return answer
            finally:
                ours.close()
                self._live.discard(request)
                self._exits.pop(request, None)
                if self.dead is None:
                    try:
                        send(self.sock, {"op": "done", "req": request, "retire": retire})
                    except OSError:
                        pass

    async def _stream(self, ours: socket.socket, request: int, batch: SampleBatch, timeout_s: float,
                      state: Optional[dict], units: Optional[int] = None,
                      texts: Optional[_OutputBudget] = None) -> "_Streamed":
        """Reads a streamed answer (:mod:`..protocol.codec`) unit by unit, each within its own deadline. Forked, units
        answered before a retiring trailer are kept; the unit running when the slot process died, hung or broke the
        format gets that status (each answer leaves it before the next unit starts: the unit that ran is the first
        unanswered); the rest are left unscored. Not forked, the one unit's answer, and nothing after it."""
        loop = asyncio.get_running_loop()
        streamed = _Streamed(texts=texts)
        streamed.failed = await self._begin(ours, request, batch, timeout_s, state)
        if streamed.failed is not None:
            return streamed
        units = len(batch) if units is None else units
        forked = self._forks()
        # The slot process moves a unit's deadline by what its processes waited for a CPU others held (cpu_wait),
        # within cpu_wait.most_forgiven_s in all; this one moves with it, never further.
        per_unit = len(batch) // units
        reader = stream.StreamReader(units, per_unit, self.config.max_log_bytes, forked,
                                     cpu_wait.most_forgiven_s(timeout_s) + WAITED_SLACK_S,
                                     cpu_wait.MIN_EXTENSION_MS / 1000)
        receive = _Receiver(ours, loop)
        unit_s = self._hard_timeout(per_unit, timeout_s)
        deadline_s = loop.time() + unit_s  # each unit's answer and trailer, from the end of the last one
        try:
            while reader.state is not stream.State.DONE:
                event = reader.next()
                if event is None:
                    reader.feed(await receive(deadline_s))
                elif isinstance(event, stream.Waited):
                    deadline_s += event.seconds
                elif isinstance(event, stream.Answered):
                    for answer in event.results:
                        streamed.add(answer)
                    if event.clean:
                        deadline_s = loop.time() + unit_s
                elif event.reason is None:  # a CLEAN trailer
                    deadline_s = loop.time() + unit_s
                else:
                    log.warning("reward %s: a slot process retires after sample %d of its request: %r", self.name,
                                event.index, event.reason)
                    streamed.retired = True
                    return streamed
            if not forked:  # the process scored its one unit itself and serves no other request
                streamed.retired = True
                return streamed
        except (asyncio.TimeoutError, _Ended, codec.MalformedResult) as e:
            if reader.state is stream.State.TRAILER:
                # The unit's answer came whole, sent once its processes were gone and its /tmp emptied, and no unit
                # runs until its trailer is out: what stopped or ended the slot process there (the kernel's OOM
                # killer, the memory guard), or what it sent instead of a trailer, is no unit's doing. It retires
                # (killed unless it ended); the units after it were never started and go back to the queue.
                if isinstance(e, codec.MalformedResult):
                    log.warning("reward %s: a slot process broke the stream after an answer: %s", self.name, e)
                if not isinstance(e, _Ended):
                    self._kill(request, timeout_s)
                streamed.retired = True
                return streamed
            if isinstance(e, codec.MalformedResult):
                streamed.failed = Outcome.failed(Status.INVALID, f"malformed answer from the worker: {e}")
            elif isinstance(e, asyncio.TimeoutError):
                streamed.failed = self._kill(request, timeout_s)
            else:
                streamed.failed = await self._died(request)
        if streamed.failed is not None or len(streamed.answered) < units:
            streamed.retired = True
        return streamed

    async def _exchange(self, ours: socket.socket, request: int, batch: SampleBatch, timeout_s: float,
                        state: Optional[dict]):
        never_started = await self._begin(ours, request, batch, timeout_s, state)
        if never_started is not None:
            return None, never_started
        limit = codec.result_limit(len(batch), self.config.max_log_bytes)
        end = asyncio.get_running_loop().time() + self._hard_timeout(len(batch), timeout_s)
        try:
            data = await self._read_answer(ours, len(batch), limit + 1, end)
        except asyncio.TimeoutError:
            return None, self._kill(request, timeout_s)
        if not data:
            return None, await self._died(request)
        try:
            return codec.decode_result(data, len(batch), self.config.max_log_bytes), None
        except codec.MalformedResult as e:
            return None, Outcome.failed(Status.INVALID, f"malformed answer from the worker: {e}")

    def _forks(self) -> bool:
        """Whether streamed requests run forked (:mod:`..processes.forked`): isolation: sample, where the template's
        slot processes fork (it said so when it loaded the function)."""
        return self.config.isolation == "sample" and self.info.forks

    async def _begin(self, ours: socket.socket, request: int, batch: SampleBatch, timeout_s: float,
                     state: Optional[dict]) -> Optional[Outcome]:
        """Writes the request and waits for the worker's start byte. Returns None once it started, else the crash the
        samples share (its process died first).

        Raises:
            PoolUnavailable: the template is gone.
        """
        ours.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_sendall(ours, codec.encode_request(batch, timeout_s, state))
            ours.shutdown(socket.SHUT_WR)
        except OSError:  # its process died while the request was written (the memory guard killed it: red team)
            if self.dead is not None:
                raise PoolUnavailable(f"reward {self.name!r}: {self.dead}") from None
            return await self._died(request)
        # Waiting for a free slot has no deadline of its own: the RPC's deadline covers it.
        if await self._read_start(ours) is not None:
            return None
        if self.dead is not None:
            raise PoolUnavailable(f"reward {self.name!r}: {self.dead}")
        return await self._died(request)

    def _kill(self, request: int, timeout_s: float) -> Outcome:
        """Has the template kill the process running ``request`` (past its deadline); returns the samples' timeout."""
        try:
            send(self.sock, {"op": "kill", "req": request})
        except OSError:
            pass
        return Outcome.failed(Status.TIMEOUT, f"exceeded timeout_s={timeout_s:g}; the worker was killed")

    async def _read_start(self, ours: socket.socket) -> Optional[bytes]:
        """The start byte, once a slot took the request (no deadline of its own: see _begin); None if the template
        or the pool went away first."""
        loop = asyncio.get_running_loop()
        receive = _Receiver(ours, loop)
        while True:
            try:
                byte = await receive(loop.time() + 1.0, 1)
            except asyncio.TimeoutError:
                if self.dead is not None:
                    return None
                continue
            except _Ended:  # the template went away holding the other end
                return None
            return byte if byte == stream.Marker.STARTED else None

    async def _read_answer(self, ours: socket.socket, samples: int, limit: int, end: float) -> bytes:
        """The answer's bytes: up to the length it declares (or EOF, or ``limit``, whichever comes first).

        Raises: asyncio.TimeoutError: not all of it by ``end`` (the loop's clock)."""
        receive = _Receiver(ours, asyncio.get_running_loop())
        data = b""
        while len(data) < limit:
            expected = codec.answer_length(data, samples)
            if expected is not None and len(data) >= expected:
                break
            want = min(_READ_CHUNK, limit - len(data)) if expected is None else min(expected, limit) - len(data)
            try:
                data += await receive(end, want)
            except _Ended:  # closed, or reset by a dying worker: what arrived is judged as it is
                break
        return data

    async def _died(self, request: int) -> Outcome:
        exit_ = self._exits.setdefault(request, _Exit(""))
        try:
            await asyncio.wait_for(exit_.event.wait(), 2.0)
        except asyncio.TimeoutError:
            pass
        how = f" ({exit_.status})" if exit_.status else ""
        return Outcome.failed(Status.CRASH, f"worker process died{how}")

    # -- life ----------------------------------------------------------------------------------------------------
    def retire(self) -> None:
        """A newer version took over: stop once the requests still using this one are done."""
        self.retiring = True
        if self.in_flight == 0:
            self.close()

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        try:
            send(self.sock, {"op": "close"})
        except OSError:
            pass
        if self.dead is None:
            self.dead = "closed"
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except (RuntimeError, ValueError):
            pass
        self.sock.close()
