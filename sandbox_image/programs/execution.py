"""``rewardbox.sandbox.run`` and ``run_tests``: reward code runs model-written programs, safely.

Inside a sandbox each program runs under a uid of its own, not the reward's, in a scratch directory that is wiped
before and after it, with limits on CPU time, memory, processes, file size, open files and output, and without
network; the whole process tree is killed when it ends (see :mod:`.runner`). Outside a sandbox (plain Python, the
in-process or local backend) the same limits apply, but the program runs as the caller's own user: no isolation.

    from rewardbox.sandbox import run, run_tests
    r = run("print(input()[::-1])", stdin="abc")          # r.status == "ok", r.stdout == "cba\\n"
    t = run_tests(code, tests=[{"stdin": "1 2", "stdout": "3"}], language="cpp")
    t.fraction                                              # passed / total

Standard library only.
"""

from __future__ import annotations

import _signal
import _thread
import base64
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

from . import run_requests
from .languages import LANGUAGES, lookup

if TYPE_CHECKING:
    import subprocess

_sigmask = _signal.pthread_sigmask  # bound at import: a reward that replaces signal's does not change ours
STATUSES = ("ok", "runtime_error", "timeout", "memory", "compile_error", "output_limit")
MAX_REPLY = 2 * run_requests.MAX_REQUEST + (64 << 20)


@dataclass(frozen=True)
class RunResult:
    """How one program ended.

    ``status``: ``ok`` (exit code 0), ``runtime_error`` (another exit code or a signal, or it could not start),
    ``timeout`` (past ``timeout_s`` of wall time, or its CPU time), ``memory`` (an allocation failed or the OOM
    killer took it), ``compile_error`` (the build failed; its output is in ``stderr``), ``output_limit`` (stdout or
    stderr went past ``max_output_bytes``; the kept part is there). ``exit_code`` is negative for a signal, as in
    :mod:`subprocess`. ``passed`` is set by :func:`run_tests` (None from :func:`run`).
    """

    status: str
    exit_code: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    signal: Optional[str] = None
    passed: Optional[bool] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class TestsResult:
    """The outcome of :func:`run_tests`: one :class:`RunResult` per test run (fewer with ``stop_on_failure``),
    ``passed`` of ``total`` tests, and the build's result for compiled languages."""

    results: list
    passed: int
    total: int
    compile: Optional[RunResult] = None
    statuses: dict = field(default_factory=dict)  # status -> how many tests ended so

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def status(self) -> str:
        """``ok`` when every test passed, else the status of the first test that did not (``wrong_answer`` when it
        ran fine but printed something else)."""
        for r in self.results:
            if not r.passed:
                return r.status if r.status != "ok" else "wrong_answer"
        return "ok" if self.passed == self.total else "skipped"


class RunnerUnavailable(RuntimeError):
    """The program runner cannot be reached (the sandbox is shutting down, or it could not start one)."""


class _Channel:
    """The way to this process's runner: the socket the sandbox gave this slot process, else a helper process."""

    def __init__(self, sock: socket.socket, process: Optional[subprocess.Popen] = None):
        self.sock = sock
        self.process = process
        self.lock = _thread.allocate_lock()  # one request at a time per socket

    def call(self, request: dict) -> dict:
        with self.lock:
            # The reward's own timeout (SIGALRM) waits until the reply is in: raised in the middle of the exchange
            # it would leave half a frame on the socket for the next call. Past its timeout the sandbox kills
            # the process, and the runner, seeing the socket close, kills the program. (Masked in whichever thread
            # calls: Python runs the handler in the main thread, and a mask elsewhere changes nothing.)
            old = _sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            try:
                run_requests.write_frame(self.sock, request)
                reply = run_requests.read_frame(self.sock, MAX_REPLY)
            except (OSError, run_requests.RequestError) as e:
                raise RunnerUnavailable(f"the program runner failed: {e}") from None
            finally:
                _sigmask(signal.SIG_SETMASK, old)
            if reply is None:
                raise RunnerUnavailable("the program runner went away (the sandbox is stopping, or it ran out of "
                                        "processes: see the reward's pids)")
            return reply


