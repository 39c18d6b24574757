"""The status of one scored sample (the one list of statuses, shared by the sandbox, the host, logs and metrics) and
its outcome."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Union


class Status(str, enum.Enum):
    """What happened to one sample. Compares equal to its value (``Status.OK == "ok"``).

    Every status but ``OK`` gives the reward's ``default_score``. Members are in the order reports show them; each
    one's wire value is ``STATUS_<NAME>`` of the ``Status`` enum in reward.proto.
    """

    OK = "ok"
    ERROR = "error"  # the function raised (or called sys.exit)
    TIMEOUT = "timeout"  # exceeded timeout_s
    CRASH = "crash"  # the worker process died
    INVALID = "invalid"  # not a finite float or None, or the wrong number of values
    UNAVAILABLE = "unavailable"  # host only: the sandbox could not be reached after all retries

    def __str__(self) -> str:  # "ok", not "Status.OK", in messages and f-strings
        return self.value

    def __format__(self, format_spec: str) -> str:  # the value, as __str__, under any format spec
        return str.__format__(self, format_spec)

    @property
    def wire(self) -> int:
        """The reward.proto enum value (``pb.STATUS_OK``, ...)."""
        return _TO_WIRE[self]

    @classmethod
    def from_wire(cls, value: int) -> "Status":
        """The status for a reward.proto enum value; an unknown or unset value reads as ``ERROR``."""
        return _FROM_WIRE.get(value, cls.ERROR)

    @classmethod
    def fallbacks(cls) -> tuple["Status", ...]:
        """Every status that falls back to ``default_score``, in report order."""
        return tuple(s for s in cls if s is not cls.OK)


# reward.proto numbers its enum in this same order, after STATUS_UNSPECIFIED = 0 (tests/wire checks the stubs).
_TO_WIRE = {status: number for number, status in enumerate(Status, start=1)}
_FROM_WIRE = {number: status for status, number in _TO_WIRE.items()}


class Outcome(NamedTuple):
    """What became of one sample: a value only when the status is OK (None is a valid OK value). A named tuple:
    one is made per sample on hot paths."""

    value: Union[float, str, None]  # a reward's score; a tool's result, as text (rewardbox.sandbox.protocol.codec)
    status: Status
    error: str = ""

    @classmethod
    def ok(cls, value: Optional[float]) -> "Outcome":
        return cls(value, Status.OK)

    @classmethod
    def failed(cls, status: Status, error: str) -> "Outcome":
        return cls(None, status, error)
