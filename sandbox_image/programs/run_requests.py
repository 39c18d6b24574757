"""What crosses between a slot process and its program runner (:mod:`.runner`): length-prefixed JSON frames,
and the requests they carry, parsed and checked field by field before anything runs (:func:`parse`). Standard library
only: :mod:`.execution` (in the reward's process) and the runner both use it.
"""

from __future__ import annotations

import base64
import json
import math
import select
import socket
import struct
from dataclasses import dataclass
from typing import Optional

from . import languages

_LENGTH = struct.Struct("<Q")
MAX_REQUEST = 256 * 1024 * 1024
# A slot process's frame that hands the runner a fresh socket for one child of its (:mod:`..processes.forked`); the
# socket follows as one byte with the descriptor attached.
CHANNEL = "channel"
# A slot process's frame, answered with the same frame once nothing a sample left at the runner is left (see
# :func:`release`).
RELEASE = "release"
RELEASE_TIMEOUT_S = 10.0  # the runner kills the programs a sample left and empties their directory first
MAX_RUNS = 1000
# Of stdout and of stderr each: the runner's monitor holds it (and the memory guard counts it toward the slot).
MAX_OUTPUT_BYTES = 64 << 20
MAX_FILES = 1000


class RequestError(ValueError):
    """A request the runner does not take; the message says which field and why."""


# -- frames ---------------------------------------------------------------------------------------------------------
def encode_frame(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


def release(sock: socket.socket) -> bool:
    """From a slot process, over its own socket to the runner: waits until nothing a sample left at the runner is
    left, before the next sample starts. That is a socket the runner served for a forked child, with whatever the
    child left in flight there (descriptors sent over the socket itself outlive every process: a file that fills
    the slot's /tmp, a socket set to signal the slot process when it closes), and that child's programs; or, for a
    slot's new process, all of its last process's (:meth:`..programs.runner.Runner._start` answers once that process's
    monitor ended). Returns False where the runner is gone or did not answer in RELEASE_TIMEOUT_S."""
    try:
        sock.sendall(encode_frame({"op": RELEASE}), socket.MSG_NOSIGNAL)
        if not select.select([sock], [], [], RELEASE_TIMEOUT_S)[0]:
            return False
        return read_frame(sock, 1024) == {"op": RELEASE}
    except (OSError, RequestError):
        return False


def write_frame(sock: socket.socket, message: dict, watch: Optional[socket.socket] = None) -> None:
    """Sends one JSON object. With ``watch``: gives up (ConnectionAbortedError) as soon as ``watch`` has something
    to read, however slowly the peer keeps reading.

    Raises:
        OSError: the peer is gone, or (``watch``) no longer wanted.
    """
    frame = memoryview(encode_frame(message))
    if watch is None:
        # MSG_NOSIGNAL: reward code may have given SIGPIPE its default action back (slot processes ignore it, as
        # python3 does), and a runner that is gone must fail its program calls, not kill the process
        sock.sendall(frame, socket.MSG_NOSIGNAL)
        return
    while frame:
        readable, writable, _ = select.select([watch], [sock], [])
        if readable:
            raise ConnectionAbortedError("the reply is no longer wanted")
        try:
            frame = frame[sock.send(frame, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL):]
        except BlockingIOError:
            pass


def _recv_exact(sock: socket.socket, n: int, watch: Optional[socket.socket] = None) -> Optional[bytes]:
    chunks, size = [], 0
    while size < n:
        if watch is not None and watch in select.select([sock, watch], [], [])[0]:
            return None  # as if ``sock`` closed: see read_frame
        data = sock.recv(min(n - size, 1 << 20))
        if not data:
            return None
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int, watch: Optional[socket.socket] = None) -> Optional[dict]:
    """One JSON object, or None when the peer closed the socket (or, with ``watch``, as soon as ``watch`` has
    something to read).

    Raises:
        RequestError: over ``limit`` bytes, or not a JSON object.
    """
    header = _recv_exact(sock, _LENGTH.size, watch)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > limit:
        raise RequestError(f"a request of {length} bytes is over the limit of {limit}")
    data = _recv_exact(sock, length, watch)
    if data is None:
        return None
    try:
        message = json.loads(data)
    except ValueError as e:
        raise RequestError(f"not JSON: {e}") from None
    if not isinstance(message, dict):
        raise RequestError("not a JSON object")
    return message


