"""1.0 when the model's last message states the answer, 0.5 when a tool result it got holds it."""


def correct(completions, answer, **kwargs):
    scores = []
    for messages, expected in zip(completions, answer):
        final = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        tool_results = [m["content"] for m in messages if m["role"] == "tool"]
        scores.append(1.0 if expected in final.split() or f"{expected}." in final.split()
                      else 0.5 if expected in tool_results else 0.0)
    return scores
