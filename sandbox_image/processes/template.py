"""A template: imports one version of a reward function once, then forks slot processes from that state.

The supervisor forks it (docker backend: as root holding SETUID, SETGID and KILL, which its slot processes give up).
It talks only to the server, over a control socket (:mod:`..protocol.channel`):

- server -> template: ``run`` (with the request's socket), ``done`` (the server read a request's answer; with
  ``retire``, the process that served it is killed: a forked slot process that could not clean up after a unit),
  ``kill`` (a request ran past its deadline), ``close``;
- template -> server: ``loaded`` (the function's signature info) or ``load_error`` once, then ``exited`` for each
  slot process that ended while it held requests (with its exit status), and ``slot_failed`` when a slot cannot
  be prepared at all.

It never reads what a slot process writes after its one ready byte: slot processes run reward code on model output,
and nothing they say reaches the template or the server except through a request socket's fixed format.

Before it imports the reward it forks the program runner (:mod:`..programs.runner`), and gives each slot process it
starts a socket to it, telling the runner which slot that socket belongs to.
"""

from __future__ import annotations

import _queue  # queue.SimpleQueue itself, without the threading module queue imports (see tests/test_layering.py)
import _thread
import collections
import dataclasses
import gc
import math
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

from ..confine import private_memory, private_tmp, seccomp
from ..memory import sockets
from ..programs import runner as runner_module
from ..programs.program import RunSlot
from ..protocol.channel import ChannelClosed, optional_fd, pair, recv, send
from ..protocol.records import WorkerConfig
from . import import_effects, tree, slot as slots
from . import worker

# A slot process that dies before it is ready this many times in a row is reported and no longer respawned.
MAX_SETUP_FAILURES = 3
RESPAWN_BACKOFF_S = 0.05
# Style environment and isolation "call": each process serves one episode (or one call) and is killed when it ends.
# What it left (processes: the template is their subreaper; Unix sockets open or in flight, which can hold a port or
# a socket's name) is looked for once it is reaped: where anything is, its slot's next process (which kills and
# frees all of its uid's) is started at once; where nothing is, that start waits until no call came for
# IDLE_RESPAWN_S (TRL resets a whole batch's instances, and calls a turn's tools, one after another, then generates:
# a process's start costs several calls' CPU, spent then and not in the burst's way), or the slots holding a fresh
# process are down to a reserve (RESERVE_FRACTION of them, at least MIN_RESERVE), or MAX_RESPAWN_DELAY_S passed.
# No episode or call starts while a process that ended is not yet known to have left nothing (Template.cleaning).
# Half an environment's slots are spares (sandbox_slots): a batch's resets fit in them.
IDLE_RESPAWN_S = 0.05
RESERVE_FRACTION = 1 / 32
MIN_RESERVE = 2
MAX_RESPAWN_DELAY_S = 10.0
# Ended processes' namespaces held until calls pause (Namespaces.let_go), at most: 256 held in a sandbox of 512 slots
# moved its kernel memory by less than 10 MiB (a mount's copy is a few hundred bytes).
MAX_HELD_NAMESPACES = 1024


