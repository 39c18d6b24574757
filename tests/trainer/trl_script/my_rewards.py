"""The user's own reward module, beside their training script (not an installed package)."""

import re

_DIGITS = re.compile(r"\d")


def digit_share(completions, **kwargs):
    """A module function: the share of digits in the completion."""
    texts = [c[0]["content"] for c in completions]
    return [len(_DIGITS.findall(t)) / max(1, len(t)) for t in texts]


def get_length_reward(target: int, scale: float = 1.0):
    """A factory, as open-r1's get_cosine_scaled_reward: the reward it returns is a closure over its arguments."""

    def length_reward(completions, completion_ids, **kwargs):
        return [-scale * abs(len(ids) - target) / target for ids in completion_ids]

    return length_reward
