"""What the sandbox's sockets hold: kernel memory that no process's resident set shows (for the memory guard), and
sockets that a finished sample left in flight (for cleanup).

Linux (runc): ``sock_diag`` (netlink, no privilege needed, this network namespace only) lists every socket with the
uid that made it and the bytes queued on it: Unix sockets (what each sent that is still queued, held open or in
flight alike; what a closed one sent, at its receiver: SEND_BUFFER_MOST) and TCP and UDP ones over IPv4 and IPv6
(:func:`bytes_by_uid`). What a socket holds is real kernel
memory, so a sample cannot make it count for more than it costs, as it could when the guard counted 240 KiB for
every descriptor slot of every process (a ``dup2`` to descriptor 511 counted for 120 MiB; red team).

A sample's sockets close when its processes die, except those left in flight: sent over a Unix socket that is itself
in flight (a cycle). Linux's collector frees a cycle only when some Unix socket is released somewhere while one is in
flight, and until then a listening socket carried in it keeps its port: the next sample's plain ``bind()`` to that
port failed (red team 13). Cleanup releases one itself and waits until the uid has no Unix socket left
(:meth:`UnixSockets.wait_for_in_flight`): every socket in flight rides in one.

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
import time
from typing import Iterable, Optional

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_ATTRIBUTE = struct.Struct("=HH")  # struct rtattr
# Unix: struct unix_diag_req, the UDIAG_SHOW_* flags of what to show, and the UNIX_DIAG_* attributes that show it
_UNIX_REQUEST = struct.Struct("=BBHIIIII")
_UNIX_SHOW_PEER, _UNIX_SHOW_RQLEN, _UNIX_SHOW_MEMINFO, _UNIX_SHOW_UID = 0x04, 0x10, 0x20, 0x40
_UNIX_MESSAGE = 16  # struct unix_diag_msg
_UNIX_PEER, _UNIX_RQLEN, _UNIX_MEMINFO, _UNIX_SHUTDOWN, _UNIX_UID = 2, 4, 5, 6, 7
_SHUT_BOTH = 3  # a stream socket's, once its peer closed
# The attributes of each Unix socket in the dump _unix_dump asks for, after its peer's (8 bytes, where it has one):
# its queue's length (two u32), its memory (sk_meminfo: 9 u32), its shutdown (a u8) and its uid. Read of them: the
# queue's kind and length; rmem, wmem, forward, wqueued, options (as _MEMINFO); the shutdown; the uid's kind and uid.
_UNIX_TAIL = struct.Struct("=2xHI4x" "4xI4xI4xIII8x" "4xB3x" "2xHI")
_UNIX_TAIL_SIZES = (_UNIX_TAIL.size, _UNIX_TAIL.size + 8)
_PEER_KIND = (8, 2)
_UNIX_MESSAGE_HEAD = struct.Struct("=xBBxI")  # its type, state and inode
# TCP and UDP: struct inet_diag_req_v2 (its socket id zeroed: every socket); show INET_DIAG_SKMEMINFO (7)
_INET_REQUEST = struct.Struct("=BBBxI48x")
_INET_SKMEMINFO = 7
_INET_MESSAGE = 72  # struct inet_diag_msg
_INET_UID_AT = 64  # its uid
_U32 = struct.Struct("=I")
_ALL_STATES = 0xFFFFFFFF
_TCP_LISTEN = 10
# struct sk_meminfo, its first u32s: receive queue, receive buffer, what was sent and is still queued, send buffer,
# forward-allocated memory, send queue, options
_MEMINFO = struct.Struct("=7I")
TABLES = tuple(f"/proc/net/{name}" for name in ("unix", "tcp", "tcp6", "udp", "udp6"))
# What a socket costs the kernel with nothing queued (the socket, its inode, its file; measured: 16,000 empty ones
# took 41 MiB of kernel memory, about 2.6 KB each). Uncounted, a sample's empty sockets were memory no process held.
SOCKET_OBJECT_BYTES = 2560
# What a Unix socket's sender leaves queued at its peer counts as the sender's (its send buffer's use), but once the
# sender is closed it is listed no more, and what it sent waits, in no one's figures, for the peer to read it: 600 MB
# hidden so made the guard stop the whole sandbox instead of the sample (red team 14). Such a queue counts for its
# receiver as much as its sender could have left there, a send buffer's most (a sample's sockets keep the default
# size, net.core.wmem_default: .seccomp; a sender may pass it by one message, so twice that): what the queue's length
# says is no bound (a thousand one-byte messages hold a thousand times that, and a message read but for one byte
# keeps all its memory: red team 15). Samples make stream Unix sockets only (.seccomp): a datagram socket's queue
# may hold messages of many senders, and tells the size of its first only.


def _sysctl(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


SEND_BUFFER_MOST = 2 * _sysctl("/proc/sys/net/core/wmem_default", 212992)


class SocketBytes(dict):
    """{uid: bytes} (:func:`bytes_by_uid`), and ``estimated``: how much of it is a bound, charged beyond what the
    sockets show (closed senders' queues: SEND_BUFFER_MOST). A bound is what a uid may hold, for blame; it is not
    what the sandbox holds in calm times, which the guard weighs its figures against (1,440 socket pairs with a
    byte each, charged 585 MiB, made every later hog look like memory no one holds: red team 16)."""

    estimated: int = 0


def bytes_by_uid() -> Optional[SocketBytes]:
    """{uid: bytes queued on the sockets that uid made, and SOCKET_OBJECT_BYTES for each} for every socket of this
    network namespace, or None where the kernel has no ``sock_diag`` (gVisor)."""
    try:
        diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    except OSError:
        return None
    found = SocketBytes()
    try:
        with diag:
            diag.settimeout(1.0)
            _unix_dump(diag, found)
            for family in (socket.AF_INET, socket.AF_INET6):
                for protocol in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                    request = _INET_REQUEST.pack(family, protocol, 1 << (_INET_SKMEMINFO - 1), _ALL_STATES)
                    _inet_dump(diag, request, found)
    except OSError:
        return None
    return found


class UnixSockets:
    """A ``sock_diag`` socket kept open for listing the Unix sockets of one uid, once per forked sample: opened once,
    read into one buffer (each page a slot process writes after a fork costs a fault, so little is written)."""

    def __init__(self, uid: int):
        self.uid = uid
        self.passed: set = set()  # not waited for again (wait_for_in_flight)
        self._buffer = bytearray(1 << 13)  # a few messages at a time: a large buffer costs more
        request = _UNIX_REQUEST.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, _UNIX_SHOW_UID, 0xFFFFFFFF, 0xFFFFFFFF)
        self._request = _framed(request)
        self._diag: Optional[socket.socket] = None
        self._open()

    def _open(self) -> None:
        try:
            self._diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
        except OSError:
            return  # gVisor
        self._diag.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 1, 0))

    def fileno(self) -> int:
        """Its descriptor (-1 where there is none), which a forked child closes."""
        return -1 if self._diag is None else self._diag.fileno()

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    def listed(self) -> Optional[set]:
        """The inodes of the Unix sockets its uid made in this network namespace (open or in flight), or None where
        the kernel has no ``sock_diag`` (gVisor).

        Raises:
            OSError: the dump failed (its socket is made afresh for the next, so that no rest of it is read then).
        """
        diag, data = self._diag, self._buffer
        if diag is None:
            return None
        inodes: set = set()
        try:
            diag.send(self._request)
            while True:
                size = diag.recv_into(data)
                if not size or not self._read_part(data, size, inodes):
                    return inodes
        except OSError:
            self.close()
            self._open()
            raise

    def _read_part(self, data: bytearray, size: int, inodes: set) -> bool:
        """Adds to ``inodes`` those of its uid's sockets in one part of a dump. Returns whether more parts follow.
        Every socket of the sandbox is in the dump (about 140 of them beside two busy slots), once per forked sample:
        read one by one in Python they cost 0.1 ms a sample. So where the part's messages are alike (one header,
        hence one length and one layout: the kernel writes the same attributes for each), its uid's are found by
        the bytes of their uid attribute at its place, at the speed of ``bytes.find``; otherwise one by one."""
        if size < _HEADER.size:
            raise OSError("sock_diag answered a part shorter than its header")
        length, kind, _, _, _ = _HEADER.unpack_from(data, 0)
        if kind == _NLMSG_DONE:
            return False
        if kind == _NLMSG_ERROR or length < _HEADER.size + _UNIX_MESSAGE or length > size:
            raise OSError("sock_diag refused the dump")
        count, rest = divmod(size, length)
        header = bytes(data[:_HEADER.size])
        at = self._uid_at(data, length)
        alike = at is not None and data.count(header, 0, count * length) == count and (
            rest == 0 or (rest >= _HEADER.size and _HEADER.unpack_from(data, count * length)[1] == _NLMSG_DONE))
        if alike:
            pattern = _ATTRIBUTE.pack(_ATTRIBUTE.size + 4, _UNIX_UID) + _U32.pack(self.uid)
            hit = data.find(pattern, 0, count * length)
            while hit >= 0:
                record, offset = divmod(hit, length)
                if offset == at:
                    inodes.add(_UNIX_MESSAGE_HEAD.unpack_from(data, record * length + _HEADER.size)[2])
                hit = data.find(pattern, hit + 1, count * length)
            return rest == 0
        found, done = _walk(data, size, _UNIX_MESSAGE)
        for body, end in found:
            at = body - _HEADER.size
            offset = self._uid_at(data[at:end], end - at)
            if offset is not None and _U32.unpack_from(data, at + offset + _ATTRIBUTE.size)[0] == self.uid:
                inodes.add(_UNIX_MESSAGE_HEAD.unpack_from(data, body)[2])
        return not done

    @staticmethod
    def _uid_at(message, length: int) -> Optional[int]:
        """Where the uid attribute of the message at the start of ``message`` is (None: it has none)."""
        attribute = _HEADER.size + _UNIX_MESSAGE
        while attribute + _ATTRIBUTE.size <= length:
            size, what = _ATTRIBUTE.unpack_from(message, attribute)
            if size < _ATTRIBUTE.size:
                return None
            if what == _UNIX_UID and size >= _ATTRIBUTE.size + 4:
                return attribute
            attribute += (size + 3) & ~3
        return None

    def wait_for_in_flight(self, most_s: float = 0.1) -> Optional[set]:
        """From cleanup, once every process of its uid is gone: waits (at most ``most_s``) until no Unix socket of
        the uid is left but those this process holds and those an earlier wait gave up on (``passed``: held by a
        process of another uid that received them, or a cycle through another uid's socket; not this sample's
        leftover, and not waited for again). A dump that fails counts as sockets left. Adds to ``passed`` its own
        and those it gives up on. Returns the latter (empty: none was left, or no dump succeeded), or None where the
        kernel has no ``sock_diag`` (gVisor)."""
        if self._diag is None:
            return None
        end = time.monotonic() + most_s
        pause = 0.0002
        own = None
        while True:
            try:
                inodes = self.listed()  # None where a failed dump could not open its socket again: failed too
            except OSError:
                inodes = None
            left = None if inodes is None else inodes - self.passed
            if left and own is None:
                own = left & held_by(os.getpid(), most=1 << 20)[0]
                self.passed |= own  # its own (socket inodes are not reused soon: a counter of 2**32)
                left -= own
            if left == set() or time.monotonic() >= end:
                break
            # Linux runs its collector when a Unix socket is released while any is in flight (anywhere on the
            # machine): without one released, a cycle that a sample's processes left as they died may wait for long
            # (500 ms and more, measured).
            a, b = socket.socketpair()
            a.close()
            b.close()
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        if left is None:
            return set()
        self.passed |= left
        return left


def _unix_dump(diag: socket.socket, found: SocketBytes) -> None:
    """Adds to ``found`` ({uid: bytes}) what each Unix socket holds, and what a closed sender left queued at it (see
    SEND_BUFFER_MOST), at a socket or at a connection a listener has not accepted yet."""
    show = _UNIX_SHOW_PEER | _UNIX_SHOW_RQLEN | _UNIX_SHOW_MEMINFO | _UNIX_SHOW_UID
    request = _UNIX_REQUEST.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
    listed: set = set()
    unread: list = []  # (its uid, its peer's inode or None, bytes waiting) of each stream socket with any
    pending: dict = {}  # {uid: connections its listeners have not accepted yet}
    connecting: dict = {}  # {uid: its connected sockets whose peer is such a connection (no inode yet)}
    unpack_attribute, unpack_memory = _ATTRIBUTE.unpack_from, _MEMINFO.unpack_from
    unpack_u32, unpack_head, unpack_tail = _U32.unpack_from, _UNIX_MESSAGE_HEAD.unpack_from, _UNIX_TAIL.unpack_from
    for data, body, end in _messages(diag, request, _UNIX_MESSAGE):
        kind_of, state, inode = unpack_head(data, body)
        uid = queued = waiting = shutdown = 0
        peer = None
        attribute = body + _UNIX_MESSAGE
        # As Linux writes them (a peer's inode, if any; then the queue's length, the memory, the shutdown and
        # the uid, in that order): read in one step. Tens of thousands are read near the mark.
        if end - attribute in _UNIX_TAIL_SIZES and end >= attribute + _UNIX_TAIL.size:
            first, waiting, rmem, wmem, forward, wqueued, options, shutdown, last, uid = \
                unpack_tail(data, end - _UNIX_TAIL.size)
            # the first and the last where they belong (the length fixes those between)
            if first == _UNIX_RQLEN and last == _UNIX_UID:
                if end - attribute > _UNIX_TAIL.size:
                    if unpack_attribute(data, attribute) != _PEER_KIND:
                        raise OSError("sock_diag answered an attribute out of its place")
                    peer = unpack_u32(data, attribute + _ATTRIBUTE.size)[0]
                queued = _queued(rmem, wmem, forward, wqueued, options)
                attribute = end
            else:
                waiting = shutdown = uid = 0
        while attribute + _ATTRIBUTE.size <= end:
            size, what = unpack_attribute(data, attribute)
            if size < _ATTRIBUTE.size:
                break
            value = attribute + _ATTRIBUTE.size
            if what == _UNIX_MEMINFO and size >= _ATTRIBUTE.size + _MEMINFO.size:
                rmem, _, wmem, _, forward, wqueued, options = unpack_memory(data, value)
                queued = _queued(rmem, wmem, forward, wqueued, options)
            elif what == _UNIX_UID and size >= _ATTRIBUTE.size + 4:
                uid = unpack_u32(data, value)[0]
            elif what == _UNIX_PEER and size >= _ATTRIBUTE.size + 4:
                peer = unpack_u32(data, value)[0]
            elif what == _UNIX_RQLEN and size >= _ATTRIBUTE.size + 8:
                waiting = unpack_u32(data, value)[0]
            elif what == _UNIX_SHUTDOWN and size >= _ATTRIBUTE.size + 1:
                shutdown = data[value]
            attribute += (size + 3) & ~3
        listed.add(inode)
        found[uid] = found.get(uid, 0) + SOCKET_OBJECT_BYTES + queued
        if state == _TCP_LISTEN:
            pending[uid] = pending.get(uid, 0) + waiting  # its queue's length: connections
        elif kind_of != socket.SOCK_STREAM:
            continue  # the sandbox's own: samples make stream sockets only (.seccomp)
        elif peer == 0 and shutdown != _SHUT_BOTH:  # a peer without inode: the connection, not accepted yet
            connecting[uid] = connecting.get(uid, 0) + 1
        elif waiting:
            unread.append((uid, peer, waiting))
    for uid, peer, waiting in unread:
        if not (peer and peer in listed):  # else its sender's send buffer counts it (a closed one has no inode)
            found[uid] = found.get(uid, 0) + SEND_BUFFER_MOST
            found.estimated += max(0, SEND_BUFFER_MOST - waiting)
    # A connection not accepted yet has a socket of its own that the dump does not list (no inode), with what its
    # client sent queued at it; while the client is open, the client's send buffer counts that. So each such
    # connection of a uid's listeners beyond the uid's own clients still waiting counts a send buffer's most.
    for uid, count in pending.items():
        closed = count - connecting.get(uid, 0)
        if closed > 0:
            found[uid] = found.get(uid, 0) + closed * (SOCKET_OBJECT_BYTES + SEND_BUFFER_MOST)
            found.estimated += closed * (SOCKET_OBJECT_BYTES + SEND_BUFFER_MOST)


def _inet_dump(diag: socket.socket, request: bytes, found: dict) -> None:
    """Adds to ``found`` ({uid: bytes}) what each socket of a TCP or UDP dump holds."""
    unpack_attribute, unpack_memory, unpack_u32 = _ATTRIBUTE.unpack_from, _MEMINFO.unpack_from, _U32.unpack_from
    for data, body, end in _messages(diag, request, _INET_MESSAGE):
        uid = unpack_u32(data, body + _INET_UID_AT)[0]
        queued = 0
        attribute = body + _INET_MESSAGE
        while attribute + _ATTRIBUTE.size <= end:
            size, what = unpack_attribute(data, attribute)
            if size < _ATTRIBUTE.size:
                break
            if what == _INET_SKMEMINFO and size >= _ATTRIBUTE.size + _MEMINFO.size:
                rmem, _, wmem, _, forward, wqueued, options = unpack_memory(data, attribute + _ATTRIBUTE.size)
                queued = _queued(rmem, wmem, forward, wqueued, options)
            attribute += (size + 3) & ~3
        found[uid] = found.get(uid, 0) + SOCKET_OBJECT_BYTES + queued


def _messages(diag: socket.socket, request: bytes, message: int):
    """Sends a sock_diag dump ``request`` and yields each message of its answer, read in place: (the part it is in,
    where its body starts, where it ends). A sample may make tens of thousands of sockets, and the guard reads them
    all near the limit (16,000 took 35 ms sliced apart).

    Raises:
        OSError: the kernel refused the dump, or a message is shorter than ``message`` bytes.
    """
    diag.send(_framed(request))
    while True:
        data = diag.recv(1 << 17)
        if not data:
            return
        found, done = _walk(data, len(data), message)
        for body, end in found:
            yield data, body, end
        if done:
            return


def _walk(data, size: int, message: int) -> tuple[list, bool]:
    """The messages in one part of a dump (its first ``size`` bytes), each as (where its body starts, where it ends),
    and whether the dump ends in this part.

    Raises:
        OSError: the kernel refused the dump, a message is shorter than ``message`` bytes, or it was cut short.
    """
    found: list = []
    unpack_header, at = _HEADER.unpack_from, 0
    while at + _HEADER.size <= size:
        length, kind, _, _, _ = unpack_header(data, at)
        if kind == _NLMSG_DONE:
            return found, True
        if kind == _NLMSG_ERROR or length < _HEADER.size + message or at + length > size:
            raise OSError("sock_diag refused the dump, or cut it short")
        found.append((at + _HEADER.size, at + length))
        at += (length + 3) & ~3
    return found, False


def _framed(request: bytes) -> bytes:
    """A sock_diag dump request, with its netlink header."""
    return _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + request


def _queued(rmem: int, wmem: int, forward: int, wqueued: int, options: int) -> int:
    """What a socket holds beyond itself, from its sk_meminfo (_MEMINFO)."""
    return rmem + max(wmem, wqueued) + forward + options


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
