"""Reward factories in the config (`args:`): the sandbox calls function(**args) once at load and scores with what
it returns, as TRL's and open-r1's parametrised rewards are made; and they fail at start, naming the file and the
function, when they cannot make a reward."""

from __future__ import annotations

import pytest

from rewardbox import ConfigError, RewardLoadError, RewardSandboxes, build_samples, load_config
from rewardbox.api.in_process import in_process_rewards
from tests.conftest import run

FACTORIES = """
def get_length_reward(target, scale=1.0):
    def length_reward(completions, **kwargs):
        return [scale * -abs(len(c) - target) for c in completions]
    return length_reward

def get_contains(word):
    calls = []
    def contains(prompt, completion, example):
        calls.append(1)
        return float(word in completion) + 10 * (len(calls) - 1)  # made once: a fresh process per sample
    return contains

def not_a_factory(x):
    return 42

def broken_factory(x):
    raise ValueError("no such x: " + str(x))
"""


def test_a_factory_is_called_once_with_its_args_and_scores_as_in_process(write_config):
    path = write_config([
        {"name": "length", "code": FACTORIES, "file": "f.py", "function": "get_length_reward", "style": "batch",
         "args": {"target": 5, "scale": 0.5}},
        {"name": "contains", "file": "f.py", "function": "get_contains", "args": {"word": "yes"}}])
    config = load_config(path)
    completions = ["yes", "no", "yes indeed", "nope!!"]
    with RewardSandboxes(config) as sandboxes:
        length = run(sandboxes["length"].client.score(build_samples(["p"] * 4, completions, {})))
        contains = run(sandboxes["contains"].client.score(build_samples(["p"] * 4, completions, {})))
    assert length.values == [-1.0, -1.5, -2.5, -0.5]
    assert contains.values == [1.0, 0.0, 1.0, 0.0]
    in_process = {f.__name__: f for f in in_process_rewards(config)}
    assert in_process["length"](prompts=["p"] * 4, completions=completions) == length.values


@pytest.mark.parametrize("function, args, message", [
    ("not_a_factory", {"x": 1}, r"f\.py:\d+: not_a_factory\(\*\*\{'x': 1\}\) returned a int, not a callable"),
    ("broken_factory", {"x": 7}, r"f\.py:\d+: broken_factory\(\*\*\{'x': 7\}\) .* raised ValueError: no such x: 7"),
    ("get_length_reward", {"wrong": 1}, r"get_length_reward\(\*\*\{'wrong': 1\}\) .* raised TypeError"),
])
def test_a_factory_that_makes_no_reward_fails_at_start_naming_file_and_function(write_config, function, args,
                                                                                 message):
    config = load_config(write_config([{"name": "r", "code": FACTORIES, "file": "f.py", "function": function,
                                        "args": args}]))
    with pytest.raises(RewardLoadError, match=message):
        RewardSandboxes(config).start()


def test_args_must_be_json(write_config, tmp_path):
    path = write_config([{"name": "r", "code": FACTORIES, "file": "f.py", "function": "get_contains",
                          "args": {"word": "x"}}])
    path.write_text(path.read_text().replace("word: x", "word: .nan"))
    with pytest.raises(ConfigError, match="args must hold JSON values only"):
        load_config(path)
