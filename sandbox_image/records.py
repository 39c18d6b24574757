"""The records that cross the boundary between the sandbox server and its worker processes.

Frozen dataclasses with plain fields, one per kind of message: what a worker is configured with, what it is asked
to score, what it answers. Standard library only: the worker module that uses them is preloaded into the fork
server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire import Outcome

__all__ = ["BatchResult", "ChunkResult", "FunctionInfo", "Outcome", "SampleInput", "WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """The one function version a worker process serves."""

    name: str
    filename: str
    source: str
    function: str
    style: str  # "sample" | "batch"
    concurrency: int
    max_log_bytes: int
    registry_dir: str  # where each worker registers its pid (its process group is killed when it is gone)


@dataclass(frozen=True)
class SampleInput:
    """One sample as the reward function receives it."""

    prompt: str
    completion: str
    example: dict  # column -> string
    prompt_messages_json: str = ""  # conversational data: the message lists as JSON; empty otherwise
    completion_messages_json: str = ""


@dataclass(frozen=True)
class ChunkResult:
    """What a worker returns for a chunk of samples: one outcome each, in order, and the captured output."""

    outcomes: list
    logs: str = ""
    dropped: int = 0  # characters of output beyond max_log_bytes


@dataclass(frozen=True)
class FunctionInfo:
    """The loaded function as a worker sees it."""

    is_async: bool
    accepted_keywords: tuple = ()  # the optional keywords it declares (trainer_state, prompt_messages, ...)
    accepts_var_keywords: bool = False
    signature: str = ""


@dataclass
class BatchResult:
    """What the server's pool made of a whole batch: one outcome per sample, in order."""

    outcomes: list = field(default_factory=list)
    logs: str = ""
    dropped: int = 0
    workers_replaced: int = 0
    isolated_reruns: int = 0

    def add(self, other: "BatchResult | ChunkResult") -> None:
        self.outcomes.extend(other.outcomes)
        self.logs += other.logs
        self.dropped += other.dropped
        if isinstance(other, BatchResult):
            self.workers_replaced += other.workers_replaced
            self.isolated_reruns += other.isolated_reruns
