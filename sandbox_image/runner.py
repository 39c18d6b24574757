"""The program runner: runs the programs reward code hands to :func:`rewardbox.sandbox.run`, under uids of their own.

A template forks one runner before it imports the reward (docker backend: as root holding SETUID, SETGID and KILL,
like the template itself). Each slot process the template starts gets one end of a fresh socket pair, the runner
the other, with the slot's index: the runner knows which run uid and scratch directory belong to that socket, so
nothing a slot process says can choose them. When a slot's socket first has a request, the runner forks a monitor
for it, which serves that socket's requests one after another until it closes; a slot's next monitor starts only
after the last one ended, so two never share a run uid. A slot's new process asks (:func:`.run_requests.release`)
before any reward code runs in it, and the runner answers once the last monitor ended: nothing its last process
left at the runner is left then.

For each program, the monitor:

1. kills whatever the run uid still runs and empties its scratch directory (as in :func:`.slot.prepare`);
2. writes the code, the files and the build's output there (as the run uid);
3. forks the program: a session of its own, ``oom_score_adj`` 1000, the run uid (no capability left), limits on
   CPU time, writable memory (``RLIMIT_DATA``) and address space, processes, file size and open files, a seccomp
   filter without network (:mod:`.seccomp`), the scratch directory as cwd, HOME and TMPDIR (mounted on ``/tmp``
   in a mount namespace of its own where the container allows it: :mod:`.private_tmp`), and a clean environment
   (none of the reward's, secrets included);
4. feeds stdin, reads stdout and stderr up to a limit, watches the memory of all the run uid's processes together
   (the rlimits hold per process: a program's forks could otherwise add up to many times its ``memory_mb`` and get
   a concurrent sample's program OOM-killed), and kills the whole tree (every process of the run uid) when the
   program exits, overruns its wall time, its memory or its output limit, or the slot process goes away;
5. empties the directory again.

The reward's own process runs under another uid: a program can neither signal, trace or read it, nor read or
write its directory. Local backend and plain Python (no sandbox): the same, minus the uids (no isolation; a
program runs as its caller). Standard library only.
"""

from __future__ import annotations

import math
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass
from typing import Optional

from . import languages, private_tmp, processes, seccomp
from .run_requests import (CHANNEL, MAX_REQUEST, COMPARISONS, RELEASE, Request, RequestError, encode_frame, parse,
                           read_frame, write_frame)

# A monitor holds what a sample sends it in memory the sample does not pay for: at most this much (or half the
# sample's own address space, where it has a limit), so a sample cannot make it hold more than the sample could.
MAX_MONITORED_REQUEST = 64 * 1024 * 1024
MAX_ARTIFACT = 256 * 1024 * 1024
COMPILE_OUTPUT = 64 * 1024
COMPILE_PROCESSES = 64
OPEN_FILES = 256
CLOSED = 3  # a monitor's exit code when its socket closed
MEMORY_POLL_S = 0.02  # how often the memory of a program's processes is added up
_MIB = 1 << 20
MONITOR_NAME = "rbxm-"  # + the run uid: see _start_monitor
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class RunSlot:
    """Where one slot's programs run: their uid (None: the caller's own, no isolation) and scratch directory."""

    uid: Optional[int]
    directory: str
    nproc: Optional[int] = None  # RLIMIT_NPROC of the run uid (the sample's share of the sandbox's pids)
    memory: Optional[int] = None  # the sample's address space budget, bytes (gVisor), caps memory_mb
    atomic_kill: bool = False
    private_tmp: str = ""  # see slot.SlotSpec

    @property
    def home(self) -> str:
        """cwd, HOME and TMPDIR of its programs: their directory, mounted on /tmp where it can be."""
        return private_tmp.home(self.private_tmp, self.directory)


# -- one program ----------------------------------------------------------------------------------------------------
@dataclass
class Limits:
    timeout_s: float
    memory_mb: int
    address_grace_mb: int
    max_output_bytes: int
    nproc: Optional[int]
    file_bytes: int


class SlotGone(BaseException):
    """The slot process that asked went away, the runner did, or the socket broke the exchange (more bytes while a
    program runs): stop at once, killing the program, and serve that socket no more."""


def _runner_gone(signum, frame):
    raise SlotGone()


