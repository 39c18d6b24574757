"""What the sandbox's sockets hold, for the memory guard: kernel memory that no process's resident set shows.

Linux (runc): ``sock_diag`` (netlink, no privilege needed, this network namespace only) lists every socket with the
uid that made it and the bytes queued on it: Unix sockets (what each sent that is still queued, held open or in
flight alike) and TCP and UDP ones over IPv4 and IPv6 (:func:`bytes_by_uid`). What a socket holds is real kernel
memory, so a sample cannot make it count for more than it costs, as it could when the guard counted 240 KiB for
every descriptor slot of every process (a ``dup2`` to descriptor 511 counted for 120 MiB; red team).

gVisor has no ``sock_diag``. There its ``/proc`` lets any uid read another process's descriptors
(``socket:[inode]``), and ``/proc/net`` lists every socket with its inode (:func:`listed`, :func:`held_by`): a socket
no process holds (sent over a Unix socket, then closed: in flight) is told apart from one that a process holds,
though not what either holds; a process with many descriptors is only counted (each may be a socket). Standard
library only.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Iterable, Optional

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_ATTRIBUTE = struct.Struct("=HH")  # struct rtattr
# Unix: struct unix_diag_req; show its memory (UNIX_DIAG_MEMINFO, attribute 5) and its uid (UNIX_DIAG_UID, 7)
_UNIX_REQUEST = struct.Struct("=BBHIIIII")
_UNIX_SHOW = 0x20 | 0x40
_UNIX_MESSAGE = 16  # struct unix_diag_msg
_UNIX_MEMINFO, _UNIX_UID = 5, 7
# TCP and UDP: struct inet_diag_req_v2 (its socket id zeroed: every socket); show INET_DIAG_SKMEMINFO (7)
_INET_REQUEST = struct.Struct("=BBBxI48x")
_INET_SKMEMINFO = 7
_INET_MESSAGE = 72  # struct inet_diag_msg; its uid at byte 64
_INET_UID = struct.Struct("=I")
_ALL_STATES = 0xFFFFFFFF
# struct sk_meminfo (u32s): what a socket's queues hold, and the memory it has reserved for them
_RMEM_ALLOC, _WMEM_ALLOC, _FWD_ALLOC, _WMEM_QUEUED, _OPTMEM = 0, 2, 4, 5, 6
TABLES = tuple(f"/proc/net/{name}" for name in ("unix", "tcp", "tcp6", "udp", "udp6"))


def bytes_by_uid() -> Optional[dict]:
    """{uid: bytes queued on the sockets that uid made} for every socket of this network namespace, or None where
    the kernel has no ``sock_diag`` (gVisor)."""
    try:
        diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    except OSError:
        return None
    found: dict = {}
    try:
        with diag:
            diag.settimeout(1.0)
            request = _UNIX_REQUEST.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, _UNIX_SHOW, 0xFFFFFFFF, 0xFFFFFFFF)
            for body in _dump(diag, request):
                uid, memory = _owner_and_memory(body[_UNIX_MESSAGE:], _UNIX_UID, _UNIX_MEMINFO)
                if uid is not None:
                    found[uid] = found.get(uid, 0) + _queued(memory)
            for family in (socket.AF_INET, socket.AF_INET6):
                for protocol in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                    request = _INET_REQUEST.pack(family, protocol, 1 << (_INET_SKMEMINFO - 1), _ALL_STATES)
                    for body in _dump(diag, request):
                        if len(body) < _INET_MESSAGE:
                            continue
                        (uid,) = _INET_UID.unpack_from(body, 64)
                        _, memory = _owner_and_memory(body[_INET_MESSAGE:], None, _INET_SKMEMINFO)
                        found[uid] = found.get(uid, 0) + _queued(memory)
    except OSError:
        return None
    return found


def _dump(diag: socket.socket, request: bytes) -> Iterable[bytes]:
    """The bodies of a sock_diag dump's messages."""
    diag.send(_HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
              + request)
    while True:
        data = diag.recv(1 << 16)
        at = 0
        while at + _HEADER.size <= len(data):
            length, kind, _, _, _ = _HEADER.unpack_from(data, at)
            if kind == _NLMSG_DONE:
                return
            if kind == _NLMSG_ERROR or length < _HEADER.size:
                raise OSError("sock_diag refused the dump")
            yield data[at + _HEADER.size:at + length]
            at += (length + 3) & ~3
        if not data:
            return


def _owner_and_memory(attributes: bytes, uid_kind: Optional[int], memory_kind: int) -> tuple:
    uid, memory = None, ()
    at = 0
    while at + _ATTRIBUTE.size <= len(attributes):
        length, kind = _ATTRIBUTE.unpack_from(attributes, at)
        if length < _ATTRIBUTE.size:
            break
        payload = attributes[at + _ATTRIBUTE.size:at + length]
        if kind == uid_kind and len(payload) >= 4:
            (uid,) = struct.unpack_from("=I", payload)
        elif kind == memory_kind:
            memory = struct.unpack_from(f"={len(payload) // 4}I", payload)
        at += (length + 3) & ~3
    return uid, memory


def _queued(memory: tuple) -> int:
    """What a socket's ``sk_meminfo`` says it holds: its receive queue, what it sent that is still queued (a Unix
    socket's whole send: the receiver's queue is charged to the sender), its send queue and its options."""
    if len(memory) <= _OPTMEM:
        return 0
    return (memory[_RMEM_ALLOC] + max(memory[_WMEM_ALLOC], memory[_WMEM_QUEUED]) + memory[_FWD_ALLOC]
            + memory[_OPTMEM])


def listed(tables: Iterable[str] = TABLES) -> set:
    """The inodes of every socket ``/proc/net`` lists (held by a process or in flight)."""
    inodes: set = set()
    for path in tables:
        try:
            with open(path, "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            continue
        header = lines[0].split()
        if b"Inode" in header:  # unix: "Num RefCount Protocol Flags Type St Inode Path"
            column = header.index(b"Inode")
        elif b"inode" in header:  # tcp, udp: the column after "timeout" ("tx_queue rx_queue" count as one word)
            column = header.index(b"inode") - (2 if b"tx_queue" in header else 0)
        else:
            continue
        for line in lines[1:]:
            words = line.split()
            if len(words) > column and words[column].isdigit():
                inodes.add(int(words[column]))
    return inodes


def held_by(pid: int, most: int = 64) -> tuple[set, int]:
    """(The inodes of the sockets process ``pid`` holds open, 0), or (empty, how many descriptors it holds) when it
    holds more than ``most`` (under gVisor each costs a ``readlink``: 15 forks of 500 descriptors each made a scan
    outlast the memory they filled). Empty where its descriptors cannot be read."""
    directory = f"/proc/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return set(), 0
    if len(names) > most:
        return set(), len(names)
    inodes: set = set()
    for name in names:
        try:
            target = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
            inodes.add(int(target[8:-1]))
    return inodes, 0
