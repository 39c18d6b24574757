"""A real GRPOTrainer run whose tool calls run in sandboxes (real containers) trains exactly as the same seeded run
with the tools in-process: the same tool results and error texts reach the model, so the same completions, rewards
and tool-call counts follow. (The tiny model learned to call ``add`` with that tool alone in its prompt: another tool
beside it takes it off what it learned. An async tool's path is the same on the host: every sandboxed tool is async.)"""

from __future__ import annotations

import pytest

from rewardbox import sandboxed_tools

pytest.importorskip("trl")  # the train extra; tests/conftest.py marks this module `train`


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    if (a + b) % 2:  # some calls fail: TRL shows the model {"error": str(e)}, which must be the same text sandboxed
        raise ValueError(f"{a} + {b} is odd, which this tool refuses")
    return a + b


def _train(model, tmp_path, tools) -> tuple[list, list]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    seen: list = []  # every completion's messages, tool results included, as the reward saw them

    def answered(completions, **kwargs):
        seen.extend(completions)
        return [sum(m["role"] == "tool" for m in c) + len(c[-1]["content"]) / 100 for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}]}
                                 for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]])
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      # room for an error text: TRL drops a tool result that would pass max_completion_length
                      max_completion_length=160, max_steps=4, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                      save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=str(model), reward_funcs=[answered], args=args, train_dataset=dataset, tools=tools)
    trainer.train()
    logged = [{k: v for k, v in entry.items() if k.startswith(("reward", "tools/"))}
              for entry in trainer.state.log_history if "reward" in entry]
    return logged, seen


def test_a_grpo_run_with_sandboxed_tools_trains_identically_to_in_process(tiny_tool_model, tmp_path, docker_client,
                                                                          base_image):
    plain = _train(tiny_tool_model, tmp_path / "plain", [add])
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_tools([add], sandbox=sandbox) as tools:
        boxed = _train(tiny_tool_model, tmp_path / "boxed", tools)
    assert boxed[0] == plain[0]  # rewards, tool-call and failure frequencies, step by step
    assert boxed[1] == plain[1]  # every completion, with each tool message's text
    # Not vacuous: the model called the tools, some calls failed, and the error text reached it.
    assert sum(step["tools/call_frequency"] for step in plain[0]) > 0
    assert sum(step["tools/failure_frequency"] for step in plain[0]) > 0
    tool_texts = [m["content"] for c in plain[1] for m in c if m["role"] == "tool"]
    assert any("is odd, which this tool refuses" in text for text in tool_texts), " | ".join(tool_texts)
    assert any(text.isdigit() for text in tool_texts), tool_texts


class Adder:
    """An environment whose tool is add; its reward counts the calls that gave the question's answer."""

    def __init__(self):
        self.expected, self.right, self.calls = None, 0, 0

    def reset(self, **kwargs) -> None:
        question = kwargs["prompt"][-1]["content"]  # "What is a + b?"
        a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
        self.expected, self.right, self.calls = int(a) + int(b), 0, 0

    def add(self, a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: the first number
            b: the second number
        """
        self.calls += 1
        if (a + b) % 2:
            raise ValueError(f"{a} + {b} is odd, which this tool refuses")
        self.right += a + b == self.expected
        return a + b

    def get_reward(self) -> float:
        return self.right + self.calls / 10


def _train_environment(model, tmp_path, factory) -> tuple[list, list]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    seen: list = []

    def answered(completions, **kwargs):
        seen.extend(completions)
        return [len(c[-1]["content"]) / 100 for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}]}
                                 for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]])
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=160, max_steps=4, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                      save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=str(model), reward_funcs=[answered], args=args, train_dataset=dataset,
                          environment_factory=factory)
    trainer.train()
    logged = [{k: v for k, v in entry.items() if k.startswith(("reward", "tools/"))}
              for entry in trainer.state.log_history if "reward" in entry]
    return logged, seen


def test_a_grpo_run_with_a_sandboxed_environment_trains_identically_to_in_process(tiny_tool_model, tmp_path,
                                                                                  docker_client, base_image):
    from rewardbox import sandboxed_environment

    plain = _train_environment(tiny_tool_model, tmp_path / "plain", Adder)
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_environment(Adder, sandbox=sandbox, max_episodes=16) as factory:
        boxed = _train_environment(tiny_tool_model, tmp_path / "boxed", factory)
    assert boxed[0] == plain[0]  # both rewards (get_reward's included), tool-call and failure frequencies
    assert boxed[1] == plain[1]
    assert sum(step["tools/call_frequency"] for step in plain[0]) > 0
    assert sum(step["tools/failure_frequency"] for step in plain[0]) > 0
    assert any(step["rewards/Adder/mean"] > 0 for step in plain[0])  # TRL's name for the environment's get_reward
