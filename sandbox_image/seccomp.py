"""A seccomp filter a slot process installs on itself before reward code runs (it and its children keep it).

It refuses (EPERM) the system calls that would give a sample state outside its own processes and files, or reach
into other processes: SysV IPC and POSIX message queues (objects that outlive the sample; gVisor ignores the
sysctls that switch them off under runc), ptrace and process_vm_* (tracing, and tracees that cannot be stopped),
kernel keyrings and userfaultfd. A system call of another architecture or ABI (x32) kills the process. Standard
library only (ctypes for prctl).

Programs that reward code runs (:mod:`.execution`) get a stricter filter on top: no ``socket()`` at all (socket
pairs stay) and no io_uring (which can open sockets too), so they have no network even inside a reward that has
one, and no named or abstract Unix sockets to meet concurrent programs of other samples on.
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
# BPF instruction codes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06

# (audit architecture, x32 bit or None, {name: number}) by machine
_DENIED = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl", "msgget", "msgsnd",
           "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
           "mq_getsetattr", "ptrace", "process_vm_readv", "process_vm_writev", "add_key", "request_key", "keyctl",
           "userfaultfd")
_NO_NETWORK = ("socket", "io_uring_setup", "io_uring_enter", "io_uring_register")
_TABLES = {
    "x86_64": (0xC000003E, 0x40000000, {"socket": 41, "io_uring_setup": 425, "io_uring_enter": 426,
                                        "io_uring_register": 427,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "ptrace": 101, "semtimedop": 220, "mq_open": 240,
        "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
        "add_key": 248, "request_key": 249, "keyctl": 250, "process_vm_readv": 310, "process_vm_writev": 311,
        "userfaultfd": 323}),
    "aarch64": (0xC00000B7, None, {"socket": 198, "io_uring_setup": 425, "io_uring_enter": 426,
                                   "io_uring_register": 427,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190,
        "semctl": 191, "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219, "process_vm_readv": 270,
        "process_vm_writev": 271, "userfaultfd": 282}),
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
    body = [_instruction(_LD_W_ABS, 0, 0, 4)]  # seccomp_data.arch
    body.append(_instruction(_JEQ_K, 1, 0, arch))
    body.append(_instruction(_RET_K, 0, 0, _RET_KILL_PROCESS))
    body.append(_instruction(_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
    if x32_bit is not None:
        body.append(_instruction(_JGE_K, 0, 1, x32_bit))
        body.append(_instruction(_RET_K, 0, 0, _RET_KILL_PROCESS))
    # Each denied number jumps to the EPERM return at the end: count the instructions left to skip.
    for i, number in enumerate(denied):
        skip = (len(denied) - 1 - i) + 1  # the remaining comparisons, then the ALLOW return
        body.append(_instruction(_JEQ_K, skip, 0, number))
    body.append(_instruction(_RET_K, 0, 0, _RET_ALLOW))
    body.append(_instruction(_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    return b"".join(body)


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
