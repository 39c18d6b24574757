"""Whether a slot process may serve another sample (``isolation: sample``), decided where no sample can reach.

A reward that only reads its inputs (a regex, parsing, arithmetic) leaves nothing behind in its process, and that
process may score the next sample as fast as a reused worker. A process in which anything happened that could leave
state for a later sample must never serve another. Before any of that happens, only trusted code runs in the
process: the reward's own code, on data. Data becomes code, threads, processes, files or native calls only through
operations that CPython reports to audit hooks (PEP 578) *before* they take effect: ``exec``, ``compile``,
``import`` of a module not imported yet, ``pickle.find_class``, ``marshal.loads``, ``ctypes.*``, ``os.system``,
``subprocess.Popen``, ``_thread.start_new_thread``, ``open`` for writing, ``os.chdir``, ``object.__setattr__`` on
types, and so on. Every event is a taint except the few read-only ones in :data:`HARMLESS`.

On the first taint while a sample runs, the hook writes a marker naming that sample into the request's socket, before
the event's code can run. The server reads that socket: the marker reaches it ahead of anything the sample's code
could write afterwards, and nothing in this process can take back bytes already sent. The server then accepts the
tainted sample's own answer (as with a fresh process, code a reward runs in its own process can set that sample's
score), scores every later sample of the request elsewhere, and has the template kill this process. A flag in this
process would not do: the code it guards could reset it.

The hook cannot be removed (CPython offers no way to). Each unit's answer has a trailer the server checks:
:data:`CLEAN` (the process may go on) or a marker (retire), written by this trusted code after a unit that timed out
or ran out of memory, or when the state check (:class:`StateCheck`, run before answers are sent) finds a change.
"""

from __future__ import annotations

import _thread
import builtins
import collections
import contextlib
import os
import struct
import sys
from typing import Any, Callable, Iterator, Optional

CLEAN = b"C"
MARK = b"T"
# A marker of this kind says: the sample is scored again elsewhere (none of its answer counts). A process that scored
# other samples before holds their text in freed memory; code from data never runs there (see _Watch.hook).
WITHDRAW = b"W"
_MARKER = struct.Struct("<cIB")  # MARK, the sample's index in its request, length of the reason that follows
MAX_REASON = 120

