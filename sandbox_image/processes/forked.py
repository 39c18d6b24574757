"""``isolation: sample``: each unit (a sample; a batch-style call) in a child of a slot process.

Any process in which a reward scored a sample may keep something of it: a decimal context's flags, a cache, a
parser's buffer, a library's globals, whatever the reward's own code (or model text it evaluates) changed. So no
process that scored one unit scores another: the slot process runs each unit in a child of its own, which inherits
all the slot process was given (its uid, its private ``/tmp``, the seccomp filter, the limits, the niceness) and
nothing any unit did, as the slot process runs no reward code on data, ever. This holds by construction, for every
reward and every unit, whatever the reward's code does: nothing decides whether a process "looks" clean. A fresh
slot process for each unit would give the same, at several times the cost (a uid change, a user and a mount
namespace, seccomp, limits, and the template's own copy-on-write faults after every fork). The child decodes its own
sample from the request's mapping and unmaps the rest before the reward sees it (:class:`..protocol.codec.Request`).

Before the next child starts, everything a unit left is gone:

- every process of the slot's uid is killed and reaped. The slot process is the subreaper of all it forks, so every
  process of its uid is its descendant; Linux's ``kill(-1)`` reaches them all at once (no fork can pass it), and
  once ``waitpid`` finds no child left, none is left anywhere (no ``/proc`` scan is needed). gVisor's ``kill(-1)``
  is not atomic, and there an orphan need not come back to its subreaper: under gVisor each unit runs in a slot
  process of its own, and the template's next process for the slot cleans up (:func:`.slot.prepare`);
- what its processes left in flight in a cycle of Unix sockets is freed
  (:meth:`..memory.sockets.UnixSockets.wait_for_in_flight`): a listening socket there keeps its port until then, and the
  next sample's ``bind()`` to it would fail;
- its ``/tmp`` (the slot's scratch tmpfs) is emptied;
- the child's socket to the program runner is its own (:func:`runner_socket`), so a child killed halfway through a
  request leaves no half frame for the next. The runner is sent it only once the child first writes to it, and
  then lets go of it (with what the child left in flight there) before the next child starts
  (:func:`..programs.run_requests.release`).

The child writes its answer (a length, then one answer in the format the server reads: :mod:`..protocol.codec`) into a
memory mapping it shares with the slot process, then one byte into a pipe. The slot process waits for that byte by the
unit's deadline (or until it reaps the child without it: the child's own forks may hold the pipe open), cleans up
(so nothing can change the answer any more), checks the answer in place as the server would, and sends it from the
mapping, which it then unmaps: no child's answer (its output, its error text) ever passes through the slot
process's heap, where the next child, a copy of it, could find it. An answer that breaks the format, or none,
becomes the unit's failure, written by this trusted code.

What a child can still do to the slot process: signal it (they share a uid), and only while its own unit runs (its
descendants are gone before the next one starts). Each answer leaves the slot process before the next child starts
(:func:`.slot._score_forked`), so the server blames whatever then stalls or ends the slot process on the first unit
it has no answer for: stopping it (SIGSTOP) makes that unit a ``timeout``, as a sample that hangs, killing it a
``crash``; the template replaces the slot process, and the batch goes on.
"""

from __future__ import annotations

import _signal
import math
import mmap
import os
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ...wire import Outcome, Status
from ..confine import private_tmp
from ..memory import sockets
from ..programs import run_requests
from ..protocol import codec
from ..protocol.stream import ChildMarker
from . import cpu_wait, import_effects, tree

_LENGTH = struct.Struct("<I")
DONE = ChildMarker.DONE  # the child wrote its answer
# The child sets no timer of its own (:func:`.worker._timed`: three system calls and the pages they touch, in every
# child): the slot process kills it at the unit's deadline, its timeout_s from the fork and this for the child's own
# start (its fork and its sample's decoding take about a millisecond), and answers ``timeout``. Well under the
# server's HARD_TIMEOUT_MARGIN_S, so the server still gets this unit's answer in time.
START_ALLOWANCE_S = 0.05
# Bound at import: these calls are this trusted code's, whatever a reward replaces in the signal module.
_set_handler, _set_wakeup_fd = _signal.signal, _signal.set_wakeup_fd


