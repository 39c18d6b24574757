"""The tool calls of each completion, for the run record: name, arguments, what the model was shown, status, time.

TRL runs a rollout's tool calls while it generates and puts them in the completion itself (an assistant message's
``tool_calls``, then one ``{"role": "tool", "name", "content"}`` message per call), which is what the reward
functions, and so the run record, receive. What the conversation does not say is how each call ended in the sandbox
and how long it took: each sandboxed call (a tool of :func:`rewardbox.sandboxed_tools`, a method of a
:func:`rewardbox.sandboxed_environment` episode) notes that in :data:`CALLS` as it ends, and the record pairs the
calls it reads in a completion with those notes (same tool, same arguments, the same text shown; the oldest first).
A call with no note (tools run in-process, or a note pushed out of the bounded log) is recorded from the
conversation alone: ``error`` where the model was shown ``{'error': ...}``, else ``ok``, with no time.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
import time
from typing import Any, Optional

from ..wire import Status

# Calls noted and not yet recorded (a batch of 1,024 rollouts' several times over); the oldest go first. A note keeps
# digests of the arguments and of what was shown (the record writes both from the conversation), and the start of a
# failure's text: a few hundred bytes, at most about 2 KiB, whether or not a record ever reads them.
MAX_NOTES = 16384
MAX_NOTED_ERROR = 2000
MAX_TEXT = 20000  # characters of a call's result or error kept in the record


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: bytes  # digest of the arguments (:func:`arguments_key`)
    shown: bytes  # digest of what the model was shown (TRL's tool message content, as text)
    status: str  # a Status value
    error: Optional[str] = None  # the call's error text (rewardbox's for timeouts, crashes: it names the limit)
    latency_s: Optional[float] = None


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def arguments_key(arguments: Any) -> str:
    """The arguments of a call as comparable text (what TRL parsed from the model, or what a proxy was called with)."""
    try:
        return json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # keys of mixed types: sort_keys cannot order them
        return json.dumps(arguments, ensure_ascii=False, default=str)


def shown_text(content: Any) -> str:
    """A tool message's content as text (TRL's content is ``str(result)``, or the result itself where it is a list)."""
    return content if isinstance(content, str) else str(content)


class CallLog:
    """Notes of ended sandboxed calls not yet taken by a record. Thread-safe (TRL calls tools on its event loop's
    thread, the record reads on its writer's); bounded (:data:`MAX_NOTES`)."""

    def __init__(self, limit: int = MAX_NOTES):
        self._notes: collections.deque = collections.deque(maxlen=limit)
        self._lock = threading.Lock()

    def note(self, name: str, arguments: Any, started: float, status: Status, result: Any = None,
             error: Optional[str] = None) -> None:
        """One call ended: ``result`` (what it returned) when ``status`` is ok, else ``error`` (the text of the
        exception the caller raises, which TRL shows as ``{"error": text}``)."""
        shown = shown_text(result) if status is Status.OK else str({"error": error or ""})
        call = ToolCall(name, _digest(arguments_key(arguments)), _digest(shown), str(status),
                        None if status is Status.OK else (error or "")[:MAX_NOTED_ERROR], time.monotonic() - started)
        with self._lock:
            self._notes.append(call)

    def take(self, name: str, arguments: Any, shown: str) -> Optional[ToolCall]:
        """The oldest note of a call to ``name`` with these arguments that showed ``shown``, removed; None when there
        is none (a note that showed something else is another call's: an ok ``add(1, 2)`` of an earlier run must not
        lend its status to this one's error)."""
        key, shown_digest = _digest(arguments_key(arguments)), _digest(shown)
        with self._lock:
            for i, call in enumerate(self._notes):
                if call.name == name and call.arguments == key and call.shown == shown_digest:
                    del self._notes[i]
                    return call
        return None

    def __len__(self) -> int:
        return len(self._notes)


CALLS = CallLog()  # what every sandboxed tool and environment method of this process notes


def calls_in(completion: Any) -> list[tuple[str, Any, Any]]:
    """(name, arguments, content) of each tool call in a conversational completion, in the order made: each
    assistant message's ``tool_calls``, each paired with the first later tool message of that name (TRL appends a
    turn's results, sync tools' first, right after it). A call with no result (the turn was cut) has content None."""
    if not isinstance(completion, (list, tuple)):
        return []
    found: list = []
    waiting: list = []  # indices into found of calls of the last assistant turn still without a result
    for message in completion:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            waiting = []
            for call in message.get("tool_calls") or ():
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    waiting.append(len(found))
                    found.append([str(function.get("name", "")), function.get("arguments", {}), None])
        elif message.get("role") == "tool":
            for k, i in enumerate(waiting):
                if found[i][0] == message.get("name"):
                    found[i][2] = message.get("content")
                    del waiting[k]
                    break
    return [tuple(call) for call in found]


def record_rows(completion: Any, log: CallLog = CALLS) -> list[tuple]:
    """(position, name, arguments JSON, shown, status, error, latency_s) of each tool call in ``completion``, taking
    each one's note from ``log`` where there is one."""
    rows = []
    for position, (name, arguments, content) in enumerate(calls_in(completion)):
        shown = None if content is None else shown_text(content)
        note = None if shown is None else log.take(name, arguments, shown)
        if note is not None:
            status, error, latency = note.status, note.error, note.latency_s
        elif shown is None:
            status, error, latency = "unanswered", None, None
        else:
            status = str(Status.ERROR) if shown.startswith("{'error': ") else str(Status.OK)
            error, latency = None, None
        rows.append((position, name, arguments_key(arguments), None if shown is None else shown[:MAX_TEXT], status,
                     None if error is None else error[:MAX_TEXT], latency))
    return rows
