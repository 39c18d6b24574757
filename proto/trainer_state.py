"""Training progress as reward functions see it, and its conversion to and from the wire."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional


@dataclass(frozen=True)
class TrainerState:
    """What a reward sees of training progress: the scalar attributes of transformers' ``TrainerState``, by the
    same names and with the same defaults, read the same way (``trainer_state.global_step``), so a reward file
    behaves the same in the sandbox and in plain TRL. ``log_history``, ``trial_params`` and ``stateful_callbacks``
    are not sent (they grow with the run, or are the trainer's objects)."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: Optional[int] = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    best_metric: Optional[float] = None
    best_global_step: Optional[int] = None
    best_model_checkpoint: Optional[str] = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: Optional[str] = None


_NAMES = tuple(f.name for f in fields(TrainerState))
# Fields that may be None, with the type of their values; the others have the type of their default.
_OPTIONAL = {"train_batch_size": int, "best_metric": float, "best_global_step": int, "best_model_checkpoint": str,
             "trial_name": str}
_DEFAULTS = {f.name: f.default for f in fields(TrainerState)}
_KINDS = {f.name: _OPTIONAL.get(f.name) or type(f.default) for f in fields(TrainerState)}


def trainer_state_to_wire(state: Any):
    """A ``pb.TrainerState`` from a transformers ``TrainerState`` (or any object or mapping with those names); None
    for None. A missing attribute gets transformers' default."""
    if state is None:
        return None
    from .pb import reward_pb2 as pb

    get = state.get if isinstance(state, dict) else lambda name: getattr(state, name, None)
    values = {}
    for name in _NAMES:
        value = get(name)
        if value is None:
            if name in _OPTIONAL:
                continue  # absent on the wire: None again on the other side
            value = _DEFAULTS[name]
        values[name] = _KINDS[name](value)
    return pb.TrainerState(**values)


def trainer_state_from_wire(message: Any) -> Optional[TrainerState]:
    """The :class:`TrainerState` a ``pb.TrainerState`` carries."""
    if message is None:
        return None
    values: dict[str, Any] = {}
    for name in _NAMES:
        if name in _OPTIONAL:
            values[name] = _KINDS[name](getattr(message, name)) if message.HasField(name) else None
        else:
            values[name] = _KINDS[name](getattr(message, name))
    return TrainerState(**values)


def trainer_state_from_dict(values: Optional[dict]) -> Optional[TrainerState]:
    """The :class:`TrainerState` from its fields as a dict (how the sandbox server hands it to a worker); unknown
    keys are ignored."""
    if values is None:
        return None
    return TrainerState(**{k: v for k, v in values.items() if k in _KINDS})
