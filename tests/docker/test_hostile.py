"""One hostile completion among innocent ones, against a code-executing reward, in real containers (runc and gVisor).

The reward runs ``exec(completion)``: model-written code inside the reward's own call, the case the policy searches
for holes in. Each innocent completion checks, before it scores, that nothing of an earlier or concurrent sample is
visible to it (module state, builtins, environment, files, planted modules, processes), and its value is known
exactly. Every test then asserts: each innocent's exact value with status ok, the guilty sample's status, a wall
time bounded by the timeouts, and a later batch that is entirely healthy. One container lives through all attacks.
"""

from __future__ import annotations

import asyncio
import struct
import textwrap
import time

import pytest
import yaml

from rewardbox import RewardSandboxes, build_samples, load_config
from rewardbox.wire import Status
from tests.conftest import LISTENER_IN_FLIGHT
from tests.docker.conftest import docker_backend

REWARD = '''
import builtins, ctypes, importlib.util, os, sys

SHM_KEY = 0x52425831  # a SysV key a hostile sample may try to leave an object under

SEEN = []  # module state a sample could try to poison for the next ones


def _contamination():
    found = []
    if SEEN:
        found.append(f"module state {SEEN}")
    if getattr(builtins, "planted", None) is not None:
        found.append("builtins")
    if os.environ.get("PLANTED"):
        found.append("environment")
    if os.listdir("."):
        found.append(f"files in the scratch directory: {os.listdir('.')}")
    if importlib.util.find_spec("rbx_planted") is not None:
        found.append("a planted module")
    if os.path.exists("/tmp/rbx_planted_file"):
        found.append("a file in /tmp")
    if ctypes.CDLL(None).shmget(SHM_KEY, 0, 0) >= 0:  # refused (seccomp) or absent: nothing there
        found.append("a SysV shared memory segment")
    me = os.getuid()
    others = []
    # The parent may share the uid: a slot process that runs each sample in a child
    # (rewardbox.sandbox.processes.forked), and runs no reward code itself. Anything else of the uid is a leftover.
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in (os.getpid(), os.getppid()):
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if f"Uid:\\t{me}\\t" in status and "State:\\tZ" not in status:
                others.append(pid)
    if others:
        found.append(f"other processes of this sample's uid: {others}")
    return found


def run(prompt, completion, example):
    found = _contamination()
    SEEN.append(completion[:20])
    if found:
        print("CONTAMINATED:", found)
        return -1.0
    namespace = {}
    exec(completion, namespace)
    return namespace.get("score")
'''

BATCH_REWARD = '''
import os, time

def together(prompts, completions, **kwargs):
    for c in completions:
        if c == "hang":
            while True:
                pass
        if c == "crash":
            os._exit(9)
    return [float(len(completions))] * len(completions)  # a value only this exact batch gives
'''

INNOCENT = [f"score = {i} / 8" for i in range(1, 9)]
EXPECTED = [i / 8 for i in range(1, 9)]
TIMEOUT_S = 3.0


@pytest.fixture(scope="module", params=["runc", "runsc"])
def hostile_sandboxes(request, tmp_path_factory, docker_client, base_image):
    if request.param == "runsc" and "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: start it as scripts/setup.sh does")
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    (root / "exec_reward.py").write_text(textwrap.dedent(REWARD))
    (root / "batch_reward.py").write_text(textwrap.dedent(BATCH_REWARD))
    (root / "config.yaml").write_text(yaml.safe_dump({
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image,
                                                    "runtime": None if request.param == "runc" else "runsc"}},
        "rewards": [{"name": "exec", "source": "exec_reward.py", "function": "run", "timeout_s": TIMEOUT_S,
                     "workers": 2, "retries": 2, "default_score": -5.0, "memory": "1g", "pids": 256},
                    {"name": "batch", "source": "batch_reward.py", "function": "together", "style": "batch",
                     "timeout_s": TIMEOUT_S, "workers": 2, "default_score": -5.0},
                    # the same, for a test that needs a reward whose samples have not run yet
                    {"name": "contended", "source": "exec_reward.py", "function": "run", "timeout_s": TIMEOUT_S,
                     "workers": 2, "retries": 0, "default_score": -5.0, "memory": "1g", "pids": 256},
                    # the same again, for a test whose sample must run forked (under runc a pool's first ones do)
                    {"name": "fresh", "source": "exec_reward.py", "function": "run", "timeout_s": TIMEOUT_S,
                     "workers": 2, "retries": 0, "default_score": -5.0, "memory": "1g", "pids": 256}],
    }))
    config = load_config(root / "config.yaml")
    sandboxes = RewardSandboxes(config, backend=docker_backend(config, docker_client))
    sandboxes.runtime = request.param
    sandboxes.start()
    yield sandboxes
    sandboxes.stop()


