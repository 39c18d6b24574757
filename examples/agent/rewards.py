"""A small bonus for short final answers (the environment's get_reward is the main reward)."""


def brevity(completions, **kwargs):
    return [max(0.0, 1.0 - len(messages[-1]["content"]) / 500) for messages in completions]