class Namespaces:
    """Lets go of the mount namespaces of ended slot processes (:func:`.slot.own_namespace`) on a thread of its
    own, once calls pause: dropping the last reference unmounts the namespace's copies of the container's mounts
    (about 2 ms of CPU in a sandbox of 512 slots), time the template's loop spends on requests instead, and the CPU
    the calls of a burst need (TRL resets a batch's environments, and calls a turn's tools, one after another). The
    thread starts with the first namespace to let go of, after the reward's import was checked for threads of its
    own (:meth:`Template._left_by_import`). What the thread does is close descriptors; the slot processes the template
    forks meanwhile close every descriptor they inherit first (:func:`.tree.close_inherited`)."""

    def __init__(self, most: int = MAX_HELD_NAMESPACES) -> None:
        self.pending: Optional[_queue.SimpleQueue] = None
        self.held: list = []  # let go of once calls pause (let_go)
        self.most = most

    def release(self, fd: Optional[int]) -> None:
        if fd is not None:
            self.held.append(fd)

    def let_go(self, quiet: bool) -> None:
        """Hands the held namespaces to the thread once calls paused (``quiet``), or once ``most`` are held:
        unmounting one takes about 2 ms of CPU in a sandbox of 512 slots, which the calls of a burst of resets or
        tool calls waited for on a machine of two CPUs."""
        if not self.held or not (quiet or len(self.held) >= self.most):
            return
        if self.pending is None:
            self.pending = _queue.SimpleQueue()
            _thread.start_new_thread(self._close_all, (self.pending,))
        for fd in self.held:
            self.pending.put(fd)
        self.held = []

    @staticmethod
    def _close_all(pending: _queue.SimpleQueue) -> None:
        while True:
            fd = pending.get()
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass(eq=False)  # a slot is itself (its identity: in sets, as a key)
class _Slot:
    spec: slots.SlotSpec
    pid: int = 0
    control: Optional[socket.socket] = None
    ready: bool = False
    retiring: bool = False  # killed for good reason, not yet reaped: no request goes to it
    requests: set = field(default_factory=set)
    setup_failures: int = 0
    respawn_at: float = 0.0
    broken: bool = False
    last_failure: str = ""
    cleaned: bool = False  # a process of this template got ready in this slot: it had cleaned up after the uid
    served: bool = False  # its current process was given a request (a process that serves one is not "ready")
    episode: Optional[str] = None  # style environment: the episode its current process holds
    urgent: bool = False  # its last process left something behind: its next one is started at once
    namespace: Optional[int] = None  # its process's mount namespace, while it lives (slot.own_namespace)


