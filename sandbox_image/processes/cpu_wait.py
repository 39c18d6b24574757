"""How long a unit's processes waited for a CPU that others held, so that its deadline does not charge it.

``timeout_s`` bounds the time a sample takes. Samples of a sandbox share its CPUs, and Linux shares them per task:
a sample that forks as many busy processes as its process limit allows holds most of them while it runs, and an
innocent sample beside it, in another slot, may then need many times its own time and end ``timeout`` (red team 9).
No limit set from inside the container can make the share per sample (that takes a cgroup per slot, and the
container's cgroups are read-only).

What the kernel does tell (``/proc/<pid>/task/<tid>/schedstat``, second field) is how long each task was runnable but
not running. A unit whose processes were never runnable more than one at a time did not compete with itself: what
they waited, others took from it, and its deadline moves by as much, up to :func:`most_forgiven_s` more in all
(:mod:`.forked`, which tells the server, whose deadline for the unit moves with it). A unit with two or more tasks
runnable at once (the sample that forks the busy processes, a multi-threaded one) gets nothing: its own tasks made
it wait.

The slot process looks at the unit's processes (every descendant of its own: the slot's uid runs nothing else) at
random moments while the unit runs, 20 ms apart on average by its clock, whatever else wakes it (:meth:`Watch.look`;
a unit that ends before the first costs nothing), and once more at the deadline. The gaps are exponential: however
long since the last look, the next is as likely to come at once. Only what a task waited between two looks that
both saw it counts: a task first seen at the deadline earns nothing, and so does a unit whose looks were kept from
happening. To be forgiven its own contention, a unit would have to keep its busy processes asleep whenever a look
comes, and it cannot know when (the moments come from ``os.urandom``); what it would win is at most
:func:`most_forgiven_s` more. Red team 10: the first version looked only when its wait timed out, so a unit that
sent its slot process a SIGCHLD every 2 ms stopped every look but the one at the deadline, hid its 8 spinners
around it, and lived 2x ``timeout_s``. Red team 11 saw each look in the slot process's ``/proc`` state and timed its
spinners to the 10 ms that then always passed before the next look (it was still caught: a spinner left waiting).

A process that runs samples itself (the first units of a request before the server knows the reward's samples taint
their processes, ``isolation: process``, ``worker``) has no one to watch it: its own timer decides, at the timeout,
with one look at its own tasks and descendants (:func:`own_extension_s`). Reward code that ran there could change
that decision, as it could switch the timer off; either way the server's deadline for the unit still ends it, so
the extension stays within that deadline's margin: ``OWN_BUDGET_S`` per request, in all.

Not measured: gVisor has no ``schedstat`` (there a deadline is wall-clock, as before). Programs a sample runs through
the runner (:mod:`..programs.execution`) are not its descendants (another uid's, the runner's children): a forked unit
that called the runner is forgiven nothing, as its programs may be what kept it waiting, and their own timeouts stay
wall-clock.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ...wire import HARD_TIMEOUT_MARGIN_S
from . import tree

AVAILABLE = os.path.exists("/proc/self/schedstat")
# A unit with more processes than this is not looked at further (no forgiveness): each look reads a few files per
# task, and a sample that runs this many at once has its own tasks to blame.
MAX_TASKS = 64
MIN_EXTENSION_MS = 10  # a wait for a CPU shorter than this does not move a deadline
# What a process that runs samples itself may add to their deadlines per request (the server's deadline for a unit is
# its timeout plus HARD_TIMEOUT_MARGIN_S: half of that is left for the answer to arrive).
OWN_BUDGET_S = HARD_TIMEOUT_MARGIN_S / 2
_RUNNABLE = frozenset(b"RTt")  # running or waiting for a CPU; or stopped (it may be continued when nobody looks)


def most_forgiven_s(timeout_s: float) -> float:
    """The most a forked unit's deadline may move: as long as any other sample can hold the CPUs. A sample that
    blocks its own process's timer (one its slot process runs itself) runs until the server's deadline for it,
    timeout_s + HARD_TIMEOUT_MARGIN_S (red team 11: with timeout_s 1, such a hog outlived the timeout_s an innocent
    beside it was given, and the innocent ended ``timeout``)."""
    return timeout_s + HARD_TIMEOUT_MARGIN_S


class Watch:
    """The run-queue waits of one unit's processes, from a slot process that is their subreaper (:mod:`.forked`)."""

    __slots__ = ("sequential", "seen_ns", "credited_ns")

    def __init__(self) -> None:
        self.sequential = AVAILABLE  # no two of its tasks were seen runnable at once (yet)
        self.seen_ns: dict = {}  # task id: its wait for a CPU at the last look (ns)
        self.credited_ns = 0  # what its tasks waited between two looks that each saw them

    def look(self, roots: Optional[list] = None) -> None:
        """Notes the wait of each live task of ``roots`` and their descendants (default: this subreaper's children),
        and credits what each waited since the last look, where that look saw it too; a second runnable task ends
        the unit's forgiveness for good."""
        if not self.sequential:
            return
        runnable = 0
        seen: dict = {}
        todo = list(tree.children() or ()) if roots is None else list(roots)
        while todo:
            pid = todo.pop()
            for tid in _tasks(pid):
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
                if stat is None:  # gone since it was listed
                    continue
                state = stat[stat.rfind(b")") + 2]
                if state in b"ZX":
                    continue
                if state in _RUNNABLE:
                    runnable += 1
                if runnable > 1 or len(seen) >= MAX_TASKS:
                    self.sequential = False
                    return
                waited = _run_delay_ns(pid, tid)
                if waited is not None:
                    seen[tid] = waited
                todo += _children(pid, tid)
        # A task first seen now earns nothing for what it waited before (no look saw how it waited then); one that
        # slept whenever a look came would have had to know when they come: they come at random moments.
        for tid, waited in seen.items():
            before = self.seen_ns.get(tid)
            if before is not None and waited > before:
                self.credited_ns += waited - before
        self.seen_ns = seen

    def forgiven_s(self) -> float:
        """What the unit's tasks waited for a CPU between looks that saw no two of them runnable, in seconds."""
        return self.credited_ns / 1e9 if self.sequential else 0.0


