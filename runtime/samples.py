"""Turns TRL's reward keyword arguments (or rows of a JSONL file) into wire samples.

Keys of the sample-style ``example`` dict: every dataset column except ``prompt`` and ``completion``, each value a
string: strings unchanged, anything else ``str(value)`` so that ``ast.literal_eval``, ``float`` or ``int`` recovers
it. For conversational data (message lists), ``prompt`` is the content of the prompt's last message and
``completion`` the text of the completion's messages; the full lists reach functions that declare the keywords
``prompt_messages`` / ``completion_messages`` (and batch-style functions get the lists as ``prompts`` /
``completions``, as in TRL).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from .wire.pb import reward_pb2 as pb

# Keyword arguments TRL passes that are not dataset columns.
TRL_RESERVED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)


def as_text(value: Any, *, last_only: bool) -> str:
    """Plain text of a prompt/completion that may be a message list."""
    if not is_messages(value):
        return value if isinstance(value, str) else str(value)
    messages = value[-1:] if last_only else value
    return "".join(_content_text(m.get("content")) for m in messages)


def stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # numpy / torch values print differently from their Python equivalents
        value = value.tolist()
    return str(value)


def build_samples(prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Sequence[Any]]) -> list:
    """One pb.Sample per completion, in order.

    Raises:
        ValueError: a column's length differs from the number of completions (names the column).
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    samples = []
    for i in range(n):
        prompt, completion = prompts[i], completions[i]
        samples.append(
            pb.Sample(
                prompt=as_text(prompt, last_only=True),
                completion=as_text(completion, last_only=False),
                example={k: stringify(v[i]) for k, v in columns.items()},
                prompt_messages_json=json.dumps(prompt, default=str) if is_messages(prompt) else "",
                completion_messages_json=json.dumps(completion, default=str) if is_messages(completion) else "",
            )
        )
    return samples


def samples_from_rows(rows: Iterable[dict]) -> list:
    """Samples from JSONL rows with ``prompt`` and ``completion`` keys; other keys become columns.

    Raises:
        ValueError: a row lacks ``prompt`` or ``completion`` (names the row).
    """
    rows = list(rows)
    for i, row in enumerate(rows):
        for key in ("prompt", "completion"):
            if key not in row:
                raise ValueError(f"sample {i} has no {key!r} key (keys: {', '.join(row) or 'none'})")
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in ("prompt", "completion") and k not in keys)
    columns = {k: [row.get(k, "") for row in rows] for k in keys}
    return build_samples([r["prompt"] for r in rows], [r["completion"] for r in rows], columns)