class Template:
    def __init__(self, config: WorkerConfig, slot_specs: list[slots.SlotSpec], server: socket.socket):
        self.config = config
        self.mode = config.isolation  # worker | sample (each unit in a child of a slot process) | process
        self.slots = [_Slot(spec) for spec in slot_specs]
        # Whether its slot processes run each unit in a child (.forked); if not, and not under isolation: worker, a
        # slot process serves one request, of one unit, and is never given another (whatever the server says).
        self.forks = bool(self.slots) and all(slots.forks(self.mode, s.spec) for s in self.slots)
        self.one_request = self.mode != "worker" and not self.forks
        self.server = server
        self.queue: collections.deque = collections.deque()  # (request id, fd, episode or None, starts it)
        self.namespaces = Namespaces()  # of ended slot processes, let go of beside the loop
        # Style environment: each slot process holds one episode, for its life; an episode's calls go to it alone.
        self.episodes = config.style == "environment"
        # Isolation "call" (a tool's, server._isolation): each call takes a slot process that never served, which is
        # ended once its call is done; its slot processes serve as under isolation: worker.
        self.per_call = self.mode == "call"
        # Both hold each process for one use, prepared ahead of it: ended ones go, and the next are prepared, when
        # calls pause (IDLE_RESPAWN_S).
        self.prepared = self.episodes or self.per_call
        self.selector = selectors.DefaultSelector()
        self.loaded: Optional[worker.Loaded] = None
        self.closing = False
        self.runner: Optional[socket.socket] = None
        self.runner_pid = 0
        self.last_call = 0.0  # prepared: when the last call went to a slot process (see IDLE_RESPAWN_S)
        # Indexes of self.slots (an environment's may hold a thousand and more): by process, by request in flight,
        # by the episode each holds; those without a process (but broken ones), those whose episode the host ended.
        self.by_pid: dict[int, _Slot] = {}
        self.by_request: dict[int, _Slot] = {}
        self.holders: dict[str, _Slot] = {}
        self.vacant: set = set(self.slots)
        self.unused: set = set()  # slots whose process never served and is not retiring (ready or being prepared)
        # Prepared (environment, "call"): slots whose process ended and is not yet known to have left nothing (it is
        # not reaped yet, or its leftovers are not yet killed by the slot's next process): no start is dispatched.
        self.cleaning: set = set()
        self.unix_sockets: Optional[sockets.UnixSockets] = None  # for what a process left (see _left_behind)

    # -- life ----------------------------------------------------------------------------------------------------
    def _start_runner(self) -> None:
        """Forks the program runner, with each slot's run uid and directory (before the reward is imported: the
        runner never holds anything of it). A sandbox without run uids gets none: run() fails there."""
        specs = [s.spec for s in self.slots]
        if any(spec.uid is not None and spec.run_uid is None for spec in specs):
            return
        slot_map = {spec.index: RunSlot(uid=spec.run_uid, directory=spec.run_directory, nproc=spec.nproc,
                                        memory=spec.memory, atomic_kill=spec.atomic_kill,
                                        private_tmp=spec.private_tmp) for spec in specs}
        self.runner_pid, self.runner = runner_module.start(slot_map)

    def run(self) -> None:
        if any(s.spec.uid is not None for s in self.slots):
            tree.become_subreaper()  # what slot processes leave behind becomes our child: see _no_strangers
        self._start_runner()
        # here: execution imports the slot module, which imports this one's dependencies
        from ..programs import execution

        # The template runs as root (docker backend): nothing may start programs from it. Slot processes attach.
        execution.attach(None, "rewardbox.sandbox.run cannot run while the reward module is imported (nor outside a "
                               "reward call): call it from the reward function")
        # Everything the import changes that this process's own code would run or call is taken back as soon as
        # it returns, and given back only where reward code runs (import_effects).
        snapshot = import_effects.watch(self.config.filename, refuse_audit_hooks=self.mode != "worker")
        try:
            self.loaded = worker.load(self.config)
        except worker.LoadError as e:
            import_effects.take(snapshot)
            send(self.server, {"op": "load_error", "message": str(e)})
            return
        refused = import_effects.take(snapshot)
        del snapshot
        if refused:
            send(self.server, {"op": "load_error", "message": refused})
            return
        left = self._left_by_import()
        if left:
            send(self.server, {"op": "load_error", "message": f"{self.config.filename}: {left}"})
            return
        if self.mode != "worker":
            try:  # before anything is forked: no sample may share pages with another (see private_memory)
                private_memory.make_private()
            except private_memory.SharedMappingError as e:
                send(self.server, {"op": "load_error", "message": f"{self.config.filename}: {e}; use isolation: "
                                   "worker for a reward that must share memory between its processes"})
                return
        info = self.loaded.info
        send(self.server, {"op": "loaded", "info": {
            "is_async": info.is_async, "accepted_keywords": list(info.accepted_keywords),
            "accepts_var_keywords": info.accepts_var_keywords, "signature": info.signature,
            "required_keywords": list(info.required_keywords)}, "forks": self.forks})
        if info.is_async or (self.episodes and _has_coroutines(self.loaded.fn)):
            import asyncio  # noqa: F401 - here, once, for every slot process (sync rewards never load it)
        if any(s.spec.uid is not None for s in self.slots):
            seccomp.prepare()
            private_tmp.prewarm()
            tree.prewarm()
        if self.forks:
            slots.warm_up(self.loaded)
        if all(s.spec.private_tmp for s in self.slots):  # every slot's home is /tmp: set once, not per process
            os.environ.update(dict.fromkeys(slots.HOME_VARIABLES, private_tmp.PATH))
        gc.freeze()  # the module's objects stay shared with every fork instead of being copied on first touch
        wake_r = tree.sigchld_wakeup()
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(self.server, selectors.EVENT_READ, "server")
        for s in self.slots:
            self._spawn(s)
        due = 0.0  # when the earliest vacant slot is due (_respawn_due): one scan of them a turn of the loop
        while not self.closing:
            for key, _ in self.selector.select(timeout=self._next_timer(due)):
                if key.data == "wake":
                    os.read(wake_r, 4096)
                elif key.data == "server":
                    self._from_server()
                else:
                    self._ready(key.data)
            self._reap()
            self._dispatch()  # requests first: a fork costs the template about a millisecond
            due = self._respawn_due()
            self.namespaces.let_go(time.monotonic() >= self.last_call + IDLE_RESPAWN_S)
        self._kill_all()

    def _left_by_import(self) -> str:
        """Why the reward cannot be served, from what importing it left running in this process ("" where nothing):
        a process (a multiprocessing manager, a server) or a Python thread started at import runs as the sandbox's
        root, outside every slot's uid and seccomp filter, for the sandbox's life, beside every sample, and model
        code reaches it over loopback (a red team ran code as root through a manager's pickles). The processes
        are killed."""
        for _ in tree.exited_children():  # what finished is no concern (a probe run with subprocess)
            pass
        keep = {self.runner_pid} if self.runner_pid else set()
        found = sorted(tree.all_children() - keep)
        threads = _thread._count()
        if not found and not threads:
            return ""
        what = []
        if found:
            shown = ", ".join(f"{pid} ({tree.name_of(pid)})" for pid in found[:5])
            what.append(f"{len(found)} process(es) running ({shown})")
            tree.kill_children(keep)
        if threads:
            what.append(f"{threads} thread(s) running")
        return (f"importing it left {' and '.join(what)}: they would run as the sandbox's root, beside every sample "
                "and reachable by model-written code. Start them inside the reward function instead (they then "
                "run under the sample's own uid, limits and seccomp filter, and end with it; under isolation: "
                "worker they live as long as the worker)")

    def _next_timer(self, due: float) -> Optional[float]:
        """How long the loop may wait for an event: until ``due`` (when the earliest vacant slot is due), or until
        calls pause while it holds ended processes' namespaces; None: until an event comes."""
        if not self._may_spawn():
            return None  # what ends the wait (a slot exits or gets ready, a request arrives) wakes the selector
        if self.namespaces.held:
            due = min(due, self.last_call + IDLE_RESPAWN_S)
        return None if due == math.inf else max(0.0, due - time.monotonic())

    def _short(self) -> int:
        """Style environment: how many processes the reserve (RESERVE_FRACTION of the slots, at least MIN_RESERVE)
        lacks; those that are fresh (ready, never served) or being prepared count. 0 for other styles."""
        if not self.prepared:
            return 0
        reserve = math.ceil(max(MIN_RESERVE, RESERVE_FRACTION * len(self.slots)))
        return max(0, reserve - len(self.unused))

    def _earliest(self) -> tuple[float, Optional[_Slot]]:
        """(When the earliest vacant slot (its process gone) is due to get its next one, that slot), or (inf, None)
        where none is vacant. Each slot is due at its ``respawn_at``; but in an environment's (or "call"'s) sandbox
        whose reserve is not short, a slot whose last process left nothing waits for calls to pause
        (IDLE_RESPAWN_S), at most MAX_RESPAWN_DELAY_S."""
        best, chosen = math.inf, None
        waits = self.prepared and not self._short()
        idle = self.last_call + IDLE_RESPAWN_S
        for s in self.vacant:
            due = s.respawn_at
            if waits and s.cleaned and not s.urgent:
                due = max(due, min(idle, due + MAX_RESPAWN_DELAY_S))
            if due < best:
                best, chosen = due, s
        return best, chosen

    def _may_spawn(self) -> bool:
        """Whether to fork slot processes now: always, but while closing. A slot's next process is what cleans up
        after its last one (kills what it left, removes its files and IPC objects), so it is forked as soon as the
        last one is gone: nothing a finished sample left may live on beside the samples still running."""
        return not self.closing

    # -- slot processes ------------------------------------------------------------------------------------------
    def _run_channel(self, s: _Slot) -> Optional[socket.socket]:
        """A new socket to the runner for slot ``s``'s next process (None without a runner)."""
        if self.runner is None:
            return None
        slot_end: Optional[socket.socket]
        runner_end, slot_end = pair()
        try:
            send(self.runner, {"slot": s.spec.index}, fds=[runner_end.fileno()])
        except OSError:  # the runner is gone: run() fails in this slot process, clearly
            slot_end.close()
            slot_end = None
        runner_end.close()
        return slot_end

    def _no_strangers(self) -> bool:
        """Whether every child of this template is one it knows (a slot process or the runner). Every process of a
        slot's uid descends from a slot process this template forked (its first process for that uid killed
        whatever an earlier holder of the uid left): when one dies, its orphans become our children (we are their
        subreaper), and no process can leave that tree (ptrace is refused to samples). So with no stranger among
        our children, a uid whose last process we reaped has no process left anywhere."""
        return self._strangers() == set()

    def _strangers(self) -> Optional[set]:
        """This template's children that are neither a slot process nor the runner (None: it cannot tell). Every
        process it knows is its child until it is reaped (each leaves ``by_pid`` as it is reaped, the runner's pid
        is forgotten then), so where the kernel lists as many children as it knows, none is a stranger: counted
        without reading the pids, as the template does after each ended episode or call, with a thousand children."""
        listing = tree.children_listing()
        if listing is None:
            return None
        pids = listing.split()
        if len(pids) == len(self.by_pid) + (1 if self.runner_pid else 0):
            return set()
        return {int(pid) for pid in pids} - set(self.by_pid) - {self.runner_pid}

    def _spawn(self, s: _Slot) -> None:
        if s.spec.uid is not None:
            s.spec = dataclasses.replace(s.spec, known_clean=s.cleaned and self._no_strangers())
        parent_end, child_end = pair()
        run_end = self._run_channel(s)
        try:
            pid = os.fork()
        except OSError:  # the pids limit: try again shortly
            for end in (parent_end, child_end, run_end):
                if end is not None:
                    end.close()
            s.respawn_at = time.monotonic() + RESPAWN_BACKOFF_S
            return
        if pid == 0:
            parent_end.close()
            assert self.loaded is not None  # loaded before any slot is spawned
            slots.run(self.loaded, s.spec, child_end, "worker" if self.per_call else self.mode,
                      run_end)  # never returns
        child_end.close()
        if run_end is not None:
            run_end.close()
        s.pid, s.control, s.ready = pid, parent_end, False
        self.by_pid[pid] = s
        self.vacant.discard(s)
        self.unused.add(s)
        self.selector.register(parent_end, selectors.EVENT_READ, s)

    def _ready(self, s: _Slot) -> None:
        """The slot's one message, written before any reward code ran: ready, or why not."""
        message = b""
        assert s.control is not None  # registered with the selector once it had one (_spawn)
        try:
            while len(message) < len(slots.READY):
                chunk, fds, _, _ = socket.recv_fds(s.control, slots.MAX_REASON + 1, 1)
                for fd in fds:  # its mount namespace, sent with the ready byte (slot.own_namespace)
                    self.namespaces.release(s.namespace)
                    s.namespace = fd
                if not chunk:
                    break
                message += chunk
                if message[:1] == slots.FAILED:
                    break
        except OSError:
            pass
        self.selector.unregister(s.control)
        if message == slots.READY:
            s.ready, s.setup_failures, s.cleaned = True, 0, True
            s.urgent = False
            self.cleaning.discard(s)  # it killed what the uid's last process left
            # From here on reward code may run in that process: nothing it writes is read.
            s.control.shutdown(socket.SHUT_RD)
        elif message[:1] == slots.FAILED:
            s.last_failure = message[1:].decode("utf-8", "replace")

    def _reap(self) -> None:
        for pid, status in tree.exited_children():
            s = self.by_pid.get(pid)
            if s is not None:
                self._ended(s, status)
            elif pid == self.runner_pid:  # run() fails in slot processes from now on (its socket closed)
                self.runner_pid = 0

    def _ended(self, s: _Slot, status: int) -> None:
        if s.spec.uid is None:  # the local backend: what it forked is in its process group
            try:
                os.killpg(s.pid, signal.SIGKILL)
            except OSError:
                pass
        for request in sorted(s.requests):
            send(self.server, {"op": "exited", "req": request, "status": tree.describe_status(status)})
            self.by_request.pop(request, None)
        self.by_pid.pop(s.pid, None)
        self.unused.discard(s)
        self.namespaces.release(s.namespace)
        s.namespace = None
        if s.episode is not None and self.holders.get(s.episode) is s:
            del self.holders[s.episode]
        self.vacant.add(s)
        if self.prepared and (s.served or s in self.cleaning):
            s.urgent = self._left_behind(s)
            if not s.urgent:
                self.cleaning.discard(s)
            else:
                self.cleaning.add(s)
        served = bool(s.requests) or s.ready or s.served
        if s.control is not None:
            if s.control.fileno() in self.selector.get_map():
                self.selector.unregister(s.control)
            s.control.close()
        s.pid, s.control, s.ready, s.retiring, s.requests, s.served = 0, None, False, False, set(), False
        s.episode = None  # its episode, if any, is gone with it: its later calls fail (_slot_for)
        if not served:
            s.setup_failures += 1
            if s.setup_failures >= MAX_SETUP_FAILURES:
                s.broken = True
                self.vacant.discard(s)
                # Not waited for: its next processes could not be prepared (their first step as the uid kills what
                # the uid's last one left; a step before it fails for reasons of the sandbox, not of reward code).
                self.cleaning.discard(s)
                why = s.last_failure or f"its process died before it was ready ({tree.describe_status(status)})"
                send(self.server, {"op": "slot_failed", "slot": s.spec.index, "reason": why})
                return
        s.respawn_at = time.monotonic() + (RESPAWN_BACKOFF_S * s.setup_failures if s.setup_failures else 0)

    def _respawn_due(self) -> float:
        """Forks one slot process that is due; the next waits for the next turn of the loop (which does not wait
        then), so requests that arrive meanwhile are dispatched between forks. Returns when the earliest vacant
        slot is due (now, after a fork: another may be due too)."""
        if not self._may_spawn():
            return math.inf
        due, s = self._earliest()
        now = time.monotonic()
        if s is not None and due <= now:
            self._spawn(s)
            return now
        return due

    def _kill_all(self) -> None:
        for s in self.slots:
            if s.pid:
                try:
                    os.kill(s.pid, signal.SIGKILL)
                except OSError:
                    pass

    # -- requests ------------------------------------------------------------------------------------------------
    def _from_server(self) -> None:
        try:
            message, fds = recv(self.server)
        except (ChannelClosed, OSError, ValueError):
            self.closing = True
            return
        op, request = message.get("op"), message.get("req")
        if op == "run":
            fd = optional_fd(fds)
            if fd is not None:
                self.queue.append((request, fd, message.get("episode"), bool(message.get("start"))))
        elif op == "end":  # the host is done with an episode: its process goes, and a fresh one is prepared
            episode = message.get("episode")
            s = self.holders.pop(episode, None) if self.episodes and isinstance(episode, str) else None
            if s is not None:
                self._end_episode(s)
        elif op == "done":  # the server read the request's answer; ``retire``: the process must not serve again
            # Or it gave up on it while it waited here for a process (its caller went away): it never runs (an
            # episode it would start would hold a process no one ends).
            for entry in [e for e in self.queue if e[0] == request]:
                self.queue.remove(entry)
                os.close(entry[1])
            s = self.by_request.pop(request, None) if isinstance(request, int) else None
            if s is not None:
                s.requests.discard(request)
                if self.prepared and (message.get("retire") or self.per_call):  # (its one call is done)
                    self._end_episode(s)
                elif message.get("retire") and s.pid:
                    s.retiring = True
                    self.unused.discard(s)
                    try:
                        os.kill(s.pid, signal.SIGKILL)
                    except OSError:
                        pass
        elif op == "kill":
            s = self.by_request.get(request) if isinstance(request, int) else None
            if s is not None and self.prepared:
                self._end_episode(s)
            elif s is not None and s.pid:
                try:
                    os.kill(s.pid, signal.SIGKILL)
                except OSError:
                    pass
        elif op == "close":
            self.closing = True

    def _end_episode(self, s: _Slot) -> None:
        """The episode slot ``s`` holds (or its one call) is over: its process is killed, and no episode or call
        starts until it is reaped and found to have left nothing (:meth:`_left_behind`)."""
        if not s.pid:
            return
        s.retiring = True
        self.unused.discard(s)
        self.cleaning.add(s)
        try:
            os.kill(s.pid, signal.SIGKILL)
        except OSError:
            pass

    def _left_behind(self, s: _Slot) -> bool:
        """Whether the process of slot ``s`` that was just reaped may have left something of its uid: a process (its
        orphans are this template's children now: it is their subreaper), or a Unix socket (open in such a process,
        or in flight, which may hold a TCP port or a socket's name). Always where the kernel cannot tell (gVisor:
        no atomic kill(-1), no sock_diag)."""
        uid = s.spec.uid
        if uid is None or not s.spec.atomic_kill:
            return uid is not None
        strangers = self._strangers()
        if strangers is None:
            return True
        for pid in strangers:
            try:
                with open(f"/proc/{pid}/status", "rb") as f:
                    if b"\nUid:\t%d\t" % uid in f.read():
                        return True
            except OSError:
                continue  # gone (and reaped by the next _reap)
        if self.unix_sockets is None:
            self.unix_sockets = sockets.UnixSockets(uid)
        self.unix_sockets.uid = uid  # one sock_diag socket, for each slot's uid in turn
        try:
            return self.unix_sockets.listed() != set()
        except OSError:
            return True

    def _free_slot(self) -> Optional[_Slot]:
        candidates = [s for s in self.slots if s.ready and s.pid and not s.retiring]
        if self.mode != "worker":  # one request at a time per process
            return next((s for s in candidates if not s.requests), None)
        assert self.loaded is not None  # loaded before any slot is spawned
        if not self.loaded.info.is_async:
            candidates = [s for s in candidates if not s.requests]
        return min(candidates, key=lambda s: len(s.requests), default=None)

    def _slot_for(self, episode: Optional[str], start: bool) -> tuple[Optional[_Slot], bool]:
        """Style environment: (the slot to run an episode's call in, or None to wait; whether the episode is gone).
        A call that starts an episode takes a ready process that never served (one is prepared ahead for each
        slot); any other goes to the process holding its episode once that one is idle. An episode no process holds
        (its process died or was ended) is gone: its calls fail until the host starts another."""
        if start:
            return next((s for s in self.unused if s.ready), None), False
        holder = self.holders.get(episode) if episode is not None else None
        if holder is None or not holder.pid or holder.retiring:
            return None, True
        return (holder if holder.ready and not holder.requests else None), False

    def _dispatch_episodes(self) -> None:
        """Style environment, and isolation "call" (where every call starts in a process of its own)."""
        waiting: collections.deque = collections.deque()
        while self.queue:
            request, fd, episode, start = entry = self.queue.popleft()
            start = start or self.per_call
            if start and self.cleaning:  # a process that ended may have left something: nothing starts beside it
                waiting.append(entry)
                continue
            s, gone = self._slot_for(episode, start)
            if gone:  # the server reads the end of the socket, and why
                send(self.server, {"op": "exited", "req": request, "status": "the process that held its episode "
                                                                             "is gone (it timed out, crashed or "
                                                                             "was ended)"})
                os.close(fd)
                continue
            if s is None:
                waiting.append(entry)
                continue
            assert s.control is not None  # a ready slot's process has its control socket
            try:
                send(s.control, {"req": request}, fds=[fd])
            except OSError:  # it died just now: the episode is gone (a start waits for the next fresh one)
                s.ready = False
                waiting.append(entry) if start else os.close(fd)
                continue
            os.close(fd)
            s.requests.add(request)
            self.by_request[request] = s
            s.served = True
            self.unused.discard(s)
            self.last_call = time.monotonic()
            if start and episode is not None:
                earlier = self.holders.get(episode)
                if earlier is not None:  # one process per episode id: a second start of it ends the first
                    self._end_episode(earlier)
                s.episode = episode
                self.holders[episode] = s
        self.queue = waiting

    def _dispatch(self) -> None:
        if self.prepared:
            self._dispatch_episodes()
            return
        while self.queue:
            s = self._free_slot()
            if s is None:
                return
            request, fd, _, _ = self.queue.popleft()
            assert s.control is not None  # a ready slot's process has its control socket
            try:
                send(s.control, {"req": request}, fds=[fd])
            except OSError:  # it died just now; the request goes to the next slot
                self.queue.appendleft((request, fd, None, False))
                s.ready = False
                continue
            os.close(fd)
            s.requests.add(request)
            self.by_request[request] = s
            s.served = True
            self.unused.discard(s)
            if self.one_request:
                s.ready = False


def _has_coroutines(factory) -> bool:
    """Whether an environment's class (or a partial of it) has async methods: its episodes' processes then run them
    on an event loop (:func:`.worker._episode_call`), whose module is loaded here once rather than in each."""
    import inspect

    cls = getattr(factory, "func", factory)
    return inspect.isclass(cls) and any(inspect.iscoroutinefunction(f) for _, f in inspect.getmembers(cls))


def run(config: WorkerConfig, slot_specs: list[slots.SlotSpec], server: socket.socket) -> None:
    """The whole life of a template process; never returns."""
    code = 0
    try:
        tree.set_name("rbx-template")
        Template(config, slot_specs, server).run()
    except BaseException as e:  # noqa: BLE001 - the server sees the socket close
        code = 70
        try:
            os.write(2, f"rewardbox template {config.name}: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)