class Monitor:
    """Runs the requests of one slot socket (see the module docstring)."""

    def __init__(self, slot: RunSlot, sock: Optional[socket.socket]):
        self.slot = slot
        self.sock = sock  # the slot's socket: its closing means the caller is gone
        # While a child's socket is served (self.sock then): the slot process's, which it writes to only once that
        # child is gone (the next child's CHANNEL frame), whoever still holds the child's socket open.
        self.parent: Optional[socket.socket] = None
        if sock is not None:
            _bound_sends(sock)
        self.session = 0  # local backend: the last program's session, to kill
        self.frame_limit = MAX_MONITORED_REQUEST if slot.uid is not None else MAX_REQUEST
        if slot.uid is not None and slot.memory:
            self.frame_limit = min(self.frame_limit, slot.memory // 2)

    # ---- privileges
    def _as_run_uid(self, reaper: bool = False) -> None:
        """Acts as the run uid (files it owns, signals to its processes) while keeping the way back (saved 0).
        ``reaper``: with a real uid no program has, so none of them can signal this process meanwhile."""
        uid = self.slot.uid
        os.setresgid(-1, uid, -1)
        os.setresuid(uid | processes.REAPER_UID_BIT if reaper else -1, uid, 0)

    def _as_root(self) -> None:
        os.setresuid(0, 0, 0)
        os.setresgid(-1, 0, -1)

    # ---- the scratch directory
    def clean(self) -> None:
        """Kills every process of the run uid and empties its directory (and its files in /dev/shm)."""
        self._kill_tree()
        if self.slot.uid is None:
            os.makedirs(self.slot.directory, mode=0o700, exist_ok=True)
            processes.empty(self.slot.directory)
            return
        self._as_run_uid()
        try:
            processes.empty(self.slot.directory)
            if os.path.isdir("/dev/shm"):  # only under isolation: worker (no /dev/shm otherwise)
                for name in os.listdir("/dev/shm"):
                    path = os.path.join("/dev/shm", name)
                    try:
                        if os.lstat(path).st_uid == self.slot.uid:
                            os.unlink(path)
                    except OSError:
                        pass
        finally:
            self._as_root()
        if self.slot.private_tmp == "chroot" and processes.unnamed_bytes(self.slot.directory):
            private_tmp.renew(self.slot.uid, self.slot.directory, executable=True)  # see slot.prepare

    def _kill_tree(self) -> None:
        """Kills every process of the run uid (local backend: the last program's process group)."""
        if self.slot.uid is None:
            if self.session:
                try:
                    os.killpg(self.session, signal.SIGKILL)
                except OSError:
                    pass
            return
        self._as_run_uid(reaper=True)
        try:
            processes.kill_uid(self.slot.uid, atomic=self.slot.atomic_kill)
        finally:
            self._as_root()

    def materialize(self, entries: dict) -> None:
        """Writes {relative path: (content, mode)} into the (empty) scratch directory, as the run uid.

        Raises:
            RequestError: an entry cannot be written (a path under a file the request also names, no space left).
        """
        if self.slot.uid is not None:
            self._as_run_uid()
        name = ""
        try:
            top = os.open(self.slot.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                for name, (content, mode) in entries.items():
                    parent = top
                    *dirs, leaf = name.split("/")
                    opened = []
                    try:
                        for d in dirs:
                            try:
                                os.mkdir(d, 0o700, dir_fd=parent)
                            except FileExistsError:
                                pass
                            parent = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
                            opened.append(parent)
                        fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=parent)
                        try:
                            view = memoryview(content)
                            while view:
                                view = view[os.write(fd, view):]
                        finally:
                            os.close(fd)
                    finally:
                        for fd in opened:
                            os.close(fd)
            finally:
                os.close(top)
        except OSError as e:
            raise RequestError(f"files: {name!r} cannot be written: {e.strerror or e}") from None
        finally:
            if self.slot.uid is not None:
                self._as_root()

    def read_artifact(self, name: str) -> Optional[bytes]:
        if self.slot.uid is not None:
            self._as_run_uid()
        try:
            fd = os.open(os.path.join(self.slot.directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size > MAX_ARTIFACT:
                    return None
                chunks = []
                while True:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        return b"".join(chunks)
                    chunks.append(chunk)
            finally:
                os.close(fd)
        except OSError:
            return None
        finally:
            if self.slot.uid is not None:
                self._as_root()

    # ---- running
    def _child(self, argv: list, env: dict, limits: Limits, fds: tuple, report: int) -> None:
        """In the forked child: becomes the program (never returns)."""
        try:
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.dup2(report, 3)
            os.set_inheritable(3, False)
            os.closerange(4, 65536)
            for sig in range(1, signal.NSIG):
                if sig not in (signal.SIGKILL, signal.SIGSTOP):
                    try:
                        signal.signal(sig, signal.SIG_DFL)
                    except (OSError, ValueError):
                        pass
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            try:
                with open("/proc/self/oom_score_adj", "w") as f:  # before the uid change: the file is ours now
                    f.write("1000")
            except OSError:
                pass
            uid = self.slot.uid
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
            cpu = max(1, math.ceil(limits.timeout_s))
            memory = limits.memory_mb * _MIB
            for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_DATA, (memory, memory)),
                                (resource.RLIMIT_AS, ((limits.memory_mb + limits.address_grace_mb) * _MIB,) * 2),
                                (resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes)),
                                (resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES)), (resource.RLIMIT_CORE, (0, 0))):
                resource.setrlimit(kind, value)
            if limits.nproc is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
            os.umask(0o077)
            if uid is not None:
                private_tmp.become(self.slot.private_tmp, uid, self.slot.directory)  # no capability left after
            seccomp.install(network=False)
            os.chdir(self.slot.home)
            os.execvpe(argv[0], argv, env)
        except BaseException as e:  # noqa: BLE001 - reported to the monitor, which reports it as the run's error
            try:
                os.write(3, f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:2000])
            except OSError:
                pass
        os._exit(127)

    def execute(self, argv: list, stdin: bytes, limits: Limits, env: dict) -> dict:
        """Runs one program to its end. Returns its result (status before the run's own checks)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self._child(argv, env, limits, (in_r, out_w, err_w), report_w)
        for fd in (out_w, err_w, in_r, report_w):
            os.close(fd)
        self.session = pid
        failure = b""
        while True:  # empty when exec succeeded (the descriptor closes on exec)
            chunk = os.read(report_r, 4096)
            if not chunk:
                break
            failure += chunk
        os.close(report_r)
        outputs = {out_r: bytearray(), err_r: bytearray()}
        selector = selectors.DefaultSelector()
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        os.set_blocking(in_w, False)
        pending = memoryview(stdin)
        if pending:
            selector.register(in_w, selectors.EVENT_WRITE)
        else:
            os.close(in_w)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        selector.register(wake_r, selectors.EVENT_READ)
        for sock in (self.sock, self.parent):
            if sock is not None:
                selector.register(sock, selectors.EVENT_READ)
        deadline = start + limits.timeout_s
        next_poll = start + MEMORY_POLL_S if self.slot.uid is not None else math.inf
        killed_for, status_word, usage = None, None, None
        try:
            while status_word is None:
                now = time.monotonic()
                if now >= deadline:
                    killed_for = "timeout"
                    break
                if now >= next_poll:
                    if self._tree_memory() > limits.memory_mb * _MIB:
                        killed_for = "memory"
                        break
                    next_poll = now + MEMORY_POLL_S
                for key, _ in selector.select(timeout=min(deadline, next_poll) - now):
                    fd = key.fileobj
                    if fd is self.sock or fd is self.parent:
                        # Its end closed, or it wrote while its request runs, which rewardbox.sandbox.run never does
                        # (one request at a time per socket, waited for). Ignoring those bytes would mean no longer
                        # watching for the close: a sample's program would outlive it and hold up the slot's next
                        # samples for its whole timeout. (The parent: the child is gone.)
                        raise SlotGone()
                    elif fd == wake_r:
                        try:
                            os.read(wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif fd == in_w:
                        try:
                            pending = pending[os.write(in_w, pending[:65536]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        except BlockingIOError:
                            pass
                        if not pending:
                            selector.unregister(in_w)
                            os.close(in_w)
                    elif fd in outputs:
                        drained = self._drain(fd, outputs[fd], limits.max_output_bytes)
                        if drained is None:
                            selector.unregister(fd)
                        elif drained:
                            killed_for = "output"
                    if killed_for:
                        break
                if killed_for:
                    break
                waited, status, rusage = os.wait4(pid, os.WNOHANG)
                if waited == pid:
                    status_word, usage = status, rusage
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sock in (self.sock, self.parent):
                if sock is not None and sock in selector.get_map():
                    selector.unregister(sock)
            self._kill_tree()
            if status_word is None:
                _, status_word, usage = os.wait4(pid, 0)
            wall = time.monotonic() - start
            if not killed_for:  # every writer is dead now: what is left in the pipes, up to the limit
                for fd in outputs:
                    if self._drain(fd, outputs[fd], limits.max_output_bytes):
                        killed_for = "output"
            selector.close()
            for fd in (out_r, err_r, wake_r, wake_w):
                os.close(fd)
            if pending:  # stdin was not written to its end
                os.close(in_w)
            for _ in processes.exited_children():  # every descendant: this process is their subreaper
                pass
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return {"status_word": status_word, "killed_for": killed_for, "wall_s": round(wall, 6),
                "cpu_s": round(max(cpu, usage.ru_utime + usage.ru_stime), 6),
                "stdout": bytes(outputs[out_r]), "stderr": bytes(outputs[err_r]),
                "failure": failure.decode("utf-8", "replace")}

    @staticmethod
    def _drain(fd: int, buffer: bytearray, limit: int) -> Optional[bool]:
        """Reads what ``fd`` has now. Returns True when the stream went over ``limit`` (the excess is not kept),
        None at its end, else False."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return None
            room = limit - len(buffer)
            buffer += chunk[:max(0, room)]
            if len(chunk) > room:
                return True

    def _tree_memory(self) -> int:
        """Bytes of memory the run uid's processes hold together: their anonymous and shared-memory resident pages
        (pages shared after a fork count once per process), else their resident set where the kernel does not
        tell those apart (gVisor)."""
        return sum(processes.resident_kb(processes.status_fields(status))
                   for _, status in processes.statuses_of(self.slot.uid)) * 1024

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
        self.clean()
        try:
            if language.build:
                self.materialize(entries)
                limits = Limits(request.compile_timeout_s, max(memory_mb, 2048), 256, COMPILE_OUTPUT,
                                max(self.slot.nproc or 0, COMPILE_PROCESSES), file_bytes)
                raw = self.execute(languages.argv(language.build, memory_mb), b"", limits, self._env(language))
                compiled = self.result(raw, limits, language)
                artifact = self.read_artifact(language.artifact) if compiled["status"] == "ok" else None
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
                if i or language.build:
                    self.clean()  # every run starts from the same files: nothing one run wrote reaches the next
                self.materialize(entries)
                raw = self.execute(languages.argv(language.run, memory_mb) + list(run.args), run.stdin, limits,
                                   self._env(language))
                result = self.result(raw, limits, language)
                if run.expected is not None:
                    result["passed"] = result["status"] == "ok" and COMPARISONS[request.compare](
                        result["stdout"], run.expected)
                results.append(result)
                if request.stop_on_failure and result.get("passed") is False:
                    break
            return {"compile": compiled, "runs": results}
        finally:
            self.clean()

    def loop(self) -> int:
        """Serves the slot socket until it closes. Returns the exit code."""
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that a program's exit wakes execute()
        return self._serve()

    def _serve(self) -> int:
        """Serves ``self.sock`` until it closes. A slot process's :data:`.run_requests.CHANNEL` frame (not a
        child's) hands over a child's own socket, which is served first, until it closes or the slot process writes
        again (its :data:`.run_requests.RELEASE` frame, once that child is gone, whoever else holds its socket): a
        child killed in the middle of a request leaves its half frame on a socket nobody reads again."""
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
        self.parent, self.sock = self.sock, socket.socket(fileno=fds[0])
        try:
            self.sock.setblocking(True)  # its replies are written watching the slot's socket (write_frame's watch)
            self._serve()
        finally:
            let_go(self.sock)
            self.sock, self.parent = self.parent, None