# Events that only read: they cannot leave state for a later sample. ``open`` is harmless when it only reads.
HARMLESS = frozenset({
    "builtins.id", "object.__getattr__", "sys._getframe", "time.sleep", "os.listdir", "os.scandir", "glob.glob",
    "glob.glob/2", "array.__new__", "os.stat", "sys._getframemodulename",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def marker(index: int, reason: str, kind: bytes = MARK) -> bytes:
    """The bytes that tell the server that sample ``index`` of a request tainted its process, and why (``kind``
    WITHDRAW: and that it must be scored again in another process)."""
    data = reason.encode("ascii", "backslashreplace")[:MAX_REASON]
    return _MARKER.pack(kind, index, len(data)) + data


MARKER_HEAD = _MARKER.size


def parse_marker_head(head: bytes) -> tuple[int, int]:
    """(sample index, reason length) from the first MARKER_HEAD bytes of a marker."""
    _, index, length = _MARKER.unpack(head)
    return index, length


def _read_only(args: tuple) -> bool:
    _, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    return isinstance(flags, int) and not flags & _WRITE_FLAGS


class _Watch:
    """The hook's state. Only this module's functions change it, and only trusted code calls them; once the process
    is tainted, nothing here is relied on any more."""

    def __init__(self) -> None:
        self.fd = -1  # the running request's socket
        self.index = -1  # the running sample's index in it; -1: no sample is running
        self.paused = 0
        self.tainted: Optional[str] = None
        self.installed = False
        # (answer, trailer) of the request's units not sent yet: written by trusted code, sent before any taint
        self.pending: list = []
        self.first_pending = 0  # the unit of the first of them
        self.check: Optional[StateCheck] = None
        self.withdrawn: Optional[str] = None
        self.on_taint: Optional[Callable[[], None]] = None  # the running request's: unmaps its other samples
        self.fresh = True  # no sample ran in this process before the running one
        self.refusing = False  # the running sample was withdrawn: every further event of it is refused

    def flush(self, then: bytes = b"", checked: bool = False) -> None:
        """Sends what is pending, then ``then``. Before that, while the process is clean, the state check runs. The
        first pending unit started from a checked state; the others may have seen what it (or another) changed. So on
        a change only the first unit's answer is sent, with a retiring trailer, the others' are withdrawn (scored
        elsewhere), and the process retires.

        Raises:
            OSError: the socket is gone.
        """
        if self.pending and self.check is not None and self.withdrawn is None and (checked or self.tainted is None):
            why = self.check.changed()
            if why is not None:
                self.withdrawn = why
                self.pending, then = [(self.pending[0][0], marker(self.first_pending, why))], b""
        data, self.pending = b"".join(answer + trailer for answer, trailer in self.pending) + then, []
        while data:
            data = data[os.write(self.fd, data):]

    def hook(self, event: str, args: tuple) -> None:
        if self.index < 0 or self.paused or (self.tainted is not None and not self.refusing):
            return
        if event in HARMLESS or (event == "open" and _read_only(args)):
            return
        if self.refusing:
            raise RuntimeError(_REFUSED)
        try:
            detail = repr(args[0])[:60] if args else ""
        except BaseException:  # noqa: BLE001 - an argument whose repr raises
            detail = ""
        self.tainted = f"{event} {detail}".strip()  # first: the check below may raise events of its own
        try:
            # the answers of earlier samples (checked), then the marker: before the event's code can run
            self.flush(then=marker(self.index, self.tainted, MARK if self.fresh else WITHDRAW), checked=True)
            if self.on_taint is not None:
                self.on_taint()  # the request's later samples go elsewhere: their text leaves this process first
        except (OSError, BufferError):
            # The server is gone or the socket was closed, or the request could not be unmapped: the event must not
            # happen unreported, nor with the other samples readable.
            raise RuntimeError("rewardbox: this sample's process could not report an operation; refused") from None
        if not self.fresh:
            # Earlier samples' text may linger in this process's freed memory, where code from data could read it:
            # the event is refused, and the server scores this sample again in a process that ran no other.
            self.refusing = True
            raise RuntimeError(_REFUSED)


_WATCH = _Watch()
_REFUSED = ("rewardbox: refused in a process that scored other samples; this sample is scored again in a fresh "
            "process (nothing of this attempt counts)")


# What CPython 3.11 does not audit but could leave state for a later sample (a thread, a timer, a signal handler or
# mask, the umask): (module, function) pairs that install() makes raise an audit event first. The sandbox's own code
# keeps references to the originals (worker, execution).
_UNAUDITED = (("_thread", "start_new_thread"), ("_thread", "start_new"), ("_signal", "signal"),
              ("_signal", "setitimer"), ("_signal", "alarm"), ("_signal", "pthread_sigmask"),
              ("_signal", "set_wakeup_fd"), ("_signal", "siginterrupt"), ("signal", "setitimer"), ("signal", "alarm"),
              ("signal", "set_wakeup_fd"), ("signal", "siginterrupt"), ("posix", "umask"), ("os", "umask"))


def _audited(function: Callable, event: str) -> Callable:
    def wrapper(*args, **kwargs):
        sys.audit(event, *args)
        return function(*args, **kwargs)

    return wrapper


def install() -> None:
    """Installs the hook in this process (a slot process, before any reward code runs), and the wrappers that report
    what CPython 3.11 does not audit (:data:`_UNAUDITED`; ``threading`` holds its own reference to
    ``start_new_thread``)."""
    if _WATCH.installed:
        return
    sys.addaudithook(_WATCH.hook)
    _WATCH.installed = True
    wrapped: dict = {}
    for module_name, name in _UNAUDITED:
        module = sys.modules.get(module_name) or __import__(module_name)
        original = getattr(module, name, None)
        if original is None:
            continue
        if id(original) not in wrapped:
            wrapped[id(original)] = _audited(original, f"{module_name}.{name}")
        setattr(module, name, wrapped[id(original)])
    threading = sys.modules.get("threading")
    start = getattr(threading, "_start_new_thread", None)
    if start is not None and id(start) in wrapped:
        threading._start_new_thread = wrapped[id(start)]


def watch_state(check: Optional["StateCheck"]) -> None:
    """The state check that runs before answers are sent (None: no reuse, nothing to check)."""
    _WATCH.check = check


def queue(index: int, answer: bytes, trailer: bytes) -> None:
    """Keeps unit ``index``'s answer and trailer to send with the next :func:`flush` (or before the next taint's
    marker)."""
    if not _WATCH.pending:
        _WATCH.first_pending = index
    _WATCH.pending.append((answer, trailer))


def flush() -> Optional[str]:
    """Sends the pending answers (see _Watch.flush). Returns why they were withdrawn, if they were (the process must
    then retire). Raises OSError when the socket is gone."""
    _WATCH.flush()
    return _WATCH.withdrawn


def begin(fd: int, index: int, on_taint: Optional[Callable[[], None]] = None, fresh: bool = True) -> None:
    """Sample ``index`` of the request on socket ``fd`` starts running (``fresh``: the first in this process); a
    taint calls ``on_taint`` after the marker is sent, before the event's code runs."""
    _WATCH.fd, _WATCH.index, _WATCH.on_taint, _WATCH.fresh = fd, index, on_taint, fresh


def end() -> Optional[str]:
    """The running sample ended. Returns what tainted the process (None: nothing did)."""
    _WATCH.index, _WATCH.on_taint = -1, None
    return _WATCH.tainted


def withdrawn_unit() -> bool:
    """Whether the sample that ran last was withdrawn (see _Watch.hook): nothing of it may be sent."""
    return _WATCH.refusing


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Our own work inside a sample (formatting a traceback compiles source lines) is not the sample's."""
    _WATCH.paused += 1
    try:
        yield
    finally:
        _WATCH.paused -= 1


_CONTAINERS = (list, dict, set, bytearray, collections.deque)


class StateCheck:
    """What the reward's own code could have changed without any audited event: the reward module's top-level names
    (rebinding one), the sizes of the containers they hold, the function's defaults and closure cells, builtins,
    the number of entries in sys.modules, and threads still running. Taken once per process; compared after each sample (trusted code:
    nothing ran that could fool it)."""

    def __init__(self, fn: Callable) -> None:
        self.namespace: dict = getattr(fn, "__globals__", None) or {}
        self.names = dict(self.namespace)
        self.builtins = dict(vars(builtins))
        self.modules = len(sys.modules)  # an import is audited; this sees an entry added or removed by hand
        self.cells = tuple(c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c))
        self.closure = getattr(fn, "__closure__", None) or ()
        values = list(self.names.values()) + list(self.cells)
        values += list(getattr(fn, "__defaults__", None) or ()) + list((getattr(fn, "__kwdefaults__", None)
                                                                          or {}).values())
        self.containers = [v for v in values if isinstance(v, _CONTAINERS)]
        self.sizes = [len(c) for c in self.containers]

    def changed(self) -> Optional[str]:
        """What changed since the process started (None: nothing)."""
        try:
            if self.namespace != self.names:  # identity first: an untouched name costs no comparison
                rebound = [k for k in self.namespace.keys() | self.names.keys()
                           if self.namespace.get(k, _MISSING) is not self.names.get(k, _MISSING)]
                return f"the reward module's top-level name {sorted(rebound)[0]!r} changed" if rebound else \
                    "the reward module's top-level names changed"
            if tuple(c.cell_contents for c in self.closure if _filled(c)) != self.cells:
                return "the reward function's closure changed"
            if vars(builtins) != self.builtins or len(sys.modules) != self.modules:
                return "builtins or sys.modules changed"
        except BaseException:  # noqa: BLE001 - a rebound value whose == raises (a numpy array) is a change too
            return "the reward module's top-level names changed"
        if [len(c) for c in self.containers] != self.sizes:
            return "a container the reward module holds changed size"
        if _thread._count():
            return "a thread is running"
        return None


_MISSING = object()


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
