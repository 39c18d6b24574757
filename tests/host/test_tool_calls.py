"""Each completion's tool calls in the run record (rewardbox.report.tool_calls, rewardbox.report.record): read from the
conversation TRL builds, paired with the notes sandboxed calls leave (status, time), and written beside the completion's
scores. The conversations are TRL 1.16's own shape (GRPOTrainer._tool_call_loop): an assistant message with
``tool_calls``, then the turn's tool messages, sync tools' results first."""

from __future__ import annotations

import sqlite3
import time
from types import SimpleNamespace

from rewardbox.report.record import RunRecorder
from rewardbox.report.app import Record
from rewardbox.report.tool_calls import CallLog, calls_in, record_rows
from rewardbox.wire import Status
from tests.host.test_record import report


TIMED_OUT = "rewardbox: tool 'slow' timed out: exceeded timeout_s=1"


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation() -> list:
    return [
        {"role": "assistant", "content": "", "tool_calls": [_call("slow", x=1), _call("add", a=1, b=2)]},
        {"role": "tool", "name": "add", "content": "3"},  # a sync tool's result comes first
        {"role": "tool", "name": "slow", "content": str({"error": TIMED_OUT})},  # as TRL writes it
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=1, b=2), _call("add", a=9, b=9)]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "the answer is 3"},
    ]


def test_the_calls_of_a_conversation_pair_each_with_its_own_result_in_the_order_made():
    assert calls_in(_conversation()) == [
        ("slow", {"x": 1}, str({"error": TIMED_OUT})), ("add", {"a": 1, "b": 2}, "3"),
        ("add", {"a": 1, "b": 2}, "3"), ("add", {"a": 9, "b": 9}, None)]  # the last turn was cut: no result
    # what is not a conversation, or not TRL's shape, has no calls (and raises nothing)
    assert calls_in("plain text") == [] and calls_in(None) == []
    assert calls_in([{"role": "assistant", "tool_calls": [None, {"function": "x"}, 3]}, "text", {"role": "tool"}]) == []


def test_each_call_takes_the_note_of_its_own_sandboxed_call_and_a_call_with_none_is_read_from_the_conversation():
    log = CallLog()
    started = time.monotonic() - 0.25
    log.note("add", {"b": 2, "a": 1}, started, Status.OK, result=3)  # the same arguments, another key order
    log.note("slow", {"x": 1}, started, Status.TIMEOUT, error=TIMED_OUT)
    log.note("add", {"a": 5, "b": 5}, started, Status.OK, result=10)  # another completion's
    log.note("slow", {"x": 1}, started, Status.OK, result="done")  # the same call that showed another text
    rows = record_rows(_conversation(), log)
    assert [(r[1], r[4]) for r in rows] == [("slow", "timeout"), ("add", "ok"), ("add", "ok"), ("add", "unanswered")]
    assert rows[0][5] == TIMED_OUT and rows[0][6] >= 0.25
    assert rows[1][6] >= 0.25  # the one note of add(1, 2)
    assert rows[2][6] is None  # no note left for the second add(1, 2): read from the conversation alone
    assert rows[3][3] is None
    assert len(log) == 2  # add(5, 5) and the slow call that showed "done" stay for their own completions
    # in-process tools leave no notes: statuses come from what the model was shown
    plain = record_rows([{"role": "assistant", "tool_calls": [_call("f"), _call("g")]},
                         {"role": "tool", "name": "f", "content": "{'error': 'boom'}"},
                         {"role": "tool", "name": "g", "content": [{"type": "text", "text": "hi"}]}], CallLog())
    assert [(r[1], r[3], r[4], r[6]) for r in plain] == [
        ("f", "{'error': 'boom'}", "error", None), ("g", "[{'type': 'text', 'text': 'hi'}]", "ok", None)]


def test_the_record_holds_each_completions_tool_calls_and_the_report_shows_them(tmp_path):
    path = tmp_path / "record.sqlite"
    recorder = RunRecorder(path, [("a", 1.0)], num_generations=2)
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}]] * 2
    completions = [_conversation(), [{"role": "assistant", "content": "3"}]]
    recorder.observe("a", report("a", [1.0, 0.0]), SimpleNamespace(global_step=2, epoch=0.1), prompts, completions,
                     {})
    recorder.close()
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT completion_id, position, step, name, arguments, shown, status FROM tool_calls "
                          "ORDER BY completion_id, position").fetchall()
    first = rows[0][0]
    assert rows == [(first, 0, 2, "slow", '{"x": 1}', str({"error": TIMED_OUT}), "error"),
                    (first, 1, 2, "add", '{"a": 1, "b": 2}', "3", "ok"),
                    (first, 2, 2, "add", '{"a": 1, "b": 2}', "3", "ok"),
                    (first, 3, 2, "add", '{"a": 9, "b": 9}', None, "unanswered")]
    shown = Record(path).completions({})
    by_id = {r["id"]: r for r in shown["rows"]}
    assert [t["name"] for t in by_id[first]["tool_calls"]] == ["slow", "add", "add", "add"]
    assert by_id[first + 1]["tool_calls"] == []
