"""What crosses from the server to a worker and back, per request.

Request (server -> worker; trusted): its size (u64), then length-prefixed (u32) parts: a JSON header (the timeout, the
trainer state, the number of samples), then one part per sample: the byte lengths (u32) of its five texts (prompt,
completion, columns JSON, prompt and completion messages JSON) and the count (u32) of its completion's token ids
(NO_IDS: none), then the texts (UTF-8, lone surrogates passed as they are, so every str comes back equal), then the ids
(i64): no JSON to escape or parse per sample, on the server's path of every request. A slot process receives it into a
mapping of its own and decodes only the samples it runs (:class:`Request`).

Result (worker -> server; **hostile**: model-written code ran in that process and may have written anything):
a fixed binary layout, read with a size bound and validated field by field. Nothing in it is unpickled or
evaluated; a result that does not parse exactly is the samples' ``invalid``, never an exception in the server.

    header:   magic "RBX1" | u32 samples | u64 dropped characters | u32 log bytes
    per sample: u8 status | u8 has value | f64 value | u32 error bytes | f32 seconds (NaN: unknown) | error (UTF-8)
    logs (UTF-8)

``has value`` is 0 (None), 1 (the f64) or 2: a tool's result (``style: tool``), whose text (``"j"`` and JSON, or
``"s"`` and a str(): :func:`..processes.worker.tool_result`) takes the error's place, up to MAX_RESULT_BYTES; only a
one-sample answer with status ok carries one (a tool call is a one-sample request), and the server takes it only from a
tool.

The stream these answers travel in (the STARTED byte, and for ``isolation: sample`` and ``process`` the markers
between answers) is :mod:`.stream`'s.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from typing import Optional, Sequence, Union

from ...wire import Outcome, Status
from .records import ChunkResult, SampleBatch

MAGIC = b"RBX1"
_HEADER = struct.Struct("<4sIQI")
_SAMPLE = struct.Struct("<BBdIf")
_ONE = struct.Struct("<4sIQIBBdIf")  # a one-sample answer's header and sample together (the streamed common case)
MAX_SECONDS = 1e6  # a time beyond this (or negative, or not finite) is not taken
MAX_ERROR_BYTES = 8 * 1024
MAX_RESULT_BYTES = 256 * 1024  # a tool's result (has value 2): what a model's context can take, and more
RESULT = 2  # the "has value" of a tool's result
LOG_SLACK_BYTES = 4 * 1024  # the "[n more characters dropped]" note and multi-byte characters
# Statuses a worker may report itself; crash and unavailable are only ever concluded by the server or the host.
_WORKER_STATUSES = {Status.OK.wire: Status.OK, Status.ERROR.wire: Status.ERROR, Status.TIMEOUT.wire: Status.TIMEOUT,
                    Status.INVALID.wire: Status.INVALID}
# A forked request's answers (:mod:`..processes.forked`) come from the slot process, which checked each child's answer
# (with the statuses above) and concludes a crash itself when a child died without one.
_FORKED_STATUSES = {**_WORKER_STATUSES, Status.CRASH.wire: Status.CRASH}


class MalformedResult(ValueError):
    """A worker's answer broke the format (wrong size, magic, count, status, value or encoding)."""


# -- requests ----------------------------------------------------------------------------------------------------

_LENGTH = struct.Struct("<I")
_SIZE = struct.Struct("<Q")
_decode = json.JSONDecoder().decode
SIZE_BYTES = _SIZE.size


_FIELDS = struct.Struct("<6I")  # a sample part's five text lengths and its ids' count
NO_IDS = 0xFFFFFFFF  # the ids' count of a sample without token ids


def _sample_part(texts: tuple, ids: Optional[Sequence[int]]) -> bytes:
    encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
    count = NO_IDS if ids is None else len(ids)
    fields = _FIELDS.pack(*(len(e) for e in encoded), count)
    return fields + b"".join(encoded) + (b"" if ids is None else struct.pack(f"<{len(ids)}q", *ids))


def encode_request(batch: SampleBatch, timeout_s: float, trainer_state: Optional[dict]) -> bytes:
    """Each sample is a part of its own, so a slot process decodes only the samples it runs (:class:`Request`)."""
    header = json.dumps({"timeout_s": timeout_s, "trainer_state": trainer_state,
                         "samples": len(batch), "ids": batch.completion_ids is not None}, separators=(",", ":"))
    parts = [header.encode()]
    ids = batch.completion_ids
    for i, texts in enumerate(zip(batch.prompts, batch.completions, batch.columns_json, batch.prompt_messages_json,
                                  batch.completion_messages_json)):
        parts.append(_sample_part(texts, ids[i] if ids is not None else None))
    body = b"".join(_LENGTH.pack(len(part)) + part for part in parts)
    return _SIZE.pack(len(body)) + body


