"""What the entry points for other trainers share: rows scored by every reward of a config, and concurrent
one-rollout calls gathered into batches.

verl (0.6+) and OpenRLHF both ask for one rollout's reward at a time, many at once. Sent one by one, 1,000 calls in
flight would be 1,000 sandbox requests per reward; :class:`Gatherer` sends the rows that arrive together as one
batch per reward.

A batch closes :data:`GAP_S` after its last row arrived, :data:`WINDOW_S` after its first at the latest, or at
:data:`MAX_BATCH` rows. A row is ``{"prompt": str, "completion": str, "columns": {name: value}}``; its result is
``{"score": the weighted sum of the rewards' values (a ``None`` counts as nothing, as TRL's nansum does),
<reward>: its value (NaN for ``None``), <reward>_fallback: 1.0 where the reward failed and its ``default_score``
stood in, else 0.0}``.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import threading
from typing import Optional

from ..api.session import RewardSandboxes
from ..scoring.samples import build_samples
from ..spec import load_config
from ..wire import Status

WINDOW_S = 0.005  # concurrent one-rollout calls that arrive within this of the first are one batch
# ... and within this of the one before: a lone call (or the last of a wave) waits this long, not the whole window
GAP_S = 0.001
MAX_BATCH = 4096

_started: dict[str, RewardSandboxes] = {}
_start_lock = threading.Lock()


def started(config_path: str) -> RewardSandboxes:
    """The started sandboxes of the rewardbox config at ``config_path`` (an absolute path): started on the first
    call in this process (a trainer's reward worker), stopped when it exits.

    Raises:
        rewardbox's errors when the config is broken or its sandboxes cannot start (naming what to fix).
    """
    with _start_lock:
        if config_path not in _started:
            sandboxes = RewardSandboxes(load_config(config_path))
            sandboxes.start()
            atexit.register(sandboxes.stop)
            _started[config_path] = sandboxes
        return _started[config_path]


def already_started(config_path: str) -> Optional[RewardSandboxes]:
    """:func:`started`'s sandboxes where they are started already (None: not yet)."""
    return _started.get(config_path)


async def score_rows(sandboxes: RewardSandboxes, rows: list[dict]) -> list[dict]:
    """Every reward of ``sandboxes`` over ``rows``, concurrently; one result per row, in order (module docstring).

    Raises:
        ValueError: the rows' columns cannot be sent (build_samples names the column).
    """
    names = list(dict.fromkeys(k for row in rows for k in row["columns"]))
    columns = {k: [row["columns"].get(k) for row in rows] for k in names}
    prompts, completions = [row["prompt"] for row in rows], [row["completion"] for row in rows]
    samples = build_samples(prompts, completions, columns)
    rewards = sandboxes.rewards
    reports = await asyncio.gather(*(r.client.score(samples) for r in rewards))
    out = []
    for i in range(len(rows)):
        result, total = {}, 0.0
        for reward, spec, report in zip(rewards, sandboxes.config.rewards, reports):
            value = report.values[i]
            result[reward.__name__] = math.nan if value is None else float(value)
            result[f"{reward.__name__}_fallback"] = 0.0 if report.statuses[i] == Status.OK else 1.0
            if value is not None:
                total += spec.weight * float(value)
        out.append({"score": total, **result})
    return out


class Gatherer:
    """Gathers rows submitted concurrently on one event loop into batches for :func:`score_rows`."""

    def __init__(self, sandboxes: RewardSandboxes, window_s: float = WINDOW_S, max_batch: int = MAX_BATCH,
                 gap_s: float = GAP_S):
        self.sandboxes, self.window_s, self.max_batch, self.gap_s = sandboxes, window_s, max_batch, gap_s
        self._pending: list = []  # [(row, future)] of the batch being gathered
        self._timer: Optional[asyncio.TimerHandle] = None
        self._closes_by = 0.0  # the loop's time by which the batch being gathered goes, whatever arrives
        self._scoring: set = set()  # the batches' tasks (the loop keeps only weak references to tasks)
        self.batches = 0  # sent so far (rewardbox serve --openrlhf reports it)

    async def submit(self, row: dict) -> dict:
        """The row's result, scored in a batch with the rows submitted around it.

        Raises:
            whatever scoring this row raised (a batch that raised is scored again row by row, so that one row's
            failure is its own caller's alone).
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((row, future))
        if len(self._pending) >= self.max_batch:
            self._flush()
        else:
            now = loop.time()
            if self._timer is None:
                self._closes_by = now + self.window_s
            else:
                self._timer.cancel()
            self._timer = loop.call_at(min(self._closes_by, now + self.gap_s), self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            self.batches += 1
            task = asyncio.ensure_future(self._score(batch))
            self._scoring.add(task)
            task.add_done_callback(self._scoring.discard)

    async def _score(self, batch: list) -> None:
        try:
            results = await score_rows(self.sandboxes, [row for row, _ in batch])
        except Exception as e:  # noqa: BLE001 - a row no sandbox can take, or the sandboxes gone
            if len(batch) > 1:  # each row alone: one caller's bad row must not fail the others' calls
                await asyncio.gather(*(self._score([one]) for one in batch))
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        except BaseException as e:  # noqa: BLE001 - cancelled: every waiting call gets it
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            raise
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)