@dataclass
class Forker:
    """What a slot process needs to run units in children: descriptors no child may hold (the template's socket),
    its own socket to the runner, and its ``/tmp``."""

    close: tuple
    runner: Optional[socket.socket]
    scratch: str
    unix_sockets: sockets.UnixSockets  # its uid's, for what a unit left in flight
    reaper: bool = False
    wake: tuple = ()

    def arm(self) -> None:
        """Before a request's first unit: each SIGCHLD from now on writes a byte into a pipe that the wait for a
        unit's child watches (:meth:`_Unit.wait`), so what a unit's forks orphan is reaped at once, as the template does
        for its slot processes (a fork storm's zombies would otherwise fill the uid's process limit between two
        reaps). Once per request, not per unit: each child puts SIGCHLD back as it was (:func:`_quiet`)."""
        if not self.reaper:
            tree.become_subreaper()  # what its children leave becomes its own child: see kill_descendants
            self.reaper = True
            self.wake = os.pipe()
            for fd in self.wake:
                os.set_blocking(fd, False)
        _set_wakeup_fd(self.wake[1])
        _set_handler(signal.SIGCHLD, _ignore)

    def disarm(self) -> None:
        """After a request's last unit (reward code may run in this process again: SIGCHLD as it was)."""
        _quiet()
        if self.wake:
            _drain(self.wake[0])

    def run(self, score: Callable[[], bytes], samples: int, timeout_s: float, max_log_bytes: int,
            request_fd: int, attach: Callable[[Optional[int]], None],
            send: Callable[[memoryview, Optional[str]], None], waited: Callable[[int], None]) -> Optional[str]:
        """Runs ``score`` (which returns one unit's encoded answer) in a child, cleans up after it, and calls
        ``send(answer, retire)`` with its answer, checked, or the unit's failure, and why the slot process must
        retire (None: it may go on), which it also returns. The request's socket ``request_fd`` is closed in the
        child; ``attach(fd)`` gives the child its runner socket. ``waited(ms)`` tells the server that the unit's
        deadline moved by that many milliseconds (its processes waited as long for a CPU others held:
        :mod:`.cpu_wait`).
        Between :meth:`arm` and :meth:`disarm`."""
        limit = codec.result_limit(samples, max_log_bytes)
        # Shared with the child, which writes its answer there: the answer never passes through this process's heap,
        # where the next child (a copy of this process) could find it.
        answer = mmap.mmap(-1, _LENGTH.size + limit)
        try:
            return self._run(answer, score, samples, timeout_s, max_log_bytes, request_fd, attach, send, waited)
        finally:
            answer.close()

    def _run(self, answer: mmap.mmap, score: Callable[[], bytes], samples: int, timeout_s: float,
             max_log_bytes: int, request_fd: int, attach: Callable, send: Callable,
             waited: Callable[[int], None]) -> Optional[str]:
        child_end, runner_end = runner_socket(self.runner)
        read_end, write_end = os.pipe()
        # All that the wait needs is made before the fork: a page this process writes while the child lives is
        # copied (the child holds the original), several times the cost of the same write once the child is gone.
        unit = _Unit(self.runner, runner_end, read_end, self.wake[0], timeout_s, waited)
        os.set_blocking(read_end, False)  # what the child forked may hold the write end after it ended: see wait
        try:
            unit.pid = os.fork()
        except OSError as e:
            for fd in (read_end, write_end, *(() if child_end is None else (child_end,))):
                os.close(fd)
            if runner_end is not None:
                runner_end.close()
            send(_failure(samples, max_log_bytes, Status.ERROR,
                          f"rewardbox could not start this sample's process: {e}"), None)
            return None
        if unit.pid == 0:
            code = 70
            try:
                _quiet()  # SIGCHLD's default action, and no wake-up descriptor (it is this process's to close)
                # Descriptors 0-2 of its own: the slot process's /dev/null is one open file that every child would
                # share, with its flock and open-file locks and its status flags (red team of #40: a hostile's
                # flock(0) held every later sample's lock on /dev/null).
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.close(null)
                import_effects.give_back()  # the import's signal handlers, hooks and replaced functions
                tree.set_name("rbx-sample")
                private_tmp.make_dumpable()  # seen by this process's looks at its tree (cpu_wait) despite hidepid
                os.close(read_end)
                for fd in (request_fd, *self.close, *self.wake, self.unix_sockets.fileno(),
                           *(() if runner_end is None else (runner_end.fileno(),))):
                    if fd >= 0:
                        os.close(fd)
                attach(child_end)
                data = score()
                answer[:_LENGTH.size] = _LENGTH.pack(len(data))
                if len(data) <= len(answer) - _LENGTH.size:
                    answer[_LENGTH.size:_LENGTH.size + len(data)] = data
                os.write(write_end, DONE)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        if child_end is not None:
            os.close(child_end)
        try:
            failed, why = unit.wait()
        finally:
            # First: nothing of the unit is left (its memory gone with it: what this process writes from here on
            # is no longer copied).
            status, retire = None, None
            try:
                status = tree.kill_descendants(unit.pid)
            except OSError as e:
                retire = f"what a sample left could not be removed: {e}"
            os.close(read_end)
            if runner_end is not None:
                runner_end.close()
        status = unit.reaped.get(unit.pid, status)
        if unit.handed is not None and not (unit.handed and self.runner is not None
                                            and run_requests.release(self.runner)):
            # Its next process gets a socket of its own, and with it a monitor of its own.
            retire = retire or "the program runner is gone, or did not let go of a finished sample's socket"
        try:
            _drain(self.wake[0])  # its SIGCHLDs' bytes would wake the next unit's wait for nothing
            # What its processes left in flight in a cycle of Unix sockets is freed first (a few milliseconds where
            # any is left): a listener riding there holds its port, an unlinked file the bytes of this /tmp.
            self.unix_sockets.wait_for_in_flight()
            if tree.empty_own_tmpfs(self.scratch):
                # Held by something no kill reaches (gVisor: a Unix socket sent over itself): the slot's next
                # process gets a fresh tmpfs (slot.prepare).
                retire = retire or "its /tmp still holds data no file name reaches"
        except OSError as e:
            retire = retire or f"what a sample left could not be removed: {e}"
        if failed is Status.OK:  # nothing of the uid is left: the answer holds still while it is checked and sent
            (length,) = _LENGTH.unpack_from(answer, 0)
            limit = len(answer) - _LENGTH.size
            try:
                if length > limit:
                    raise codec.MalformedResult(f"the answer declared {length} bytes, over the limit of {limit}")
                with memoryview(answer) as whole, whole[_LENGTH.size:_LENGTH.size + length] as view:
                    codec.check_result(view, samples, max_log_bytes)
                    send(view, retire)
                return retire
            except codec.MalformedResult as e:
                failed, why = Status.INVALID, str(e)
        if failed is Status.TIMEOUT:
            why = f"exceeded timeout_s={timeout_s:g}; the worker was killed"
            if unit.granted_ms:
                why += f" ({unit.granted_ms / 1000:.2f} s after it, as long as it waited for a CPU that others held)"
        elif failed is Status.INVALID:
            why = f"malformed answer from the worker: {why}"
        else:
            details = tree.describe_status(status) if status is not None else ""
            why = f"worker process died ({details})" if details else "worker process died"
        send(_failure(samples, max_log_bytes, failed, why), retire)
        return retire


