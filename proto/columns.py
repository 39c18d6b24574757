"""Dataset columns on the wire: one JSON object per sample, in the dataset's column order.

Batch-style functions get each column's values as the dataset has them, which is why only what JSON carries exactly
may travel for them: str, int, float (NaN and infinities included), bool, None, and lists and str-keyed dicts of
those. Sample-style functions get every value as a string, by one rule, :func:`stringify`, the same for
``rewardbox score`` and training: strings unchanged, anything else ``str(value)`` (so ``None`` is ``'None'``, ``3``
is ``'3'``, ``[1, 2]`` is ``'[1, 2]'``: ``ast.literal_eval`` recovers them). Standard library only.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional


def stringify(value: Any) -> str:
    """A column value as sample-style functions get it in ``example``."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # numpy / torch values print differently from their Python equivalents
        value = value.tolist()
    return str(value)


def json_problem(value: Any) -> Optional[str]:
    """None when JSON carries ``value`` exactly (it comes back equal and of the same types), else what does not
    travel, e.g. ``'bytes'`` or ``'tuple inside a list'``."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None  # json writes NaN and Infinity and reads them back
    if isinstance(value, list):
        for item in value:
            problem = json_problem(item)
            if problem is not None:
                return f"{problem} inside a list"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"dict key of type {type(key).__name__}"
            problem = json_problem(item)
            if problem is not None:
                return f"{problem} inside a dict"
        return None
    return type(value).__name__


def _portable(value: Any) -> Any:
    """``value`` where JSON carries it exactly, else its string (what a sample-style function gets anyway)."""
    return value if json_problem(value) is None else stringify(value)


def encode_columns(columns: Mapping, i: int) -> str:
    """Sample ``i``'s columns as the wire's JSON object (``columns`` maps name to one value per sample)."""
    if not columns:
        return ""
    return json.dumps({name: _portable(values[i]) for name, values in columns.items()}, allow_nan=True)


def decode_columns(text: str) -> dict:
    """The columns of one sample, in order: values as they were sent."""
    return json.loads(text) if text else {}


def example_of(text: str) -> dict:
    """The ``example`` dict of a sample-style call: every column as a string, in the dataset's order."""
    return {name: stringify(value) for name, value in decode_columns(text).items()}


__all__ = ["decode_columns", "encode_columns", "example_of", "json_problem", "stringify"]
