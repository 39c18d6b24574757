"""``SandboxedReward``: the TRL-facing reward callable.

``GRPOTrainer(reward_funcs=[SandboxedReward, ...])`` accepts it as is: it is an async callable (TRL awaits async
rewards concurrently on its event loop) whose ``__name__`` is the reward's name, so ``rewards/<name>/mean`` and the
completions table work unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional, Sequence

from ..scoring.client import RewardClient, ScoreReport
from ..scoring.samples import TRL_RESERVED, build_samples, column_problem
from ..wire import Status, trainer_state_to_wire
from ..wire.pb import reward_pb2 as pb

log = logging.getLogger("rewardbox")


class SandboxedReward:
    """A reward function that runs in a sandbox.

    Call it as TRL does: ``await reward(prompts=..., completions=..., **columns, trainer_state=..., log_metric=...)``.
    Returns one float (or None, where ``default_score`` is null or the function returned None) per completion, in
    order. Never raises for reward or sandbox failures; those become fallbacks, counted through ``log_metric`` as
    ``sandbox/<name>/{fallback,error,timeout,crash,invalid,unavailable}_rate``, with ``latency_s``, ``attempts``
    (RPC attempts for the batch), ``restarts_total`` (sandbox restarts so far) and ``workers_replaced``; and each
    completion's status (``ok``, or the status and the error's last line) as the completions-table column
    ``<name>_status`` through TRL's ``log_extra``.

    Raises ValueError only for input no retry can fix: a batch-style reward given a column that JSON cannot carry
    unchanged (``RewardSandboxes.check_columns`` finds that before training).
    """

    def __init__(self, client: RewardClient, info: Optional[pb.FunctionInfo] = None):
        self.client = client
        self.info = info  # what the sandbox said of the function (its signature, the keywords it takes)
        self.__name__ = client.reward.name
        self.__qualname__ = self.__name__
        self.listeners: list[Callable[[ScoreReport, Optional[pb.TrainerState]], None]] = []
        # Called with (name, report, trainer_state, prompts, completions, columns, completion_ids) after each batch:
        # the run record (rewardbox.report.record.RunRecorder.observe).
        self.recorders: list[Callable[..., None]] = []
        self.last_report: Optional[ScoreReport] = None

    @property
    def name(self) -> str:
        return self.__name__

    @property
    def style(self) -> str:
        return self.client.reward.style

    @property
    def weight(self) -> float:
        return self.client.reward.weight

    def __repr__(self) -> str:
        return f"SandboxedReward({self.__name__!r}, replicas={len(self.client.replicas)})"

    async def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Optional[Sequence[Sequence[int]]] = None,
        trainer_state: Any = None,
        log_metric: Optional[Callable[[str, float], None]] = None,
        log_extra: Optional[Callable[[str, list], None]] = None,
        **kwargs: Any,
    ) -> list:
        columns = {k: v for k, v in kwargs.items() if k not in TRL_RESERVED}
        all_ids = completion_ids
        if self.style == "batch":
            problem = column_problem(columns)
            if problem:  # the same every step: found at start-up by check_columns where the dataset is known
                raise ValueError(f"reward {self.__name__!r}: {problem}")
        if completion_ids is not None and self.info is not None and \
                "completion_ids" not in self.info.accepted_keywords:
            completion_ids = None  # the function does not take them: they would only fill the request
        samples = build_samples(prompts, completions, columns, completion_ids)
        state = trainer_state_to_wire(trainer_state)
        report = await self.client.score(samples, state, details=bool(self.recorders))
        self.last_report = report
        self._report(report, state, log_metric)
        for recorder in self.recorders:
            try:
                recorder(self.__name__, report, trainer_state, prompts, completions, columns, all_ids)
            except Exception:  # noqa: BLE001 - the record must never stop training
                log.exception("reward %s: the run record failed", self.__name__)
        if log_extra is not None:
            # A column of TRL's completions table: which completions fell back, and why.
            log_extra(f"{self.__name__}_status", [
                str(status) if status == Status.OK else f"{status}: {_last_line(error)[:200]}"
                for status, error in zip(report.statuses, report.errors)
            ])
        return report.values

    def score_sync(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list:
        """Blocking form of ``__call__`` for code that has no event loop."""
        return asyncio.run(self(prompts, completions, **kwargs))

    def _report(self, report: ScoreReport, state: Optional[pb.TrainerState], log_metric) -> None:
        n = max(1, len(report.statuses))
        if log_metric is not None:
            prefix = f"sandbox/{self.__name__}"
            log_metric(f"{prefix}/fallback_rate", report.fallbacks / n)
            for status in Status.fallbacks():
                log_metric(f"{prefix}/{status}_rate", report.count(status) / n)
            log_metric(f"{prefix}/latency_s", report.latency_s)
            # Recoveries that succeeded leave no fallback behind; these show a sandbox that needed them.
            log_metric(f"{prefix}/attempts", float(report.attempts))
            log_metric(f"{prefix}/restarts_total", float(report.restarts))
            log_metric(f"{prefix}/workers_replaced", float(report.workers_replaced))
        if report.fallbacks:
            first = next((e for e in report.errors if e), "")
            log.warning("reward %s: %d/%d samples fell back to %r (%s). First error: %s", self.__name__,
                        report.fallbacks, n, self.client.reward.default_score,
                        ", ".join(f"{s}={report.count(s)}" for s in Status.fallbacks() if report.count(s)),
                        _last_line(first))
        for listener in self.listeners:
            try:
                listener(report, state)
            except Exception:  # noqa: BLE001 - a broken log sink must not stop training
                log.exception("reward %s: a report listener failed", self.__name__)


def _last_line(text: Optional[str]) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""
