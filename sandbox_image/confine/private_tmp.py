"""A private, writable ``/tmp`` for every slot process and every program a reward runs.

Rewards written for plain Python write to ``/tmp`` by name (``open("/tmp/solution.py", "w")``,
``subprocess.run(["python3", "/tmp/x.py"])``). The container's ``/tmp`` is on its read-only root, so each process
that runs reward code gets a view of the file system of its own in which its scratch directory (its slot's tmpfs,
0700, its uid's alone, emptied before it starts) is ``/tmp``. A file written there is seen by that process and
its children only: no concurrent sample can see it or plant one there (they each see their own), and no later one
either (the next process of the slot finds the tmpfs emptied). ``/tmp/slot-*`` is hidden behind it.

Two ways, one per runtime (the host picks: ``--private-tmp``):

``userns`` (runc): the process first becomes its slot uid (no capability left), then makes a user namespace that
maps that uid to itself and a mount namespace it owns, mounts its directory on ``/tmp``, and drops the
capabilities it holds inside that namespace before any reward code runs. Docker's seccomp profile lets
``unshare`` and ``mount`` through only to a container holding ``SYS_ADMIN``, so the container is given it and the
sandbox's first process drops it at once (:func:`drop_sys_admin`, before anything is forked): no process of the
sandbox holds a capability over anything but its own namespaces, and the slot and program seccomp filters
(:mod:`.seccomp`) refuse namespaces and mounts to reward code.

``chroot`` (gVisor): gVisor's kernel (as Debian ships it) has one mount namespace for everything (``unshare``
answers success and changes nothing) and refuses mounts in a nested user namespace. Its ``SYS_ADMIN`` and
``SYS_CHROOT`` are its own (the host kernel never sees these calls), so at start-up the sandbox builds one root per
uid under :data:`ROOTS` (a tmpfs of its own) that repeats the container's mounts (its read-only root, ``/proc``,
``/dev``, ...; not ``/tmp/slot-*`` nor the gRPC socket's directory), with the uid's own directory on ``/tmp``. A
slot process or program ``chroot``\ s into its uid's root as root, before it drops to that uid (after which it
can never ``chroot`` again). No root holds ``ROOTS`` itself, so no sample sees another's.

Where neither works (an AppArmor profile that forbids mounts, as Docker's default one does, or a Kubernetes
``RuntimeDefault`` seccomp profile), :func:`probe` says why at start-up and ``/tmp`` stays read-only.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

MODES = ("userns", "chroot")
PATH = "/tmp"
ROOTS = "/tmp/rewardbox-roots"  # chroot: a tmpfs the docker backend mounts, root's (mode 0711)
LEAKS = ROOTS + "/leaked"  # see renew: root's, mode 0700
FIX = ("Under runc, an AppArmor profile that forbids mounts (Docker's default one, on hosts that confine containers "
       "with AppArmor) or a kernel without unprivileged user namespaces stops it: load rewardbox's profile "
       "(`sudo rewardbox apparmor --install`) and set sandbox.docker.apparmor_profile: rewardbox-sandbox, or run "
       "sandboxes under gVisor (sandbox.docker.runtime: runsc). sandbox.docker.private_tmp: off silences this (and "
       "leaves /tmp read-only).")

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REMOUNT, _MS_RELATIME = 32, 1 << 21
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_DUMPABLE = 4
_CAP_SYS_ADMIN = 21
_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _set_capabilities(keep) -> None:
    """Sets each of this process's effective, permitted and inheritable capability sets to ``keep(bits)`` of it."""
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    for word in data:
        word.effective, word.permitted, word.inheritable = keep(word.effective), keep(word.permitted), \
            keep(word.inheritable)
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def drop_sys_admin() -> None:
    """Drops ``CAP_SYS_ADMIN`` from this process, and so from all it will start: runc's container holds it only so
    that its seccomp profile lets namespaces and mounts through (see the module docstring). It stays in the
    bounding set (dropping it there needs ``CAP_SETPCAP``), which cannot give it back: with ``no-new-privileges``,
    what a root process execs never gains a capability its parent did not hold."""
    _set_capabilities(lambda bits: bits & ~(1 << _CAP_SYS_ADMIN))


def hide_others() -> Optional[str]:
    """Remounts ``/proc`` so that each process sees there only the processes it may trace (``hidepid=invisible``:
    those of its own uid that are dumpable), but for root's group (``gid=0``: the sandbox's own processes, which
    read every process's figures and kill what a uid left). Without it a sample reads the command line (``cmdline``)
    of every program the other samples run, whatever its uid: their code or test data where a reward passes them
    as arguments (red team 12: 3 of 3 batches). As root holding ``CAP_SYS_ADMIN``, before :func:`drop_sys_admin`
    (runc, in the sandbox's first process). Returns why it could not be done (gVisor's /proc has no ``hidepid``), or
    None."""
    flags = _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RELATIME  # as the engine mounts it
    try:
        _check(_libc.mount(b"proc", b"/proc", b"proc", flags, b"hidepid=invisible,gid=0"),
               "remounting /proc with hidepid")
    except OSError as e:
        return e.strerror
    return None


def make_dumpable() -> None:
    """Lets the processes of this one's uid see it in ``/proc`` (:func:`hide_others`) and trace it: a slot process's
    child for one sample (:mod:`..processes.forked`), so that its parent can look at it (:mod:`..processes.cpu_wait`).
    The slot process itself stays as its uid change left it, not dumpable: its children cannot read its memory (the
    request's other samples are mapped there). Core dumps stay off (RLIMIT_CORE 0)."""
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


