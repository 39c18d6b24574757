"""A seccomp filter a slot process installs on itself before reward code runs (it and its children keep it).

It refuses (EPERM) the system calls that would give a sample state outside its own processes and files, or reach
into other processes: SysV IPC and POSIX message queues (objects that outlive the sample; gVisor ignores the
sysctls that switch them off under runc), ptrace and process_vm_* (tracing, and tracees that cannot be stopped),
kernel keyrings, userfaultfd, ``ioprio_set`` (it can set the I/O class of the uid's other processes) and io_uring
(whose operations no seccomp filter sees, and whose rings are memory in no process's resident set). It also
refuses new namespaces and mounts (``unshare``, ``setns``, ``clone`` with a namespace flag, ``mount`` and the new
mount API, ``pivot_root``, ``chroot``), ``bpf`` and ``perf_event_open``: a container that holds ``SYS_ADMIN`` for
the private ``/tmp`` (:mod:`.private_tmp`) has Docker's seccomp profile let these through, and a sample must not
make a user namespace (the kernel code that opens to an unprivileged user is large) nor change its mounts (its
``/tmp``). ``prlimit64`` and the
``sched_set*`` calls work on the calling process only (pid 0): a sample forked by its slot process shares its uid,
and could otherwise lower the limits, the CPUs or the scheduling class that every later child of it inherits
(:mod:`..processes.forked`). Nor may a sample choose which process the kernel signals for a descriptor (``fcntl``
F_SETOWN and F_SETOWN_EX, ``ioctl`` FIOSETOWN and SIOCSPGRP): a descriptor can outlive every process of the sample (sent
over a socket, in flight in the runner's), and would signal its slot process at a moment it chose. And
``memfd_create``: a memory file is held by its descriptor, not by any process, so it counts toward no process's
memory, and the OOM killer would take an innocent concurrent sample instead. For the same reason a socket's
buffers stay at their default size: ``setsockopt`` SO_SNDBUF, SO_RCVBUF and their FORCE forms succeed and change
nothing (the kernel may adjust what is asked anyway), and a pipe's too (``fcntl`` F_SETPIPE_SZ is refused; gVisor
shows pipe buffers in no memory figure at all), so what a sample's sockets and pipes hold is bounded by its open
files (:data:`..processes.slot.SAMPLE_OPEN_FILES`); the memory guard reads what sockets hold (:mod:`..memory.sockets`).
``setsockopt`` SO_LINGER succeeds and changes nothing as well: a TCP socket that lingers makes the ``close`` that drops
its last reference wait (up to the hour it asks for) until its queued data is taken, and a sample can make that close
somebody else's (its socket sent to the program runner, whose monitor closes what it finds in flight there); under
gVisor such a close stalled the whole sandbox, ``docker exec`` included (red team). Unix sockets are stream sockets
only (``socket`` and ``socketpair`` of another type are refused): what a closed sender left queued at a datagram or
seqpacket socket cannot be told from ``sock_diag``'s figures (a datagram socket shows its first message's size, and
a message of no bytes shows none: 250 of them hold 200 KB), and 600 MB hidden so made the memory guard restart the
whole sandbox (red team 15). And ``vmsplice``: a pipe holds the pages spliced into it, each a whole 2 MB huge page
where the sample asked for them, after the sample unmapped them, in no process's figures (600 MB in pipes of 64 KiB;
red team 15). ``clone3`` answers ENOSYS
(its flags are in memory a filter cannot read; the C library falls back to ``clone``). A system call of another
architecture or ABI (x32) kills the process. Standard library only (ctypes for prctl).

Programs that reward code runs (:mod:`..programs.execution`) get a stricter filter on top: no ``socket()`` at all
(socket pairs stay), so they have no network even inside a reward that has one, and no named or abstract Unix sockets to
meet concurrent programs of other samples on.
"""

from __future__ import annotations

