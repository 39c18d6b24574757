"""Processes of a sandbox by uid and by parentage: forking children that die with us, reaping them, listing, killing
and cleaning up after everything of a uid (processes, SysV IPC objects, files). Used by the supervisor, templates,
slot processes and the program runner alike; standard library only (ctypes for prctl, close_range and IPC calls).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import stat
import sys
import time
from typing import Callable, Iterator, Optional

_CLOSE_RANGE = 436  # the same number on every Linux architecture


def _close_range(low: int, high: int) -> None:
    """Closes descriptors low..high in one system call (os.closerange lists /proc/self/fd first)."""
    if _LIBC.syscall(_CLOSE_RANGE, ctypes.c_uint(low), ctypes.c_uint(high), ctypes.c_uint(0)) != 0:
        os.closerange(low, min(high + 1, 65536))  # a kernel without close_range (gVisor's)


def close_inherited(*keep: int) -> None:
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


def statuses() -> Iterator[tuple[int, bytes]]:
    """(pid, /proc/<pid>/status as bytes) of every process this one can see (zombies included)."""
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
        yield int(entry), status


def statuses_of(uid: int) -> Iterator[tuple[int, bytes]]:
    """:func:`statuses` of each process whose real uid is ``uid``. Finds the uid without parsing the rest: it runs
    before every sample."""
    wanted = str(uid).encode()
    for pid, status in statuses():
        at = status.find(b"\nUid:\t")
        if at >= 0 and status[at + 6:].split(b"\t", 1)[0] == wanted:
            yield pid, status


def status_fields(status: bytes) -> dict:
    """A /proc/<pid>/status as {field: its words}."""
    fields = {}
    for line in status.split(b"\n"):
        key, _, value = line.partition(b":")
        fields[key] = value.split()
    return fields


def status_kb(fields: dict, key: bytes) -> int:
    """A field of :func:`status_fields` given in kB (0 where absent)."""
    return int(fields[key][0]) if fields.get(key) else 0


def resident_kb(fields: dict) -> int:
    """What a process holds in memory of its own, from :func:`status_fields`: its anonymous and shared-memory
    resident pages (pages shared after a fork count in each process), else its resident set where the kernel does
    not tell those apart (gVisor)."""
    if b"RssAnon" in fields:
        return status_kb(fields, b"RssAnon") + status_kb(fields, b"RssShmem")
    return status_kb(fields, b"VmRSS")


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# The libc already loaded (find_library would run ldconfig in a subprocess), loaded once, before any fork.
_LIBC = ctypes.CDLL(None, use_errno=True)


def prewarm() -> None:
    """Looks up the C functions a slot process calls, once in its template (see private_tmp.prewarm)."""
    for name in ("syscall", "prctl"):
        getattr(_LIBC, name)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send ``sig`` (SIGKILL) to this process when its parent exits."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def describe_status(status: int) -> str:
    """A wait status in words: ``killed by SIGKILL``, ``exit code 70``."""
    if os.WIFSIGNALED(status):
        try:
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"


_PR_SET_NAME = 15


def set_name(name: str) -> None:
    """Names this process (at most 15 bytes) for ``ps``, ``top`` and ``perf`` (see the process tree in
    docs/explanation/architecture.md). Only for people: nothing trusts a name, and reward code may change its own."""
    _LIBC.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def become_subreaper() -> None:
    """Makes this process the one that inherits its orphaned descendants (not their init)."""
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children_listing() -> Optional[bytes]:
    """The kernel's list of the pids of this process's main thread's children (each followed by a space); None
    where it does not list them."""
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
    return data


def children() -> Optional[set]:
    """The pids of this (single-threaded) process's children, from the kernel; None where it does not list them."""
    listing = children_listing()
    return None if listing is None else {int(pid) for pid in listing.split()}


def all_children() -> set:
    """The pids of this process's children, whichever of its threads forked them (each task's ``children`` file;
    where the kernel lists none, every process whose parent is this one, from ``/proc``)."""
    found: set = set()
    try:
        tasks = os.listdir("/proc/self/task")
        for task in tasks:
            with open(f"/proc/self/task/{task}/children", "rb") as f:
                found.update(int(pid) for pid in f.read().split())
        return found
    except OSError:
        pass
    me = os.getpid()
    for pid, status in statuses():
        at = status.find(b"\nPPid:\t")
        if at >= 0 and int(status[at + 7:status.index(b"\n", at + 1)]) == me:
            found.add(pid)
    return found