class _Unit:
    """One unit's child, as its slot process watches it until it answers, ends or passes its deadline: the pipe its
    done byte comes through, the SIGCHLD wake-up pipe, the runner's end of its runner socket until the child wants
    it, what exited of its processes, and how far its deadline moved for waits for a CPU. Made before the fork (see
    :meth:`Forker._run`); ``pid`` is set by it."""

    def __init__(self, runner: Optional[socket.socket], runner_end: Optional[socket.socket], done: int, woken: int,
                 timeout_s: float, waited: Callable[[int], None]):
        self.runner, self.runner_end, self.done, self.woken = runner, runner_end, done, woken
        self.timeout_s, self.waited = timeout_s, waited
        self.pid = 0
        # Once the child first wrote to (or closed) its runner socket: whether the runner took it (None: not yet)
        self.handed: Optional[bool] = None
        self.reaped: dict = {}  # the wait status of each process reaped while the unit ran (the child's, where it was)
        self.watch = cpu_wait.Watch()
        self.granted_ms = 0  # how far the deadline moved
        self.first_look = look_interval()
        self.poller = _poller(done, woken, runner_end)

    def hand_over_runner(self) -> None:
        """The child wants the runner (or will never call it): its end is the runner's now."""
        assert self.runner is not None and self.runner_end is not None  # only a runner's end is watched (_poller)
        self.poller.unregister(self.runner_end)
        self.handed = hand_over(self.runner, self.runner_end)
        if not self.handed:  # the runner is gone: the child's program calls end now (EOF), not at its deadline
            self.runner_end.close()

    def reap(self) -> None:
        """What the unit's own forks orphan comes to this process (their subreaper): a zombie still counts toward
        the uid's process limit, so left unreaped until the unit ends, they would stop its forks halfway."""
        for child, wait_status in tree.exited_children():
            self.reaped[child] = wait_status

    def ended(self) -> bool:
        return self.pid in self.reaped

    def extend(self) -> float:
        """At the deadline: what the unit's processes waited for a CPU that others held is added to it, up to
        cpu_wait.most_forgiven_s in all; the server's deadline for the unit moves with it (whole milliseconds).
        Returns how much later it is now (0: it passed)."""
        if self.handed is not None:  # its programs ran beside it, out of its tree (another uid): its wait may be theirs
            return 0.0
        self.watch.look()
        allowed_ms = math.ceil(min(self.watch.forgiven_s(), cpu_wait.most_forgiven_s(self.timeout_s)) * 1000)
        extra_ms = allowed_ms - self.granted_ms
        if extra_ms < cpu_wait.MIN_EXTENSION_MS:
            return 0.0
        self.granted_ms = allowed_ms
        self.waited(extra_ms)
        return extra_ms / 1000

    def wait(self) -> tuple[Status, str]:
        """Waits for the child's done byte from the fork on, by the unit's deadline (its timeout_s plus
        START_ALLOWANCE_S): (ok when it came, timeout when the deadline passed first, crash when the pipe closed
        without it or the child was reaped without it, invalid when something else came; and what to add).
        Meanwhile, the first time the child writes to (or closes) its runner socket, it hands that over
        (:meth:`hand_over_runner`), and it reaps whenever the SIGCHLD pipe is readable. From the first look on, at
        random moments about REAP_EVERY_S apart by the clock, whatever else woke it, it reaps and looks at the
        unit's waits for a CPU (cpu_wait); at the deadline, :meth:`extend` may move it."""
        started = time.monotonic()
        deadline = started + self.timeout_s + START_ALLOWANCE_S
        next_look = started + self.first_look
        while True:
            now = time.monotonic()
            if now >= next_look:
                _drain(self.woken)
                self.reap()
                self.watch.look()
                next_look = now + look_interval()
                if self.ended():
                    break
            left = deadline - now
            events = self.poller.poll(min(left, next_look - now) * 1000) if left > 0 else []
            if any(fd == self.done for fd, _ in events):
                break
            if any(fd == self.woken for fd, _ in events):
                _drain(self.woken)
                self.reap()
                if self.ended():
                    # The child wrote its byte before it exited, or never will: the processes it forked may hold
                    # the pipe open until the deadline (a sample that died beside its forks was a ``timeout`` there).
                    break
                continue
            if not events:
                if time.monotonic() < deadline:  # a look's moment came
                    continue
                later = self.extend()
                if later:
                    deadline += later
                    continue
                return Status.TIMEOUT, ""
            # Only the runner's end is watched besides the two pipes (_poller).
            self.hand_over_runner()
        try:
            byte = os.read(self.done, 1)
        except BlockingIOError:  # the child ended without it
            byte = b""
        if not byte:
            return Status.CRASH, ""
        return (Status.OK, "") if byte == DONE else (Status.INVALID, f"{byte!r} came where the done byte belongs")


