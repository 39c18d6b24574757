"""The supervisor: the one process of a sandbox that keeps the right to switch uids, and the parent of templates.

The sandbox's entry point (:mod:`rewardbox.sandbox.__main__`) forks it before anything else runs and before the
server drops to its own uid. Docker backend: the container starts as root holding only SETUID, SETGID and KILL
(``cap_drop: ALL`` otherwise, ``no-new-privileges``), so the supervisor and the templates it forks can start slot
processes under the slot uids, which then hold no capability at all. Local backend: everyone is the trainer's user
and slots share its uid (no isolation, as documented).

The server asks for a template with ``template`` (the function's config) and receives the template's end of a
fresh socket pair. Each template gets slots (uid, scratch directory) from the sandbox's pool and returns them when
it exits. The supervisor dies with the server (PR_SET_PDEATHSIG) and templates die with the supervisor. Between
messages it runs the memory guard (:mod:`..memory.memory_guard`): near the sandbox's memory limit, the slot whose
processes hold the most together is killed, not the largest process.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import stat
from dataclasses import dataclass
from typing import Optional

from ..confine import private_tmp
from ..memory import memory_guard, memory_use
from ..protocol.channel import ChannelClosed, pair, recv, send
from ..protocol.records import WorkerConfig
from . import template
from .slot import SlotSpec
from .tree import become_subreaper, fork_child, kill_children, set_name, sigchld_wakeup

SLOT_DIR_PREFIX = "/tmp/slot-"  # docker backend: one tmpfs per slot uid, mode 0700, owned by that uid


@dataclass(frozen=True)
class SlotPool:
    """Where slots come from: dedicated uids with their tmpfs (docker), or directories under ``root`` (local)."""

    uids: tuple = ()  # empty: the local backend
    run_uids: tuple = ()  # one per slot uid: the uid of the programs its reward code runs
    root: str = ""  # local backend: where slot directories go; with uids: see make_slot_dirs
    atomic_kill: bool = False  # see SlotSpec
    private_tmp: str = ""  # see SlotSpec

    def directory(self, uid: int) -> str:
        return os.path.join(self.root, f"slot-{uid}") if self.root else f"{SLOT_DIR_PREFIX}{uid}"

    def specs(self) -> list:
        """(uid, directory, run uid, run directory) of each slot."""
        if self.uids:
            run_uids = self.run_uids or (None,) * len(self.uids)
            return [(uid, self.directory(uid), run, self.directory(run) if run is not None else "")
                    for uid, run in zip(self.uids, run_uids)]
        return [(None, os.path.join(self.root, f"slot-{i}"), None, os.path.join(self.root, f"run-{i}"))
                for i in range(256)]


def make_slot_dirs(root: str, uids: tuple) -> None:
    """Where no per-slot tmpfs can be mounted (a Kubernetes pod: ``--slot-root``), makes each ``root/slot-<uid>``
    as that uid with mode 0700 (a child per uid: root holds no CAP_CHOWN), then ``root`` (an emptyDir, owned by
    root and world-writable as the kubelet makes it) 0711, so no sample can create, rename or remove anything in
    it. Runs as root before anything else: no sample process exists yet (an emptyDir outlives a restart of the
    container, its processes do not).

    Raises:
        OSError: ``root`` is not ours to change, or a slot directory exists with another owner.
    """
    os.chmod(root, 0o777)  # as its owner (no CAP_FOWNER needed): the uids below create their directories
    for uid in uids:
        path = os.path.join(root, f"slot-{uid}")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:  # the pod's emptyDir outlives a restart of the container
                    info = os.lstat(path)
                    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                        raise
                    os.chmod(path, 0o700)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise OSError(f"cannot make the slot directory {path} as uid {uid}")
    os.chmod(root, 0o711)  # also clears the setgid bit an fsGroup sets


def parse_uids(text: str) -> tuple:
    """``100000-100063`` -> the uids in that range."""
    first, _, last = text.partition("-")
    return tuple(range(int(first), int(last or first) + 1))


STRAYS_KILL_S = 2.0


class Supervisor:
    def __init__(self, server: socket.socket, pool: SlotPool):
        self.server = server
        self.free = pool.specs()
        self.atomic_kill = pool.atomic_kill
        self.private_tmp = pool.private_tmp
        self.held: dict[int, list] = {}  # template pid -> its slots
        self.selector = selectors.DefaultSelector()
        usage = memory_use.find_usage() if pool.uids else None
        # A slot's files count toward it where each slot has a tmpfs of its own (not a pod's one shared directory).
        slots = self.free if not pool.root else [(uid, "", run_uid, "") for uid, _, run_uid, _ in self.free]
        self.guard = memory_guard.Guard(
            slots, usage, pool.atomic_kill,
            renewed=private_tmp.leaked_bytes if pool.private_tmp == "chroot" else None, server=os.getppid(),
        ) if usage is not None else None

    def run(self) -> None:
        set_name("rbx-supervisor")
        # What a template leaves when it exits (processes its reward's import started, as the sandbox's root: a
        # failed import's, or those a thread of the import started again as fast as the template killed them; slot
        # processes still running) comes to this process, which kills it (_reap).
        become_subreaper()
        wake_r = sigchld_wakeup()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(self.server, selectors.EVENT_READ, "server")
        while True:
            if self.guard is not None and not self.guard.timeout() and self.guard.check() == memory_guard.RESTART:
                return  # the server sees this process end: NOT_SERVING, and the host replaces the sandbox
            for key, _ in self.selector.select(self.guard.timeout() if self.guard is not None else None):
                if key.data == "wake":
                    os.read(wake_r, 4096)
                    self._reap()
                elif not self._from_server():
                    return

    def _reap(self) -> None:
        """Takes back the slots of templates that exited, and kills (and reaps) every child this process did not
        start itself (its templates; the memory guard's killers): only a template's orphans are (its subreaper's),
        for at most STRAYS_KILL_S a time (a process that keeps forking as fast as it is killed is taken at the next
        SIGCHLD)."""
        keep = set(self.held) | (set(self.guard.killing) if self.guard is not None else set())
        kill_children(keep, STRAYS_KILL_S, self._reaped)

    def _reaped(self, pid: int) -> None:
        # Returned slots go last: a template started again takes fresh ones first.
        self.free = self.free + self.held.pop(pid, [])
        if self.guard is not None:
            self.guard.reaped(pid)

    def _from_server(self) -> bool:
        try:
            message, _ = recv(self.server)
        except (ChannelClosed, OSError, ValueError):
            return False
        if message.get("op") == "quiet":  # the server had no call in flight for a while, or has one again
            if self.guard is not None:
                self.guard.quiet(bool(message.get("quiet")))
            return True
        if message.get("op") != "template":
            return True
        config = WorkerConfig(**message["config"])
        wanted = max(1, int(message.get("slots", 1)))
        nproc, memory = message.get("nproc"), message.get("memory")
        if not self.free:
            send(self.server, {"op": "template", "error": "no free slot uid is left in this sandbox"})
            return True
        taken, self.free = self.free[:wanted], self.free[wanted:]
        specs = [SlotSpec(i, uid, directory, nproc, memory, atomic_kill=self.atomic_kill, run_uid=run_uid,
                          run_directory=run_directory, private_tmp=self.private_tmp)
                 for i, (uid, directory, run_uid, run_directory) in enumerate(taken)]
        server_end, template_end = pair()

        def become_template() -> None:
            server_end.close()
            self.server.close()
            self.selector.close()
            template.run(config, specs, template_end)  # never returns

        pid = fork_child(become_template)
        template_end.close()
        self.held[pid] = taken
        send(self.server, {"op": "template", "pid": pid, "slots": len(specs)}, fds=[server_end.fileno()])
        server_end.close()
        return True


def start(pool: SlotPool) -> tuple[int, socket.socket]:
    """Forks the supervisor. Returns its pid and the server's end of the control socket."""
    server_end, supervisor_end = pair()

    def supervise() -> None:
        server_end.close()
        Supervisor(supervisor_end, pool).run()  # if it raises, the server sees the socket close: NOT_SERVING

    pid = fork_child(supervise)
    supervisor_end.close()
    return pid, server_end


def local_pool(state_dir: Optional[str]) -> SlotPool:
    """Slots for the local backend: directories in the sandbox's state directory (or a new temporary one)."""
    import tempfile  # here, in the local backend only: it loads random, whose reseeding runs after every fork

    root = os.path.join(state_dir, "slots") if state_dir else tempfile.mkdtemp(prefix="rbx-slots-")
    os.makedirs(root, mode=0o700, exist_ok=True)
    return SlotPool(root=root)