def prewarm() -> None:
    """Looks up the C functions and builds the ctypes types a slot process calls, once in the template: done after
    the fork instead, each process would pay for it again (dlsym, type objects, and the pages they dirty)."""
    for name in ("capget", "capset", "prctl", "unshare", "mount"):
        getattr(_libc, name)
    _CapHeader(_CAPABILITY_VERSION_3, 0)
    (_CapData * 2)()


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mount(source: str, target: str, flags: int) -> None:
    _check(_libc.mount(source.encode(), target.encode(), None, flags, None), f"mount --bind {source} {target}")


def enter_as_user(directory: str) -> None:
    """``userns``, as the slot's uid (no capability): a user namespace mapping this uid and gid to themselves, a
    mount namespace of its own with ``directory`` on ``/tmp``, then no capability again."""
    uid, gid = os.getuid(), os.getgid()
    # After the uid change the process is not dumpable and its /proc files are root's: it could not write its maps.
    _check(_libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    try:
        _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        _mount(directory, PATH, _MS_BIND)  # a bind mount keeps the source's nosuid, nodev and noexec
        _set_capabilities(lambda bits: 0)
    finally:
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def home(mode: str, directory: str) -> str:
    """Where a process of a slot (or its program) works, and its HOME and TMPDIR: ``/tmp`` where its directory is
    mounted there, else the directory itself."""
    return PATH if mode else directory


def root_of(uid: int) -> str:
    return os.path.join(ROOTS, str(uid))


def _mount_points() -> list:
    """Every mount point of this process's view, parents before children (mountinfo's order)."""
    with open("/proc/self/mountinfo") as f:
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def build_roots(directories: dict, hidden: tuple) -> None:
    """``chroot``, at start-up as root: for each ``uid: directory``, a root under :data:`ROOTS` that repeats the
    container's mounts (the root file system and each mount on it, one bind mount each: gVisor binds nothing
    recursively), but none under ``/tmp`` or ``hidden``, with ``directory`` on ``/tmp``."""
    hidden = (PATH,) + hidden
    points = [point for point in _mount_points()
              if point != "/" and not any(point == h or point.startswith(h + "/") for h in hidden)]
    for uid, directory in directories.items():
        root = root_of(uid)
        os.mkdir(root, 0o755)
        _mount("/", root, _MS_BIND)  # read-only, as the container's root is
        for point in points:
            _mount(point, root + point, _MS_BIND)
        _mount(directory, root + PATH, _MS_BIND)
    os.mkdir(LEAKS, 0o700)
    os.chmod(ROOTS, 0o711)  # nobody can list the roots; each is entered by its path, as root


def renew(uid: int, directory: str, executable: bool) -> None:
    """``chroot`` (gVisor), as root: a fresh tmpfs, as large as the one there, on ``directory`` and on the uid's
    root's ``/tmp``, for a uid whose tmpfs still holds data once emptied (:func:`..processes.tree.unnamed_bytes`):
    gVisor frees no Unix socket sent over itself, nor an unlinked file riding in it, so every later sample of the slot
    would find its ``/tmp`` full. The old tmpfs stays beneath, held by the leak alone (the memory guard restarts
    the sandbox when memory no process holds grows too large). ``executable``: a programs' directory (compiled
    programs run from it), else ``noexec``.

    Raises:
        OSError: the mount failed.
    """
    info = os.statvfs(directory)
    flags = _MS_NOSUID | _MS_NODEV | (0 if executable else _MS_NOEXEC)
    options = f"size={info.f_blocks * info.f_frsize},mode=0700,uid={uid},gid={uid}".encode()
    _check(_libc.mount(b"tmpfs", directory.encode(), b"tmpfs", flags, options), f"mount -t tmpfs {directory}")
    _mount(directory, root_of(uid) + PATH, _MS_BIND)
    # What the old one holds, for the memory guard (leaked_bytes): an empty file named by it (gVisor shows no mount
    # source in its mount table, and the old tmpfs can no longer be reached by its path).
    held = (info.f_blocks - info.f_bfree) * info.f_frsize
    os.close(os.open(os.path.join(LEAKS, f"{held}-{uid}-{os.getpid()}-{len(os.listdir(LEAKS))}"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def leaked_bytes() -> int:
    """Bytes held in slot tmpfs that :func:`renew` replaced (as they were then; gVisor never frees them)."""
    return sum(int(name.split("-", 1)[0]) for name in os.listdir(LEAKS))


def become(mode: str, uid: int, directory: str) -> None:
    """Takes ``uid`` for good (the caller is root, its gid already set; no capability is left after this) with
    ``directory`` on ``/tmp`` as ``mode`` makes it (none for ``""``): ``chroot`` before the uid change, ``userns``
    after it."""
    if mode == "chroot":
        os.chroot(root_of(uid))
        os.chdir("/")
    os.setresuid(uid, uid, uid)
    if mode == "userns":
        enter_as_user(directory)


def probe(mode: str, uid: int, directory: str) -> Optional[str]:
    """Tries ``mode`` once in a child that becomes ``uid``, mounts ``directory`` on ``/tmp`` and writes there.
    Returns why it failed, or None. Runs as root before any slot exists (the file it writes is gone with it)."""
    if mode not in MODES:
        return f"unknown mode {mode!r} (one of {', '.join(MODES)})"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 1
        try:
            expected = os.stat(directory).st_dev
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            become(mode, uid, directory)
            name = os.path.join(PATH, ".rewardbox-probe")
            with open(name, "w") as f:
                f.write("ok")
            if os.stat(name).st_dev != expected:
                raise OSError(f"a file written to {PATH} is not on {directory}'s file system")
            os.unlink(name)
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(write_end, f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:1000])
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        reason = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if status == 0:
        return None
    return reason or f"the probe ended with status {status}"