def request_size(prefix: bytes) -> int:
    """The length of the request that follows its first SIZE_BYTES bytes."""
    return _SIZE.unpack(prefix)[0]


class Request:
    """A request as a slot process holds it: the bytes after its size, in a memory mapping of their own (never in
    Python's heap), decoded a sample at a time. :meth:`close` unmaps them once the process that scores a unit decoded
    its own samples, before the reward sees them (a forked child: :mod:`..processes.forked`; a process that scores its
    one unit itself). So code from one sample never finds the text of the request's other samples in its process's
    memory.

    Raises (on construction):
        ValueError: the bytes do not hold a request (the server wrote them: a bug, not an attack).
    """

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offsets: list = []  # (start, end) of each part: the header, then one per sample
        position = 0
        while position < len(data):
            (length,) = _LENGTH.unpack_from(data, position)
            self.offsets.append((position + _LENGTH.size, position + _LENGTH.size + length))
            position += _LENGTH.size + length
        if position != len(data) or not self.offsets:
            raise ValueError("a request that does not end where its last part does")
        start, end = self.offsets[0]
        header = _decode(self.data[start:end].decode())
        if header["samples"] != len(self.offsets) - 1:
            raise ValueError(f"a request of {len(self.offsets) - 1} samples says {header['samples']}")
        self.timeout_s = float(header["timeout_s"])
        self.trainer_state: Optional[dict] = header["trainer_state"]
        self.ids = bool(header["ids"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _sample(self, k: int) -> list:
        """Sample ``k``'s row: its five texts and its token ids (or None).

        Raises:
            ValueError: its part does not hold exactly its fields.
        """
        start, end = self.offsets[k + 1]
        data = self.data
        *sizes, count = _FIELDS.unpack_from(data, start)
        at = start + _FIELDS.size
        row: list = []
        for size in sizes:
            row.append(data[at:at + size].decode("utf-8", "surrogatepass"))
            at += size
        if count == NO_IDS:
            row.append(None)
        else:
            row.append(list(struct.unpack_from(f"<{count}q", data, at)))
            at += 8 * count
        if at != end:
            raise ValueError(f"sample {k}'s part does not end where its fields do")
        return row

    def take(self, indices: Sequence[int]) -> SampleBatch:
        """The samples at ``indices``, decoded (raises ValueError once :meth:`close`d)."""
        rows = [self._sample(i) for i in indices]
        if len(rows) == 1:  # a unit of isolation: sample, once per sample: half the time of the general case
            row = rows[0]
            return SampleBatch([row[0]], [row[1]], [row[2]], [row[3]], [row[4]], [row[5]] if self.ids else None)
        columns = [list(column) for column in zip(*rows)] if rows else [[] for _ in range(6)]
        prompts, completions, columns_json, prompt_messages, completion_messages = columns[:5]
        return SampleBatch(prompts, completions, columns_json, prompt_messages, completion_messages,
                           columns[5] if self.ids else None)

    def close(self) -> None:
        self.data.close()


# -- results -----------------------------------------------------------------------------------------------------

def _utf8(text: str, limit: int) -> bytes:
    # A lone surrogate (from model output) cannot be encoded as UTF-8; it becomes U+FFFD, not an exception.
    data = text.encode("utf-8", "replace")
    return data[:limit]


def encode_result(outcomes: Sequence[Outcome], logs: str, dropped: int, max_log_bytes: int,
                  seconds: Optional[float] = None) -> bytes:
    """The worker's answer; ``seconds``: how long the unit took (each of its samples gets it). Never raises for what
    the values or texts contain."""
    took = math.nan if seconds is None else min(seconds, MAX_SECONDS)
    if len(outcomes) == 1 and not logs and not outcomes[0].error and not isinstance(outcomes[0].value, str):
        o = outcomes[0]  # a sample's own answer, the streamed common case
        return _ONE.pack(MAGIC, 1, max(0, dropped), 0, o.status.wire, o.value is not None,
                         0.0 if o.value is None else float(o.value), 0, took)
    parts = [b""]
    for o in outcomes:
        if isinstance(o.value, str):  # a tool's result (the worker checked its size: see worker.tool_result)
            text = _utf8(o.value, MAX_RESULT_BYTES)
            parts.append(_SAMPLE.pack(o.status.wire, RESULT, 0.0, len(text), took))
            parts.append(text)
            continue
        error = _utf8(o.error or "", MAX_ERROR_BYTES)
        parts.append(_SAMPLE.pack(o.status.wire, o.value is not None, 0.0 if o.value is None else float(o.value),
                                  len(error), took))
        parts.append(error)
    log_bytes = _utf8(logs, max_log_bytes + LOG_SLACK_BYTES)
    parts[0] = _HEADER.pack(MAGIC, len(outcomes), max(0, dropped), len(log_bytes))
    parts.append(log_bytes)
    return b"".join(parts)


def result_limit(samples: int, max_log_bytes: int) -> int:
    """The most bytes a well-formed answer for this many samples can have (one sample: a tool's result too)."""
    texts = MAX_RESULT_BYTES if samples == 1 else samples * MAX_ERROR_BYTES
    return _HEADER.size + samples * _SAMPLE.size + texts + max_log_bytes + LOG_SLACK_BYTES


HEADER_SIZE = _HEADER.size
SAMPLE_SIZE = _SAMPLE.size
_OK_WIRE = Status.OK.wire


def frame_header(header: bytes, samples: int, max_log_bytes: int) -> tuple[int, int]:
    """(samples, log bytes) that a streamed answer's header declares, checked against what the request can
    have, so a reader knows how much to read before :func:`decode_result` checks the rest.

    Raises:
        MalformedResult: wrong magic, count or log length.
    """
    magic, count, _, log_length = _HEADER.unpack(header)
    if magic != MAGIC or count != samples or log_length > max_log_bytes + LOG_SLACK_BYTES:
        raise MalformedResult(f"a streamed answer declares {count} samples and {log_length} log bytes"
                              if magic == MAGIC else "a streamed answer does not start with the magic bytes")
    return count, log_length


def _text_bound(has_value: int, samples: int) -> int:
    """The most bytes one sample's text may have: a tool's result (one-sample answers only), else an error."""
    return MAX_RESULT_BYTES if has_value == RESULT and samples == 1 else MAX_ERROR_BYTES


def sample_error_length(head: bytes, samples: int) -> int:
    """The text's length (an error, or a tool's result) that one sample's fixed part declares, in an answer for
    ``samples`` samples.

    Raises:
        MalformedResult: over its bound (:func:`_text_bound`).
    """
    _, has_value, _, length, _ = _SAMPLE.unpack(head)
    if length > _text_bound(has_value, samples):
        raise MalformedResult(f"a sample's {'result' if has_value == RESULT else 'error'} text declares {length} "
                              "bytes")
    return length


def answer_length(data: Union[bytes, bytearray], samples: int, start: int = 0) -> Optional[int]:
    """How long the answer that starts ``data`` is, once enough of it arrived to tell (None before that), so the
    reader stops at its end instead of waiting for the socket to close (a process the sample left behind may hold
    it open). The result is only a length: :func:`decode_result` still checks everything."""
    if len(data) < start + _HEADER.size:
        return None
    _, count, _, log_length = _HEADER.unpack_from(data, start)
    offset = start + _HEADER.size
    for _ in range(min(count, samples)):
        if offset + _SAMPLE.size > len(data):
            return None
        offset += _SAMPLE.size + _SAMPLE.unpack_from(data, offset)[3]
    return offset + log_length - start


def _seconds(value: float) -> Optional[float]:
    """A sample's own time as its process measured it (shown, never used to decide anything), or None when it is
    unknown (NaN) or not a time at all."""
    return value if math.isfinite(value) and 0 <= value <= MAX_SECONDS else None


def decode_clean_units(data: bytearray, start: int, samples: int, units: int, max_log_bytes: int,
                       clean: int, forked: bool = False) -> tuple[list, int]:
    """Parses, from ``start``, up to ``units`` consecutive streamed answers of ``samples`` samples that have all
    arrived, each followed by the trailer byte ``clean``; stops before anything else (a marker, a partial answer).
    Returns (their ChunkResults, where it stopped). ``forked``: see :func:`decode_result`.

    Raises:
        MalformedResult: the first answer, arrived whole, does not parse (one after others that did stops the
        parse there: the error is that unit's, not theirs).
    """
    results: list[ChunkResult] = []
    end = len(data)
    while len(results) < units and start < end and data[start] == MAGIC[0]:
        if samples == 1 and start + _ONE.size < end:
            # The common case in one unpack: one sample, ok, no error text, no output. Anything else (or anything
            # off) takes the general path below, which checks it all.
            magic, count, dropped, log_length, code, has_value, value, error_length, seconds = \
                _ONE.unpack_from(data, start)
            if magic == MAGIC and count == 1 and not (dropped or log_length or error_length) \
                    and code == _OK_WIRE and data[start + _ONE.size] == clean \
                    and (has_value == 0 or (has_value == 1 and math.isfinite(value))):
                results.append(ChunkResult([value if has_value else None], [Status.OK], [""], "", 0,
                                           [_seconds(seconds)]))
                start += _ONE.size + 1
                continue
        length = answer_length(data, samples, start)
        if length is None or start + length >= end or data[start + length] != clean:
            break
        try:
            results.append(decode_result(bytes(data[start:start + length]), samples, max_log_bytes, forked))
        except MalformedResult:
            if results:  # the units before it keep their answers; the caller reads this one again, and blames it
                break
            raise
        start += length + 1
    return results, start


def _walk(data, samples: int, max_log_bytes: int, forked: bool) -> tuple[list, int, int]:
    """Checks a worker's answer for ``samples`` samples field by field, reading it in place (``data``: bytes, or a
    mapping or view of one: nothing of it is copied). Returns ([(status, value or None, text start, text end,
    seconds, whether the text is a tool's result) per sample], where the logs start, dropped characters).

    Raises:
        MalformedResult: anything at all is off.
    """
    if len(data) > result_limit(samples, max_log_bytes):
        raise MalformedResult(f"the worker's answer is {len(data)} bytes, over the bound")
    if len(data) < _HEADER.size:
        raise MalformedResult("the worker's answer is truncated")
    magic, count, dropped, log_length = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or count != samples:
        raise MalformedResult(f"the worker answered for {count} samples, expected {samples}" if magic == MAGIC
                              else "the worker's answer does not start with the format's magic bytes")
    fields = []
    offset = _HEADER.size
    for _ in range(count):
        if offset + _SAMPLE.size > len(data):
            raise MalformedResult("the worker's answer is truncated")
        code, has_value, value, error_length, seconds = _SAMPLE.unpack_from(data, offset)
        offset += _SAMPLE.size
        status = (_FORKED_STATUSES if forked else _WORKER_STATUSES).get(code)
        if status is None or has_value not in (0, 1, RESULT) or error_length > _text_bound(has_value, count):
            raise MalformedResult(f"the worker's answer has an invalid field (status {code}, has_value "
                                  f"{has_value}, text length {error_length})")
        if has_value and (status is not Status.OK or not math.isfinite(value)):
            raise MalformedResult(f"the worker answered value {value} with status {status}")
        if has_value == RESULT and count != 1:
            raise MalformedResult(f"the worker answered a tool's result in an answer for {count} samples")
        if offset + error_length > len(data):
            raise MalformedResult("the worker's answer is truncated")
        fields.append((status, value if has_value == 1 else None, offset, offset + error_length, _seconds(seconds),
                       has_value == RESULT))
        offset += error_length
    if offset + log_length != len(data) or log_length > max_log_bytes + LOG_SLACK_BYTES:
        raise MalformedResult("the worker's answer has a wrong length")
    return fields, offset, dropped


def check_result(data, samples: int, max_log_bytes: int) -> None:
    """Checks a worker's answer as :func:`decode_result` does, without making a copy of any of it (a forked
    request's slot process: :mod:`..processes.forked`).

    Raises:
        MalformedResult: anything at all is off.
    """
    _walk(data, samples, max_log_bytes, forked=False)


def decode_result(data: bytes, samples: int, max_log_bytes: int, forked: bool = False) -> ChunkResult:
    """Parses and validates a worker's answer for ``samples`` samples (``forked``: of a forked request, which may
    report a crash: see _FORKED_STATUSES).

    Raises:
        MalformedResult: anything at all is off.
    """
    fields, logs_start, dropped = _walk(data, samples, max_log_bytes, forked)
    values, errors = [], []
    for _, value, start, end, _, result in fields:
        text = data[start:end].decode("utf-8", "replace")
        values.append(text if result else value)  # a tool's result is the sample's value, as text
        errors.append("" if result else text)
    return ChunkResult(values, [status for status, *_ in fields], errors,
                       data[logs_start:].decode("utf-8", "replace"), dropped,
                       [seconds for _, _, _, _, seconds, _ in fields])
