"""Training progress as reward functions see it, and its conversion to and from the wire."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional


@dataclass(frozen=True)
class TrainerState:
    """What a reward sees of training progress: ``trainer_state.global_step``, ``.max_steps``, ``.epoch``.

    The fields are those of the ``TrainerState`` message in reward.proto, by the same names as transformers'
    ``TrainerState`` attributes. Item access (``trainer_state["epoch"]``) works as well.
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


# Each field's type, from its default: the wire's int64/double become int/float again.
_FIELDS = {f.name: type(f.default) for f in fields(TrainerState)}


def trainer_state_to_wire(state: Any):
    """A ``pb.TrainerState`` from a transformers ``TrainerState`` (or any object or mapping with those names); None
    for None. Missing or None values are 0."""
    if state is None:
        return None
    from .pb import reward_pb2 as pb

    get = state.get if isinstance(state, dict) else lambda name: getattr(state, name, None)
    return pb.TrainerState(**{name: kind(get(name) or 0) for name, kind in _FIELDS.items()})


def trainer_state_from_wire(message: Any) -> Optional[TrainerState]:
    """The :class:`TrainerState` a ``pb.TrainerState`` carries."""
    if message is None:
        return None
    return TrainerState(**{name: kind(getattr(message, name)) for name, kind in _FIELDS.items()})
