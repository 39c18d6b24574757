"""Every marker byte the sandbox's processes send each other, and the server's reading of a streamed answer.

On a request's socket, slot process -> server (**hostile**: a slot process is a copy of processes that ran reward
code; the server trusts nothing it reads there and reads it within each unit's deadline)::

    STARTED                                  when the slot process takes the request (the deadline starts there)
    then, forked (isolation: sample where slot processes fork, :mod:`..processes.forked`):
        FORKING
        per unit, in order:  WAITED* answer trailer
            WAITED   u32 ms: the running unit's deadline moved (its processes waited for a CPU others held)
            answer   one unit's answer in the format of :mod:`.codec`
            trailer  CLEAN (the slot process goes on) | RETIRE u32 unit index, u8 length, reason (ASCII): it must
                     not serve again, and the stream ends
    or, alone (isolation: process, and sample where slot processes cannot fork):
        one answer, for the request's one unit; nothing after it is read

Elsewhere: a forked child -> its slot process, on a pipe: DONE once its answer is in their shared mapping; a slot
process -> the template, on its control socket: READY or FAILED (why follows).

:class:`StreamReader` reads the stream as a state machine that does no I/O: the server feeds it what arrives and
acts on its events (tests/sandbox/test_stream.py reads every rule from a table of byte sequences). Every length the
stream declares is checked as soon as its bytes arrive, before more is waited for.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Optional, Union

from . import codec
from .records import ChunkResult


class Marker(bytes, enum.Enum):
    """Slot process -> server, on a request's socket."""

    STARTED = b"S"
    FORKING = b"F"
    CLEAN = b"C"
    RETIRE = b"T"
    WAITED = b"Q"


class ChildMarker(bytes, enum.Enum):
    """A forked child -> its slot process, on the pipe it shares with it."""

    DONE = b"D"


class SlotMarker(bytes, enum.Enum):
    """A slot process -> the template, on its control socket."""

    READY = b"R"
    FAILED = b"F"  # followed by why (UTF-8), before the process exits


_RETIRE = struct.Struct("<cIB")  # RETIRE, the unit's index in its request, length of the reason that follows
RETIRE_HEAD = _RETIRE.size
MAX_REASON = 120
_WAITED = struct.Struct("<cI")
WAITED_SIZE = _WAITED.size


def retire(index: int, reason: str) -> bytes:
    """The trailer that tells the server that the slot process must not serve again after unit ``index``, and why."""
    data = reason.encode("ascii", "backslashreplace")[:MAX_REASON]
    return _RETIRE.pack(Marker.RETIRE, index, len(data)) + data


def waited(ms: int) -> bytes:
    """The WAITED marker for a deadline moved by ``ms`` milliseconds."""
    return _WAITED.pack(Marker.WAITED, ms)


# -- the server's reading ------------------------------------------------------------------------------------------

class State(enum.Enum):
    """What the reader expects next."""

    FORKING = "the FORKING byte"
    UNIT = "a unit's answer or a WAITED marker"
    TRAILER = "a unit's trailer"
    DONE = "nothing more: every unit answered, or the slot process retired"


@dataclass(frozen=True)
class Answered:
    """Units answered: ``clean`` (forked, the fast path), their CLEAN trailers came too and the stream is at the
    next unit; not ``clean``, one answer, whose trailer comes next (forked) or which ends the stream (alone)."""

    results: list
    clean: bool


@dataclass(frozen=True)
class Trailer:
    """The answered unit's trailer: ``reason`` is None for CLEAN (the next unit follows), else the slot process
    retires after unit ``index`` and the stream ends."""

    index: int = 0
    reason: Optional[str] = None


@dataclass(frozen=True)
class Waited:
    """The running unit's deadline moved by ``seconds``."""

    seconds: float


Event = Union[Answered, Trailer, Waited]


