"""A slot process: the process that runs reward code on samples, under a uid and in a scratch directory of its own.

A template forks it and it prepares itself, in this order, before any reward code runs (until then it is trusted
code of ours):

1. a session of its own, default signal handlers, stdin/stdout/stderr on /dev/null, every inherited descriptor
   closed but its control socket;
2. the slot's uid (docker backend: the container starts as root holding only SETUID, SETGID and KILL; after
   ``setuid`` no capability is left, so it can signal, trace or write into nothing of the server's or the other
   slots');
3. limits: RLIMIT_NPROC (a fork bomb stops there, the other samples can still fork), no core files, and
   ``oom_score_adj`` 1000 (the OOM killer takes a sample before the server);
4. whatever an earlier process of this uid left is removed: every process (``setsid`` daemons included), its SysV
   IPC objects and POSIX message queues, and the contents of the scratch directory;
5. cwd, HOME and TMPDIR are the scratch directory.

Then it sends the template one byte (ready) and waits for request sockets. ``isolation: sample``: it serves one
request and exits, so every sample (a whole call, for batch style) starts from the module's state after import.
``isolation: worker``: it serves requests for its whole life, with one event loop for async functions.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import stat
import struct
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..wire import Outcome, Status, trainer_state_from_dict
from . import codec, reuse, seccomp, worker
from .channel import ChannelClosed, optional_fd, recv

READY = b"R"  # followed by the IPC mark (u64)
FAILED = b"F"  # followed by why (UTF-8, at most MAX_REASON bytes), before the process exits
MAX_REASON = 2000
_MARK = struct.Struct("<Q")
READY_SIZE = 1 + _MARK.size
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class SlotSpec:
    """One slot: its uid (None: the server's own, for the local backend) and scratch directory."""

    index: int
    uid: Optional[int]
    directory: str
    nproc: Optional[int] = None  # RLIMIT_NPROC for its uid
    memory: Optional[int] = None  # RLIMIT_AS of each of its processes, bytes
    ipc_mark: int = 0  # gVisor: the last SysV IPC id this slot's cleanup saw
    atomic_kill: bool = False  # the kernel signals kill(-1) atomically against fork (Linux; not gVisor)
    run_uid: Optional[int] = None  # the uid of the programs its reward code runs (rewardbox.sandbox.run)
    run_directory: str = ""  # their scratch directory
    # The template proved that no process of this uid is left (see Template._no_strangers): the cleanup needs no
    # kill or /proc scan, and no IPC objects can exist (the seccomp filter refuses them to every slot process).
    known_clean: bool = False


_CLOSE_RANGE = 436  # the same number on every Linux architecture


def _close_range(low: int, high: int) -> None:
    """Closes descriptors low..high in one system call (os.closerange lists /proc/self/fd first)."""
    if _LIBC.syscall(_CLOSE_RANGE, ctypes.c_uint(low), ctypes.c_uint(high), ctypes.c_uint(0)) != 0:
        os.closerange(low, min(high + 1, 65536))  # a kernel without close_range (gVisor's)


def _close_inherited(*keep: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        if fd > low:
            _close_range(low, fd - 1)
        low = fd + 1
    _close_range(low, 0xFFFFFFFF)
    if devnull > 2 and devnull not in keep:
        try:
            os.close(devnull)
        except OSError:
            pass


def statuses_of(uid: int) -> Iterator[tuple[int, bytes]]:
    """(pid, /proc/<pid>/status as bytes) of each process whose real uid is ``uid`` (zombies included). Reads the
    files as bytes and finds the uid without parsing the rest: it runs before every sample."""
    wanted = str(uid).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/status", os.O_RDONLY)
            try:
                status = os.read(fd, 8192)
            finally:
                os.close(fd)
        except OSError:
            continue
        at = status.find(b"\nUid:\t")
        if at >= 0 and status[at + 6:].split(b"\t", 1)[0] == wanted:
            yield int(entry), status


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# The libc already loaded (find_library would run ldconfig in a subprocess), loaded once, before any fork.
_LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send ``sig`` (SIGKILL) to this process when its parent exits."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def become_subreaper() -> None:
    """Makes this process the one that inherits its orphaned descendants (not their init)."""
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children() -> Optional[set]:
    """The pids of this (single-threaded) process's children, from the kernel; None where it does not list them."""
    try:
        fd = os.open(f"/proc/self/task/{os.getpid()}/children", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return {int(pid) for pid in data.split()}


def fork_child(main: Callable[[], None]) -> int:
    """Forks a child that dies with this process, runs ``main`` and exits: 0 when it returns, 70 when it raises (the
    parent learns of it from the socket it shares with the child closing). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            die_with_parent()
            main()
            code = 0
        finally:
            os._exit(code)
    return pid


def sigchld_wakeup() -> int:
    """Makes SIGCHLD wake a selector loop. Returns the read end of a pipe that gets a byte per signal: read it, then
    collect the children with :func:`exited_children`."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_r


def exited_children() -> Iterator[tuple[int, int]]:
    """(pid, wait status) of each child that has exited, collected without waiting for the others."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _pids_of(uid: int, running_only: bool = False) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid`` (with ``running_only``: those that could fork now:
    neither stopped, nor traced-stopped, nor waiting in the kernel)."""
    found = []
    for pid, status in statuses_of(uid):
        at = status.find(b"\nState:\t")
        state = status[at + 8:at + 9] if at >= 0 else b"?"
        if state != b"Z" and not (running_only and state in b"TtD"):
            found.append(pid)
    return found


def _signal_all(sig: int) -> None:
    try:
        os.kill(-1, sig)
    except ProcessLookupError:  # gVisor: nothing it may signal
        pass


STABLE_SCANS = 3
STOP_BUDGET_S = 0.5


def kill_uid(uid: int, deadline_s: float = 10.0, atomic: bool = False) -> None:
    """Kills every process whose real uid is ``uid``, from a process whose real uid differs (the kernel then lets
    no process of ``uid`` signal it) but whose effective uid is ``uid`` (so kill(-1) reaches all of them).

    kill(-1) reaches exactly those processes. Linux (``atomic``) holds its task list while it signals, so none can
    fork past it. gVisor does not, and a process caught forking may leave a child: there they are first stopped
    (a stopped process cannot fork) until several scans in a row find none that could fork, for at most
    STOP_BUDGET_S (whatever resists stopping, a tracee or a process waiting in the kernel, is not forking either).
    Then they are killed until /proc shows none left (kill(-1) returns success whenever any other process exists,
    so /proc is the only proof; without an atomic kill, several scans in a row).

    Raises:
        RuntimeError: some survived ``deadline_s`` (a process stuck in the kernel).
    """
    end = time.monotonic() + deadline_s
    stop_end = time.monotonic() + STOP_BUDGET_S
    stable = 0
    while not atomic and stable < STABLE_SCANS and time.monotonic() < stop_end:
        _signal_all(signal.SIGSTOP)
        stable = stable + 1 if not _pids_of(uid, running_only=True) else 0
    # Without an atomic kill(-1), one empty scan may have raced a fork that was under way (a child not yet listed,
    # its parent already dead): there, several empty scans in a row, each after another kill, are the proof.
    empty_scans = 0
    while True:
        _signal_all(signal.SIGKILL)
        empty_scans = empty_scans + 1 if not _pids_of(uid) else 0
        if empty_scans >= (1 if atomic else STABLE_SCANS):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"processes of uid {uid} survived SIGKILL for {deadline_s:g}s")
        time.sleep(0.001)


_IPC_RMID, _IPC_STAT = 0, 2
# (control function, *_INFO command giving the highest index, *_STAT command taking an index, creation call)
_IPC_KINDS = (("shmctl", 14, 13, lambda libc: libc.shmget(0, 1, 0o1600)),
              ("msgctl", 12, 11, lambda libc: libc.msgget(0, 0o1600)),
              ("semctl", 19, 18, lambda libc: libc.semget(0, 1, 0o1600)))


def _ctl(libc, kind: str, ident: int, command: int, buf) -> int:
    if kind == "semctl":
        return libc.semctl(ident, 0, command, buf)
    return getattr(libc, kind)(ident, command, buf)


def remove_ipc(uid: int, mark: int) -> int:
    """Removes the SysV IPC objects ``uid`` created or owns (running with effective uid ``uid``: the kernel allows
    the creator or the owner to remove an object, whoever it was given to) and its POSIX message queues.

    Linux lists objects by index (*_INFO, *_STAT). gVisor has no such index, but numbers objects in order: the ids
    allocated since ``mark`` (what this slot's last cleanup saw) are tried. Returns the new mark.
    """
    libc = _LIBC
    buf = ctypes.create_string_buffer(512)
    indexed = os.path.isdir("/proc/sysvipc")
    new_mark = mark
    for kind, info, stat_by_index, create in _IPC_KINDS:
        if indexed:
            top = _ctl(libc, kind, 0, info, buf)
            candidates = [_ctl(libc, kind, i, stat_by_index, buf) for i in range(max(-1, top) + 1)]
        else:
            probe = create(libc)  # the next id: every object created since the mark is below it
            if probe < 0:
                continue  # this kind cannot be created at all here
            candidates = list(range(mark + 1, probe))
            _ctl(libc, kind, probe, _IPC_RMID, None)
            new_mark = max(new_mark, probe)
        for ident in candidates:
            if ident >= 0:
                _ctl(libc, kind, ident, _IPC_RMID, None)  # EPERM for other uids' objects: left alone
    if os.path.isdir("/dev/mqueue"):
        for name in os.listdir("/dev/mqueue"):
            path = os.path.join("/dev/mqueue", name)
            try:
                if os.lstat(path).st_uid == uid:
                    os.unlink(path)
            except OSError:
                pass
    return new_mark


def empty(directory: str) -> None:
    """Removes everything in ``directory``, however deep, as its owner.

    Iterative and relative to open directories: a tree deeper than the recursion limit or longer than PATH_MAX
    is flattened, one subdirectory at a time, into the top directory (renamed there under a fresh name), so at most
    two directories are open at once.

    Raises:
        OSError: something cannot be removed.
    """
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    counter = 0
    try:
        os.fchmod(top, stat.S_IRWXU)
        while True:
            with os.scandir(top) as entries:
                names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            if not names:
                return
            for name, is_dir in names:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                # The owner may do anything to its own directories once it gave itself the permission (a mode-000
                # directory cannot even be opened before). Nothing else runs as this uid now: no race.
                os.chmod(name, stat.S_IRWXU, dir_fd=top)
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    with os.scandir(sub) as entries:
                        inner = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                    for inner_name, inner_is_dir in inner:
                        if inner_is_dir:
                            counter += 1
                            # Moving a directory to another parent rewrites its "..": it must be writable.
                            os.chmod(inner_name, stat.S_IRWXU, dir_fd=sub)
                            os.rename(inner_name, f".rbx-{counter}", src_dir_fd=sub, dst_dir_fd=top)
                        else:
                            os.unlink(inner_name, dir_fd=sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)


def _set_oom_score_adj(value: int) -> None:
    # Before dropping privileges: afterwards this process is no longer dumpable and the file is root's.
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


SAMPLE_NICE = 19
REAPER_UID_BIT = 1 << 31  # a real uid of its own for the cleanup stage: no slot process runs under it


def prepare(slot: SlotSpec, control_fd: int, run_fd: Optional[int] = None) -> int:
    """Makes this freshly forked process a slot (see the module docstring). Returns the IPC mark for the template.
    ``run_fd``: its socket to the program runner (:mod:`.runner`), kept open for :func:`rewardbox.sandbox.run`.

    Raises:
        OSError, RuntimeError: it cannot be prepared; the slot is not used.
    """
    os.setsid()
    if slot.uid is None:
        # Local backend: nothing reaps by uid, so a slot process must not outlive its template.
        die_with_parent()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    _close_inherited(control_fd, *(() if run_fd is None else (run_fd,)))
    try:
        _set_oom_score_adj(1000)
    except OSError:
        if slot.uid is not None:
            raise
    mark = slot.ipc_mark
    if slot.uid is not None:
        os.setgroups([])
        os.setresgid(slot.uid, slot.uid, slot.uid)
        # Clean up after the uid's earlier processes while they can neither signal nor trace this one.
        os.setresuid(slot.uid | REAPER_UID_BIT, slot.uid, 0)
        if not slot.known_clean:
            kill_uid(slot.uid, atomic=slot.atomic_kill)
            mark = remove_ipc(slot.uid, mark)
        empty(slot.directory)
        os.seteuid(0)  # the capabilities return (the saved uid is 0) for the one last change
        os.setresuid(slot.uid, slot.uid, slot.uid)  # no capability is left after this
        seccomp.install()  # no SysV IPC, message queues, ptrace, keyrings: for this process and all it starts
    else:
        os.makedirs(slot.directory, mode=0o700, exist_ok=True)
        empty(slot.directory)
    if slot.uid is not None:
        # Files the reward makes are its own alone: its directory is 0700, and the files themselves too, as gVisor
        # lets other uids follow /proc/<pid>/fd links past the directory (a program the reward runs among them).
        os.umask(0o077)
    if slot.nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (slot.nproc, slot.nproc))
    if slot.memory is not None:
        resource.setrlimit(resource.RLIMIT_AS, (slot.memory, slot.memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if slot.uid is not None:
        # Samples yield the CPU to the sandbox's own processes (nice only weighs tasks of the container's own
        # cgroup against each other: the container's share of the machine is unchanged). Whatever a sample leaves
        # spinning cannot slow down the template that cleans up after it, nor the server.
        os.setpriority(os.PRIO_PROCESS, 0, SAMPLE_NICE)
    os.chdir(slot.directory)
    os.environ.update(HOME=slot.directory, TMPDIR=slot.directory, PWD=slot.directory)
    from . import execution  # here: execution imports this module

    execution.attach(run_fd, "" if run_fd is not None or slot.uid is None else
                     "this sandbox cannot run programs: it has no uid for them (started without --run-uids) or its "
                     "program runner is gone (see the sandbox's log)")
    worker.install_capture()
    return mark


def _read_request(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        data = sock.recv(_READ_CHUNK)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def _answer(loaded: worker.Loaded, sock: socket.socket, result: tuple) -> None:
    outcomes, logs, dropped = result
    payload = codec.encode_result(outcomes, logs, dropped, loaded.config.max_log_bytes)
    try:
        sock.sendall(payload)
    except OSError:
        pass  # the server gave up on this request (its deadline passed)
    sock.close()


def _internal_error(n: int) -> tuple:
    """Every sample's error when something of ours failed around the reward's calls."""
    text = "rewardbox could not run this request: " + traceback.format_exc()[-worker.MAX_ERROR_CHARS:]
    return [Outcome.failed(Status.ERROR, text)] * n, "", 0


def _handle(loaded: worker.Loaded, fd: int) -> None:
    """isolation: worker: one answer for the request's samples."""
    import asyncio  # preloaded by the template of an async function (see worker)

    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.sendall(codec.STARTED)
    batch, timeout_s, state = codec.decode_request(_read_request(sock))
    try:
        trainer_state = trainer_state_from_dict(state)
        if loaded.info.is_async:
            result = asyncio.run(worker.score_async(loaded, batch, timeout_s, trainer_state))
        else:
            result = worker.score(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001 - reported as these samples' error, not as a crash
        result = _internal_error(len(batch))
    _answer(loaded, sock, result)


_RETIRING_ERRORS = ("MemoryError", "RecursionError")


def _retire_reason(outcomes: list, check: Optional[reuse.StateCheck]) -> Optional[str]:
    """Why this process must not serve another sample although nothing tainted it (None: it may)."""
    for o in outcomes:
        if o.status is Status.TIMEOUT:
            return "a call was interrupted at its timeout"
        if o.status is Status.ERROR and o.error and o.error.rstrip().rsplit("\n", 1)[-1].startswith(_RETIRING_ERRORS):
            return "a call ran out of memory or recursion depth"
    return check.changed() if check is not None else "isolation: process"


FLUSH_S = 0.002  # answers of clean samples are sent together, at least this often (and before any taint's marker)


def _units(loaded: worker.Loaded, batch) -> list:
    """What is scored, answered and judged for reuse one at a time: each sample (by index), or the whole call
    (batch style)."""
    return [batch] if loaded.config.style == "batch" else list(range(len(batch)))


async def _score_unit(loaded: worker.Loaded, batch, unit, timeout_s: float, state) -> tuple:
    """(outcomes, logs, dropped characters) of one unit. Never raises."""
    try:
        if isinstance(unit, int):
            if not loaded.info.is_async:
                outcome, logs, dropped = worker.score_sample(loaded, batch, unit, timeout_s, state)
                return [outcome], logs, dropped
            unit = batch.slice(unit, unit + 1)
        if loaded.info.is_async:
            return await worker.score_async(loaded, unit, timeout_s, state)
        return worker.score(loaded, unit, timeout_s, state)
    except BaseException:  # noqa: BLE001 - reported as these samples' error, not as a crash
        return _internal_error(1 if isinstance(unit, int) else len(unit))


async def _score_units(loaded: worker.Loaded, sock: socket.socket, batch, timeout_s: float, state: Optional[dict],
                       check: Optional[reuse.StateCheck]) -> bool:
    """Scores the units of a streamed request in order. Each answer is queued and sent at least every FLUSH_S, and
    always before the marker of a taint (the audit hook sends them: :mod:`.reuse`), so what a clean unit answered is
    out of this process before any code from data runs in it. Returns whether this process may serve another
    request."""
    try:
        trainer_state = trainer_state_from_dict(state)
    except BaseException:  # noqa: BLE001
        trainer_state = None
    flushed = time.monotonic()
    try:
        for k, unit in enumerate(_units(loaded, batch)):
            reuse.begin(sock.fileno(), k)
            try:
                outcomes, logs, dropped = await _score_unit(loaded, batch, unit, timeout_s, trainer_state)
            finally:
                tainted = reuse.end()
            retire = tainted or _retire_reason(outcomes, check)
            reuse.queue(codec.encode_result(outcomes, logs, dropped, loaded.config.max_log_bytes)
                        + (reuse.marker(k, retire) if retire else reuse.CLEAN))
            if retire:
                return False
            if time.monotonic() - flushed >= FLUSH_S:
                reuse.flush()
                flushed = time.monotonic()
        return True
    finally:
        try:
            reuse.flush()
        except OSError:
            pass  # the server gave up on this request (its deadline passed)


def _handle_stream(loaded: worker.Loaded, fd: int, check: Optional[reuse.StateCheck]) -> bool:
    """isolation: sample (``check`` set) and process: a streamed answer, unit by unit (:mod:`.codec`). Returns
    whether this process may serve another request."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    try:
        sock.sendall(codec.STARTED)
        batch, timeout_s, state = codec.decode_request(_read_request(sock))
        units = _score_units(loaded, sock, batch, timeout_s, state, check)
        if not loaded.info.is_async:
            return _run_coroutine(units)
        import asyncio  # preloaded by the template of an async function (see worker)

        return asyncio.run(units)
    finally:
        sock.close()


def _run_coroutine(coroutine) -> bool:
    """Runs a coroutine that never awaits anything (a sync function's units) without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a sync reward's units awaited something")


async def _handle_async(loaded: worker.Loaded, fd: int) -> None:
    import asyncio  # preloaded by the template of an async function (see worker)

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    await loop.sock_sendall(sock, codec.STARTED)
    chunks = []
    while True:
        data = await loop.sock_recv(sock, _READ_CHUNK)
        if not data:
            break
        chunks.append(data)
    batch, timeout_s, state = codec.decode_request(b"".join(chunks))
    try:
        trainer_state = trainer_state_from_dict(state)
        result = await worker.score_async(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001
        result = _internal_error(len(batch))
    sock.setblocking(True)
    _answer(loaded, sock, result)


async def _serve_async(loaded: worker.Loaded, control: socket.socket) -> None:
    """isolation: worker with an async function: one event loop for the worker's life, requests concurrently."""
    import asyncio  # preloaded by the template of an async function (see worker)

    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    tasks: set = set()

    def on_request() -> None:
        try:
            _, fds = recv(control)
        except (ChannelClosed, OSError, ValueError):
            loop.remove_reader(control.fileno())
            if not closed.done():
                closed.set_result(None)
            return
        fd = optional_fd(fds)
        if fd is not None:
            task = loop.create_task(_handle_async(loaded, fd))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    control.setblocking(True)  # messages are small: a ready reader is read whole
    loop.add_reader(control.fileno(), on_request)
    await closed


def serve(loaded: worker.Loaded, control: socket.socket, mode: str, mark: int) -> None:
    """Serves request sockets sent over ``control`` (``mode`` is the isolation level): ``worker``, until the
    template goes away; ``sample``, until a request leaves this process unfit for another (:mod:`.reuse`);
    ``process``, one request."""
    control.sendall(READY + _MARK.pack(mark))
    if mode == "worker" and loaded.info.is_async:
        import asyncio  # preloaded by the template of an async function (see worker)

        asyncio.run(_serve_async(loaded, control))
        return
    check = reuse.StateCheck(loaded.fn) if mode == "sample" else None
    while True:
        try:
            _, fds = recv(control)
        except (ChannelClosed, OSError, ValueError):
            return
        fd = optional_fd(fds)
        if fd is None:
            continue
        if mode == "worker":
            _handle(loaded, fd)
            continue
        if mode == "process":
            control.close()  # reward code never holds a channel to the template
        if not _handle_stream(loaded, fd, check) or mode == "process":
            return


def run(loaded: worker.Loaded, slot: SlotSpec, control: socket.socket, mode: str,
        run_channel: Optional[socket.socket] = None) -> None:
    """The whole life of a slot process; never returns."""
    code = 0
    try:
        try:
            mark = prepare(slot, control.fileno(), None if run_channel is None else run_channel.detach())
            if mode == "sample":
                reuse.install()
        except BaseException as e:  # noqa: BLE001 - still trusted code here: tell the template why
            code = 70
            reason = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:MAX_REASON]
            try:
                control.sendall(FAILED + reason)
            except OSError:
                pass
            return
        serve(loaded, control, mode, mark)
    except BaseException:  # noqa: BLE001 - reward code ran in this process: nothing it says is reported
        code = 70
    finally:
        os._exit(code)
