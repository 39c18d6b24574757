"""Incremental format reward (batch style, as TRL writes them): 0.25 for each of the four tags used exactly once,
so a model gets credit on its way to the full format."""

TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def partial_format_reward(prompts, completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(0.25 for tag in TAGS if text.count(tag) == 1) for text in texts]
