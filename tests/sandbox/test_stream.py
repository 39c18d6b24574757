"""The server's reading of a slot process's stream (sandbox_image/protocol/stream.py), rule by rule from a table of byte
sequences: well-formed, truncated (the reader waits, and its state says whom a timeout blames), out of order and
forged (a clear MalformedResult, before anything past a bound is waited for)."""

from __future__ import annotations

import math
import struct

import pytest

from rewardbox.sandbox.protocol import codec, stream
from rewardbox.sandbox.protocol.stream import Marker, State
from rewardbox.wire import Outcome, Status

MAX_LOG = 1000
HEADER = struct.Struct("<4sIQI")
SAMPLE = struct.Struct("<BBdIf")


def ok(value: float) -> bytes:
    return codec.encode_result([Outcome.ok(value)], "", 0, MAX_LOG, 0.001)


def noisy(value: float) -> bytes:
    """An answer off the fast path: an error text and logs."""
    return codec.encode_result([Outcome(None, Status.ERROR, f"boom {value}")], f"printed {value}", 0, MAX_LOG)


def raw(count: int = 1, log_length: int = 0, status: int = Status.OK.wire, has_value: int = 1,
        value: float = 1.0, error_length: int = 0, magic: bytes = codec.MAGIC) -> bytes:
    return HEADER.pack(magic, count, 0, log_length) + SAMPLE.pack(status, has_value, value, error_length, 0.0)


F, C, S = bytes(Marker.FORKING), bytes(Marker.CLEAN), bytes(Marker.STARTED)

# (name, forked, units, stream bytes, values of the answers read, trailers and waits read, final state)
WELL_FORMED = [
    ("two clean units", True, 2, F + ok(1.0) + C + ok(2.0) + C, [1.0, 2.0], [], State.DONE),
    ("answers with error text and logs", True, 2, F + noisy(1.0) + C + noisy(2.0) + C, [None, None],
     [("clean",), ("clean",)], State.DONE),
    ("a deadline moved, then the answer", True, 1, F + stream.waited(500) + ok(1.0) + C, [1.0], [("waited", 0.5)],
     State.DONE),
    ("moves add up within the budget, per unit", True, 2,
     F + stream.waited(600) + stream.waited(400) + ok(1.0) + C + stream.waited(900) + ok(2.0) + C, [1.0, 2.0],
     [("waited", 0.6), ("waited", 0.4), ("waited", 0.9)], State.DONE),
    ("a retiring trailer ends the stream", True, 3, F + ok(1.0) + stream.retire(0, "its /tmp held data") + ok(2.0),
     [1.0], [("retire", 0, "its /tmp held data")], State.DONE),
    ("a reason is ASCII, cut at MAX_REASON", True, 1, F + ok(1.0) + stream.retire(0, "é" * 200), [1.0],
     [("retire", 0, ("\\xe9" * 200)[:stream.MAX_REASON])], State.DONE),
    ("alone: one answer, nothing after it read", False, 1, ok(3.0) + b"anything at all", [3.0], [], State.DONE),
    ("units past the request's are never read", True, 1, F + ok(1.0) + C + b"garbage", [1.0], [], State.DONE),
    ("a crash the slot process concluded (forked)", True, 1,
     F + codec.encode_result([Outcome.failed(Status.CRASH, "worker process died")], "", 0, MAX_LOG) + C,
     [None], [("clean",)], State.DONE),
]

TRUNCATED = [  # (name, forked, units, bytes that arrived, values read so far, state: whom a timeout blames)
    ("nothing after FORKING", True, 1, F, [], State.UNIT),
    ("half an answer", True, 1, F + ok(1.0)[:20], [], State.UNIT),
    ("an answer without its trailer: it is kept", True, 2, F + noisy(1.0), [None], State.TRAILER),
    ("the fast path's answer without its trailer", True, 2, F + ok(1.0), [1.0], State.TRAILER),
    ("half a retire marker", True, 2, F + ok(1.0) + stream.retire(0, "why")[:4], [1.0], State.TRAILER),
    ("a retire marker without all its reason", True, 2, F + ok(1.0) + stream.retire(0, "why")[:-1], [1.0],
     State.TRAILER),
    ("half a WAITED marker", True, 1, F + stream.waited(10)[:3], [], State.UNIT),
    ("not even the FORKING byte", True, 1, b"", [], State.FORKING),
    ("alone: half an answer", False, 1, ok(1.0)[:-3], [], State.UNIT),
]