import ctypes
import platform
import struct

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_EPERM = 1
_ENOSYS = 38
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET, and NEWTIME
_NAMESPACE_FLAGS = 0x7E020000 | 0x80
# BPF instruction codes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JSET_K = 0x45
_ARG0_LOW = 16  # offsetof(struct seccomp_data, args[0]), little-endian: its low 32 bits
_ARG1_LOW = 24  # args[1]'s
# fcntl commands and ioctl requests refused: those that choose the process signalled for a descriptor (F_SETOWN,
# F_SETOWN_EX; FIOSETOWN, SIOCSPGRP), and F_SETPIPE_SZ (a pipe's buffer stays at 64 KiB)
_REFUSED_COMMANDS = {"fcntl": (8, 15, 1031), "ioctl": (0x8901, 0x8902)}
_ARG2_LOW = 32  # args[2]'s
_SOL_SOCKET = 1
# setsockopt options at SOL_SOCKET that succeed and change nothing: SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE,
# SO_RCVBUFFORCE (memory in no process), SO_LINGER (a close that blocks whoever drops the last reference)
_IGNORED_OPTIONS = (7, 8, 32, 33, 13)
_JGE_K = 0x35
_RET_K = 0x06
_AND_K = 0x54
_AF_UNIX, _SOCK_STREAM, _SOCK_TYPE_MASK = 1, 1, 0xF  # the type's low bits (SOCK_CLOEXEC, SOCK_NONBLOCK above)

# (audit architecture, x32 bit or None, {name: number}) by machine
_DENIED = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl", "msgget", "msgsnd",
           "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
           "mq_getsetattr", "ptrace", "process_vm_readv", "process_vm_writev", "add_key", "request_key", "keyctl",
           "userfaultfd", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
           "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "ioprio_set",
           "memfd_create", "io_uring_setup", "io_uring_enter", "io_uring_register", "vmsplice")
