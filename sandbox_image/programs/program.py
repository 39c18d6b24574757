"""One slot's programs: the run uid and scratch directory that :func:`rewardbox.sandbox.run` runs them in.

A monitor (:mod:`.monitor`) holds one :class:`Workspace` per slot socket it serves. For each program it:

1. kills whatever the run uid still runs and empties its scratch directory (as in :func:`..processes.slot.prepare`);
2. writes the code, the files and the build's output there (as the run uid);
3. forks the program: a session of its own, ``oom_score_adj`` 1000, the run uid (no capability left), limits on
   CPU time, writable memory (``RLIMIT_DATA``) and address space, processes, file size and open files, a seccomp
   filter without network (:mod:`..confine.seccomp`), the scratch directory as cwd, HOME and TMPDIR (mounted on ``/tmp``
   in a mount namespace of its own where the container allows it: :mod:`..confine.private_tmp`), and a clean environment
   (none of the reward's, secrets included);
4. feeds stdin, reads stdout and stderr up to a limit, watches the memory of all the run uid's processes together
   (the rlimits hold per process: a program's forks could otherwise add up to many times its ``memory_mb`` and get
   a concurrent sample's program OOM-killed), and kills the whole tree (every process of the run uid) when the
   program exits, overruns its wall time, its memory or its output limit, or the slot process goes away;
5. empties the directory again.

The reward's own process runs under another uid: a program can neither signal, trace or read it, nor read or
write its directory. Local backend and plain Python (no sandbox): the same, minus the uids (no isolation; a
program runs as its caller). Standard library only.
"""

from __future__ import annotations

import math
import os
import resource
import selectors
import signal
import stat
import time
from dataclasses import dataclass
from typing import Optional

from ..confine import private_tmp, seccomp
from ..processes import tree
from .run_requests import RequestError

MAX_ARTIFACT = 256 * 1024 * 1024
OPEN_FILES = 256
_RESET_SIGNALS = tuple(sig for sig in range(1, signal.NSIG) if sig not in (signal.SIGKILL, signal.SIGSTOP))
MEMORY_POLL_S = 0.02  # how often the memory of a program's processes is added up
_MIB = 1 << 20


@dataclass(frozen=True)
class RunSlot:
    """Where one slot's programs run: their uid (None: the caller's own, no isolation) and scratch directory."""

    uid: Optional[int]
    directory: str
    nproc: Optional[int] = None  # RLIMIT_NPROC of the run uid (the sample's share of the sandbox's pids)
    memory: Optional[int] = None  # the sample's address space budget, bytes (gVisor), caps memory_mb
    atomic_kill: bool = False
    private_tmp: str = ""  # see slot.SlotSpec

    @property
    def home(self) -> str:
        """cwd, HOME and TMPDIR of its programs: their directory, mounted on /tmp where it can be."""
        return private_tmp.home(self.private_tmp, self.directory)


@dataclass
class Limits:
    timeout_s: float
    memory_mb: int
    address_grace_mb: int
    max_output_bytes: int
    nproc: Optional[int]
    file_bytes: int


class SlotGone(BaseException):
    """The slot process that asked went away, the runner did, or the socket broke the exchange (more bytes while a
    program runs): stop at once, killing the program, and serve that socket no more."""


def prepare_filter() -> None:
    """Builds the programs' seccomp filter in this process (a runner), so that every program's child, forked from
    one of its monitors, only installs it: building it and loading libc took each child 2-8 ms under gVisor."""
    try:
        seccomp.prepare(network=False)
    except (KeyError, OSError):
        pass  # each program's child tries again and reports why it cannot start


