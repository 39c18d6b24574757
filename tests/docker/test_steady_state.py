"""isolation: sample in steady state: after hundreds of samples per pool, a hostile completion changes no other
sample's score through state the reward itself keeps, of the kinds no audit event or state snapshot reports (a
decimal context's sticky flags, an lru_cache's keys, a parser object's buffer, a module global a YAML gadget sets,
a dict the reward module holds, a page of shared memory it mapped at import, a signal handler it installed), nor
through reward code its import hooked into the interpreter (audit, trace, profile and fork hooks, replaced functions
of the modules the sandbox's own code calls). Real containers, runc and gVisor.

Every pool first scores 5 x 64 neutral samples (past any warm-up a pool could have): the sync cases share one reward
(``steady``, which calls the case's own function, named by the example's ``case`` column), so that one warm-up
serves them all, and every case's innocents are among its samples; the async case has its own. Then each case:
``[hostile] + [innocent] * 7`` in one call and ``[innocent] * 4`` in the next; every innocent must score exactly what
it scores alone. These broke under the process reuse of stop 38 (the red team of #40): every innocent after the
hostile one scored 0.0.
"""

from __future__ import annotations

import asyncio

import pytest

from rewardbox import RewardLoadError, build_samples
from rewardbox.wire import Status
from tests.docker.conftest import sandboxes_on_runtime

REWARDS = '''
import decimal
import fcntl
import functools
import json
import math
import mmap
import os
import signal
import sys
import time
from html.parser import HTMLParser

import yaml


def decimal_answer(prompt, completion, example):
    """Exact decimal answers only: an answer the context cannot hold exactly scores 0."""
    value = decimal.Decimal(completion.strip()).normalize()  # in the thread's context: Inexact is sticky there
    with decimal.localcontext() as ctx:  # a copy of it, flags included
        if ctx.flags[decimal.Inexact]:
            return 0.0
    return 1.0 if value == decimal.Decimal(example["answer"]) else 0.0


@functools.lru_cache(maxsize=None)
def same_answer(predicted, reference):
    return predicted == reference and type(predicted) is type(reference)


def cached(prompt, completion, example):
    """(True, "1") == (1, "1") and they hash alike: whichever comes first answers for the other."""
    return 1.0 if same_answer(json.loads(completion)["answer"], json.loads(example["answer"])) else 0.0


class _Answers(HTMLParser):
    def __init__(self):
        super().__init__()
        self.inside, self.found = False, []

    def handle_starttag(self, tag, attrs):
        self.inside = tag == "answer"

    def handle_endtag(self, tag):
        self.inside = False

    def handle_data(self, data):
        if self.inside:
            self.found.append(data)


PARSER = _Answers()  # one parser for the module: fed each completion


def parsed(prompt, completion, example):
    PARSER.found = []
    PARSER.feed(completion)
    return 1.0 if PARSER.found and PARSER.found[-1].strip() == example["answer"] else 0.0


def yaml_area(prompt, completion, example):
    """A reward that trusts its YAML (UnsafeLoader calls any function of an imported module, no audit event)."""
    data = yaml.load(completion, Loader=yaml.UnsafeLoader)
    return 1.0 if abs(float(data["area"]) - math.pi * 4) < 1e-6 else 0.0


def yaml_depth(prompt, completion, example):
    """The depth of a nested YAML answer."""
    data = yaml.load(completion, Loader=yaml.UnsafeLoader)
    depth = 0
    while isinstance(data, list) and data:
        data, depth = data[0], depth + 1
    return float(depth)


WEIGHTS = {"correct": 1.0}
SHARED = mmap.mmap(-1, 4096)  # MAP_SHARED: every process forked from the template would write the same page


STATE = {"seen": []}


async def remembers(prompt, completion, example):
    """An async reward that keeps what it saw in a nested list (no top-level name or size changes)."""
    STATE["seen"].append(completion)
    return float(len(STATE["seen"]))


def shared(prompt, completion, example):
    """Runs the completion; its module keeps a page of shared memory."""
    namespace = {}
    exec(completion, namespace)
    return 0.0 if SHARED[0] else float(namespace.get("score", 0.0))


POKED = []


def _poked(signum, frame):
    POKED.append(signum)


signal.signal(signal.SIGUSR1, _poked)  # installed at import, as a reward's own debugging hook would be


def signalled(prompt, completion, example):
    """Scores 1 where its module's handler is in place and has never run. The hostile signals the process that
    forked it: a handler run there would change what every later sample starts from."""
    if completion == "poke":
        os.kill(os.getppid(), signal.SIGUSR1)
        time.sleep(0.5)
    return (1.0 if signal.getsignal(signal.SIGUSR1) is _poked else 0.0) - len(POKED)


# Where the template may write a file (the root file system is read-only; /dev is a tmpfs under runc and gVisor)
_TABLE_PATH = "/dev/shm/rbx-table.bin" if os.path.isdir("/dev/shm") else "/dev/rbx-table.bin"
with open(_TABLE_PATH, "wb") as _f:
    _f.write(b"\\x01" * mmap.PAGESIZE)
with open(_TABLE_PATH, "r+b") as _f:  # opened for writing, mapped read-only: a fork could make it writable
    TABLE = mmap.mmap(_f.fileno(), 0, access=mmap.ACCESS_READ)


def mapped(prompt, completion, example):
    """Reads a table its import mapped; runs model-written code first."""
    exec(completion, {})
    return float(TABLE[0])


def steady(prompt, completion, example):
    """The sync cases' rewards behind one function: the one the example's case column names."""
    return globals()[example["case"]](prompt, completion, example)


def stdin_flags(prompt, completion, example):
    """1 where its standard input is as a fresh process has it; runs model-written code first."""
    exec(completion, {})
    return 0.0 if fcntl.fcntl(0, fcntl.F_GETFL) & (os.O_NONBLOCK | os.O_APPEND) else 1.0


def weighted(prompt, completion, example):
    """Evaluates model-written arithmetic with the reward's weights in scope."""
    return float(eval(completion, {"__builtins__": {}}, {"W": WEIGHTS}))
'''

