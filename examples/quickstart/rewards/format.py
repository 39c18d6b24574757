"""1.0 when the completion is exactly <think>...</think><answer>...</answer>, else 0.0."""

import re

PATTERN = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_reward(prompt, completion, example):
    return 1.0 if PATTERN.match(completion) else 0.0