SEND_TIMEOUT_S = 2
LET_GO_READS = 256  # at most this many reads (of up to 64 KiB and 64 descriptors each) before a socket is closed


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


def _start_monitor(slot: RunSlot, sock: socket.socket, keep: tuple = ()) -> int:
    """Forks a monitor for ``sock``. Returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            # Not SIGKILL: a monitor that loses its runner (the template closed) still kills its program first.
            signal.signal(signal.SIGTERM, _runner_gone)
            processes.die_with_parent(signal.SIGTERM)
            for fd in keep:
                os.close(fd)
            # The memory guard counts what a monitor holds (a program's output, up to max_output_bytes per stream
            # and run) toward the slot it serves, by this name: only root's processes are taken at their name.
            processes.set_name(MONITOR_NAME + str(slot.uid) if slot.uid is not None else "rbx-monitor")
            processes.become_subreaper()
            code = Monitor(slot, sock).loop()
        finally:
            try:
                let_go(sock)
            finally:
                os._exit(code)
    return pid


# -- the runner -----------------------------------------------------------------------------------------------------
_RELEASE_FRAME = encode_frame({"op": RELEASE})


class Runner:
    """One per template: hands each slot socket with a request to a monitor, one monitor per slot at a time."""

    def __init__(self, control: socket.socket, slot_map: dict):
        self.control = control
        self.slots = slot_map  # index -> RunSlot
        self.sockets: dict = {}  # index -> the current slot process's socket, while no monitor has it
        self.busy: dict = {}  # monitor pid -> index
        self.selector = selectors.DefaultSelector()

    def run(self) -> None:
        processes.set_name("rbx-runner")
        wake_r = processes.sigchld_wakeup()
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        while True:
            for key, _ in self.selector.select():
                if key.data == "wake":
                    os.read(wake_r, 4096)
                    self._reap()
                elif key.data == "control":
                    if not self._from_template():
                        return
                else:
                    self._start(key.data)

    def _from_template(self) -> bool:
        from .channel import ChannelClosed, optional_fd, recv

        try:
            message, fds = recv(self.control)
        except (ChannelClosed, OSError, ValueError):
            return False
        fd = optional_fd(fds)
        index = message.get("slot")
        if fd is None or index not in self.slots:
            if fd is not None:
                os.close(fd)
            return True
        old = self.sockets.pop(index, None)
        if old is not None:
            self.selector.unregister(old)
            let_go(old)
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        self.sockets[index] = sock
        busy = [pid for pid, i in self.busy.items() if i == index]
        if not busy:
            self.selector.register(sock, selectors.EVENT_READ, index)
        for pid in busy:
            # The template forks a slot's next process only once the last one is gone: whatever its monitor still
            # serves (a socket another process holds open, or reads slowly) has no caller. It kills its program and
            # ends, and the new socket is served once it is reaped.
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return True

    def _start(self, index: int) -> None:
        sock = self.sockets[index]
        try:
            first = sock.recv(len(_RELEASE_FRAME), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        if first == _RELEASE_FRAME:
            # A slot's new process asks before any reward code runs in it (slot._released). Its socket is read
            # only once the slot's last monitor ended (_reap): nothing its last process left here is left.
            try:
                sock.recv(len(first))
                sock.sendall(_RELEASE_FRAME)
            except OSError:
                pass
            return  # its first request starts a monitor
        self.sockets.pop(index)
        self.selector.unregister(sock)
        if not first:
            # The slot process is gone without asking for a program (most never do): no monitor, as nothing of
            # the run uid can exist that a monitor did not start and clean up after.
            sock.close()
            return
        keep = [self.control.fileno(), *(s.fileno() for s in self.sockets.values())]
        try:
            pid = _start_monitor(self.slots[index], sock, tuple(keep))
        except OSError:  # the pids limit: the caller sees its socket close and reports it
            sock.close()
            return
        sock.close()
        self.busy[pid] = index

    def _reap(self) -> None:
        for pid, _ in processes.exited_children():
            index = self.busy.pop(pid, None)
            if index is not None and index in self.sockets:  # the slot's next process waited for this one
                self.selector.register(self.sockets[index], selectors.EVENT_READ, index)


def start(slot_map: dict) -> tuple:
    """Forks a runner for ``slot_map`` (index -> RunSlot). Returns (pid, the template's end of its socket)."""
    from .channel import pair

    template_end, runner_end = pair()

    def serve() -> None:
        keep = runner_end.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
        Runner(runner_end, slot_map).run()  # if it raises, the template sees the socket close: run() calls fail

    pid = processes.fork_child(serve)
    runner_end.close()
    return pid, template_end


def main(argv: Optional[list] = None) -> int:
    """``python -m rewardbox.sandbox.runner FD``: serves one socket outside any sandbox (plain Python, the in-process
    backend), in a temporary directory, as the caller's own user."""
    fd = int((argv if argv is not None else sys.argv[1:])[0])
    processes.become_subreaper()
    processes.die_with_parent()
    import tempfile  # here: it loads random, whose reseeding would run after every fork of a template

    with tempfile.TemporaryDirectory(prefix="rbx-run-") as directory:
        slot = RunSlot(uid=None, directory=os.path.join(directory, "scratch"))
        return Monitor(slot, socket.socket(fileno=fd)).loop()


if __name__ == "__main__":
    sys.exit(main())