# name: (hostile completion, innocent completion, the innocent's example answer, what the innocent scores alone)
CASES = {
    "decimal_answer": ("1.2345678901234567890123456789012345", "0.25", "0.25", 1.0),
    "cached": ('{"answer": true}', '{"answer": 1}', "1", 1.0),
    "parsed": ("<answer>4</answer><!-- ", "<answer>4</answer>", "4", 1.0),
    "yaml_area": ("area: !!python/object/apply:setattr [!!python/module:math '', pi, 3.0]", "area: 12.566370614359172",
                  "", 1.0),
    "yaml_depth": ("a: !!python/object/apply:sys.setrecursionlimit [60]", "[" * 40 + "1" + "]" * 40, "", 40.0),
    "weighted": ('W.__setitem__("correct", 0.0) or 1', 'W["correct"]', "", 1.0),
    "remembers": ("anything", "something else", "", 1.0),
    "signalled": ("poke", "innocent", "", 1.0),
    "mapped": ("import ctypes\nlibc = ctypes.CDLL(None)\nfor line in open('/proc/self/maps'):\n"
               "    if line.rstrip().endswith('rbx-table.bin'):\n"
               "        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
               "        if libc.mprotect(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 3) == 0:\n"
               "            ctypes.memset(lo, 0, 1)", "pass", "", 1.0),
    "stdin_flags": ("import fcntl, os\nfcntl.fcntl(0, fcntl.F_SETFL, os.O_NONBLOCK | os.O_APPEND)", "pass", "", 1.0),
    "shared": ("import sys\nnext(m for m in list(sys.modules.values()) if hasattr(m, 'SHARED')).SHARED[0] = 1\n"
               "score = 1.0", "score = 1.0", "", 1.0),
}


# The reward each case runs under, and the cases of each: the sync ones share ``steady`` (one pool to warm up);
# ``remembers`` is async, and async rewards run another path in the sample's process.
POOLS = {"steady": [name for name in CASES if name != "remembers"], "remembers": ["remembers"]}
REWARD_OF = {name: reward for reward, names in POOLS.items() for name in names}


@pytest.fixture(scope="module", params=["runc", "runsc"])
def sandboxes(request, tmp_path_factory, docker_client, base_image):
    common = {"timeout_s": 5.0, "workers": 2, "cpus": 2, "default_score": -5.0, "retries": 1, "packages": ["pyyaml"]}
    started = sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, REWARDS,
                                   [{"name": reward, **common} for reward in POOLS])
    try:
        for _ in range(5):  # steady state: hundreds of samples through each pool first, every case's innocents
            for names in POOLS.values():
                cases = [names[i % len(names)] for i in range(64)]
                warm = score(started, cases, [CASES[case][1] for case in cases])
                assert warm.values == [CASES[case][3] for case in cases], (warm.values, warm.errors[:2])
        yield started
    finally:
        started.stop()


