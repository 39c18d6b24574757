"""verl: its reward function, run in rewardbox sandboxes (docker or ray backend).

verl loads a custom reward from a module and a name, and calls it per sample as
``compute_score(data_source, solution_str, ground_truth, extra_info)`` with the config's ``reward_kwargs`` merged
in. Point it here and name a rewardbox config::

    reward:
      custom_reward_function:
        path: pkg://rewardbox.integrations.verl
        name: compute_score            # compute_score_sync for verl before 0.6 (its reward managers are sync)
        reward_kwargs:
          config: /abs/path/rewardbox.yaml   # `sandbox:` and `rewards:`, as for `rewardbox score`

Every reward of that config scores every sample; the sample's score is their weighted sum (a reward's ``None``
counts as nothing, as TRL's nansum does), and the returned dict also carries each reward's value and whether it
fell back (``<name>_fallback``: 1.0 when the reward failed and ``default_score`` stood in), which verl keeps as
per-sample extra info. What each reward gets:

- sample style: ``prompt`` (``extra_info["prompt"]`` when verl's data has it, else ""), ``completion`` (verl's
  ``solution_str``) and ``example``: ``data_source``, ``ground_truth`` and every ``extra_info`` key, as strings;
- batch style: ``prompts``, ``completions`` and the same columns as lists, one entry per sample.

verl 0.6+ calls the (async) ``compute_score`` for every sample of a batch at once: calls that arrive together
are sent as one batch per reward (:class:`.batching.Gatherer`). ``compute_score_batch`` serves verl's batch reward
manager (lists in, a list of dicts out). Each process (verl's reward workers are Ray actors) starts the config's
sandboxes once, on its first call, and stops them when it exits.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

from ..api.session import RewardSandboxes
from .batching import Gatherer, already_started, score_rows, started

_gatherers: dict[tuple, Gatherer] = {}  # (config, loop) -> its calls being gathered


def _key(config: Optional[str]) -> str:
    if not config:
        raise ValueError("rewardbox.integrations.verl needs its rewardbox config: set "
                         "reward.custom_reward_function.reward_kwargs.config=/path/to/rewardbox.yaml in verl's config")
    return str(Path(config).resolve())


def sandboxes_for(config: Optional[str]) -> RewardSandboxes:
    """The started sandboxes of a rewardbox config (once per process; stopped at exit).

    Raises:
        ValueError: no config named (saying where to name it); rewardbox's errors when it cannot start.
    """
    return started(_key(config))


def _row(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Optional[dict]) -> dict:
    extra = dict(extra_info or {})
    return {"prompt": extra.get("prompt", ""), "completion": solution_str,
            "columns": {"data_source": data_source, "ground_truth": ground_truth, **extra}}


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                        config: Optional[str] = None, **kwargs: Any) -> dict:
    """verl's custom reward (async: verl 0.6+). ``config``: the rewardbox config (``reward_kwargs``)."""
    path = _key(config)
    # Started: at once; else started in a thread (the first call of a process), while the loop serves the others
    sandboxes = already_started(path)
    if sandboxes is None:
        sandboxes = await asyncio.to_thread(started, path)
    key = (path, id(asyncio.get_running_loop()))
    gatherer = _gatherers.get(key)
    if gatherer is None:
        gatherer = _gatherers[key] = Gatherer(sandboxes)
    return await gatherer.submit(_row(data_source, solution_str, ground_truth, extra_info))


def compute_score_sync(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                       config: Optional[str] = None, **kwargs: Any) -> dict:
    """verl's custom reward, for verl's synchronous reward managers (before 0.6): one sample per call."""
    return compute_score_batch([data_source], [solution_str], [ground_truth], [extra_info], config=config)[0]


def compute_score_batch(data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list,
                        config: Optional[str] = None, **kwargs: Any) -> list[dict]:
    """verl's batch reward manager form: lists in, one dict per sample out."""
    sandboxes = sandboxes_for(config)
    rows = [_row(*args) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]
    return asyncio.run(score_rows(sandboxes, rows))