def _score(sandboxes, completions, reward: str = "exec"):
    reward = sandboxes[reward]
    return asyncio.run(reward.client.score(build_samples(["p"] * len(completions), completions, {})))


def attack(sandboxes, hostile: str, statuses: set, innocents: int = 6) -> None:
    """A batch with the hostile completion in the middle of innocent ones, then a batch of innocents only."""
    batch = INNOCENT[: innocents // 2] + [textwrap.dedent(hostile)] + INNOCENT[innocents // 2: innocents]
    expected = EXPECTED[: innocents // 2] + [None] + EXPECTED[innocents // 2: innocents]
    started = time.monotonic()
    report = _score(sandboxes, batch)
    elapsed = time.monotonic() - started
    guilty = innocents // 2
    for i, (value, status, error) in enumerate(zip(report.values, report.statuses, report.errors)):
        if i == guilty:
            assert status in statuses, (status, error)
        else:
            assert (value, status) == (expected[i], Status.OK), (i, value, status, error, report.logs[-2000:])
    # the whole batch took about one timeout (two, counting a kill), however hard the sample tried to stall it
    assert elapsed < 3 * TIMEOUT_S + 10, elapsed
    later = _score(sandboxes, INNOCENT)
    assert later.statuses == [Status.OK] * 8 and later.values == EXPECTED, (later.errors, later.logs[-2000:])
    assert "CONTAMINATED" not in later.logs and "CONTAMINATED" not in report.logs


def test_a_sample_cannot_forge_the_answers_of_others_through_any_descriptor(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                os.write(fd, b"RBX1" + b"\\xff" * 256)
            except OSError:
                pass
        score = 100.0
    """, {Status.INVALID})  # it broke its own answer's format: never trusted


def test_a_forged_nan_answer_is_rejected(hostile_sandboxes):
    nan_frame = struct.pack("<4sIQI", b"RBX1", 1, 0, 0) + struct.pack("<BBdIf", 1, 1, float("nan"), 0, 0.0)
    attack(hostile_sandboxes, f"""
        import os, stat
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, {nan_frame!r})
            except OSError:
                pass
        os._exit(0)
    """, {Status.INVALID, Status.CRASH})  # crash: run forked, it holds no socket to the server and exits unanswered


def test_a_sample_cannot_reach_the_server_to_load_its_own_reward(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect("/run/rewardbox/grpc.sock")  # PermissionError: the server's directory is not ours
        score = 100.0
    """, {Status.ERROR})


def test_signals_and_ptrace_reach_no_other_process(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        me = os.getpid()
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            if pid == me:
                continue
            libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        os.kill(-1, signal.SIGKILL)  # everything it may signal: only its own uid (kill(-1) spares the caller)
    """, {Status.OK, Status.ERROR, Status.CRASH})
    # ok or error: gVisor answers kill(-1) with ESRCH when it may signal nothing. crash: the sample ran forked
    # (rewardbox.sandbox.processes.forked) and killed the slot process that forked it, which shares its uid: only its
    # own sample fails, as every innocent above and after it shows.


def test_memory_no_process_holds_cannot_be_made(hostile_sandboxes):
    # A memory file is held by its descriptor, not by a process: 3 GiB of it counted toward no process's memory, and
    # the OOM killer took concurrent innocents instead of the sample that held it (red team). memfd_create is
    # refused (seccomp.py); /tmp is the sample's own tmpfs, of a fixed size.
    attack(hostile_sandboxes, """
        import os
        fd = os.memfd_create("hoard")
        for _ in range(192):
            os.write(fd, bytes(16 << 20))
        score = 100.0
    """, {Status.ERROR})


def test_a_setsid_daemon_burning_cpu_dies_with_its_sample(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    pass
            os._exit(0)
        score = 100.0
    """, {Status.OK})


def test_a_sample_that_dies_beside_its_forks_is_a_crash_not_a_timeout(hostile_sandboxes):
    # Run forked, the sample's process writes a byte into a pipe when it answered; its forks hold that pipe open too.
    # Its death without the byte was seen only once every write end had closed: at the deadline, a `timeout`.
    # Under runc it must run forked (an `error` otherwise: the test would prove nothing), as a pool's first samples do.
    forked = hostile_sandboxes.runtime == "runc"
    report = _score(hostile_sandboxes, [textwrap.dedent(f"""
        import os, signal, time
        if {forked} and open("/proc/self/comm").read().strip() != "rbx-sample":
            raise RuntimeError("not run forked")
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    """), "score = 0.5"], reward="fresh")
    assert report.statuses == [Status.CRASH, Status.OK] and report.values == [-5.0, 0.5], report.errors
    assert "killed by SIGKILL" in report.errors[0], report.errors


def test_a_fork_bomb_stops_at_its_own_limit(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError:
            pass
        score = 100.0
    """, {Status.OK, Status.TIMEOUT})


def test_patched_builtins_globals_and_environment_stay_with_their_sample(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import builtins, os, sys
        builtins.planted = True
        os.environ["PLANTED"] = "1"
        module = next(m for n, m in sys.modules.items() if n.startswith("rewardbox_user_"))
        module.SEEN.append("poison")
        module.run = lambda *args, **kwargs: 0.123
        score = 100.0
    """, {Status.OK})


def test_files_planted_anywhere_writable_never_reach_another_sample(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os
        written = []
        for path in ("/tmp/rbx_planted.py", "/tmp/rbx_planted_file", "rbx_planted.py", "/tmp/random.py",
                     "/run/rewardbox/planted", "/dev/shm/planted", "/var/tmp/planted", os.path.expanduser("~/planted")):
            try:
                with open(path, "w") as f:
                    f.write("score = 99")
                written.append(path)
            except OSError:
                pass
        os.makedirs("deep/er", exist_ok=True)
        os.chmod("deep", 0)  # a subtree its owner made unreadable: the slot's next process empties it anyway
        score = 100.0
    """, {Status.OK})


def test_filling_the_disk_fills_only_the_samples_own_tmpfs(hostile_sandboxes):
    attack(hostile_sandboxes, """
        chunk = b"x" * (1 << 20)
        with open("fill", "wb") as f:
            try:
                for _ in range(2048):  # 2 GiB, far past its 64 MiB
                    f.write(chunk)
            except OSError:
                pass
        score = 100.0
    """, {Status.OK})


def test_a_flood_of_output_is_bounded_and_reaches_no_log(hostile_sandboxes, docker_client):
    container = hostile_sandboxes.replicas["exec"][0].sandbox.container
    before = len(container.logs())
    attack(hostile_sandboxes, """
        import os, sys
        block = "y" * 65536
        for _ in range(160):  # 10 MiB through print, and 10 MiB straight to the descriptors
            print(block)
            os.write(1, block.encode())
            os.write(2, block.encode())
        score = 100.0
    """, {Status.OK})
    assert len(container.logs()) - before < 64 * 1024


@pytest.mark.parametrize("hostile, status", [
    ("class F(float):\n    def __float__(self):\n        raise RuntimeError('no')\nscore = F(1.0)\n", Status.INVALID),
    ("class R:\n    def __repr__(self):\n        raise RuntimeError('no')\nscore = R()\n", Status.INVALID),
    ("print('\\ud800 lone surrogate')\nscore = 1.0\n", Status.OK),
    ("raise ValueError('\\udcff in an error')\n", Status.ERROR),
    ("class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\nraise E()\n", Status.ERROR),
    ("score = 'x' * 10_000_000\n", Status.INVALID),
])
def test_failures_after_the_call_are_the_samples_own(hostile_sandboxes, hostile, status):
    attack(hostile_sandboxes, hostile, {status})


def test_a_sample_that_stops_itself_times_out_alone(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os, signal
        os.kill(os.getpid(), signal.SIGSTOP)
    """, {Status.TIMEOUT})


def test_a_memory_bomb_kills_only_its_sample(hostile_sandboxes):
    attack(hostile_sandboxes, """
        hog = []
        while True:
            hog.append(bytearray(64 << 20))
    """, {Status.CRASH, Status.ERROR})  # the OOM killer (crash) or a MemoryError (error)


def test_a_sample_cannot_read_what_another_process_holds(hostile_sandboxes):
    attack(hostile_sandboxes, """
        import os
        readable = []
        for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
            for what in ("environ", "mem", "fd/0"):
                try:
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        f.read(1)
                    readable.append((pid, what))
                except OSError:
                    pass
        score = float(len(readable))  # whatever it found (its own children only) changes nothing of others
    """, {Status.OK})


@pytest.mark.parametrize("guilty, status", [("hang", Status.TIMEOUT), ("crash", Status.CRASH)])
def test_a_batch_call_that_hangs_or_crashes_scores_its_innocents_together_without_the_guilty(
        hostile_sandboxes, guilty, status):
    completions = ["a", "b", guilty, "c", "d", "e"]
    started = time.monotonic()
    report = asyncio.run(hostile_sandboxes["batch"].client.score(build_samples(["p"] * 6, completions, {})))
    assert time.monotonic() - started < 3 * TIMEOUT_S + 10
    assert report.statuses[2] == status and report.values[2] == -5.0
    # the five innocents were scored as one batch of five, not as batches of one
    assert [report.values[i] for i in (0, 1, 3, 4, 5)] == [5.0] * 5, report.errors
    assert [report.statuses[i] for i in (0, 1, 3, 4, 5)] == [Status.OK] * 5
    later = asyncio.run(hostile_sandboxes["batch"].client.score(build_samples(["p"] * 3, ["x", "y", "z"], {})))
    assert later.values == [3.0] * 3 and later.statuses == [Status.OK] * 3


def test_leftovers_that_kill_every_new_process_of_their_uid_cannot_keep_the_slot(hostile_sandboxes):
    # The red team's slot breaker: a guard SIGKILLs each new process of its uid (the slot's next one, right after
    # it takes the uid), and squatters fill the uid's process limit and spin on the CPU once the sample is over.
    # Cleanup runs with a real and saved uid of its own: they can neither signal it nor outlive it.
    for _ in range(3):
        attack(hostile_sandboxes, """
            import os, resource, select, time
            r, w = os.pipe()

            def child(body):
                if os.fork() == 0:
                    try:
                        os.setsid()
                        os.closerange(0, r)
                        os.closerange(r + 1, 65536)
                        body()
                    finally:
                        os._exit(0)

            def spin():
                os.read(r, 1)  # EOF once the sample's process is gone
                while True:
                    pass

            def guard():
                me, seen = os.getpid(), set()
                while True:
                    for p in [int(e) for e in os.listdir("/proc") if e.isdigit()]:
                        if p != me:
                            try:
                                os.kill(p, 9)
                            except OSError:
                                pass

            for _ in range(max(0, resource.getrlimit(resource.RLIMIT_NPROC)[0] - 3)):
                try:
                    child(spin)
                except OSError:
                    break
            child(guard)
            score = 100.0
        """, {Status.OK, Status.TIMEOUT, Status.CRASH})  # its guard may kill its own sample first


def test_processes_that_keep_changing_pid_are_killed_all_the_same(hostile_sandboxes):
    for _ in range(2):
        attack(hostile_sandboxes, """
            import os
            for _ in range(4):
                if os.fork() == 0:
                    os.setsid()
                    while True:  # a new pid every few microseconds: no /proc scan finds it twice
                        if os.fork() != 0:
                            os._exit(0)
            score = 100.0
        """, {Status.OK})


def test_a_directory_tree_deeper_than_any_limit_is_emptied(hostile_sandboxes):
    for _ in range(2):
        attack(hostile_sandboxes, """
            import os
            top = os.open(".", os.O_RDONLY)
            for i in range(3000):  # deeper than the recursion limit, longer than PATH_MAX
                os.mkdir("d", dir_fd=top)
                fd = os.open("d", os.O_RDONLY, dir_fd=top)
                os.close(top)
                top = fd
            os.fchmod(top, 0)
            score = 100.0
        """, {Status.OK})


GIVE_AWAY_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ident = libc.shmget(0x52425831, 1 << 20, 0o1666)  # IPC_CREAT | 0666 (none at all under runc)
if ident >= 0:
    buf = ctypes.create_string_buffer(256)
    libc.shmctl(ident, 2, buf)  # IPC_STAT
    ctypes.c_uint32.from_buffer(buf, 4).value = 65534  # hand it to the server's uid
    libc.shmctl(ident, 1, buf)  # IPC_SET
score = 100.0
"""


def test_a_sysv_object_given_to_another_uid_does_not_outlive_its_sample(hostile_sandboxes, request):
    if "runsc" not in request.node.name:
        attack(hostile_sandboxes, GIVE_AWAY_SHM, {Status.OK})  # runc: no SysV IPC exists at all
        return
    # gVisor ignores the sysctls that switch SysV IPC off: the seccomp filter of every slot process refuses the
    # segment (test_ipc_message_queues_ptrace_and_keyrings_are_refused_to_samples), which is why no slot's cleanup
    # looks for IPC objects; the samples after it find nothing.
    report = _score(hostile_sandboxes, [GIVE_AWAY_SHM])
    assert report.statuses == [Status.OK]
    time.sleep(0.5)
    later = _score(hostile_sandboxes, INNOCENT)
    assert later.statuses == [Status.OK] * 8 and later.values == EXPECTED, later.logs


def test_memory_spread_over_many_children_kills_samples_not_the_server(hostile_sandboxes):
    # Each child smaller than the server: the OOM killer still takes them (oom_score_adj 1000), so innocents that
    # are still running when it strikes keep their scores.
    slow = [f"import time\ntime.sleep(1.0)\nscore = {i} / 8" for i in range(1, 7)]
    hostile = textwrap.dedent("""
        import os, time
        for _ in range(70):
            if os.fork() == 0:
                try:
                    hog = bytearray(15 << 20)
                    for i in range(0, len(hog), 4096):
                        hog[i] = 1
                    time.sleep(30)
                finally:
                    os._exit(0)
        score = 100.0
    """)
    report = _score(hostile_sandboxes, slow[:3] + [hostile] + slow[3:])
    innocent = [0, 1, 2, 4, 5, 6]
    assert [report.statuses[i] for i in innocent] == [Status.OK] * 6, report.errors
    assert [report.values[i] for i in innocent] == [i / 8 for i in range(1, 7)]
    later = _score(hostile_sandboxes, INNOCENT)
    assert later.statuses == [Status.OK] * 8 and later.values == EXPECTED


def test_a_scratch_tree_built_to_defeat_cleanup_is_emptied_every_time(hostile_sandboxes):
    # The second red team's slot poisoners: a 255-byte name of 3-byte characters, a mode-000 directory, and a
    # read-only directory inside a writable one (moving a directory needs write permission on it). Each once broke
    # its slot for good; enough of them took the whole reward down.
    for _ in range(4):
        attack(hostile_sandboxes, """
            import os
            os.makedirs("a/" + "\u20ac" * 85, exist_ok=True)
            os.mkdir("locked")
            os.chmod("locked", 0)
            os.makedirs("outer/inner", exist_ok=True)
            os.chmod("outer/inner", 0o555)
            score = 100.0
        """, {Status.OK})
    logs = hostile_sandboxes.replicas["exec"][0].sandbox.logs(tail=200)
    assert "cannot be prepared" not in logs and "NOT_SERVING" not in logs, logs


def test_a_process_stuck_in_the_kernel_does_not_outlive_its_sample(hostile_sandboxes):
    # A vfork parent waiting on a child that blocks opening a FIFO cannot be stopped (state D): cleanup must kill
    # it anyway rather than wait for it to stop.
    attack(hostile_sandboxes, """
        import os
        os.mkfifo("fifo")
        os.posix_spawn("/bin/true", ["true"], {}, file_actions=[(os.POSIX_SPAWN_OPEN, 3, "fifo", os.O_RDONLY, 0)])
        score = 100.0
    """, {Status.TIMEOUT})
    logs = hostile_sandboxes.replicas["exec"][0].sandbox.logs(tail=200)
    assert "cannot be prepared" not in logs, logs


def test_ipc_message_queues_ptrace_and_keyrings_are_refused_to_samples(hostile_sandboxes):
    probe = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "shmget": lambda: libc.shmget(0, 4096, 0o1600), "msgget": lambda: libc.msgget(0, 0o1600),
    "semget": lambda: libc.semget(0, 1, 0o1600), "ptrace": lambda: libc.ptrace(0, 0, 0, 0),
    "mq_open": lambda: libc.mq_open(b"/rbx", 0o100 | 0o2, 0o600, None),
    "add_key": lambda: libc.syscall(248, b"user", b"rbx", b"x", 1, -3),
    # memory a sample could hide from the guard (red team 15): a Unix datagram or seqpacket socket's queue, pages
    # spliced into a pipe
    "unix datagram": lambda: libc.socket(1, 2, 0), "unix seqpacket": lambda: libc.socket(1, 5, 0),
    "vmsplice": lambda: libc.syscall(278, 1, 0, 0, 0),
}
refused = 0
for name, call in calls.items():
    if call() == -1 and ctypes.get_errno() == errno.EPERM:
        refused += 1
    else:
        print("ALLOWED", name)
score = refused / len(calls)
"""
    report = _score(hostile_sandboxes, [probe, INNOCENT[0]])
    assert (report.values, report.statuses) == ([1.0, EXPECTED[0]], [Status.OK, Status.OK]), report.logs


BUSY_INNOCENT = """
import time
started = time.process_time()
while time.process_time() - started < {cpu_s}:
    pass
score = {i} / 8
"""

HOG = """
import os
while True:
    try:
        if os.fork() == 0:
            break
    except OSError:  # as many as its uid may run
        break
while True:
    pass
"""


def test_busy_processes_of_one_sample_do_not_time_out_the_innocents_beside_it(hostile_sandboxes):
    """A sample that forks as many busy processes as its uid may run holds nearly all of the sandbox's CPU until its
    timeout (the scheduler shares it per task). An innocent in the other slot that needs a few tenths of a second of
    CPU then takes longer than timeout_s: what it waited for a CPU is not charged to it (cpu_wait), and it ends ok
    with its value. The hog's wait is its own doing: it is killed at its own timeout, not later."""
    # Under runc the samples run forked (a new pool's first ones too), and the slot process adds up to timeout_s +
    # 2 s; under gVisor (no schedstat) deadlines stay wall-clock, and this hog's contention is milder there. The hog
    # first: the other slot's share of the batch runs beside it from the start.
    for cpu_s in (0.3, 0.6):
        batch = [HOG] + [BUSY_INNOCENT.format(i=i, cpu_s=cpu_s) for i in range(1, 7)]
        report = _score(hostile_sandboxes, batch, "contended")
        assert report.statuses[0] == Status.TIMEOUT and "waited for a CPU" not in report.errors[0], report.errors
        assert (report.values[1:], report.statuses[1:]) == ([i / 8 for i in range(1, 7)], [Status.OK] * 6), \
            (cpu_s, report.errors)
        assert "CONTAMINATED" not in report.logs


CMDLINE_WATCHER = """
import os, time
found = set()
end = time.monotonic() + 2.0
while time.monotonic() < end:  # while the other slot's samples run their programs
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.update(w for w in f.read().split(b"\\0") if w.startswith(b"SECRET-"))
            except OSError:
                pass
    time.sleep(0.01)
print("FOUND", sorted(found))
score = float(len(found))
"""
CMDLINE_HOLDER = """
import subprocess
subprocess.run(["python3", "-c", "import time; time.sleep(0.4)", "SECRET-{i}"], check=True)
score = {i} / 8
"""


# gVisor's /proc has no hidepid: docs/explanation/security-defaults.md
@pytest.mark.parametrize("hostile_sandboxes", ["runc"], indirect=True)
def test_a_sample_cannot_read_the_command_lines_of_programs_other_samples_run(hostile_sandboxes):
    """A program's command line (/proc/<pid>/cmdline) is readable by every uid unless /proc hides other processes:
    where a reward passes a sample's code or test data as arguments, a sample beside it would read them (red team
    12: 3 of 3 batches). The sandbox remounts /proc with hidepid (private_tmp.hide_others)."""
    batch = [CMDLINE_WATCHER] + [CMDLINE_HOLDER.format(i=i) for i in range(1, 7)]
    report = _score(hostile_sandboxes, batch)
    assert report.statuses == [Status.OK] * 7, report.errors
    assert report.values == [0.0] + [i / 8 for i in range(1, 7)], report.logs[-2000:]


TIME_WAIT_MAKER = """
import socket, time
for port in range(18760, 18766):  # a connection closed by its accepting side first: that side's port in TIME_WAIT
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()
    time.sleep(0.02)
    client.close()
    server.close()
score = 0.0
"""
PLAIN_SERVER = """
import socket
server = socket.socket()  # no SO_REUSEADDR, as a plain test server binds
server.bind(("127.0.0.1", {port}))
server.listen()
server.close()
score = {i} / 8
"""


# gVisor's network stack keeps TIME_WAIT: docs/explanation/security-defaults.md
@pytest.mark.parametrize("hostile_sandboxes", ["runc"], indirect=True)
def test_connections_a_finished_sample_closed_keep_no_port_from_later_samples(hostile_sandboxes):
    """TCP keeps a connection its side closed first in TIME_WAIT for 60 s, in the container's network namespace and
    held by no process, so no kill of a sample's processes ends it: a later sample's bind() to that port failed
    with EADDRINUSE (red team 12: 6 of 6 batches). The containers keep no TIME_WAIT (containers.NO_TIME_WAIT)."""
    report = _score(hostile_sandboxes, [TIME_WAIT_MAKER] + INNOCENT[:3])
    assert report.statuses == [Status.OK] * 4, report.errors
    later = _score(hostile_sandboxes, [PLAIN_SERVER.format(port=18760 + i, i=i + 1) for i in range(6)])
    assert later.statuses == [Status.OK] * 6, later.errors
    assert later.values == [i / 8 for i in range(1, 7)]


def test_a_listener_left_in_flight_in_a_unix_socket_cycle_keeps_its_port_from_no_later_sample(docker_sandboxes):
    """A listening socket sent over a cycle of Unix sockets outlives the processes of its sample until the kernel's
    collector frees the cycle, some milliseconds later: the samples right after it in its slot failed to bind() its
    port (red team 13: 2 to 4 of 7 in each of 3 batches, one slot). Cleanup waits until the slot's uid has no Unix
    socket left (sockets.wait_for_in_flight), whether its next sample is forked or starts a new slot process."""
    s = docker_sandboxes([{"name": "exec", "code": REWARD, "function": "run", "workers": 1, "timeout_s": TIMEOUT_S,
                           "retries": 0}])
    for attempt in range(3):
        port = 18780 + attempt
        batch = [LISTENER_IN_FLIGHT.format(port=port)] + [PLAIN_SERVER.format(port=port, i=i) for i in range(1, 7)]
        report = _score(s, batch)
        assert report.statuses == [Status.OK] * 7, (attempt, report.errors)
        assert report.values == [0.0] + [i / 8 for i in range(1, 7)]
