"""A slot process: the process that runs reward code on samples, under a uid and in a scratch directory of its own.

A template forks it and it prepares itself, in this order, before any reward code runs (until then it is trusted
code of ours):

1. a session of its own, default signal handlers, stdin/stdout/stderr on /dev/null, every inherited descriptor
   closed but its control socket;
2. the slot's uid (docker backend: the container starts as root holding only SETUID, SETGID and KILL; after
   ``setuid`` no capability is left, so it can signal, trace or write into nothing of the server's or the other
   slots');
3. limits: RLIMIT_NPROC (a fork bomb stops there, the other samples can still fork), no core files, and
   ``oom_score_adj`` 1000 (the OOM killer takes a sample before the server);
4. whatever an earlier process of this uid left is removed: every process (``setsid`` daemons included), the
   contents of the scratch directory, and (once freed: a port they hold) its sockets left in flight
   (:meth:`..memory.sockets.UnixSockets.wait_for_in_flight`). It needs no SysV IPC objects or message queues
   removed: the seccomp filter (step 5) refuses them to every process of a slot's uid;
5. docker backend: its scratch directory is mounted on ``/tmp`` in a mount namespace of its own
   (:mod:`..confine.private_tmp`) where the container allows it;
6. cwd, HOME and TMPDIR are the scratch directory (``/tmp`` where it is mounted there).

Then it sends the template one byte (ready) and waits for request sockets. ``isolation: sample``: it runs each
unit (a sample; a whole call, for batch style) in a child of its own (:mod:`.forked`) and runs no reward code on
data itself, so every unit starts from the module's state after import; where it cannot fork (gVisor, the local
backend), and under ``isolation: process``, it scores one unit itself and exits. ``isolation: worker``: it serves
requests for its whole life, with one event loop for async functions.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ...wire import Outcome, Status, trainer_state_from_dict
from ..confine import private_tmp, seccomp
from ..memory import sockets
from ..programs import execution
from ..programs import run_requests
from ..protocol import codec, stream
from ..protocol.channel import ChannelClosed, optional_fd, recv
from ..protocol.records import SampleBatch
from . import cpu_wait, forked, import_effects, tree, worker
from .tree import die_with_parent, empty, kill_uid

READY = stream.SlotMarker.READY
FAILED = stream.SlotMarker.FAILED  # followed by why (UTF-8, at most MAX_REASON bytes), before the process exits
MAX_REASON = 2000


@dataclass(frozen=True)
class SlotSpec:
    """One slot: its uid (None: the server's own, for the local backend) and scratch directory."""

    index: int
    uid: Optional[int]
    directory: str
    nproc: Optional[int] = None  # RLIMIT_NPROC for its uid
    memory: Optional[int] = None  # RLIMIT_AS of each of its processes, bytes
    atomic_kill: bool = False  # the kernel signals kill(-1) atomically against fork (Linux; not gVisor)
    run_uid: Optional[int] = None  # the uid of the programs its reward code runs (rewardbox.sandbox.run)
    run_directory: str = ""  # their scratch directory
    # The template proved that no process of this uid is left (see Template._no_strangers): the cleanup needs no
    # kill or /proc scan.
    known_clean: bool = False
    # How its processes get a private /tmp (see private_tmp.py): "userns", "mount", or "" (none: /tmp read-only)
    private_tmp: str = ""


def _set_oom_score_adj(value: int) -> None:
    # Before dropping privileges: afterwards this process is no longer dumpable and the file is root's.
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


SAMPLE_NICE = 19
HOME_VARIABLES = ("HOME", "TMPDIR", "PWD")
SAMPLE_OPEN_FILES = 512  # a slot process's descriptors (its own included): see prepare


def prepare(slot: SlotSpec, control_fd: int, run_fd: Optional[int] = None) -> None:
    """Makes this freshly forked process a slot (see the module docstring).
    ``run_fd``: its socket to the program runner (:mod:`..programs.runner`), kept open for
    :func:`rewardbox.sandbox.run`.

    Raises:
        OSError, RuntimeError: it cannot be prepared; the slot is not used.
    """
    os.setsid()
    tree.set_name("rbx-slot")
    if slot.uid is None:
        # Local backend: nothing reaps by uid, so a slot process must not outlive its template.
        die_with_parent()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    # As in any python3 process: a write to a socket or pipe whose reader is gone raises BrokenPipeError (the reward
    # sees what it would see in-process), and a request the server gave up on ends that request, not this process.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    tree.close_inherited(control_fd, *(() if run_fd is None else (run_fd,)))
    try:
        _set_oom_score_adj(1000)
    except OSError:
        if slot.uid is not None:
            raise
    if slot.uid is not None:
        os.setgroups([])
        # Clean up after the uid's earlier processes while they can neither signal nor trace this one, and with
        # root's group still, which sees all of them in /proc (private_tmp.hide_others: not dumpable, they are
        # hidden from their own uid).
        os.setresuid(slot.uid | tree.REAPER_UID_BIT, slot.uid, 0)
        if not slot.known_clean:
            kill_uid(slot.uid, atomic=slot.atomic_kill)
        # No SysV IPC object or message queue of the uid can exist: the seccomp filter below refuses them to every
        # process of a slot's uid (each descends from a slot process, which installs it before any reward code runs,
        # or fails to start), so none is looked for.
        # Samples yield the CPU to the sandbox's own processes (nice only weighs tasks of the container's own
        # cgroup against each other: the container's share of the machine is unchanged). Whatever a sample leaves
        # spinning cannot slow down the template that cleans up after it, nor the server. From here on, once what
        # the uid's last processes left is killed (at the template's priority): the rest of this preparing yields
        # to the calls in flight too (an environment's next process is prepared while the resets go on).
        os.setpriority(os.PRIO_PROCESS, 0, SAMPLE_NICE)
        # What they left in flight in a cycle is freed first (as after a forked sample: forked.Forker._run): a port,
        # or an unlinked file in the scratch directory, held until then.
        in_flight = sockets.UnixSockets(slot.uid)
        in_flight.wait_for_in_flight()
        in_flight.close()
        empty(slot.directory)
        os.seteuid(0)  # the capabilities return (the saved uid is 0) for the last changes
        os.setresgid(slot.uid, slot.uid, slot.uid)
        if slot.private_tmp == "chroot" and tree.unnamed_bytes(slot.directory):
            private_tmp.renew(slot.uid, slot.directory, executable=False)
        private_tmp.become(slot.private_tmp, slot.uid, slot.directory)  # no capability is left after this
        seccomp.install()  # no SysV IPC, message queues, ptrace, keyrings: for this process and all it starts
    else:
        os.makedirs(slot.directory, mode=0o700, exist_ok=True)
        empty(slot.directory)
    if slot.uid is not None:
        # Files the reward makes are its own alone: its directory is 0700, and the files themselves too, as gVisor
        # lets other uids follow /proc/<pid>/fd links past the directory (a program the reward runs among them).
        os.umask(0o077)
    if slot.nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (slot.nproc, slot.nproc))
    if slot.memory is not None:
        resource.setrlimit(resource.RLIMIT_AS, (slot.memory, slot.memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if slot.uid is not None:
        # What a sample's sockets and pipes hold (kernel memory, in no process's resident set, so the OOM killer
        # would take innocent concurrent samples for it) is bounded by its open files: about 120 MB at most.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        limit = SAMPLE_OPEN_FILES if hard == resource.RLIM_INFINITY else min(SAMPLE_OPEN_FILES, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    home = private_tmp.home(slot.private_tmp, slot.directory)
    os.chdir(home)
    if any(os.environ.get(name) != home for name in HOME_VARIABLES):  # the template set them where it could
        os.environ.update(dict.fromkeys(HOME_VARIABLES, home))
    if slot.uid is not None and run_fd is not None and not _released(run_fd):
        os.close(run_fd)
        run_fd = None
    execution.attach(run_fd, "" if run_fd is not None or slot.uid is None else
                     "this sandbox cannot run programs: it has no uid for them (started without --run-uids) or its "
                     "program runner is gone (see the sandbox's log)")
    worker.install_capture()


def _released(run_fd: int) -> bool:
    """Waits until the program runner holds nothing the slot's last process left there (the socket it served, with
    descriptors a sample sent over it in flight, and their programs): the runner answers on this process's fresh
    socket only once the last one's monitor ended (:func:`..programs.run_requests.release`). Before any reward code
    runs."""
    channel = socket.socket(fileno=run_fd)
    try:
        return run_requests.release(channel)
    finally:
        channel.detach()


async def _receive(recv_into: Callable) -> codec.Request:
    """A request, received straight into a mapping of its own (:class:`..protocol.codec.Request`): its samples' text is
    never in this process's heap. ``recv_into(view)`` is the socket's (awaitable).

    Raises:
        ConnectionError: the request ended early.
    """
    async def fill(view: memoryview) -> None:
        got = 0
        while got < len(view):
            with view[got:] as rest:
                n = await recv_into(rest)
            if not n:
                raise ConnectionError("the request ended early")
            got += n

    prefix = bytearray(codec.SIZE_BYTES)
    with memoryview(prefix) as view:
        await fill(view)
    data = mmap.mmap(-1, codec.request_size(bytes(prefix)))
    with memoryview(data) as view:
        await fill(view)
    return codec.Request(data)


def _receive_blocking(sock: socket.socket) -> codec.Request:
    async def recv_into(view: memoryview) -> int:
        return sock.recv_into(view)

    return _run_coroutine(_receive(recv_into))


def _whole(request: codec.Request) -> tuple:
    """(all of a request's samples, its timeout, its trainer state), for isolation: worker (the samples share a
    process anyway); unmaps the request."""
    try:
        return request.take(range(len(request))), request.timeout_s, request.trainer_state
    finally:
        request.close()


def _answer(loaded: worker.Loaded, sock: socket.socket, result: tuple) -> None:
    outcomes, logs, dropped = result
    payload = codec.encode_result(outcomes, logs, dropped, loaded.config.max_log_bytes)
    try:
        sock.sendall(payload)
    except OSError:
        pass  # the server gave up on this request (its deadline passed)
    sock.close()


def _internal_error(n: int) -> tuple:
    """Every sample's error when something of ours failed around the reward's calls."""
    text = "rewardbox could not run this request: " + traceback.format_exc()[-worker.MAX_ERROR_CHARS:]
    return [Outcome.failed(Status.ERROR, text)] * n, "", 0


def _handle(loaded: worker.Loaded, fd: int) -> None:
    """isolation: worker: one answer for the request's samples."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.sendall(stream.Marker.STARTED)
    request = _receive_blocking(sock)
    batch, timeout_s, state = _whole(request)
    cpu_wait.begin_request()
    try:
        trainer_state = trainer_state_from_dict(state)
        if loaded.info.is_async:
            import asyncio  # preloaded by the template of an async function (see worker); a sync one never needs it

            result = asyncio.run(worker.score_async(loaded, batch, timeout_s, trainer_state))
        else:
            result = worker.score(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001 - reported as these samples' error, not as a crash
        result = _internal_error(len(batch))
    _answer(loaded, sock, result)


def forks(mode: str, slot: SlotSpec) -> bool:
    """Whether a slot process of ``mode`` runs each unit in a child of its own (:mod:`.forked`): ``isolation:
    sample`` where ``kill(-1)`` reaches only the slot's uid (not the local backend's) and all of it at once (not
    gVisor). Elsewhere ``sample`` is ``process``: each unit in a slot process of its own."""
    return mode == "sample" and slot.uid is not None and slot.atomic_kill


def _units(loaded: worker.Loaded, request: codec.Request) -> list:
    """What is scored and answered as one, as the indices of its samples: each sample alone, or all of them (batch
    style: the whole call)."""
    n = len(request)
    return [range(n)] if loaded.config.style == "batch" else [range(k, k + 1) for k in range(n)]


def _score_unit(loaded: worker.Loaded, samples, timeout_s: Optional[float], state) -> tuple:
    """(outcomes, logs, dropped characters) of one unit's ``samples``; an async function's on an event loop of its
    own. ``timeout_s`` None: no timer (a forked child, which its slot process ends at the deadline). Never raises."""
    try:
        if loaded.info.is_async:
            import asyncio  # preloaded by the template of an async function (see worker)

            return asyncio.run(worker.score_async(loaded, samples, timeout_s, state))
        if loaded.config.style == "batch":
            return worker.score(loaded, samples, timeout_s, state)
        # a sample-style unit without a one-sample batch or a coroutine: a regex reward's samples spent a tenth of
        # their time making and running them
        outcome, logs, dropped = worker.score_sample(loaded, samples, 0, timeout_s, state)
        return [outcome], logs, dropped
    except BaseException:  # noqa: BLE001 - reported as these samples' error, not as a crash
        return _internal_error(len(samples))


WARM_UP_UNITS = 16  # enough runs for CPython 3.11 to specialize the path's bytecode


def warm_up(loaded: worker.Loaded) -> None:
    """In the template, before it forks slot processes: runs this module's path for one unit (decode a sample from
    a request's mapping, score it, encode the answer) a few times, with a stand-in for the reward that ignores its
    arguments. The bytecode of that path is then specialized and its allocator pools in place before the forks, so
    that every forked child does not write them again: a page a child writes is a page it copies (about 4 us each,
    and again when it exits). The reward itself is never called here, and no sample exists yet. Sync rewards only
    (an async one's children run an event loop of their own anyway)."""
    if loaded.info.is_async:
        return
    batch_style = loaded.config.style == "batch"

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return [0.0] if batch_style else 0.0

    stub = worker.Loaded(fn=stand_in, info=loaded.info, config=loaded.config)
    one = codec.encode_request(SampleBatch([""], [""], ["{}"], [""], [""], None), 1.0, None)
    for _ in range(WARM_UP_UNITS):
        data = mmap.mmap(-1, len(one) - codec.SIZE_BYTES)
        data[:] = one[codec.SIZE_BYTES:]
        request = codec.Request(data)
        try:
            samples = request.take(_units(stub, request)[0])
        finally:
            request.close()
        outcomes, logs, dropped = _score_unit(stub, samples, None, None)
        codec.encode_result(outcomes, logs, dropped, loaded.config.max_log_bytes, 0.0)


def warm_up_call(loaded: worker.Loaded) -> None:
    """Style environment and isolation "call" (a tool's), in a slot process once prepared, before its ready byte:
    serves one call (the request's socket, its decoding, the call, the answer: :func:`_handle`) to a stand-in for
    the environment (whose instance it then drops) or the tool. The pages that path writes are then this process's
    own when its first real call (an episode's reset, a tool's call) comes: each would be a fault on that call's
    path, a copy of the template's page (about a millisecond in all, measured). No code of the user's runs here."""

    class StandIn:
        def reset(self, **kwargs: Any) -> None:
            return None

    def stand_in(**kwargs: Any) -> str:
        return ""

    environment = loaded.config.style == "environment"
    stub = worker.Loaded(fn=StandIn if environment else stand_in, info=loaded.info, config=loaded.config)
    call = json.dumps({"method": "reset", "args": {}} if environment else {})
    one = codec.encode_request(SampleBatch([""], [""], [call], [""], [""], None), 1.0, None)
    ours, theirs = socket.socketpair()
    try:
        ours.sendall(one)
        ours.shutdown(socket.SHUT_WR)
        _handle(stub, theirs.detach())
        while ours.recv(65536):
            pass
    finally:
        ours.close()
        worker.drop_episode()


def _trainer_state(request: codec.Request) -> Any:
    try:
        return trainer_state_from_dict(request.trainer_state)
    except BaseException:  # noqa: BLE001 - a state this version cannot convert: the reward gets None
        return None


def _score_forked(loaded: worker.Loaded, sock: socket.socket, request: codec.Request, forker: forked.Forker) -> bool:
    """Scores the units of a request in order, each in a child of this process (:mod:`.forked`), which runs no
    reward code on data itself: every unit starts from the state the template left after the import, whatever the
    ones before it did. Each answer is sent from the child's mapping before the next child starts: whatever stalls
    or ends this process then (a child may signal it) is the fault of the first unit the server has no answer for.
    Returns whether this process may serve another request."""
    trainer_state = _trainer_state(request)
    timeout_s, max_log_bytes = request.timeout_s, loaded.config.max_log_bytes
    try:
        sock.sendall(stream.Marker.FORKING)
        forker.arm()
        for k, indices in enumerate(_units(loaded, request)):
            def score(indices=indices) -> bytes:  # in the child
                samples = request.take(indices)
                request.close()  # the other samples' text leaves the child before the reward sees its own
                started = time.perf_counter()
                # No timer of its own (its process's three system calls): forked.Forker ends it at the deadline
                outcomes, logs, dropped = _score_unit(loaded, samples, None, trainer_state)
                return codec.encode_result(outcomes, logs, dropped, max_log_bytes, time.perf_counter() - started)

            def send(answer, retire: Optional[str], k: int = k) -> None:
                forked.send_with_trailer(sock, answer, stream.retire(k, retire) if retire else stream.Marker.CLEAN)

            def waited(ms: int) -> None:
                sock.sendall(stream.waited(ms))

            if forker.run(score, len(indices), timeout_s, max_log_bytes, sock.fileno(), execution.attach_child,
                          send, waited):
                return False
        return True
    except OSError:
        return False  # the server gave up on this request (its deadline passed)
    finally:
        forker.disarm()


def _score_alone(loaded: worker.Loaded, sock: socket.socket, request: codec.Request) -> None:
    """Scores the request's first unit (the server sends one) in this process, which serves no other request: the
    answer alone, nothing after it."""
    cpu_wait.begin_request()
    trainer_state = _trainer_state(request)
    timeout_s, max_log_bytes = request.timeout_s, loaded.config.max_log_bytes
    samples = request.take(_units(loaded, request)[0])
    request.close()  # any other sample's text leaves this process before the reward sees its own
    started = time.perf_counter()
    outcomes, logs, dropped = _score_unit(loaded, samples, timeout_s, trainer_state)
    try:
        sock.sendall(codec.encode_result(outcomes, logs, dropped, max_log_bytes, time.perf_counter() - started))
    except OSError:
        pass  # the server gave up on this request (its deadline passed)


def _handle_stream(loaded: worker.Loaded, fd: int, forker: Optional[forked.Forker] = None) -> bool:
    """isolation: sample and process: a streamed answer (:mod:`..protocol.codec`), each unit in a child with a
    ``forker``, else the request's one unit in this process. Returns whether this process may serve another request."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    try:
        sock.sendall(stream.Marker.STARTED)
        request = _receive_blocking(sock)
        try:
            if forker is not None:
                return _score_forked(loaded, sock, request, forker)
            _score_alone(loaded, sock, request)
            return False
        finally:
            request.close()
    except OSError:
        return False
    finally:
        sock.close()


def _run_coroutine(coroutine) -> Any:
    """Runs a coroutine that never awaits anything (a sync function's units, a blocking receive) without an event
    loop. Returns its value."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a sync reward's units awaited something")


async def _handle_async(loaded: worker.Loaded, fd: int) -> None:
    import asyncio  # preloaded by the template of an async function (see worker)

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    await loop.sock_sendall(sock, stream.Marker.STARTED)
    request = await _receive(lambda view: loop.sock_recv_into(sock, view))
    batch, timeout_s, state = _whole(request)
    try:
        trainer_state = trainer_state_from_dict(state)
        result = await worker.score_async(loaded, batch, timeout_s, trainer_state)
    except BaseException:  # noqa: BLE001
        result = _internal_error(len(batch))
    sock.setblocking(True)
    _answer(loaded, sock, result)


async def _serve_async(loaded: worker.Loaded, control: socket.socket) -> None:
    """isolation: worker with an async function: one event loop for the worker's life, requests concurrently."""
    import asyncio  # preloaded by the template of an async function (see worker)

    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    tasks: set = set()

    def on_request() -> None:
        try:
            _, fds = recv(control)
        except (ChannelClosed, OSError, ValueError):
            loop.remove_reader(control.fileno())
            if not closed.done():
                closed.set_result(None)
            return
        fd = optional_fd(fds)
        if fd is not None:
            task = loop.create_task(_handle_async(loaded, fd))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    control.setblocking(True)  # messages are small: a ready reader is read whole
    loop.add_reader(control.fileno(), on_request)
    await closed


def serve(loaded: worker.Loaded, control: socket.socket, mode: str,
          forker: Optional[forked.Forker] = None, namespace: Optional[int] = None) -> None:
    """Serves request sockets sent over ``control`` (``mode`` is the isolation level): ``worker``, until the
    template goes away; ``sample`` with a ``forker``, each unit in a child (:mod:`.forked`), until a unit leaves
    something no cleanup removes; otherwise (``process``, ``sample`` where slot processes cannot fork) one request.
    ``namespace``: its mount namespace (:func:`own_namespace`), sent to the template with the ready byte."""
    if namespace is None:
        control.sendall(READY)
    else:
        socket.send_fds(control, [READY], [namespace])
        os.close(namespace)
    if mode == "worker" and loaded.info.is_async:
        import asyncio  # preloaded by the template of an async function (see worker)

        asyncio.run(_serve_async(loaded, control))
        return
    while True:
        try:
            _, fds = recv(control)
        except (ChannelClosed, OSError, ValueError):
            return
        fd = optional_fd(fds)
        if fd is None:
            continue
        if mode == "worker":
            _handle(loaded, fd)
            continue
        if forker is None:
            control.close()  # reward code runs in this process: it never holds a channel to the template
        if not _handle_stream(loaded, fd, forker):
            return


def own_namespace(slot: SlotSpec) -> Optional[int]:
    """A descriptor of this process's own mount namespace (``userns``: made by :func:`prepare`), for the template to
    hold (None: it shares the container's). Its namespace is a copy of the container's mounts, one tmpfs per slot
    among them (Docker's ``/tmp/slot-<uid>``: 540 mounts in an environment's sandbox of 512 slots), and the process
    that drops the last reference to it unmounts them all: about a millisecond, in the exit of a slot process
    otherwise, before its parent learns of it; an episode's reset, a tool's next call and a sample's next process
    wait for that exit. Held by the template, the namespace outlives the process, which ends at once; the
    template lets go of it beside its own work (:class:`.template.Namespaces`). What the namespace holds is mounts
    this trusted code made (the process drops every capability in it before any reward code runs, and the seccomp
    filter refuses mounts): none of a sample's data."""
    if slot.private_tmp != "userns" or slot.uid is None:
        return None
    return os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


def run(loaded: worker.Loaded, slot: SlotSpec, control: socket.socket, mode: str,
        run_channel: Optional[socket.socket] = None) -> None:
    """The whole life of a slot process; never returns."""
    code = 0
    try:
        try:
            prepare(slot, control.fileno(), None if run_channel is None else run_channel.detach())
        except BaseException as e:  # noqa: BLE001 - still trusted code here: tell the template why
            code = 70
            reason = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:MAX_REASON]
            try:
                control.sendall(FAILED + reason)
            except OSError:
                pass
            return
        namespace = own_namespace(slot)  # before any reward code runs in this process
        forker = None
        if forks(mode, slot):
            assert slot.uid is not None  # forks() says so
            forker = forked.Forker(close=(control.fileno(),), runner=execution.attached_socket(),
                                   scratch=private_tmp.home(slot.private_tmp, slot.directory),
                                   unix_sockets=sockets.UnixSockets(slot.uid))
        else:
            if (loaded.config.style == "environment" or loaded.config.isolation == "call") and mode == "worker" \
                    and not loaded.info.is_async:
                warm_up_call(loaded)
            import_effects.give_back()  # reward code runs in this process from here on
        serve(loaded, control, mode, forker, namespace)
    except BaseException:  # noqa: BLE001 - reward code ran in this process: nothing it says is reported
        code = 70
    finally:
        os._exit(code)
