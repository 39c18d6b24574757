"""OpenRLHF's own reward client (``openrlhf/utils/agent.py`` of the OpenRLHF that scripts/setup.sh puts in
``.openrlhf``), loaded as OpenRLHF's own tests load it: its logging module stood in for, nothing of its GPU stack
imported. Also run as a script (the file route, in a process of its own):

    python openrlhf_agent.py REWARD_FILE ROLLOUTS_JSON   (REWARDBOX_CONFIG in the environment)

prints one JSON line: OpenRLHF's answer for each rollout, fetched as its SingleTurnAgentExecutor fetches them (all
rollouts at once, each in a thread of its own).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

AGENT = Path(__file__).resolve().parents[2] / ".openrlhf" / "openrlhf" / "utils" / "agent.py"


def load_agent() -> ModuleType:
    """OpenRLHF's agent module. Raises AssertionError naming the set-up step where OpenRLHF's files are missing."""
    assert AGENT.exists(), f"{AGENT} is missing: run `bash scripts/setup.sh` (it installs OpenRLHF's files there)"
    sys.modules.setdefault("openrlhf.utils.logging_utils", SimpleNamespace(init_logger=logging.getLogger))
    spec = importlib.util.spec_from_file_location("_openrlhf_agent", AGENT)
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    return agent


def load_samples_generator() -> ModuleType:
    """OpenRLHF's samples generator (``trainer/ppo_utils/samples_generator.py``, which turns the executor's output
    and its reward into the Experience PPO trains on), loaded as OpenRLHF's own tests load it: its Experience from
    their ``tests/test_experience.py``, Ray and vLLM stood in for."""
    from unittest.mock import MagicMock

    root = AGENT.parents[2]
    experience = _load(root / "tests" / "test_experience.py", "_openrlhf_test_experience")
    stand_ins = {"openrlhf.trainer.ppo_utils.experience": SimpleNamespace(Experience=experience.Experience),
                 "openrlhf.trainer.ray.vllm_engine": MagicMock(), "ray": sys.modules.get("ray") or MagicMock(),
                 "vllm": MagicMock()}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        return _load(root / "openrlhf" / "trainer" / "ppo_utils" / "samples_generator.py", "_openrlhf_samples")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CharTokenizer:
    """A tokenizer of one token per character, enough for OpenRLHF's executor to tokenize a prompt and decode a
    rollout."""

    def __call__(self, text, **kwargs):
        import torch

        return {"input_ids": torch.tensor([[ord(c) for c in text]])}

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(map(chr, tokens))


class ScriptedEngine:
    """Generates the given response, as OpenRLHF's vLLM engine wrapper answers its executor."""

    def __init__(self, response: str):
        self.response = response

    async def generate(self, token_ids, params, **kwargs):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[ord(c) for c in self.response],
                                                        text=self.response, finish_reason="stop", logprobs=None)])


async def rollout(executor, prompt: str, label, response: str) -> dict:
    """One whole single-turn rollout through OpenRLHF's executor: generate ``response``, decode prompt and
    response, fetch its reward. Returns the executor's output."""
    return await executor.execute(prompt, label, SimpleNamespace(max_tokens=None, logprobs=None), 4096,
                                  CharTokenizer(), ScriptedEngine(response))


async def fetch_all(executor, rollouts: list, via: str) -> list:
    """OpenRLHF's answer for each (query, prompt, label), all requested at once, as its executor requests them."""
    fetch = executor._fetch_rewards_via_func if via == "func" else executor._fetch_rewards_via_http
    answers = await asyncio.gather(*(fetch([q], [p], [label]) for q, p, label in rollouts))
    return [answer[0] for answer in answers]


if __name__ == "__main__":
    reward_file, rollouts_file = sys.argv[1], sys.argv[2]
    executor = load_agent().SingleTurnAgentExecutor(reward_file)
    assert executor.reward_func is not None, "OpenRLHF did not load reward_func from the file"
    rollouts = json.loads(Path(rollouts_file).read_text())
    print("ANSWERS " + json.dumps(asyncio.run(fetch_all(executor, rollouts, "func"))))