def score(sandboxes, cases: list, completions: list):
    """The report of ``completions``, each scored by its case's reward (all of one pool)."""
    (reward,) = {REWARD_OF[case] for case in cases}
    samples = build_samples(["p"] * len(completions), completions,
                            {"answer": [CASES[case][2] for case in cases], "case": cases})
    return asyncio.run(sandboxes[reward].client.score(samples))


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_completion_changes_no_later_samples_score_through_the_rewards_own_state(sandboxes, name):
    hostile, innocent, answer, alone = CASES[name]
    assert score(sandboxes, [name], [innocent]).values == [alone]
    own = score(sandboxes, [name], [hostile])  # what the hostile completion scores alone
    # (its pool has scored hundreds of samples: the fixture's)
    batch = score(sandboxes, [name] * 8, [hostile] + [innocent] * 7)
    assert list(zip(batch.values, batch.statuses)) == [(own.values[0], own.statuses[0])] + [(alone, Status.OK)] * 7, \
        (batch.values, batch.errors)
    after = score(sandboxes, [name] * 4, [innocent] * 4)
    assert list(zip(after.values, after.statuses)) == [(alone, Status.OK)] * 4, (after.values, after.errors)


def test_a_multiprocessing_manager_started_at_import_fails_the_load(docker_sandboxes):
    # It would run as the sandbox's root beside every sample: a completion that holds its authkey (every process
    # forked from the template does) sends it a pickle that runs as root (red team of #40). The load fails instead,
    # naming the file and the fix.
    code = """
    from multiprocessing.managers import SyncManager
    MANAGER = SyncManager(address=("127.0.0.1", 0))
    MANAGER.start()
    CACHE = MANAGER.dict()
    def cached(prompt, completion, example):
        return CACHE.get(completion, 0.0)
    """
    with pytest.raises(RewardLoadError, match=r"cached.py: importing it left 1 process\(es\) running .* as the "
                                              r"sandbox's root"):
        docker_sandboxes([{"name": "cached", "code": code}])


