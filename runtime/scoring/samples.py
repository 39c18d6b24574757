"""Turns TRL's reward keyword arguments (or rows of a JSONL file) into wire samples.

Every dataset column except ``prompt`` and ``completion`` travels with each sample, in the dataset's column order
(see :mod:`rewardbox.wire.columns`): batch-style functions get the values as the dataset has them, sample-style
functions get them in ``example`` as strings (strings unchanged, anything else ``str(value)``, so ``None`` is
``'None'``). For conversational data (message lists), ``prompt`` is the content of the prompt's last message and
``completion`` the text of the completion's messages; the full lists reach functions that declare the keywords
``prompt_messages`` / ``completion_messages`` (and batch-style functions get the lists as ``prompts`` /
``completions``, as in TRL). ``completion_ids`` travel when the trainer passes them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Optional, Sequence

from ..wire import BATCH_KEYWORDS, TRAINER_OBJECTS, encode_columns, json_problem
from ..wire.pb import reward_pb2 as pb

# Keyword arguments TRL passes that are not dataset columns.
TRL_RESERVED = frozenset(BATCH_KEYWORDS + TRAINER_OBJECTS)

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


def column_problem(columns: dict[str, Sequence[Any]]) -> Optional[str]:
    """Why a batch-style function could not get these columns exactly as the dataset has them (naming the column,
    the sample and the type), or None."""
    for name, values in columns.items():
        for i, value in enumerate(values):
            problem = json_problem(value)
            if problem is not None:
                return (f"column {name!r} holds a {problem} (sample {i}), which cannot reach a sandbox unchanged: "
                        "batch-style rewards get columns as the dataset has them, and only what JSON carries "
                        "(str, int, float, bool, None, lists and dicts of them) travels exactly. Convert the column "
                        "in the dataset (e.g. bytes to base64 text, a tensor to a list), drop it, or use a "
                        "sample-style reward (it gets every column as a string)")
    return None


def build_samples(prompts: Sequence[Any], completions: Sequence[Any], columns: Mapping[str, Sequence[Any]],
                  completion_ids: Optional[Sequence[Sequence[int]]] = None) -> list:
    """One pb.Sample per completion, in order; ``columns`` in the dataset's column order.

    Raises:
        ValueError: a column's (or completion_ids') length differs from the number of completions (names it).
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"got {len(completion_ids)} completion_ids for {n} completions")
    samples = []
    for i in range(n):
        prompt, completion = prompts[i], completions[i]
        sample = pb.Sample(
            prompt=as_text(prompt, last_only=True),
            completion=as_text(completion, last_only=False),
            columns_json=encode_columns(columns, i),
            prompt_messages_json=json.dumps(prompt, default=str) if is_messages(prompt) else "",
            completion_messages_json=json.dumps(completion, default=str) if is_messages(completion) else "",
        )
        if completion_ids is not None:
            ids = completion_ids[i]
            sample.completion_ids.extend(ids.tolist() if hasattr(ids, "tolist") else ids)
            sample.has_completion_ids = True
        samples.append(sample)
    return samples


def samples_from_rows(rows: Iterable[dict]) -> list:
    """Samples from JSONL rows with ``prompt`` and ``completion`` keys (and optionally ``completion_ids``); other
    keys become columns.

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
        keys.extend(k for k in row if k not in ("prompt", "completion", "completion_ids") and k not in keys)
    columns = {k: [row.get(k) for row in rows] for k in keys}  # a missing key is None, as in a dataset
    ids = [row.get("completion_ids") or [] for row in rows] if any("completion_ids" in r for r in rows) else None
    return build_samples([r["prompt"] for r in rows], [r["completion"] for r in rows], columns, ids)