# This process's waits when its request began; what it may still add.
_own: dict[str, Any] = {"base_ns": None, "budget_s": 0.0}


def begin_request() -> None:
    """In a process that runs samples itself, before a request's first sample: its waits from now on count, and it
    may add up to OWN_BUDGET_S to its samples' deadlines."""
    _own["base_ns"] = _own_waits_ns() if AVAILABLE else None
    _own["budget_s"] = OWN_BUDGET_S


def own_extension_s() -> float:
    """At a sample's timeout, in the process that runs it: how much later it may end (0: none). What this process
    and its descendants waited for a CPU since the request began, less what its samples were given already, within
    what is left of OWN_BUDGET_S; nothing where two of them were runnable at once."""
    base, budget = _own["base_ns"], _own["budget_s"]
    if base is None or budget * 1000 < MIN_EXTENSION_MS:
        return 0.0
    watch = Watch()
    watch.look([os.getpid()])
    waited = (sum(watch.seen_ns.values()) - base) / 1e9 if watch.sequential else 0.0
    extra = min(waited - (OWN_BUDGET_S - budget), budget)
    if extra * 1000 < MIN_EXTENSION_MS:
        return 0.0
    _own["budget_s"] = budget - extra
    return extra


def _own_waits_ns() -> int:
    return sum(_run_delay_ns(os.getpid(), tid) or 0 for tid in _tasks(os.getpid()))


def _read(path: str) -> Optional[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _tasks(pid: int) -> list:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []


def _children(pid: int, tid: int) -> list:
    data = _read(f"/proc/{pid}/task/{tid}/children")
    return [int(child) for child in data.split()] if data else []


def _run_delay_ns(pid: int, tid: int) -> Optional[int]:
    data = _read(f"/proc/{pid}/task/{tid}/schedstat")
    fields = data.split() if data else []
    return int(fields[1]) if len(fields) >= 2 else None