def send_with_trailer(sock: socket.socket, answer, trailer: bytes) -> None:
    """Sends a unit's ``answer`` (a view of the child's mapping, or bytes) and its ``trailer`` in one system call
    where the socket takes them whole: the server reads both in one wake-up. The answer is never copied here."""
    sent = sock.sendmsg([answer, trailer], [], socket.MSG_NOSIGNAL)
    if sent < len(answer):
        with memoryview(answer) as view, view[sent:] as rest:
            sock.sendall(rest, socket.MSG_NOSIGNAL)
        sent = len(answer)
    if sent < len(answer) + len(trailer):
        # Nothing more once the trailer is out: the server may have closed its end on reading it, and any further
        # write (even an empty one) would fail with EPIPE.
        sock.sendall(trailer[sent - len(answer):], socket.MSG_NOSIGNAL)


def runner_socket(runner: Optional[socket.socket]) -> tuple[Optional[int], Optional[socket.socket]]:
    """A fresh socket to the program runner for one child: (the child's end, the other end), (None, None) without a
    runner. The slot process keeps the other end until the child first writes to its own (or closes it), and only
    then hands it to the runner (:func:`hand_over`): a sample that runs no program costs the runner nothing."""
    if runner is None:
        return None, None
    ours, theirs = socket.socketpair()
    return theirs.detach(), ours


