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
_INET_MESSAGE = 72  # struct inet_diag_msg
_INET_UID_AT = 64  # its uid
_U32 = struct.Struct("=I")
_ALL_STATES = 0xFFFFFFFF
# struct sk_meminfo, its first u32s: receive queue, receive buffer, what was sent and is still queued, send buffer,
# forward-allocated memory, send queue, options
_MEMINFO = struct.Struct("=7I")
TABLES = tuple(f"/proc/net/{name}" for name in ("unix", "tcp", "tcp6", "udp", "udp6"))
# What a socket costs the kernel with nothing queued (the socket, its inode, its file; measured: 16,000 empty ones
# took 41 MiB of kernel memory, about 2.6 KB each). Uncounted, a sample's empty sockets were memory no process held.
SOCKET_OBJECT_BYTES = 2560


def bytes_by_uid() -> Optional[dict]:
    """{uid: bytes queued on the sockets that uid made, and SOCKET_OBJECT_BYTES for each} for every socket of this
    network namespace, or None where the kernel has no ``sock_diag`` (gVisor)."""
    try:
        diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    except OSError:
        return None
    found: dict = {}
    try:
        with diag:
            diag.settimeout(1.0)
            request = _UNIX_REQUEST.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, _UNIX_SHOW, 0xFFFFFFFF, 0xFFFFFFFF)
            _dump(diag, request, _UNIX_MESSAGE, _UNIX_UID, _UNIX_MEMINFO, found)
            for family in (socket.AF_INET, socket.AF_INET6):
                for protocol in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                    request = _INET_REQUEST.pack(family, protocol, 1 << (_INET_SKMEMINFO - 1), _ALL_STATES)
                    _dump(diag, request, _INET_MESSAGE, None, _INET_SKMEMINFO, found)
    except OSError:
        return None
    return found


def _dump(diag: socket.socket, request: bytes, message: int, uid_kind: Optional[int], memory_kind: int,
          found: dict) -> None:
    """Adds to ``found`` ({uid: bytes}) what each socket of a sock_diag dump holds. Read in place: a sample may make
    tens of thousands of sockets, and the guard reads them all near the limit (16,000 took 35 ms sliced apart)."""
    diag.send(_HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
              + request)
    unpack_header, unpack_attribute, unpack_memory = _HEADER.unpack_from, _ATTRIBUTE.unpack_from, _MEMINFO.unpack_from
    unpack_u32 = _U32.unpack_from
    while True:
        data = diag.recv(1 << 17)
        if not data:
            return
        at = 0
        while at + _HEADER.size <= len(data):
            length, kind, _, _, _ = unpack_header(data, at)
            if kind == _NLMSG_DONE:
                return
            if kind == _NLMSG_ERROR or length < _HEADER.size + message:
                raise OSError("sock_diag refused the dump")
            end = at + length
            body = at + _HEADER.size
            uid = unpack_u32(data, body + _INET_UID_AT)[0] if uid_kind is None else None
            queued = 0
            attribute = body + message
            while attribute + _ATTRIBUTE.size <= end:
                size, what = unpack_attribute(data, attribute)
                if size < _ATTRIBUTE.size:
                    break
                if what == memory_kind and size >= _ATTRIBUTE.size + _MEMINFO.size:
                    rmem, _, wmem, _, forward, wqueued, options = unpack_memory(data, attribute + _ATTRIBUTE.size)
                    queued = rmem + max(wmem, wqueued) + forward + options
                elif what == uid_kind and size >= _ATTRIBUTE.size + 4:
                    uid = unpack_u32(data, attribute + _ATTRIBUTE.size)[0]
                attribute += (size + 3) & ~3
            if uid is not None:
                found[uid] = found.get(uid, 0) + SOCKET_OBJECT_BYTES + queued
            at += (length + 3) & ~3


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
