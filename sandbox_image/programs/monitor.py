"""A monitor of the program runner: serves one slot's socket, one request of :func:`rewardbox.sandbox.run` at a time.

The program runner (:mod:`.runner`) forks one for a slot socket once it has a request; it serves that socket until
it closes, running each request's programs in the slot's :class:`.program.Workspace`. Anything written to the
socket while a program runs, or its close, kills the program and ends the service (:class:`.program.SlotGone`); so
does a reply that makes no progress for SEND_TIMEOUT_S. A slot process's CHANNEL frame hands over a forked child's
own socket, served until it closes or the slot process writes again. When it lets go of a socket, it reads and
closes what a sample left in flight there (:func:`let_go`). Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
from typing import Optional

from ..processes import tree
from .run_requests import (CHANNEL, MAX_REQUEST, COMPARISONS, RELEASE, Request, RequestError, parse,
                                     read_frame, write_frame)
from . import languages
from .program import Limits, RunSlot, SlotGone, Workspace

# A monitor holds what a sample sends it in memory the sample does not pay for: at most this much (or half the
# sample's own address space, where it has a limit), so a sample cannot make it hold more than the sample could.
MAX_MONITORED_REQUEST = 64 * 1024 * 1024
COMPILE_OUTPUT = 64 * 1024
COMPILE_PROCESSES = 64
CLOSED = 3  # a monitor's exit code when its socket closed
_MIB = 1 << 20
MONITOR_NAME = "rbxm-"  # + the run uid: see start
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
SEND_TIMEOUT_S = 2
LET_GO_READS = 256  # at most this many reads (of up to 64 KiB and 64 descriptors each) before a socket is closed


def _runner_gone(signum, frame):
    raise SlotGone()


class Monitor:
    """Runs the requests of one slot socket (see the module docstring)."""

    def __init__(self, slot: RunSlot, sock: socket.socket):
        self.slot = slot
        self.workspace = Workspace(slot)
        self.sock = sock  # the slot's socket: its closing means the caller is gone
        # While a child's socket is served (self.sock then): the slot process's, which it writes to only once that
        # child is gone (the next child's CHANNEL frame), whoever still holds the child's socket open.
        self.parent: Optional[socket.socket] = None
        if sock is not None:
            _bound_sends(sock)
        self.frame_limit = MAX_MONITORED_REQUEST if slot.uid is not None else MAX_REQUEST
        if slot.uid is not None and slot.memory:
            self.frame_limit = min(self.frame_limit, slot.memory // 2)

    def _env(self, language: languages.Language) -> dict:
        env = dict(BASE_ENV, HOME=self.slot.home, TMPDIR=self.slot.home, PWD=self.slot.home)
        if language.name == "python":
            env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONIOENCODING="utf-8")
            if os.environ.get("PYTHONPATH"):  # the image's packages (the reward's own pip packages among them)
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def result(self, raw: dict, limits: Limits, language: languages.Language) -> dict:
        """The run's status from how it ended (see rewardbox.sandbox.RunResult)."""
        status_word, killed_for = raw["status_word"], raw["killed_for"]
        stderr = raw["stderr"].decode("utf-8", "replace")
        signal_name = None
        if os.WIFSIGNALED(status_word):
            number = os.WTERMSIG(status_word)
            exit_code = -number
            try:
                signal_name = signal.Signals(number).name
            except ValueError:
                signal_name = f"signal {number}"
        else:
            exit_code = os.WEXITSTATUS(status_word)
        if raw["failure"]:
            status = "runtime_error"
            stderr = (stderr + f"\n[rewardbox] the program could not start: {raw['failure']}").lstrip("\n")
        elif killed_for == "output":
            status = "output_limit"
        elif killed_for == "memory":
            status = "memory"
            stderr += f"\n[rewardbox] its processes together held more than {limits.memory_mb} MiB"
        elif killed_for == "timeout":
            status = "timeout"
        elif exit_code == 0:
            status = "ok"
        elif signal_name == "SIGXCPU" or (signal_name == "SIGKILL" and raw["cpu_s"] >= limits.timeout_s):
            status = "timeout"
        elif signal_name == "SIGKILL" or any(m in stderr for m in language.memory_markers):
            status = "memory"  # an allocation failed, or the kernel's OOM killer took it (oom_score_adj 1000)
        elif signal_name == "SIGXFSZ":
            status = "runtime_error"
            stderr += "\n[rewardbox] a file grew over the file size limit"
        else:
            status = "runtime_error"
        return {"status": status, "exit_code": exit_code, "signal": signal_name,
                "stdout": raw["stdout"].decode("utf-8", "replace"), "stderr": stderr,
                "wall_s": raw["wall_s"], "cpu_s": raw["cpu_s"]}

    def serve(self, request: Request) -> dict:
        """Builds (if the language has a build step) and runs the request's programs."""
        language = request.language
        problem = languages.missing_tool(language)
        if problem:
            return {"error": problem}
        memory_mb = request.memory_mb
        if self.slot.memory is not None:  # gVisor: the sample's own budget caps what its programs get
            memory_mb = min(memory_mb, max(16, self.slot.memory // _MIB))
        # Owner only (the run uid): gVisor lets other uids open what a process has open through /proc/<pid>/fd,
        # past the directory's 0700, so a file readable by others would be readable by concurrent samples.
        entries = {language.source: (request.code, 0o600)}
        entries.update({name: (content, 0o600) for name, content in request.files.items()})
        file_bytes = max(64 * _MIB, 2 * request.max_output_bytes)
        compiled = None
        self.workspace.clean()
        try:
            if language.build:
                assert language.artifact is not None  # every language with a build step names what it leaves
                self.workspace.materialize(entries)
                limits = Limits(request.compile_timeout_s, max(memory_mb, 2048), 256, COMPILE_OUTPUT,
                                max(self.slot.nproc or 0, COMPILE_PROCESSES), file_bytes)
                raw = self.workspace.execute(languages.argv(language.build, memory_mb), b"", limits,
                                             self._env(language), (self.sock, self.parent))
                compiled = self.result(raw, limits, language)
                artifact = self.workspace.read_artifact(language.artifact) if compiled["status"] == "ok" else None
                if artifact is None:
                    if compiled["status"] == "timeout":
                        compiled["stderr"] += f"\n[rewardbox] the build ran past {request.compile_timeout_s:g}s"
                    elif compiled["status"] == "ok":
                        compiled["stderr"] += f"\n[rewardbox] the build left no {language.artifact}"
                    failed = dict(compiled, status="compile_error", exit_code=compiled["exit_code"])
                    runs = [dict(failed, passed=False if r.expected is not None else None) for r in request.runs]
                    return {"compile": compiled, "runs": runs}
                entries[language.artifact] = (artifact, 0o700)
            limits = Limits(request.timeout_s, memory_mb, language.address_grace_mb, request.max_output_bytes,
                            self.slot.nproc, file_bytes)
            results = []
            for i, run in enumerate(request.runs):
                if i or language.build:  # every run starts from the same files: nothing one run wrote reaches the next
                    self.workspace.clean()
                self.workspace.materialize(entries)
                raw = self.workspace.execute(languages.argv(language.run, memory_mb) + list(run.args), run.stdin,
                                             limits, self._env(language), (self.sock, self.parent))
                result = self.result(raw, limits, language)
                if run.expected is not None:
                    result["passed"] = result["status"] == "ok" and COMPARISONS[request.compare](
                        result["stdout"], run.expected)
                results.append(result)
                if request.stop_on_failure and result.get("passed") is False:
                    break
            return {"compile": compiled, "runs": results}
        finally:
            self.workspace.clean()

    def loop(self) -> int:
        """Serves the slot socket until it closes. Returns the exit code."""
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that a program's exit wakes execute()
        return self._serve()

    def _serve(self) -> int:
        """Serves ``self.sock`` until it closes. A slot process's :data:`.run_requests.CHANNEL` frame (not a
        child's) hands over a child's own socket, which is served first, until it closes or the slot process writes
        again (its :data:`.run_requests.RELEASE` frame, once that child is gone, whoever else holds its
        socket): a child killed in the middle of a request leaves its half frame on a socket nobody reads again."""
        while True:
            try:
                message = read_frame(self.sock, self.frame_limit, self.parent)
            except RequestError as e:
                try:
                    write_frame(self.sock, {"error": f"rewardbox.sandbox.run: {e}"}, self.parent)
                except OSError:
                    pass
                return 0  # the stream cannot be trusted to be at a frame boundary any more
            except OSError:
                return CLOSED
            if message is None:
                return CLOSED
            if message.get("op") == CHANNEL and self.parent is None:
                self._serve_child()
                continue
            if message.get("op") == RELEASE and self.parent is None:
                # The child is gone: _serve_child returned (the slot process wrote), closed its socket, and its
                # programs were killed and cleaned up after (Monitor.serve).
                try:
                    write_frame(self.sock, {"op": RELEASE})
                except OSError:
                    return CLOSED
                continue
            try:
                reply = self.serve(parse(message))
            except RequestError as e:
                reply = {"error": f"rewardbox.sandbox.run: {e}"}
            except SlotGone:
                return CLOSED
            try:
                write_frame(self.sock, reply, self.parent)
            except OSError:
                return CLOSED

    def _serve_child(self) -> None:
        try:
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        except OSError:
            return
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return
        slot_sock = self.sock
        self.parent, self.sock = slot_sock, socket.socket(fileno=fds[0])
        try:
            self.sock.setblocking(True)  # its replies are written watching the slot's socket (write_frame's watch)
            self._serve()
        finally:
            let_go(self.sock)
            self.sock, self.parent = slot_sock, None


def let_go(sock: socket.socket) -> None:
    """Closes a socket a sample wrote to, after reading (and closing) the descriptors it left in flight there. Under
    gVisor, which has no collector for Unix sockets sent over themselves, a sample's socket sent over that very
    socket (with what else came along: an unlinked file that fills the slot's /tmp) would otherwise live on for
    good once the socket closed; Linux collects them. Bounded: another process may still hold the socket and keep
    writing."""
    try:
        sock.setblocking(False)
        for _ in range(LET_GO_READS):
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
            for fd in fds:
                os.close(fd)
            if not data and not fds:
                break
    except OSError:
        pass
    finally:
        sock.close()


def _bound_sends(sock: socket.socket) -> None:
    """On a slot process's own socket: a reply that makes no progress for SEND_TIMEOUT_S fails (and the socket is
    served no more). A caller waits for its reply, reading; one that does not may also hold the socket open past its
    own death (its end sent over the socket itself, in flight in our receive queue), and a monitor blocked writing
    would never serve again. (A forked child's socket is written watching the slot process's instead.)"""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", SEND_TIMEOUT_S, 0))


def start(slot: RunSlot, sock: socket.socket, keep: tuple = ()) -> int:
    """Forks a monitor for ``sock``. Returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            # Not SIGKILL: a monitor that loses its runner (the template closed) still kills its program first.
            signal.signal(signal.SIGTERM, _runner_gone)
            tree.die_with_parent(signal.SIGTERM)
            for fd in keep:
                os.close(fd)
            # The memory guard counts what a monitor holds (a program's output, up to max_output_bytes per stream
            # and run) toward the slot it serves, by this name: only root's processes are taken at their name.
            tree.set_name(MONITOR_NAME + str(slot.uid) if slot.uid is not None else "rbx-monitor")
            tree.become_subreaper()
            code = Monitor(slot, sock).loop()
        finally:
            try:
                let_go(sock)
            finally:
                os._exit(code)
    return pid