_NO_NETWORK = ("socket",)
_SELF_ONLY = ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr")
_TABLES = {
    "x86_64": (0xC000003E, 0x40000000, {"socket": 41, "io_uring_setup": 425, "io_uring_enter": 426,
                                        "io_uring_register": 427,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "ptrace": 101, "semtimedop": 220, "mq_open": 240,
        "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
        "add_key": 248, "request_key": 249, "keyctl": 250, "process_vm_readv": 310, "process_vm_writev": 311,
        "userfaultfd": 323, "clone": 56, "clone3": 435, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 321,
        "perf_event_open": 298, "ioprio_set": 251, "prlimit64": 302, "sched_setaffinity": 203,
        "sched_setscheduler": 144, "sched_setparam": 142, "sched_setattr": 314, "memfd_create": 319, "fcntl": 72,
        "ioctl": 16, "setsockopt": 54, "socketpair": 53, "vmsplice": 278}),
    "aarch64": (0xC00000B7, None, {"socket": 198, "io_uring_setup": 425, "io_uring_enter": 426,
                                   "io_uring_register": 427,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190,
        "semctl": 191, "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219, "process_vm_readv": 270,
        "process_vm_writev": 271, "userfaultfd": 282, "clone": 220, "clone3": 435, "unshare": 97, "setns": 268,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 280,
        "perf_event_open": 241, "ioprio_set": 30, "prlimit64": 261, "sched_setaffinity": 122, "sched_setscheduler": 119,
        "sched_setparam": 118, "sched_setattr": 274, "memfd_create": 279, "fcntl": 25, "ioctl": 29,
        "setsockopt": 208, "socketpair": 199, "vmsplice": 75}),
}


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program(machine: str, network: bool = True) -> bytes:
    """The filter for ``machine`` as packed sock_filter instructions; without ``network``, socket() and io_uring
    are refused too (socketpair() is not).

    Raises:
        KeyError: no table for this machine.
    """
    arch, x32_bit, numbers = _TABLES[machine]
    denied = sorted({numbers[name] for name in _DENIED + (() if network else _NO_NETWORK)})
    # (code, true target, false target, k), targets as labels; resolved into relative jumps below
    code: list = [(_LD_W_ABS, None, None, 4),  # seccomp_data.arch
                  (_JEQ_K, "nr", "kill", arch),
                  ("nr", None, None, None), (_LD_W_ABS, None, None, 0)]  # seccomp_data.nr
    if x32_bit is not None:
        code.append((_JGE_K, "kill", "checks", x32_bit))
    code.append(("checks", None, None, None))
    code.append((_JEQ_K, "enosys", "clone?", numbers["clone3"]))
    code.append(("clone?", None, None, None))
    code.append((_JEQ_K, "clone", "denied", numbers["clone"]))
    code.append(("denied", None, None, None))
    for number in denied:
        code.append((_JEQ_K, "eperm", None, number))
    for number in sorted(numbers[name] for name in _SELF_ONLY):
        code.append((_JEQ_K, "self", None, number))
    for name in _REFUSED_COMMANDS:
        code.append((_JEQ_K, name, None, numbers[name]))
    code.append((_JEQ_K, "setsockopt", None, numbers["setsockopt"]))
    if network:
        code.append((_JEQ_K, "unix", None, numbers["socket"]))
    code.append((_JEQ_K, "unix", None, numbers["socketpair"]))
    code.append((_RET_K, None, None, _RET_ALLOW))
    code += [("unix", None, None, None), (_LD_W_ABS, None, None, _ARG0_LOW),  # the domain
             (_JEQ_K, None, "allow", _AF_UNIX), (_LD_W_ABS, None, None, _ARG1_LOW),  # the type
             (_AND_K, None, None, _SOCK_TYPE_MASK), (_JEQ_K, "allow", "eperm", _SOCK_STREAM)]
    code += [("setsockopt", None, None, None), (_LD_W_ABS, None, None, _ARG1_LOW),  # the level
             (_JEQ_K, None, "allow", _SOL_SOCKET), (_LD_W_ABS, None, None, _ARG2_LOW)]  # the option
    code += [(_JEQ_K, "ignore", None, option) for option in _IGNORED_OPTIONS]
    code.append((_RET_K, None, None, _RET_ALLOW))
    for name, commands in _REFUSED_COMMANDS.items():
        code += [(name, None, None, None), (_LD_W_ABS, None, None, _ARG1_LOW)]  # the command (a 32-bit int)
        code += [(_JEQ_K, "eperm", None, command) for command in commands]
        code.append((_RET_K, None, None, _RET_ALLOW))
    code += [("self", None, None, None), (_LD_W_ABS, None, None, _ARG0_LOW),  # the pid (a 32-bit int)
             (_JEQ_K, "allow", "eperm", 0),
             ("clone", None, None, None), (_LD_W_ABS, None, None, _ARG0_LOW),
             (_JSET_K, "eperm", "allow", _NAMESPACE_FLAGS),
             ("allow", None, None, None), (_RET_K, None, None, _RET_ALLOW),
             ("eperm", None, None, None), (_RET_K, None, None, _RET_ERRNO | _EPERM),
             ("ignore", None, None, None), (_RET_K, None, None, _RET_ERRNO | 0),  # returns 0, does nothing
             ("enosys", None, None, None), (_RET_K, None, None, _RET_ERRNO | _ENOSYS),
             ("kill", None, None, None), (_RET_K, None, None, _RET_KILL_PROCESS)]
    return _assemble(code)


def _assemble(code: list) -> bytes:
    """Packs instructions whose jump targets are labels (a label is a ``(name, None, None, None)`` entry; None as
    a target: the next instruction)."""
    labels, at = {}, 0
    for entry in code:
        if isinstance(entry[0], str):
            labels[entry[0]] = at
        else:
            at += 1
    out, at = [], 0
    for op, true, false, k in code:
        if isinstance(op, str):
            continue
        at += 1  # jumps count from the next instruction
        jt, jf = (0 if t is None else labels[t] - at for t in (true, false))
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError("a jump out of reach in the seccomp program")
        out.append(_instruction(op, jt, jf, k))
    return b"".join(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_prepared: dict = {}


def prepare(network: bool = True) -> None:
    """Builds a filter ahead of time (in the template, once, before it forks), so a slot only makes the calls."""
    if network not in _prepared:
        code = program(platform.machine(), network)
        buffer = ctypes.create_string_buffer(code, len(code))
        # buffer is kept alive beside fprog, which points into it
        _prepared[network] = (_SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p)), buffer)
        _prepared["libc"] = ctypes.CDLL(None, use_errno=True)


def install(network: bool = True) -> None:
    """Installs a filter on this process (and, through fork and exec, on everything it starts); ``network``
    false: the programs' filter.

    Raises:
        OSError: the kernel refused it; KeyError: no table for this machine.
    """
    prepare(network)
    libc, fprog = _prepared["libc"], _prepared[network][0]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
