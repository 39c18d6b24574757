"""SandboxedReward inside a real GRPOTrainer: TRL awaits it, and what it logs came from the sandbox."""

from __future__ import annotations

import os

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rewardbox import RewardSandboxes, load_config

REWARDS = """
import ast, os

def sandbox_marker(prompt, completion, example, trainer_state=None):
    # the numbers column arrives as a string; the pid proves which process scored it
    numbers = ast.literal_eval(example["numbers"])
    print(f"scored-by-pid={os.getpid()} step={trainer_state.global_step}")
    return 10.0 + sum(numbers)

def batch_len(prompts, completions, **kwargs):
    return [float(len(c)) / 100 for c in completions]
"""


def test_grpo_trainer_step_uses_sandboxed_rewards(write_config, tiny_model, tmp_path):
    config = load_config(write_config([
        {"name": "sandbox_marker", "code": REWARDS},
        {"name": "batch_len", "file": "sandbox_marker.py", "style": "batch"},
    ]))
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "numbers": [i, 1]} for i in range(4)
    ])
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
        learning_rate=1e-3, save_strategy="no", seed=0,
    )
    with RewardSandboxes(config) as sandboxes:
        trainer = GRPOTrainer(model=str(tiny_model), reward_funcs=sandboxes.rewards, args=args, train_dataset=dataset)
        trainer.train()
        marker = sandboxes["sandbox_marker"]
        assert marker.last_report is not None
        logs = marker.last_report.logs
    history = [h for h in trainer.state.log_history if "rewards/sandbox_marker/mean" in h]
    assert len(history) == 2
    # numbers are [i, 1] for i in 0..3, so a sandbox-scored reward is 10 + i + 1, mean over the batch in [11, 14]
    for h in history:
        assert 11.0 <= h["rewards/sandbox_marker/mean"] <= 14.0
        assert h["sandbox/sandbox_marker/fallback_rate"] == 0.0
        assert "rewards/batch_len/mean" in h
    assert "scored-by-pid=" in logs and f"scored-by-pid={os.getpid()} " not in logs
    # each completion's sandbox status is a column of TRL's completions table
    assert list(trainer._logs["extra"]["sandbox_marker_status"]) == ["ok"] * 4
    assert "step=1" in logs  # trainer_state reached the sandbox
