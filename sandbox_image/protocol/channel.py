"""Control messages between the sandbox's own processes (server, supervisor, template), with file descriptors.

A message is a length-prefixed JSON object, optionally carrying file descriptors (SCM_RIGHTS). Only trusted
processes speak this: nothing that ran model-written code ever holds one of these sockets. (What a worker returns
travels in :mod:`rewardbox.sandbox.protocol.codec`'s fixed format instead.) Standard library only.
"""

from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any, Optional, Sequence

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 * 1024 * 1024  # a template's Load config carries the reward's source text
MAX_FDS = 16


class ChannelClosed(Exception):
    """The other end closed its socket."""


def send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """Sends one message (blocking until it is written)."""
    data = json.dumps(message, separators=(",", ":")).encode()
    frame = _LENGTH.pack(len(data)) + data
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([frame], ancillary)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list) -> bytes:
    chunks, size = [], 0
    while size < n:
        data, ancdata, _, _ = sock.recvmsg(n - size, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % 4])
                fds.extend(received)
        if not data:
            for fd in fds:
                socket.close(fd)
            raise ChannelClosed()
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    """Receives one message and the descriptors sent with it (blocking).

    Raises:
        ChannelClosed: the peer closed the socket.
        ValueError: the frame is larger than MAX_MESSAGE or not a JSON object.
    """
    fds: list[int] = []
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, fds))
    if length > MAX_MESSAGE:
        raise ValueError(f"control message of {length} bytes is over the limit")
    message = json.loads(_recv_exact(sock, length, fds))
    if not isinstance(message, dict):
        raise ValueError("control message is not a JSON object")
    return message, fds


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets, not inherited across exec."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def optional_fd(fds: list[int]) -> Optional[int]:
    """The one descriptor a message carried (closing any extra), or None."""
    for extra in fds[1:]:
        socket.close(extra)
    return fds[0] if fds else None


def describe(message: Any) -> str:
    """A short form of a message for logs."""
    return json.dumps(message)[:200]
