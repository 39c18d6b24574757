"""The records that cross the boundary between the sandbox server and its worker processes. Dataclasses with plain
fields (frozen, but for the two made once per sample), one per kind of message: what a worker is configured with,
what it is asked to score, what it answers. A batch travels column by column (lists of strings and numbers, not one
object per sample): per-sample objects cost more to make and move than the samples themselves. Standard library
only: the worker module that uses them is preloaded into the fork server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ...wire import Outcome

__all__ = ["BatchResult", "ChunkResult", "FunctionInfo", "Outcome", "SampleBatch", "WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """The one function version a template serves, and how its slot processes run."""

    name: str
    filename: str
    source: str
    function: str
    style: str  # "sample" | "batch"
    isolation: str  # "sample": each unit forked from a clean slot process | "process": a fresh one per unit | "worker"
    workers: int  # samples (sync) or requests (worker isolation) running at once
    concurrency: int  # async functions: samples in flight per process
    max_log_bytes: int
    warm: int  # isolation sample: processes kept forked and ready
    args_json: str = ""  # a factory's keyword arguments (JSON object); "": ``function`` is the reward


@dataclass
class SampleBatch:
    """Samples as the reward function receives them, one list entry per sample. Not frozen: under ``isolation:
    sample`` one is made per sample, and a frozen dataclass's ``__init__`` costs three times as much."""

    prompts: list
    completions: list
    columns_json: list  # per sample: the dataset's other columns as one JSON object (rewardbox.wire.columns)
    prompt_messages_json: list  # per sample: the message list as JSON for conversational data, else ""
    completion_messages_json: list
    completion_ids: Optional[list] = None  # per sample: the token ids, when the trainer passed them

    def __len__(self) -> int:
        return len(self.completions)

    def take(self, indices: Sequence[int]) -> "SampleBatch":
        """The samples at ``indices``, in that order."""
        def pick(column: list) -> list:
            return [column[i] for i in indices]

        return SampleBatch(pick(self.prompts), pick(self.completions), pick(self.columns_json),
                           pick(self.prompt_messages_json), pick(self.completion_messages_json),
                           None if self.completion_ids is None else pick(self.completion_ids))

    def slice(self, start: int, stop: int) -> "SampleBatch":
        return self.take(range(start, min(stop, len(self))))


@dataclass(slots=True)  # not frozen: one is made per streamed sample, and a frozen one costs twice as much to make
class ChunkResult:
    """What a worker returns for a chunk of samples: per sample, in order, a value (only with status OK), a status
    and an error text; and the captured output."""

    values: list
    statuses: list
    errors: list
    logs: str = ""
    dropped: int = 0  # characters of output beyond max_log_bytes
    seconds: list = field(default_factory=list)  # per sample: how long its unit took, where the worker said

    @classmethod
    def of(cls, outcomes: Sequence[Outcome], logs: str = "", dropped: int = 0) -> "ChunkResult":
        return cls([o.value for o in outcomes], [o.status for o in outcomes], [o.error for o in outcomes], logs,
                   dropped)

    def __len__(self) -> int:
        return len(self.statuses)


@dataclass(frozen=True)
class FunctionInfo:
    """The loaded function as a worker sees it."""

    is_async: bool
    accepted_keywords: tuple = ()  # the optional keywords it declares (trainer_state, prompt_messages, ...)
    accepts_var_keywords: bool = False
    signature: str = ""
    required_keywords: tuple = ()  # batch style: parameters without a default that must be dataset columns
    forks: bool = False  # isolation: sample: its slot processes run each unit in a child (.forked)


@dataclass
class BatchResult:
    """What the server's pool made of a whole batch: per sample, in order, as in ChunkResult."""

    values: list = field(default_factory=list)
    statuses: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    log_parts: list = field(default_factory=list)  # the call's output, in order: see logs
    shared_logs: bool = False  # some of it is no one sample's own (a chunk's, a batch-style call's)
    dropped: int = 0
    workers_replaced: int = 0
    isolated_reruns: int = 0
    sample_logs: list = field(default_factory=list)  # per sample: its own output where it ran alone, else ""
    sample_seconds: list = field(default_factory=list)  # per sample: how long it took (None: unknown)

    @property
    def logs(self) -> str:
        """The call's output, joined once (one ``+=`` per sample copied it all again for each: quadratic time, and
        the server's memory twice over while thousands of chatty samples' output was joined)."""
        return "".join(self.log_parts)

    @logs.setter
    def logs(self, text: str) -> None:
        self.log_parts = [text] if text else []
        self.shared_logs = bool(text)

    def add(self, other: "BatchResult | ChunkResult") -> None:
        self.values.extend(other.values)
        self.statuses.extend(other.statuses)
        self.errors.extend(other.errors)
        self.dropped += other.dropped
        if isinstance(other, BatchResult):
            self.log_parts.extend(other.log_parts)
            self.shared_logs = self.shared_logs or other.shared_logs
            self.workers_replaced += other.workers_replaced
            self.isolated_reruns += other.isolated_reruns
            self.sample_logs.extend(other.sample_logs)
            self.sample_seconds.extend(other.sample_seconds)
        else:
            if other.logs:
                self.log_parts.append(other.logs)
                self.shared_logs = self.shared_logs or len(other) != 1
            self.sample_logs.extend([other.logs] if len(other) == 1 else [""] * len(other))
            self.sample_seconds.extend(other.seconds if len(other.seconds) == len(other) else [None] * len(other))

    def put(self, i: int, answer: "ChunkResult | Outcome") -> None:
        """Sample ``i``'s outcome replaced by ``answer`` (a one-sample ChunkResult, or an Outcome): it was scored
        again."""
        if isinstance(answer, ChunkResult):
            self.values[i], self.statuses[i], self.errors[i] = answer.values[0], answer.statuses[0], answer.errors[0]
            self.sample_logs[i] = answer.logs
            self.sample_seconds[i] = answer.seconds[0] if len(answer.seconds) == 1 else None
            if answer.logs:
                self.log_parts.append(answer.logs)
        else:
            self.values[i], self.statuses[i], self.errors[i] = None, answer.status, answer.error

    def add_failed(self, outcome: Outcome) -> None:
        """One sample whose worker was killed or died."""
        self.values.append(None)
        self.statuses.append(outcome.status)
        self.errors.append(outcome.error)
        self.sample_logs.append("")
        self.sample_seconds.append(None)