class StreamReader:
    """Reads one request's stream (see the module docstring) of ``units`` units of ``per_unit`` samples each:
    :meth:`feed` what arrives, then take :meth:`next` events until it returns None (it needs more bytes).
    ``waited_budget_s``: the most a unit's deadline may move in all; ``waited_least_s``: the least one WAITED
    marker may move it (the slot process never sends less: a stream of markers of no time would otherwise never
    end).

    Every method raises :class:`.codec.MalformedResult` where the stream breaks the format; the reader is then
    unusable. Which unit a timeout or an end of stream is blamed on is the caller's, from :attr:`state`: in
    ``TRAILER`` the running unit had answered whole.
    """

    def __init__(self, units: int, per_unit: int, max_log_bytes: int, forked: bool, waited_budget_s: float = 0.0,
                 waited_least_s: float = 0.0):
        self.units, self.per_unit, self.max_log_bytes = units, per_unit, max_log_bytes
        self.forked, self.waited_budget_s, self.waited_least_s = forked, waited_budget_s, waited_least_s
        self.state = State.FORKING if forked else State.UNIT
        self.answered = 0  # units whose answer came
        self.moved_s = 0.0  # how far the running unit's deadline moved
        self._buffer = bytearray()
        self._pos = 0
        # How far the answer at the read position was scanned: [samples declared, log bytes declared, offset from
        # the read position, samples scanned] (None: not begun). A unit of many samples arrives in many pieces;
        # each is scanned once.
        self._scan: Optional[list] = None

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._buffer[:self._pos]
            self._pos = 0
        self._buffer += data

    def next(self) -> Optional[Event]:
        """The next event, or None until more bytes arrive (or after the stream ended: :attr:`state` DONE)."""
        if self.state is State.DONE or self._pos >= len(self._buffer):
            return None
        first = self._buffer[self._pos:self._pos + 1]
        if self.state is State.FORKING:
            if first != Marker.FORKING:
                raise codec.MalformedResult("a forked request's answer did not start with its FORKING byte")
            self._pos += 1
            self.state = State.UNIT
            return self.next()
        if self.state is State.TRAILER:
            return self._trailer(first)
        if self.forked and first == Marker.WAITED:
            return self._waited()
        if self.forked and self.per_unit == 1:
            clean, self._pos = codec.decode_clean_units(self._buffer, self._pos, self.per_unit,
                                                        self.units - self.answered, self.max_log_bytes,
                                                        Marker.CLEAN[0], True)
            if clean:  # what has arrived of the clean units, at once
                self._unit_done(len(clean))
                return Answered(clean, clean=True)
        length = self._answer_length()
        if length is None:
            return None
        result = codec.decode_result(bytes(self._buffer[self._pos:self._pos + length]), self.per_unit,
                                     self.max_log_bytes, self.forked)
        self._pos += length
        self._scan = None
        self.answered += 1
        self.state = State.TRAILER if self.forked else State.DONE
        return Answered([result], clean=False)

    def _trailer(self, first: bytearray) -> Optional[Trailer]:
        if first == Marker.CLEAN:
            self._pos += 1
            self._unit_done(0)
            return Trailer()
        if first != Marker.RETIRE:
            raise codec.MalformedResult(f"{bytes(first)!r} came where a unit's trailer belongs")
        if len(self._buffer) - self._pos < RETIRE_HEAD:
            return None
        _, index, length = _RETIRE.unpack_from(self._buffer, self._pos)
        if len(self._buffer) - self._pos < RETIRE_HEAD + length:
            return None
        start = self._pos + RETIRE_HEAD
        reason = self._buffer[start:start + length].decode("ascii", "replace")
        self._pos = start + length
        self.state = State.DONE
        return Trailer(index, reason)

    def _waited(self) -> Optional[Waited]:
        if len(self._buffer) - self._pos < WAITED_SIZE:
            return None
        seconds = _WAITED.unpack_from(self._buffer, self._pos)[1] / 1000
        if seconds < self.waited_least_s:
            raise codec.MalformedResult(f"a WAITED marker of {seconds * 1000:.0f} ms, less than the least a "
                                        f"deadline moves by")
        if self.moved_s + seconds > self.waited_budget_s:
            raise codec.MalformedResult(f"the unit's deadline moved {self.moved_s + seconds:.3f} s, more than "
                                        f"its timeout allows")
        self._pos += WAITED_SIZE
        self.moved_s += seconds
        return Waited(seconds)

    def _unit_done(self, answered: int) -> None:
        self.answered += answered
        self.moved_s = 0.0
        self._scan = None
        self.state = State.UNIT if self.answered < self.units else State.DONE

    def _answer_length(self) -> Optional[int]:
        """The length of the answer at the read position once it arrived whole (None before), every length it
        declares checked as soon as its bytes are here (:func:`.codec.frame_header`,
        :func:`.codec.sample_error_length`), so nothing past a bound is ever waited for."""
        data, start = self._buffer, self._pos
        if self._scan is None:
            if len(data) - start < codec.HEADER_SIZE:
                if not codec.MAGIC.startswith(bytes(data[start:start + len(codec.MAGIC)])):
                    raise codec.MalformedResult("a streamed answer does not start with the magic bytes")
                return None
            count, log_length = codec.frame_header(bytes(data[start:start + codec.HEADER_SIZE]), self.per_unit,
                                                   self.max_log_bytes)
            self._scan = [count, log_length, codec.HEADER_SIZE, 0]
        count, log_length, offset, scanned = self._scan
        while scanned < count and len(data) - start - offset >= codec.SAMPLE_SIZE:
            fixed = bytes(data[start + offset:start + offset + codec.SAMPLE_SIZE])
            offset += codec.SAMPLE_SIZE + codec.sample_error_length(fixed, count)
            scanned += 1
        self._scan[2:] = [offset, scanned]
        if scanned < count or len(data) - start < offset + log_length:
            return None
        return offset + log_length
