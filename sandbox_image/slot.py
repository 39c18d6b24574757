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

import asyncio
import ctypes
import ctypes.util
import os
import resource
import shutil
import signal
import socket
import stat
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from ..wire import Outcome, Status, TrainerState
from . import codec, worker
from .channel import ChannelClosed, optional_fd, recv

READY = b"R"
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class SlotSpec:
    """One slot: its uid (None: the server's own, for the local backend) and scratch directory."""

    index: int
    uid: Optional[int]
    directory: str
    nproc: Optional[int] = None  # RLIMIT_NPROC for its uid
    memory: Optional[int] = None  # RLIMIT_AS of each of its processes, bytes


def _close_inherited(keep: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    if devnull > 2 and devnull != keep:
        try:
            os.close(devnull)
        except OSError:
            pass


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry))
    return found


def reap_uid(uid: int, deadline_s: float = 10.0) -> None:
    """Kills every other process of ``uid`` (run as ``uid``, so kill(-1) reaches exactly those).

    kill(-1) returns success whenever any other process exists in the pid namespace, signalled or not, so the
    only proof that none is left is /proc.
    """
    me = os.getpid()
    end = time.monotonic() + deadline_s
    while [p for p in _pids_of(uid) if p != me]:
        if time.monotonic() > end:
            raise RuntimeError(f"processes of uid {uid} survived SIGKILL for {deadline_s:g}s")
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.001)


def _remove_ipc(uid: int) -> None:
    """Removes the SysV IPC objects and POSIX message queues ``uid`` owns (the owner may remove them)."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
    ipc_rmid = 0
    for kind, remove in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            columns = line.split()
            ident, owner = int(columns[1]), int(columns[7 if kind == "shm" else 4 if kind == "sem" else 7])
            if owner == uid and libc is not None:
                if kind == "sem":
                    libc.semctl(ident, 0, ipc_rmid)
                else:
                    getattr(libc, remove)(ident, ipc_rmid, None)
    if os.path.isdir("/dev/mqueue"):
        for name in os.listdir("/dev/mqueue"):
            path = os.path.join("/dev/mqueue", name)
            try:
                if os.lstat(path).st_uid == uid:
                    os.unlink(path)
            except OSError:
                pass


def _empty(directory: str) -> None:
    """Removes everything in ``directory`` (the owner may make a read-only subtree writable again)."""
    def make_writable(function, path, excinfo):
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            os.chmod(path, stat.S_IRWXU)
        except OSError:
            pass
        try:
            (shutil.rmtree if os.path.isdir(path) and not os.path.islink(path) else os.unlink)(path)
        except OSError:
            pass

    try:
        os.chmod(directory, stat.S_IRWXU)
        entries = os.listdir(directory)
    except OSError:
        return
    for name in entries:
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=make_writable)
            else:
                os.unlink(path)
        except OSError:
            make_writable(None, path, None)


def prepare(slot: SlotSpec, control_fd: int) -> None:
    """Makes this freshly forked process a slot (see the module docstring). Raises OSError when it cannot."""
    os.setsid()
    if slot.uid is None:
        # Local backend: nothing reaps by uid, so a slot process must not outlive its template. (With dedicated
        # uids it may: an innocent sample keeps running to its answer, and the slot's next process reaps.)
        from .supervisor import die_with_parent

        die_with_parent()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    _close_inherited(control_fd)
    if slot.uid is not None:
        os.setgroups([])
        os.setgid(slot.uid)
        os.setuid(slot.uid)
    if slot.nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (slot.nproc, slot.nproc))
    if slot.memory is not None:
        resource.setrlimit(resource.RLIMIT_AS, (slot.memory, slot.memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    if slot.uid is not None:  # never as the server's own user: kill(-1) would reach the whole user
        reap_uid(slot.uid)
        _remove_ipc(slot.uid)
    os.makedirs(slot.directory, mode=0o700, exist_ok=True)
    _empty(slot.directory)
    os.chdir(slot.directory)
    os.environ.update(HOME=slot.directory, TMPDIR=slot.directory, PWD=slot.directory)
    worker.install_capture()


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
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.sendall(codec.STARTED)
    batch, timeout_s, state = codec.decode_request(_read_request(sock))
    try:
        trainer_state = TrainerState(**state) if state is not None else None
        if loaded.info.is_async:
            result = asyncio.run(worker.score_async(loaded, batch, timeout_s, trainer_state))
        else:
            result = worker.score(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001 - reported as these samples' error, not as a crash
        result = _internal_error(len(batch))
    _answer(loaded, sock, result)


async def _handle_async(loaded: worker.Loaded, fd: int) -> None:
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
        trainer_state = TrainerState(**state) if state is not None else None
        result = await worker.score_async(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001
        result = _internal_error(len(batch))
    sock.setblocking(True)
    _answer(loaded, sock, result)


async def _serve_async(loaded: worker.Loaded, control: socket.socket) -> None:
    """isolation: worker with an async function: one event loop for the worker's life, requests concurrently."""
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


def serve(loaded: worker.Loaded, control: socket.socket, reuse: bool) -> None:
    """Serves request sockets sent over ``control``: one (``reuse`` false) or until the template goes away."""
    control.sendall(READY)
    if reuse and loaded.info.is_async:
        asyncio.run(_serve_async(loaded, control))
        return
    while True:
        try:
            _, fds = recv(control)
        except (ChannelClosed, OSError, ValueError):
            return
        fd = optional_fd(fds)
        if fd is None:
            continue
        if not reuse:
            control.close()  # reward code never holds a channel to the template
        _handle(loaded, fd)
        if not reuse:
            return


def run(loaded: worker.Loaded, slot: SlotSpec, control: socket.socket, reuse: bool) -> None:
    """The whole life of a slot process; never returns."""
    code = 0
    try:
        prepare(slot, control.fileno())
        serve(loaded, control, reuse)
    except BaseException as e:  # noqa: BLE001 - reported through the exit code; the template logs it
        code = 70
        try:
            os.write(2, f"rewardbox slot {slot.index}: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    finally:
        sys.stdout.flush = lambda: None  # nothing of user code's buffered output reaches a descriptor
        os._exit(code)