_channel: Optional[_Channel] = None
_channel_fd: Optional[int] = None  # the sandbox's socket for this process, made a channel on first use
_channel_pid = 0
_channel_lock = _thread.allocate_lock()
_unavailable = ""  # why this process may not run programs at all
_sandboxed = False  # attached to a sandbox's runner: programs run through it, or not at all


def attach(fd: Optional[int], why_not: str = "") -> None:
    """Called by the sandbox in a slot process before reward code runs: ``fd`` is its socket to the runner (None:
    programs cannot run here, for ``why_not``; never a fallback to running them as the reward's own uid)."""
    global _channel, _channel_fd, _channel_pid, _unavailable, _sandboxed
    _sandboxed = fd is not None or bool(why_not)  # not the local backend's (no uid of their own: a helper runs them)
    # Made a channel on first use: most samples a slot process forks never run a program, and every object made
    # in such a child is a page it copies.
    _channel, _channel_fd = None, fd
    _channel_pid, _unavailable = os.getpid(), why_not


def _attached() -> Optional[_Channel]:
    """The channel on the socket the sandbox attached to this process, made now if it was not yet."""
    global _channel, _channel_fd
    if _channel is None and _channel_fd is not None and _channel_pid == os.getpid():
        _channel, _channel_fd = _Channel(socket.socket(fileno=_channel_fd)), None
    return _channel


def attach_child(fd: Optional[int]) -> None:
    """In a child a slot process forked for one sample (:mod:`..processes.forked`): ``fd`` is the child's own socket to
    the runner (None: its parent could not run programs either, or the runner is gone). Never the parent's channel."""
    if _channel is not None:
        _channel.sock.close()
    elif _channel_fd is not None:
        os.close(_channel_fd)
    attach(fd, "" if fd is not None else _unavailable or "the program runner is gone (see the sandbox's log)")


def attached_socket() -> Optional[socket.socket]:
    """The socket to the runner the sandbox attached to this process (None: none)."""
    channel = _attached()
    return channel.sock if channel is not None and channel.process is None else None


def _connect() -> _Channel:
    """This process's channel; outside a sandbox, a helper process started on first use (and after a fork)."""
    global _channel, _channel_pid
    with _channel_lock:
        if _unavailable:
            raise RunnerUnavailable(_unavailable)
        if _sandboxed and _channel_pid != os.getpid():
            # A process the reward forked: a helper runner here would run programs as the reward's own uid (red team)
            raise RunnerUnavailable("rewardbox.sandbox.run works in the reward's own process, not in a process it "
                                    "forked (call it from there, or from a thread)")
        _attached()
        if _channel is None or _channel_pid != os.getpid():
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # where this rewardbox came from
            command = f"from rewardbox.sandbox.programs.runner import main; main([{theirs.fileno()}])"
            import subprocess  # here: outside a sandbox only (threading, which it loads, slows every fork)

            process = subprocess.Popen([sys.executable, "-c", command], pass_fds=(theirs.fileno(),), env=env,
                                       stdin=subprocess.DEVNULL)
            theirs.close()
            _channel, _channel_pid = _Channel(ours, process), os.getpid()
        return _channel


def _content(value: Union[str, bytes, bytearray, memoryview], what: str):
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    raise TypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def _result(data: dict) -> RunResult:
    return RunResult(status=data["status"], exit_code=data.get("exit_code"), stdout=data.get("stdout", ""),
                     stderr=data.get("stderr", ""), wall_s=float(data.get("wall_s", 0.0)),
                     cpu_s=float(data.get("cpu_s", 0.0)), signal=data.get("signal"), passed=data.get("passed"))