FORGED = [  # (name, forked, units, bytes, what the error says)
    ("no FORKING byte first", True, 1, C + ok(1.0) + C, "did not start with its FORKING byte"),
    ("a trailer before any answer", True, 1, F + C, "does not start with the magic bytes"),
    ("a second answer where the trailer belongs", True, 2, F + noisy(1.0) + noisy(2.0), "where a unit's trailer"),
    ("answers for two samples in a one-sample unit", True, 1, F + raw(count=2), "declares 2 samples"),
    ("wrong magic", False, 1, raw(magic=b"RBX9"), "does not start with the magic bytes"),
    ("an error text past its bound, before it arrives", True, 1,
     F + raw(has_value=0, error_length=codec.MAX_ERROR_BYTES + 1), "error text declares"),
    ("logs past their bound, before they arrive", True, 1,
     F + HEADER.pack(codec.MAGIC, 1, 0, MAX_LOG + codec.LOG_SLACK_BYTES + 1), "log bytes"),
    ("a deadline moved past the budget", True, 1, F + stream.waited(700) + stream.waited(400),
     "deadline moved 1.100 s"),
    ("a value that is not finite", True, 1, F + raw(value=math.nan) + C, "answered value nan"),
    ("a value with a failed status", True, 1, F + raw(status=Status.ERROR.wire) + C, "with status error"),
    ("alone: a crash the process cannot report of itself", False, 1,
     raw(status=Status.CRASH.wire, has_value=0), "invalid field"),
    ("a status no one knows", True, 1, F + raw(status=99, has_value=0) + C, "invalid field"),
    ("has_value neither 0 nor 1", True, 1, F + raw(has_value=7) + C, "invalid field"),
    ("a WAITED marker alone: not in a forked stream", False, 1, stream.waited(1), "magic bytes"),
    ("a WAITED marker of no time (endless, else)", True, 1, F + stream.waited(0), "WAITED marker of 0 ms"),
    ("a WAITED marker under the least extension", True, 1, F + stream.waited(9), "WAITED marker of 9 ms"),
]


def read(forked: bool, units: int, data: bytes, byte_by_byte: bool = False, budget_s: float = 1.0,
         per_unit: int = 1):
    reader = stream.StreamReader(units, per_unit, MAX_LOG, forked, budget_s, 0.01)
    values, marks = [], []
    for chunk in ([data[i:i + 1] for i in range(len(data))] if byte_by_byte else [data]):
        reader.feed(chunk)
        while (event := reader.next()) is not None:
            if isinstance(event, stream.Answered):
                values += [v for r in event.results for v in r.values]
            elif isinstance(event, stream.Waited):
                marks.append(("waited", event.seconds))
            elif event.reason is None:
                marks.append(("clean",))
            else:
                marks.append(("retire", event.index, event.reason))
    return values, marks, reader.state


@pytest.mark.parametrize("byte_by_byte", [False, True], ids=["whole", "byte-by-byte"])
@pytest.mark.parametrize("name,forked,units,data,values,marks,state", WELL_FORMED, ids=[c[0] for c in WELL_FORMED])
def test_well_formed_streams_read_the_same_however_they_arrive(name, forked, units, data, values, marks, state,
                                                                byte_by_byte):
    got_values, got_marks, got_state = read(forked, units, data, byte_by_byte)
    assert got_values == values
    # The fast path reads clean units with their trailers at once; one at a time, each trailer is an event.
    assert [m for m in got_marks if m != ("clean",)] == [m for m in marks if m != ("clean",)]
    assert got_state is state


@pytest.mark.parametrize("name,forked,units,data,values,state", TRUNCATED, ids=[c[0] for c in TRUNCATED])
def test_a_truncated_stream_waits_and_its_state_says_whom_a_timeout_blames(name, forked, units, data, values, state):
    for byte_by_byte in (False, True):
        got_values, _, got_state = read(forked, units, data, byte_by_byte)
        assert (got_values, got_state) == (values, state)


@pytest.mark.parametrize("name,forked,units,data,message", FORGED, ids=[c[0] for c in FORGED])
def test_forged_or_out_of_order_bytes_are_a_malformed_answer(name, forked, units, data, message):
    for byte_by_byte in (False, True):
        with pytest.raises(codec.MalformedResult, match=message.replace(".", r"\.")):
            read(forked, units, data, byte_by_byte)


def test_a_batch_style_unit_reads_all_its_samples_once_each_however_it_arrives(monkeypatch):
    """One unit of many samples (a batch-style call), forked and alone: every sample's fixed part is scanned once,
    however many pieces the answer comes in (a scan from the answer's start on each piece was quadratic)."""
    n = 500
    outcomes = [Outcome.ok(float(i)) if i % 3 else Outcome(None, Status.ERROR, f"err {i}") for i in range(n)]
    answer = codec.encode_result(outcomes, "some logs", 0, MAX_LOG)
    scans = []
    real = codec.sample_error_length
    monkeypatch.setattr(codec, "sample_error_length", lambda head, samples: scans.append(1) or real(head, samples))
    for forked, data in ((True, F + answer + C), (False, answer)):
        for piece in (len(data), 22):
            scans.clear()
            reader = stream.StreamReader(1, n, MAX_LOG, forked, 1.0, 0.01)
            values = []
            for i in range(0, len(data), piece):
                reader.feed(data[i:i + piece])
                while (event := reader.next()) is not None:
                    if isinstance(event, stream.Answered):
                        values += [v for r in event.results for v in r.values]
            assert values == [o.value for o in outcomes] and reader.state is State.DONE
            assert len(scans) == n