def name_of(pid: int) -> str:
    """The process's name (its ``comm``), or "?" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip().decode("utf-8", "replace")
    except OSError:
        return "?"


def kill_children(keep: set, deadline_s: float = 2.0, reaped: Callable[[int], None] = lambda pid: None) -> None:
    """Kills and reaps every child of this process but those in ``keep``, and what they orphan to it (its
    subreaper's), until none is left or ``deadline_s`` passed. ``reaped(pid)`` is called for each child reaped
    meanwhile, kept ones included."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid, _ in exited_children():
            reaped(pid)
        left = all_children() - keep
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


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


def _states_of(uid: int) -> list[bytes]:
    """The state letter (``/proc/<pid>/status``) of each live (not zombie) process whose real uid is ``uid``: ``T``,
    ``t`` (stopped, traced-stopped) and ``D`` (waiting in the kernel) cannot fork now."""
    found = []
    for _, status in statuses_of(uid):
        at = status.find(b"\nState:\t")
        state = status[at + 8:at + 9] if at >= 0 else b"?"
        if state != b"Z":
            found.append(state)
    return found


def _signal_all(sig: int) -> None:
    try:
        os.kill(-1, sig)
    except ProcessLookupError:  # gVisor: nothing it may signal
        pass


def kill_descendants(pid: int) -> Optional[int]:
    """From a subreaper that shares its uid with its descendants and no other process (a forked request's slot
    process: :mod:`.forked`): kills every process of its uid, all its descendants, and reaps them. Returns the wait
    status of ``pid``. One kill(-1) reaches them all (Linux: no fork can pass it), and as their subreaper this
    process waits until it has no child left, which proves none is left."""
    status = None
    _signal_all(signal.SIGKILL)
    while True:
        try:
            reaped, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            return status  # no child is left
        if reaped == pid:
            status = wait_status


REAPER_UID_BIT = 1 << 31  # a real uid of its own for cleaning up after a uid: no sample process runs under it
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
    so /proc is the only proof; without an atomic kill, several scans in a row). Where the stopping's last scans in a
    row found no live process of the uid at all (the usual case: nothing was left), they are that proof already,
    each after a kill(-1) as the killing's would be, and the killing's scans are not made again (under gVisor, each
    scan reads every process's status: about 3 ms of a slot process's start).

    Raises:
        RuntimeError: some survived ``deadline_s`` (a process stuck in the kernel).
    """
    end = time.monotonic() + deadline_s
    stop_end = time.monotonic() + STOP_BUDGET_S
    stable = 0
    none_live = 0  # of those scans in a row, how many (the last ones) found no live process of the uid at all
    while not atomic and stable < STABLE_SCANS and time.monotonic() < stop_end:
        _signal_all(signal.SIGSTOP)
        states = _states_of(uid)
        stable = stable + 1 if all(state in b"TtD" for state in states) else 0
        none_live = none_live + 1 if not states else 0
        if none_live >= STABLE_SCANS:
            return
        if none_live:
            time.sleep(0.001)  # as between the killing's scans
    # Without an atomic kill(-1), one empty scan may have raced a fork that was under way (a child not yet listed,
    # its parent already dead): there, several empty scans in a row, each after another kill, are the proof.
    empty_scans = 0
    while True:
        _signal_all(signal.SIGKILL)
        empty_scans = empty_scans + 1 if not _states_of(uid) else 0
        if empty_scans >= (1 if atomic else STABLE_SCANS):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"processes of uid {uid} survived SIGKILL for {deadline_s:g}s")
        time.sleep(0.001)


def unnamed_bytes(directory: str) -> int:
    """Bytes the file system of ``directory`` (a slot's tmpfs) holds; once emptied, data no name reaches any more,
    kept by something that holds it open. Under gVisor that can be for good: it never frees a Unix socket sent over
    itself (Linux collects such cycles), nor what rides in it, an unlinked file among them."""
    info = os.statvfs(directory)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def empty_own_tmpfs(directory: str) -> int:
    """:func:`empty` for ``directory``, the root of a tmpfs of its own, and then its :func:`unnamed_bytes`. Where
    the file system holds no byte and no inode but its root, only the root itself can have changed: one
    ``statvfs`` tells, instead of reading the directory (once per forked sample: :mod:`.forked`)."""
    info = os.statvfs(directory)
    if info.f_files > 0 and info.f_files - info.f_ffree == 1 and info.f_blocks > 0 and info.f_blocks == info.f_bfree:
        top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _reset(top)
        finally:
            os.close(top)
        return 0
    empty(directory)
    return unnamed_bytes(directory)


# FS_IOC_GETFLAGS and FS_IOC_SETFLAGS (the same on every 64-bit Linux: _IOR/_IOW('f', 1/2, long))
_GET_FLAGS, _SET_FLAGS = 0x80086601, 0x40086602
# The inode flags an owner may set (linux/fs.h: FS_FL_USER_MODIFIABLE, with nocomp, data journalling, nocow, dax,
# project inheritance and casefold), which _reset clears. The others are the file system's own and cannot be cleared
# (ext4 marks every directory FS_EXTENT_FL, and refuses to clear it: EPERM).
_OWNER_FLAGS = 0x000380FF | 0x00000400 | 0x00004000 | 0x00800000 | 0x02000000 | 0x20000000 | 0x40000000


def _reset(directory: int) -> None:
    """Puts back what outlives the removal of everything in ``directory`` (an open descriptor), on the directory
    itself: its mode (owner only), its extended attributes (none: a default ACL there, which a tmpfs keeps, would
    set the mode of every file a later sample makes in it, and a ``user.`` attribute would carry data to later
    samples) and the inode flags its owner may set (none: ``noatime`` and ``nodump`` would too; the file system's
    own, as ext4's ``extents``, stay). Red team, runc; gVisor keeps ``user.`` attributes and has no inode flags."""
    os.fchmod(directory, stat.S_IRWXU)
    try:
        names = os.listxattr(directory)
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):  # a file system without them
            raise
        names = []
    for name in names:
        os.removexattr(directory, name)
    try:
        flags = fcntl.ioctl(directory, _GET_FLAGS, bytes(8))
    except OSError as e:
        if e.errno not in (errno.ENOTTY, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):  # gVisor: ENOTTY
            raise
        return
    value = int.from_bytes(flags[:4], sys.byteorder)
    if value & _OWNER_FLAGS:
        fcntl.ioctl(directory, _SET_FLAGS, (value & ~_OWNER_FLAGS).to_bytes(8, sys.byteorder))


def empty(directory: str) -> None:
    """Removes everything in ``directory``, however deep, as its owner, and puts back what is on the directory
    itself (:func:`_reset`).

    Iterative and relative to open directories: a tree deeper than the recursion limit or longer than PATH_MAX
    is flattened, one subdirectory at a time, into the top directory (renamed there under a fresh name), so at most
    two directories are open at once.

    Raises:
        OSError: something cannot be removed.
    """
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    counter = 0
    try:
        _reset(top)
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