def hand_over(runner: socket.socket, end: socket.socket) -> bool:
    """Sends a child's runner socket to the runner over the slot process's own. The runner serves it before anything
    else this slot sends (:meth:`..programs.monitor.Monitor.loop`), until the slot process writes again: its
    :func:`..programs.run_requests.release`, once the child is gone. Returns False where the runner is gone (the caller
    then closes ``end``, so that the child's program calls fail at once)."""
    try:
        run_requests.write_frame(runner, {"op": run_requests.CHANNEL})
        socket.send_fds(runner, [b"c"], [end.fileno()], socket.MSG_NOSIGNAL)
    except OSError:
        return False
    return True


REAP_EVERY_S = 0.02  # while a unit runs, what exited of its processes is reaped about this often (see _Unit.wait)


def look_interval() -> float:
    """A random time until the next look (cpu_wait): exponential, REAP_EVERY_S on average (at most 5 times that), so
    that no time since the last look makes the next one less likely; from os.urandom, as the random module's at-fork
    handler would reseed in every child (0.04 ms each)."""
    return min(5.0, -math.log((int.from_bytes(os.urandom(2), "little") + 1) / 65536)) * REAP_EVERY_S


def _ignore(signum, frame) -> None:
    """SIGCHLD's handler while a request runs: the wake-up byte is what counts."""


def _quiet() -> None:
    _set_handler(signal.SIGCHLD, _signal.SIG_DFL)  # the raw function takes the raw constant, not the enum
    _set_wakeup_fd(-1)


def _drain(fd: int) -> None:
    """Empties a non-blocking pipe that only this process reads (one short read, where it held less than asked)."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass


def _poller(done: int, woken: int, runner_end: Optional[socket.socket]) -> select.poll:
    poller = select.poll()
    poller.register(done, select.POLLIN)
    poller.register(woken, select.POLLIN)
    if runner_end is not None:
        poller.register(runner_end, select.POLLIN)
    return poller


def _failure(samples: int, max_log_bytes: int, status: Status, error: str) -> bytes:
    return codec.encode_result([Outcome.failed(status, error)] * samples, "", 0, max_log_bytes)