def _request(code, language: str, files: Optional[Mapping], runs: list, timeout_s: float, memory_mb: int,
             max_output_bytes: int, compile_timeout_s: float, **extra) -> dict:
    lookup(language)  # ValueError naming the known languages, before anything is sent
    if not isinstance(code, (str, bytes, bytearray)):
        raise TypeError(f"code must be str or bytes, not {type(code).__name__}")
    request = {"language": language, "code": _content(code, "code"),
               "files": {str(k): _content(v, f"files[{k!r}]") for k, v in (files or {}).items()},
               "runs": runs, "timeout_s": timeout_s, "memory_mb": memory_mb, "max_output_bytes": max_output_bytes,
               "compile_timeout_s": compile_timeout_s, **extra}
    reply = _connect().call(request)
    if "error" in reply:
        raise ValueError(reply["error"])
    return reply


def run(code: Union[str, bytes], language: str = "python", stdin: Union[str, bytes] = "", args: Sequence[str] = (),
        files: Optional[Mapping[str, Union[str, bytes]]] = None, timeout_s: float = 5.0, memory_mb: int = 512, *,
        max_output_bytes: int = 1 << 20, compile_timeout_s: float = 30.0) -> RunResult:
    """Runs ``code`` (a whole program in ``language``) once and returns how it ended.

    ``files``: more files for its scratch directory (relative path -> text or bytes). ``timeout_s``: wall time of
    the run (the build of a compiled language has ``compile_timeout_s`` of its own); its CPU time is limited to the
    same. ``memory_mb``: memory it may write to. ``max_output_bytes``: of stdout and of stderr each (at most 64 MiB).

    Raises:
        ValueError: an unknown language, a bad file name or limit, or a language the image lacks (naming the
            ``system_packages`` to add). RunnerUnavailable: the runner cannot be reached.
    """
    if isinstance(args, (str, bytes)):
        raise TypeError("args must be a sequence of strings, not one string")
    reply = _request(code, language, files, [{"stdin": _content(stdin, "stdin"), "args": [str(a) for a in args]}],
                     timeout_s, memory_mb, max_output_bytes, compile_timeout_s)
    return _result(reply["runs"][0])


def run_tests(code: Union[str, bytes], tests: Sequence[Mapping], language: str = "python",
              timeout_s: float = 5.0, memory_mb: int = 512, files: Optional[Mapping[str, Union[str, bytes]]] = None,
              *, compare: str = "lines", stop_on_failure: bool = False, max_output_bytes: int = 1 << 20,
              compile_timeout_s: float = 30.0) -> TestsResult:
    """Builds ``code`` once and runs it on each test: ``{"stdin": ..., "stdout": expected, "args": [...]}``
    (stdin and args optional). Each run starts in a fresh scratch directory holding the same files.

    ``compare``: ``lines`` (default: equal line by line, trailing whitespace and trailing blank lines aside),
    ``tokens`` (equal when split on whitespace) or ``exact``. ``stop_on_failure``: stop at the first failing test
    (the rest count as failed). ``timeout_s`` and ``memory_mb`` hold for each test.

    Raises:
        ValueError, TypeError: a test without ``stdout``, or as :func:`run`.
    """
    runs = []
    for i, test in enumerate(tests):
        if not isinstance(test, Mapping) or "stdout" not in test:
            raise ValueError(f"tests[{i}] must be a mapping with the expected 'stdout' (and optional 'stdin', "
                             f"'args'), not {test!r:.200}")
        runs.append({"stdin": _content(test.get("stdin", ""), f"tests[{i}]['stdin']"),
                     "args": [str(a) for a in test.get("args", ())], "expected": str(test["stdout"])})
    if not runs:
        return TestsResult(results=[], passed=0, total=0)
    reply = _request(code, language, files, runs, timeout_s, memory_mb, max_output_bytes, compile_timeout_s,
                     compare=compare, stop_on_failure=stop_on_failure)
    results = [_result(r) for r in reply["runs"]]
    statuses: dict = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    compiled = _result(reply["compile"]) if reply.get("compile") else None
    return TestsResult(results=results, passed=sum(1 for r in results if r.passed), total=len(runs),
                       compile=compiled, statuses=statuses)


__all__ = ["LANGUAGES", "RunResult", "RunnerUnavailable", "STATUSES", "TestsResult", "run", "run_tests"]