def test_a_broken_answer_after_clean_ones_in_one_piece_is_blamed_on_its_own_unit():
    """Units that answered well keep their answers when a later one in the same piece breaks the format: the error is
    the broken unit's (the reader stands at it), not the first unit's."""
    reader = stream.StreamReader(3, 1, MAX_LOG, True, 1.0, 0.01)
    reader.feed(F + ok(1.0) + C + ok(2.0) + C + raw(value=math.nan) + C)
    event = reader.next()
    assert isinstance(event, stream.Answered) and [r.values[0] for r in event.results] == [1.0, 2.0]
    assert reader.answered == 2 and reader.state is State.UNIT
    with pytest.raises(codec.MalformedResult, match="answered value nan"):
        reader.next()
    assert reader.answered == 2


def test_a_declared_length_is_refused_before_its_bytes_are_waited_for():
    """A header that declares logs past the bound is refused with only its own bytes here: the server never waits
    for (or buffers) what a hostile stream declares."""
    reader = stream.StreamReader(1, 1, MAX_LOG, True, 1.0)
    reader.feed(F + HEADER.pack(codec.MAGIC, 1, 0, 1 << 30))
    with pytest.raises(codec.MalformedResult):
        reader.next()


def test_markers_are_one_byte_each_and_distinct_on_their_channel():
    for channel in (stream.Marker, stream.ChildMarker, stream.SlotMarker):
        values = [bytes(m) for m in channel]
        assert all(len(v) == 1 for v in values) and len(set(values)) == len(values)
    # An answer starts with the magic bytes, which no marker of the stream may be mistaken for.
    assert codec.MAGIC[:1] not in {bytes(m) for m in stream.Marker}
    assert S == b"S"


# -- a tool's result (has value 2: codec) ---------------------------------------------------------------------------

def result(text: str) -> bytes:
    return codec.encode_result([Outcome(text, Status.OK)], "", 0, MAX_LOG, 0.001)


def test_a_tools_result_is_read_as_text_in_a_one_sample_answer_and_streamed():
    text = "j" + '{"a": "é"}' * 10_000  # past an error text's bound, within a result's
    data = result(text)
    decoded = codec.decode_result(data, 1, MAX_LOG, forked=True)
    assert (decoded.values, decoded.statuses, decoded.errors) == ([text], [Status.OK], [""])
    reader = stream.StreamReader(1, 1, MAX_LOG, forked=True)
    reader.feed(F + data + C)
    answered = reader.next()
    assert isinstance(answered, stream.Answered) and answered.results[0].values == [text]


@pytest.mark.parametrize("name,data,samples,message", [
    # a one-sample answer's bound is what lets a result be longer than an error text: a many-sample one has none
    ("a result in an answer for two samples", raw(count=2, has_value=2, value=0.0, error_length=1) + b"j"
     + SAMPLE.pack(Status.OK.wire, 0, 0.0, 0, 0.0), 2, "a tool's result in an answer for 2 samples"),
    ("a result past its bound", raw(has_value=2, value=0.0, error_length=codec.MAX_RESULT_BYTES + 1), 1,
     "invalid field"),
    ("a result with a failure's status", raw(status=Status.ERROR.wire, has_value=2, value=0.0, error_length=1)
     + b"j", 1, "with status"),
    ("a has value past 2", raw(has_value=3, value=0.0), 1, "invalid field"),
])
def test_forged_tool_results_are_malformed(name, data, samples, message):
    with pytest.raises(codec.MalformedResult, match=message):
        codec.decode_result(data, samples, MAX_LOG, forked=True)


def test_a_result_past_its_bound_is_refused_before_it_arrives():
    reader = stream.StreamReader(1, 1, MAX_LOG, forked=True)
    reader.feed(F + raw(has_value=2, value=0.0, error_length=codec.MAX_RESULT_BYTES + 1))
    with pytest.raises(codec.MalformedResult, match="result text declares"):
        reader.next()


def test_the_server_takes_a_result_only_from_a_tool_and_a_score_only_from_a_reward():
    from rewardbox.sandbox.protocol.records import ChunkResult
    from rewardbox.sandbox.server.server import _results

    answers = ChunkResult(["jtext", 1.0, None, None], [Status.OK, Status.OK, Status.OK, Status.ERROR],
                          ["", "", "", "boom"])
    _results(answers, tool=False)
    assert answers.statuses == [Status.INVALID, Status.OK, Status.OK, Status.ERROR]
    assert answers.errors[0] == "the worker answered a tool's result for a reward" and answers.values[0] is None
    answers = ChunkResult(["jtext", 1.0, None, None], [Status.OK, Status.OK, Status.OK, Status.ERROR],
                          ["", "", "", "boom"])
    _results(answers, tool=True)
    assert answers.statuses == [Status.OK, Status.INVALID, Status.INVALID, Status.ERROR]
    assert answers.values == ["jtext", None, None, None]