class Workspace:
    """One slot's run uid and scratch directory, as a monitor (root) acts on them (see the module docstring)."""

    def __init__(self, slot: RunSlot):
        self.slot = slot
        self.session = 0  # local backend: the last program's session, to kill
        # A kill proved that no process of the run uid is left, and none was started since: only this process
        # starts them (execute), so an empty directory is all that a clean still needs.
        self.none_left = False

    # ---- privileges
    def _as_run_uid(self, reaper: bool = False) -> None:
        """Acts as the run uid (files it owns, signals to its processes) while keeping the way back (saved 0).
        ``reaper``: with a real uid no program has, so none of them can signal this process meanwhile, and with
        root's group, which sees all of them in /proc (private_tmp.hide_others)."""
        uid = self.slot.uid
        assert uid is not None  # asked only of a slot with a uid of its own
        if not reaper:
            os.setresgid(-1, uid, -1)
        os.setresuid(uid | tree.REAPER_UID_BIT if reaper else -1, uid, 0)

    def _as_root(self) -> None:
        os.setresuid(0, 0, 0)
        os.setresgid(-1, 0, -1)

    # ---- the scratch directory
    def clean(self) -> None:
        """Kills every process of the run uid and empties its directory (and its files in /dev/shm)."""
        if not self.none_left:
            self._kill_tree()
        if self.slot.uid is None:
            os.makedirs(self.slot.directory, mode=0o700, exist_ok=True)
            tree.empty(self.slot.directory)
            return
        self._as_run_uid()
        try:
            tree.empty(self.slot.directory)
            if os.path.isdir("/dev/shm"):  # only under isolation: worker (no /dev/shm otherwise)
                for name in os.listdir("/dev/shm"):
                    path = os.path.join("/dev/shm", name)
                    try:
                        if os.lstat(path).st_uid == self.slot.uid:
                            os.unlink(path)
                    except OSError:
                        pass
        finally:
            self._as_root()
        if self.slot.private_tmp == "chroot" and tree.unnamed_bytes(self.slot.directory):
            private_tmp.renew(self.slot.uid, self.slot.directory, executable=True)  # see slot.prepare

    def _kill_tree(self) -> None:
        """Kills every process of the run uid (local backend: the last program's process group)."""
        if self.slot.uid is None:
            if self.session:
                try:
                    os.killpg(self.session, signal.SIGKILL)
                except OSError:
                    pass
            return
        self._as_run_uid(reaper=True)
        try:
            tree.kill_uid(self.slot.uid, atomic=self.slot.atomic_kill)
        finally:
            self._as_root()
        self.none_left = True

    def materialize(self, entries: dict) -> None:
        """Writes {relative path: (content, mode)} into the (empty) scratch directory, as the run uid.

        Raises:
            RequestError: an entry cannot be written (a path under a file the request also names, no space left).
        """
        if self.slot.uid is not None:
            self._as_run_uid()
        name = ""
        try:
            top = os.open(self.slot.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                for name, (content, mode) in entries.items():
                    parent = top
                    *dirs, leaf = name.split("/")
                    opened = []
                    try:
                        for d in dirs:
                            try:
                                os.mkdir(d, 0o700, dir_fd=parent)
                            except FileExistsError:
                                pass
                            parent = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
                            opened.append(parent)
                        fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=parent)
                        try:
                            view = memoryview(content)
                            while view:
                                view = view[os.write(fd, view):]
                        finally:
                            os.close(fd)
                    finally:
                        for fd in opened:
                            os.close(fd)
            finally:
                os.close(top)
        except OSError as e:
            raise RequestError(f"files: {name!r} cannot be written: {e.strerror or e}") from None
        finally:
            if self.slot.uid is not None:
                self._as_root()

    def read_artifact(self, name: str) -> Optional[bytes]:
        if self.slot.uid is not None:
            self._as_run_uid()
        try:
            fd = os.open(os.path.join(self.slot.directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size > MAX_ARTIFACT:
                    return None
                chunks: list[bytes] = []
                while True:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        return b"".join(chunks)
                    chunks.append(chunk)
            finally:
                os.close(fd)
        except OSError:
            return None
        finally:
            if self.slot.uid is not None:
                self._as_root()

    # ---- running
    def _child(self, argv: list, env: dict, limits: Limits, fds: tuple, report: int) -> None:
        """In the forked child: becomes the program (never returns)."""
        try:
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.dup2(report, 3)
            os.set_inheritable(3, False)
            os.closerange(4, 65536)
            # execve resets every caught signal to its default itself: only what is ignored (Python ignores SIGPIPE
            # and SIGXFSZ) or unknown to Python needs it here.
            for sig in _RESET_SIGNALS:
                if signal.getsignal(sig) in (signal.SIG_IGN, None):
                    try:
                        signal.signal(sig, signal.SIG_DFL)
                    except (OSError, ValueError):
                        pass
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            try:
                with open("/proc/self/oom_score_adj", "w") as f:  # before the uid change: the file is ours now
                    f.write("1000")
            except OSError:
                pass
            uid = self.slot.uid
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
            cpu = max(1, math.ceil(limits.timeout_s))
            memory = limits.memory_mb * _MIB
            for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_DATA, (memory, memory)),
                                (resource.RLIMIT_AS, ((limits.memory_mb + limits.address_grace_mb) * _MIB,) * 2),
                                (resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes)),
                                (resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES)), (resource.RLIMIT_CORE, (0, 0))):
                resource.setrlimit(kind, value)
            if limits.nproc is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
            os.umask(0o077)
            if uid is not None:
                private_tmp.become(self.slot.private_tmp, uid, self.slot.directory)  # no capability left after
            seccomp.install(network=False)
            os.chdir(self.slot.home)
            os.execvpe(argv[0], argv, env)
        except BaseException as e:  # noqa: BLE001 - reported to the monitor, which reports it as the run's error
            try:
                os.write(3, f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:2000])
            except OSError:
                pass
        os._exit(127)

    def execute(self, argv: list, stdin: bytes, limits: Limits, env: dict, watch: tuple = ()) -> dict:
        """Runs one program to its end. Returns its result (status before the run's own checks).

        Raises:
            SlotGone: a socket of ``watch`` (None entries skipped) closed or had bytes: the program is killed.
        """
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        self.none_left = False
        pid = os.fork()
        if pid == 0:
            self._child(argv, env, limits, (in_r, out_w, err_w), report_w)
        for fd in (out_w, err_w, in_r, report_w):
            os.close(fd)
        self.session = pid
        failure = b""
        while True:  # empty when exec succeeded (the descriptor closes on exec)
            chunk = os.read(report_r, 4096)
            if not chunk:
                break
            failure += chunk
        os.close(report_r)
        outputs = {out_r: bytearray(), err_r: bytearray()}
        selector = selectors.DefaultSelector()
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        os.set_blocking(in_w, False)
        pending = memoryview(stdin)
        if pending:
            selector.register(in_w, selectors.EVENT_WRITE)
        else:
            os.close(in_w)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        selector.register(wake_r, selectors.EVENT_READ)
        watched = [sock for sock in watch if sock is not None]
        for sock in watched:
            selector.register(sock, selectors.EVENT_READ)
        deadline = start + limits.timeout_s
        next_poll = start + MEMORY_POLL_S if self.slot.uid is not None else math.inf
        killed_for, status_word = None, None
        usage: Optional[resource.struct_rusage] = None
        try:
            while status_word is None:
                now = time.monotonic()
                if now >= deadline:
                    killed_for = "timeout"
                    break
                if now >= next_poll:
                    if self._tree_memory() > limits.memory_mb * _MIB:
                        killed_for = "memory"
                        break
                    next_poll = now + MEMORY_POLL_S
                for key, _ in selector.select(timeout=min(deadline, next_poll) - now):
                    if any(key.fileobj is sock for sock in watched):
                        # Its end closed, or it wrote while its request runs, which rewardbox.sandbox.run never does
                        # (one request at a time per socket, waited for). Ignoring those bytes would mean no longer
                        # watching for the close: a sample's program would outlive it and hold up the slot's next
                        # samples for its whole timeout. (The parent: the child is gone.)
                        raise SlotGone()
                    fd = key.fd  # a pipe's: registered as its descriptor
                    if fd == wake_r:
                        try:
                            os.read(wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif fd == in_w:
                        try:
                            pending = pending[os.write(in_w, pending[:65536]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        except BlockingIOError:
                            pass
                        if not pending:
                            selector.unregister(in_w)
                            os.close(in_w)
                    elif fd in outputs:
                        drained = self._drain(fd, outputs[fd], limits.max_output_bytes)
                        if drained is None:
                            selector.unregister(fd)
                        elif drained:
                            killed_for = "output"
                    if killed_for:
                        break
                if killed_for:
                    break
                waited, status, rusage = os.wait4(pid, os.WNOHANG)
                if waited == pid:
                    status_word, usage = status, rusage
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sock in watched:
                if sock in selector.get_map():
                    selector.unregister(sock)
            self._kill_tree()
            if status_word is None:
                _, status_word, usage = os.wait4(pid, 0)
            wall = time.monotonic() - start
            if not killed_for:  # every writer is dead now: what is left in the pipes, up to the limit
                for fd in outputs:
                    if self._drain(fd, outputs[fd], limits.max_output_bytes):
                        killed_for = "output"
            selector.close()
            for fd in (out_r, err_r, wake_r, wake_w):
                os.close(fd)
            if pending:  # stdin was not written to its end
                os.close(in_w)
            for _ in tree.exited_children():  # every descendant: this process is their subreaper
                pass
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert usage is not None  # waited for with status_word
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return {"status_word": status_word, "killed_for": killed_for, "wall_s": round(wall, 6),
                "cpu_s": round(max(cpu, usage.ru_utime + usage.ru_stime), 6),
                "stdout": bytes(outputs[out_r]), "stderr": bytes(outputs[err_r]),
                "failure": failure.decode("utf-8", "replace")}

    @staticmethod
    def _drain(fd: int, buffer: bytearray, limit: int) -> Optional[bool]:
        """Reads what ``fd`` has now. Returns True when the stream went over ``limit`` (the excess is not kept),
        None at its end, else False."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return None
            room = limit - len(buffer)
            buffer += chunk[:max(0, room)]
            if len(chunk) > room:
                return True

    def _tree_memory(self) -> int:
        """Bytes of memory the run uid's processes hold together: their anonymous and shared-memory resident pages
        (pages shared after a fork count once per process), else their resident set where the kernel does not
        tell those apart (gVisor)."""
        assert self.slot.uid is not None  # polled only for a slot with a uid of its own
        return sum(tree.resident_kb(tree.status_fields(status))
                   for _, status in tree.statuses_of(self.slot.uid)) * 1024
