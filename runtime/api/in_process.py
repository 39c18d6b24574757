"""The same reward files as plain TRL callables, in the trainer's own process: no sandbox, no isolation.

For debugging a reward and for checking that sandboxed training matches plain TRL (``rewardbox train
--in-process``). A batch-style function is handed to TRL as it is (only ``__name__`` becomes the reward's name);
a sample-style function is called once per completion with exactly what its sandbox would give it: ``prompt`` and
``completion`` as text, ``example`` with every other column as a string in the dataset's order
(:func:`rewardbox.wire.stringify`), and the optional keywords it declares. Nothing here catches a failure:
in-process, a reward that raises stops training, as in plain TRL.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable

from ..scoring.samples import TRL_RESERVED, as_text, is_messages
from ..spec import RewardboxConfig, RewardSpec
from ..wire import OPTIONAL_KEYWORDS, stringify


def load_function(reward: RewardSpec, path: Path) -> Callable:
    """Imports the reward's file as a module of its own and returns its function."""
    spec = importlib.util.spec_from_file_location(f"rewardbox_in_process_{reward.name}", path)
    assert spec is not None and spec.loader is not None  # the config allows only .py sources: a source file loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, reward.function or reward.name)
    return fn(**reward.args) if reward.args is not None else fn


def _sample_style(fn: Callable, name: str) -> Callable:
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    wanted = [k for k in OPTIONAL_KEYWORDS if k in params or takes_all]

    def calls(prompts, completions, completion_ids=None, trainer_state=None, **kwargs):
        columns = {k: v for k, v in kwargs.items() if k not in TRL_RESERVED}
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            optional: dict[str, Any] = {
                "trainer_state": trainer_state,
                "prompt_messages": json.loads(json.dumps(prompt, default=str)) if is_messages(prompt) else None,
                "completion_messages": json.loads(json.dumps(completion, default=str))
                if is_messages(completion) else None,
                "completion_ids": list(completion_ids[i]) if completion_ids is not None else None,
            }
            example = {k: stringify(v[i]) for k, v in columns.items()}
            yield fn(as_text(prompt, last_only=True), as_text(completion, last_only=False), example,
                     **{k: optional[k] for k in wanted})

    reward: Callable
    if inspect.iscoroutinefunction(fn):
        async def reward_async(prompts, completions, **kwargs):
            return list(await asyncio.gather(*calls(prompts, completions, **kwargs)))
        reward = reward_async
    else:
        def reward_sync(prompts, completions, **kwargs):
            return list(calls(prompts, completions, **kwargs))
        reward = reward_sync
    reward.__name__ = reward.__qualname__ = name
    return reward


def in_process_rewards(config: RewardboxConfig) -> list[Callable]:
    """Every reward of ``config`` as a TRL reward function, in config order."""
    rewards = []
    for reward in config.rewards:
        fn = load_function(reward, config.source_path(reward))
        if reward.style == "batch":
            call: Callable
            if inspect.iscoroutinefunction(fn):
                async def call_async(*args, __fn=fn, **kwargs):
                    return await __fn(*args, **kwargs)
                call = call_async
            else:
                def call_sync(*args, __fn=fn, **kwargs):
                    return __fn(*args, **kwargs)
                call = call_sync
            call.__name__ = call.__qualname__ = reward.name  # TRL's metric name, as sandboxed
            rewards.append(call)
        else:
            rewards.append(_sample_style(fn, reward.name))
    return rewards