# -- requests -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    stdin: bytes
    args: tuple
    expected: Optional[str]


@dataclass(frozen=True)
class Request:
    language: languages.Language
    code: bytes
    files: dict  # relative path -> bytes
    runs: tuple
    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    compile_timeout_s: float
    compare: str
    stop_on_failure: bool


def _number(message: dict, key: str, kind, low, high):
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key} must be a number, not {value!r}")
    if not low <= value <= high:
        raise RequestError(f"{key}={value!r} is outside [{low}, {high}]")
    return kind(value)


def _text(value, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, dict) and isinstance(value.get("base64"), str):
        return base64.b64decode(value["base64"], validate=True)
    raise RequestError(f"{what} must be text")


def check_path(name) -> str:
    """A file name for the scratch directory: relative, inside it, no special parts.

    Raises:
        RequestError: naming the problem.
    """
    if not isinstance(name, str) or not name or "\0" in name or len(name) > 1024:
        raise RequestError(f"file name {name!r} is not usable")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or any(len(p) > 255 for p in parts):
        raise RequestError(f"file name {name!r} must be a relative path inside the scratch directory")
    return name


def parse(message: dict) -> Request:
    """Checks a request from a slot process; nothing in it is trusted.

    Raises:
        RequestError: naming the field.
    """
    try:
        language = languages.lookup(message.get("language"))
    except ValueError as e:
        raise RequestError(str(e)) from None
    files = message.get("files") or {}
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise RequestError(f"files must be a mapping of at most {MAX_FILES} names to contents")
    reserved = {language.source, language.artifact}
    checked = {}
    for name, content in files.items():
        if check_path(name) in reserved:
            raise RequestError(f"file name {name!r} is where {language.name} code goes; choose another name")
        checked[name] = _text(content, f"files[{name!r}]")
    runs = message.get("runs")
    if not isinstance(runs, list) or not 1 <= len(runs) <= MAX_RUNS:
        raise RequestError(f"runs must be a list of 1 to {MAX_RUNS} runs")
    parsed = []
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            raise RequestError(f"runs[{i}] must be a mapping")
        args = r.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) and "\0" not in a for a in args):
            raise RequestError(f"runs[{i}].args must be a list of strings")
        expected = r.get("expected")
        if expected is not None and not isinstance(expected, str):
            raise RequestError(f"runs[{i}].expected must be text")
        parsed.append(Run(_text(r.get("stdin", ""), f"runs[{i}].stdin"), tuple(args), expected))
    compare = message.get("compare", "lines")
    if compare not in COMPARISONS:
        raise RequestError(f"compare={compare!r}: use one of {', '.join(COMPARISONS)}")
    return Request(language=language, code=_text(message.get("code"), "code"), files=checked, runs=tuple(parsed),
                   timeout_s=_number(message, "timeout_s", float, 0.001, 3600),
                   memory_mb=_number(message, "memory_mb", int, 16, 1 << 20),
                   max_output_bytes=_number(message, "max_output_bytes", int, 1, MAX_OUTPUT_BYTES),
                   compile_timeout_s=_number(message, "compile_timeout_s", float, 0.001, 3600),
                   compare=compare, stop_on_failure=bool(message.get("stop_on_failure", False)))


def _lines(text: str) -> list:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


COMPARISONS = {
    "exact": lambda actual, expected: actual == expected,
    "lines": lambda actual, expected: _lines(actual) == _lines(expected),  # trailing spaces and blank lines aside
    "tokens": lambda actual, expected: actual.split() == expected.split(),
}