# Reward code the import hooked into the interpreter or into the modules the sandbox's own code calls: each hook
# notes where it ran. A note made by a process other than the sample's own, after the import, is reward code that ran
# in the template or a slot process (which outlive samples, and fork the later ones): before import_effects, every
# sample saw them (the slot process's cleanup called the patched os functions with the names a sample chose).
HOOKED = """
import builtins, gc, os, select, selectors, signal, socket, struct, sys, threading, time

_getpid = os.getpid
TEMPLATE = _getpid()  # the process that imports the reward, and forks the slot processes
ARMED = False
SEEN = []


def _note(what):
    if ARMED:
        SEEN.append((_getpid(), what))


def _patched(owner, name):
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        _note(name)
        return original(*args, **kwargs)

    setattr(owner, name, patched)
    return owner, name, patched


PATCHED = [_patched(owner, name) for owner, names in (
    (os, ("unlink", "rmdir", "rename", "scandir", "listdir", "open", "close", "read", "write", "kill", "killpg",
          "waitpid", "wait4", "waitstatus_to_exitcode", "fork", "stat", "lstat", "fstat", "statvfs", "setsid",
          "getpid", "getppid", "sched_getaffinity", "sysconf")),
    (socket.socket, ("sendall", "sendmsg", "recv", "recv_into", "recvmsg", "close", "detach", "fileno")),
    (socket, ("socketpair",)), (select, ("select", "poll", "epoll")), (selectors.DefaultSelector, ("select",)),
    (signal, ("signal", "getsignal", "set_wakeup_fd", "pthread_sigmask", "setitimer")),
    (time, ("monotonic", "sleep", "process_time", "time")), (struct, ("pack", "unpack", "pack_into", "unpack_from")),
    (builtins, ("len", "isinstance", "open", "print", "sorted")),
) for name in names if hasattr(owner, name)]


def _trace(frame, event, arg):
    _note("trace")


def _profile(frame, event, arg):
    _note("profile")


def _collected(phase, info):
    _note("gc")


def _unraisable(info):
    _note("unraisablehook")


sys.settrace(_trace)
sys.setprofile(_profile)
threading.settrace(_trace)
gc.callbacks.append(_collected)
FORKED_FROM_IMPORT = []
os.register_at_fork(before=lambda: _note("at-fork before"), after_in_parent=lambda: _note("at-fork after_in_parent"),
                    after_in_child=lambda: FORKED_FROM_IMPORT.append(_getpid()))
sys.unraisablehook = sys.excepthook = _unraisable
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as command-line tools do


class _Module(type(os)):  # red team of import_effects: a class is no attribute, and every access went through it
    def __getattribute__(self, name):
        _note(f"os.{name}")
        return super().__getattribute__(name)


class _Environ(type(os.environ)):
    def __getitem__(self, key):
        _note("os.environ")
        return super().__getitem__(key)


os.environ.__class__ = _Environ
os.__class__ = _Module
signal.signal(signal.SIGTERM, _unraisable)  # a signal the sandbox's own processes set for themselves
ARMED = True


def hooked(prompt, completion, example):
    \"\"\"0 where a hook of the import ran in a slot process (one that outlives samples), -1 where one is not in place,
    else 1000 + how many times they ran in the template: before the sandbox takes them back there, once the import
    returned, and never after, so every sample sees the same count.\"\"\"
    me = _getpid()
    outside = sorted({what for pid, what in SEEN if pid not in (me, TEMPLATE)})
    if outside:
        print("ran outside a sample:", outside)
        return 0.0
    in_place = (all(getattr(owner, name) is patched for owner, name, patched in PATCHED) and sys.gettrace() is _trace
                and sys.getprofile() is _profile and _collected in gc.callbacks and sys.unraisablehook is _unraisable
                and signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL
                and signal.getsignal(signal.SIGTERM) is _unraisable
                and type(os) is _Module and type(vars(os)["environ"]) is _Environ
                and FORKED_FROM_IMPORT == [me])  # its process was forked from the import's: its hook ran there
    if not in_place:
        return -1.0
    if completion != "innocent":  # leaves files, directories and a helper process for the cleanup to find
        os.makedirs("rbx-hostile/deeper")
        builtins.open("rbx-hostile/file", "w").write("x")
        if os.fork() == 0:
            time.sleep(30)
            os._exit(42)
    return 1000.0 + sum(1 for pid, _ in SEEN if pid == TEMPLATE)
"""


@pytest.fixture(scope="module", params=["runc", "runsc"])
def hooked(request, tmp_path_factory, docker_client, base_image):
    started = sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, HOOKED, [
        {"name": "hooked", "timeout_s": 10.0, "workers": 2, "cpus": 2, "default_score": -5.0, "retries": 1}])
    yield started
    started.stop()


def test_what_the_import_hooked_into_the_interpreter_runs_only_in_the_samples_own_processes(hooked):
    seen = set()
    for _ in range(5):  # steady state: hundreds of samples through the pool, a hostile one in each batch
        completions = ["hostile"] + ["innocent"] * 63
        samples = build_samples(["p"] * 64, completions, {"answer": [""] * 64})
        report = asyncio.run(hooked["hooked"].client.score(samples))
        assert report.statuses == [Status.OK] * 64 and min(report.values) >= 1000.0, \
            (report.values, report.errors[:2], report.logs[-2000:])
        seen.update(report.values)
    assert len(seen) == 1, seen  # the template ran them before its first fork only


def test_an_audit_hook_added_at_import_fails_the_load_unless_the_reward_runs_in_a_worker(docker_sandboxes):
    # An audit hook cannot be removed: added at import, it would run in the slot process, which cleans up after
    # every sample with the names that sample chose, and keep what it saw for every later one (red team of #40:
    # every innocent after one hostile completion scored 0.0). Refused, naming the line and the fix.
    code = """
    import sys
    EVENTS = []
    sys.addaudithook(lambda event, args: EVENTS.append(event) if event == "os.remove" else None)
    def audited(prompt, completion, example):
        return 0.0 if EVENTS else 1.0
    """
    with pytest.raises(RewardLoadError, match=r"audited.py:4: importing it adds an audit hook \(sys.addaudithook\)"
                                              r".* use isolation: worker"):
        docker_sandboxes([{"name": "audited", "code": code}])
    started = docker_sandboxes([{"name": "audited", "code": code, "isolation": "worker"}])
    samples = build_samples(["p"] * 4, ["c"] * 4, {})
    assert asyncio.run(started["audited"].client.score(samples)).values == [1.0] * 4
