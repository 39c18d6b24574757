"""``rewardbox.wire``: what the host and the sandbox share, and nothing else.

- ``proto/rewardbox/v1/reward.proto`` (package data) is the wire format's source of truth; the generated stubs are
  ``rewardbox.wire.pb.reward_pb2`` / ``reward_pb2_grpc`` (``python -m rewardbox.wire.protogen`` regenerates them).
- :class:`Status`: the one status enum of a scored sample, and :class:`Outcome`: value, status and error.
- The shared constants: message sizes, deadline margins, per-reward defaults.
- :class:`TrainerState` and its conversion to and from the wire; dataset columns on the wire (``columns``).

Both sides import this package; neither imports the other's internals. This ``__init__`` and the modules it
imports use the standard library only, because the sandbox's worker module (preloaded into its fork server)
imports them: code that needs the protobuf stubs imports ``rewardbox.wire.pb`` itself.
"""

from .constants import (
    BATCH_KEYWORDS,
    CALL_STYLES,
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_LOG_BYTES,
    DEFAULT_WARM,
    DEFAULT_WORKERS,
    GRPC_OPTIONS,
    GVISOR_WARM,
    HARD_TIMEOUT_MARGIN_S,
    MAX_MESSAGE_BYTES,
    OPTIONAL_KEYWORDS,
    SERVICE_NAME,
    SLOT_UID_BASE,
    STYLE_NAMES,
    TRAINER_OBJECTS,
    VERSION,
    sandbox_slots,
)
from .columns import decode_columns, encode_columns, example_of, json_problem, stringify
from .status import Outcome, Status
from .trainer_state import TrainerState, trainer_state_from_dict, trainer_state_from_wire, trainer_state_to_wire

__all__ = [
    "BATCH_KEYWORDS",
    "CALL_STYLES",
    "OPTIONAL_KEYWORDS",
    "TRAINER_OBJECTS",
    "STYLE_NAMES",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MAX_LOG_BYTES",
    "DEFAULT_WARM",
    "DEFAULT_WORKERS",
    "GRPC_OPTIONS",
    "GVISOR_WARM",
    "HARD_TIMEOUT_MARGIN_S",
    "MAX_MESSAGE_BYTES",
    "Outcome",
    "SERVICE_NAME",
    "SLOT_UID_BASE",
    "VERSION",
    "Status",
    "TrainerState",
    "decode_columns",
    "encode_columns",
    "example_of",
    "json_problem",
    "sandbox_slots",
    "stringify",
    "trainer_state_from_dict",
    "trainer_state_from_wire",
    "trainer_state_to_wire",
]
