"""isolation: sample at real batch sizes, in real containers (runc and gVisor): no process that scored a sample scores
another (sandbox_image/processes/forked.py: each in a child of a slot process that runs no reward code; under gVisor, a
slot process of its own), and what a finished sample leaves (processes, files, inodes, memory a helper holds for it) is
gone before it can reach a later sample of the batch. Reward state that no event reports (caches, decimal contexts,
parser objects, library globals) is tests/docker/test_steady_state.py's.

Each test asserts the innocent samples' exact values and statuses, not only the guilty ones'.
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import time

import docker
import pytest

from rewardbox import build_samples
from rewardbox.sandbox.memory import memory_guard
from rewardbox.sandbox.server import pools
from rewardbox.wire import Status
from tests.docker.conftest import sandboxes_on_runtime

REWARDS = '''
import builtins, os, re, signal, sys, time

PATTERN = re.compile(r"<answer>(\\d+)</answer>")
SEEN = []


def pid(prompt, completion, example):
    """A pure reward that shows which process scored the sample."""
    match = PATTERN.search(completion)
    return float(os.getpid()) if match else -1.0


def act(prompt, completion, example):
    """Does what the completion names (trusted reward code doing it, so no code runs from data), then returns the
    pid of its process and when it ran (pid * 1000 + seconds of the monotonic clock, mod 1000); first returns -1
    if anything an earlier sample did is visible."""
    if (getattr(builtins, "poisoned", False) or SEEN or os.environ.get("POISONED") or os.getcwd() != os.environ["HOME"]
            or "rbx_planted" in sys.modules or signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL):
        return -1.0
    if completion == "exec":
        exec("x = 1", {})
    elif completion == "eval":
        eval("1 + 1")
    elif completion == "import":
        import wave  # noqa: F401 - a module nothing imported before
    elif completion == "thread":
        import _thread
        _thread.start_new_thread(lambda: None, ())
    elif completion == "write":
        with open("scratch.txt", "w") as f:
            f.write("x")
    elif completion == "chdir":
        os.chdir("/")
    elif completion == "putenv":
        os.environ["POISONED"] = "1"
    elif completion == "ctypes":
        import ctypes
        ctypes.CDLL(None).getpid()
    elif completion == "pickle":
        import pickle
        pickle.loads(pickle.dumps(Exception("x")))
    elif completion == "marshal":
        import marshal
        marshal.loads(marshal.dumps(1))
    elif completion == "fork":
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
    elif completion == "modules":
        sys.modules["rbx_planted"] = sys
    elif completion == "umask":
        os.umask(0)
    elif completion == "signal":
        signal.signal(signal.SIGUSR1, lambda *args: None)
    elif completion == "timer":
        signal.setitimer(signal.ITIMER_VIRTUAL, 100)
    elif completion == "sigmask":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    elif completion == "global":
        SEEN.append(1)
    elif completion == "builtins":
        builtins.poisoned = True
    return os.getpid() * 1000.0 + time.monotonic() % 1000


def mixed(prompt, completion, example):
    """Pure for most completions; runs the code of those that start with "code:" (a reward that runs code only
    sometimes)."""
    if not completion.startswith("code:"):
        return 0.5 if PATTERN.search(completion) else 0.0
    namespace = {}
    exec(completion[5:], namespace)
    return namespace.get("score")


def run(prompt, completion, example):
    """Runs the completion: model-written code in the reward's own process."""
    if getattr(builtins, "poisoned", False) or SEEN or os.listdir("."):
        return -1.0
    namespace = {}
    exec(completion, namespace)
    return namespace.get("score")
'''

ACTIONS = ["exec", "eval", "import", "thread", "write", "chdir", "putenv", "ctypes", "pickle", "marshal", "fork",
           "global", "builtins", "modules", "umask", "signal", "timer", "sigmask"]
TIMEOUT_S = 5.0
# For samples whose outcome is about what they measure or hold, not about how long they take: gVisor's deadlines are
# wall-clock (no schedstat to forgive waits for a CPU, cpu_wait.py), and in a full suite's run innocents that needed
# 2 s of a 5 s timeout there ended ``timeout`` (the CPU share they measure, or what the guard kills, is the test).
PATIENT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module", params=["runc", "runsc"])
def sandboxes(request, tmp_path_factory, docker_client, base_image):
    common = {"timeout_s": TIMEOUT_S, "workers": 2, "cpus": 2, "default_score": -5.0, "memory": "1g", "retries": 1}
    started = sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, REWARDS, [
        {"name": "pid", **common}, {"name": "pid_fresh", "function": "pid", "isolation": "process", **common},
        {"name": "pid_worker", "function": "pid", "isolation": "worker", **common},
        {"name": "act", **common}, {"name": "run", **common}, {"name": "mixed", **common},
        {"name": "run_worker", "function": "run", "isolation": "worker", **common},
        {"name": "run_patient", "function": "run", **common, "timeout_s": PATIENT_TIMEOUT_S}])
    yield started
    started.stop()


def score(sandboxes, name, completions):
    return asyncio.run(sandboxes[name].client.score(build_samples(["p"] * len(completions), completions, {})))


def test_no_process_scores_two_samples_of_a_pure_reward_and_it_scores_as_worker_isolation_does(sandboxes):
    completions = [f"<think>{i}</think><answer>{i}</answer>" if i % 3 else "no answer" for i in range(512)]
    answered = sum(1 for i in range(512) if i % 3)
    for _ in range(2):  # a pool's first samples and the samples after them alike
        report = score(sandboxes, "pid", completions)
        assert report.statuses == [Status.OK] * 512
        assert [v == -1.0 for v in report.values] == [i % 3 == 0 for i in range(512)]
        assert len({v for v in report.values if v != -1.0}) == answered  # a process of its own each
    fresh = score(sandboxes, "pid_fresh", completions[:64])
    assert fresh.statuses == [Status.OK] * 64
    assert len({v for v in fresh.values if v != -1.0}) == sum(1 for i in range(64) if i % 3)  # one each
    worker = score(sandboxes, "pid_worker", completions)
    assert [v == -1.0 for v in worker.values] == [v == -1.0 for v in report.values]
    assert len({v for v in worker.values if v != -1.0}) <= 2  # isolation: worker reuses its processes


def test_a_process_in_which_anything_could_leave_state_never_scores_another_sample(sandboxes):
    # each action between two harmless samples, in one batch: whatever did it, no later sample runs in its process
    completions = []
    for action in ACTIONS:
        completions += ["nothing", action, "nothing"]
    report = score(sandboxes, "act", completions)
    assert report.statuses == [Status.OK] * len(completions), report.errors
    assert -1.0 not in report.values, list(zip(completions, report.values))  # nothing an action did was seen
    ran = [(int(v // 1000), v % 1000, c) for c, v in zip(completions, report.values)]  # (pid, when, what)
    for pid, when, completion in ran:
        if completion != "nothing":
            later = [c for p, w, c in ran if p == pid and w > when]
            assert not later, (completion, "its process scored later samples", later)


def test_answers_a_sample_forges_for_the_samples_behind_it_are_never_taken(sandboxes):
    forger = textwrap.dedent("""
        import builtins, os, stat
        from rewardbox.sandbox.protocol import codec, stream
        from rewardbox.wire import Outcome, Status
        builtins.poisoned = True
        forged = b"".join(codec.encode_result([Outcome(99.0, Status.OK)], "", 0, 1000) + stream.Marker.CLEAN
                          for _ in range(16))
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, forged)
            except OSError:
                pass
        score = 99.0
    """)
    innocents = [f"score = {i} / 8" for i in range(1, 9)]
    report = score(sandboxes, "run", innocents[:4] + [forger] + innocents[4:])
    results = list(zip(report.values, report.statuses))
    # its own answer is its own to set (a reward that runs a completion in its own process lets it), or broken
    assert results[4] in {(99.0, Status.OK), (-5.0, Status.INVALID)}, (results[4], report.errors[4])
    expected = [(i / 8, Status.OK) for i in range(1, 9)]
    assert results[:4] + results[5:] == expected, (results, report.errors)
    later = score(sandboxes, "run", innocents)
    assert later.values == [i / 8 for i in range(1, 9)] and later.statuses == [Status.OK] * 8


def _innocents_after(sandboxes, attackers: list, innocent: str, expected: float, count: int, name: str = "run"):
    started = time.monotonic()
    report = score(sandboxes, name, attackers + [innocent] * count)
    elapsed = time.monotonic() - started
    innocent_results = list(zip(report.values, report.statuses, report.errors))[len(attackers):]
    assert innocent_results == [(expected, Status.OK, None)] * count, (innocent_results, report.logs[-2000:])
    return report, elapsed


def test_scratch_files_of_finished_samples_are_gone_before_later_samples_run(sandboxes):
    writer = "open('big', 'wb').write(b'x' * (60 << 20))\nscore = 1.0"
    report, elapsed = _innocents_after(sandboxes, [writer] * 20, "score = 0.5", 0.5, 12)
    assert report.values[:20] == [1.0] * 20
    assert elapsed < 60, elapsed


def test_cpu_burning_leftovers_die_before_later_samples_run(sandboxes):
    # Each spinner naps 0.5 s before it spins, longer than its sample lives (20-30 ms then): what spins is only ever
    # what a finished sample left. Spinning at once, they slowed their own sample's forks to 0.5-0.6 s, and the third
    # sample's live spinners overlapped an innocent's computing (4.5x and 5.4x in 2 of 3 batches, /tmp/s39/ratio2.py;
    # the innocent that failed in 2 of 4 fresh clones' full runs): contention while a sample runs, not a leftover.
    spinners = textwrap.dedent("""
        import os, time
        try:
            for _ in range(60):
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(0.5)
                    while True:
                        pass
        except OSError:
            pass  # its uid's process limit
        score = 1.0
    """)
    # 1.0 when the innocent had the CPU for at least a quarter of its wall time (60 spinners left behind by each
    # of 3 samples would give it about a 90th; innocents beside live spinners measured 20-23x). It waits first, past
    # the spinners' nap: what it computes then competes only with what finished samples left, which must be gone.
    busy = textwrap.dedent("""
        import time
        time.sleep(1.5)
        wall, cpu = time.monotonic(), time.process_time()
        sum(range(12_000_000))
        score = float(time.monotonic() - wall < 4 * (time.process_time() - cpu) + 0.05)
    """)
    # The innocents come in the next call: in the attackers' own call, an innocent on the other slot (workers: 2)
    # runs beside a spinner sample that is still forking under gVisor (0.5-3 s there), whose live spinners it
    # shares the CPU with (CI, 2 of its innocents timed out): contention with a live sample, which no isolation
    # setting bounds; what this test is about is what the finished ones left. The innocents are patient (what they
    # measure is the test: spinners left alive would give them 0.0, not a timeout) and run in another reward's
    # slots, whose samples the spinners' leftovers would compete with just the same.
    score(sandboxes, "run", [spinners] * 3)  # scored or timed out: theirs to decide
    _innocents_after(sandboxes, [], busy, 1.0, 6, name="run_patient")


def test_memory_a_helper_holds_for_a_sample_is_bounded_and_freed_with_it(sandboxes):
    holder = textwrap.dedent("""
        import os, signal, struct, time
        from rewardbox.sandbox.programs import execution
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        sock = execution._connect().sock
        if os.fork() == 0:
            os.setsid()
            time.sleep(600)  # holds the runner's socket open after the sample ends
        try:
            sock.sendall(struct.pack("<I", 250 << 20))  # announces a 250 MiB request, sends 200 MiB of it
            sock.sendall(b"x" * (200 << 20))
        except OSError:
            pass  # the runner refused the frame and closed its end
        score = 1.0
    """)
    toucher = "buffer = bytearray(280 << 20)\nscore = 0.25"
    _innocents_after(sandboxes, [holder] * 3, toucher, 0.25, 4)


def test_a_sample_cannot_hold_memory_for_which_innocents_are_killed_in_its_sockets(sandboxes):
    # Socket buffers are kernel memory in no process's resident set: 6,000 filled socket pairs (about 2.8 GB) made
    # the container's OOM killer take concurrent innocents (red team; the same with memory files, now refused). A
    # sample has SAMPLE_OPEN_FILES descriptors, and its sockets' buffers keep their default size.
    hoarder = textwrap.dedent("""
        import socket, time
        held = []
        try:
            for _ in range(6000):
                a, b = socket.socketpair()
                held.append((a, b))
                for s in (a, b):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                    s.setblocking(False)
                    try:
                        while True:
                            s.send(bytes(65536))
                    except BlockingIOError:
                        pass
        except OSError:
            pass  # out of descriptors
        time.sleep(1.5)
        score = float(len(held))
    """)
    toucher = "import time\nbuffer = bytearray(200 << 20)\nfor i in range(0, len(buffer), 4096):\n" \
              "    buffer[i] = 1\ntime.sleep(1.0)\nscore = 0.25"
    report, _ = _innocents_after(sandboxes, [hoarder] * 2, toucher, 0.25, 6)
    assert all(v is not None and v <= 256 for v in report.values[:2]), (report.values[:2], report.errors[:2])


HOLDS_60_MIB = "import time\nx = bytearray(60 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\ntime.sleep(3)\nscore = 0.5"


def _hog_beside_a_holder(sandboxes, hog: str, holder: str = HOLDS_60_MIB, guilty: tuple = (Status.CRASH,),
                         name: str = "run"):
    """Scores ``hog`` and an innocent that holds 60 MiB at the same time; the innocent must score as alone."""
    report = score(sandboxes, name, [hog, holder])
    assert (report.values[1], report.statuses[1], report.errors[1]) == (0.5, Status.OK, None), \
        (report.values, report.statuses, report.errors)
    assert report.statuses[0] in guilty and report.values[0] == -5.0, (report.statuses, report.errors)
    later = score(sandboxes, "run", [HOLDS_60_MIB] * 2)
    assert later.values == [0.5] * 2 and later.statuses == [Status.OK] * 2, later.errors


def test_a_sample_that_spreads_its_memory_over_its_forks_dies_near_the_limit_not_an_innocent(sandboxes):
    # The kernel's OOM killer ranks processes one by one: 36 forks of 24 MiB each, every one smaller than the
    # innocent's 60 MiB, got the innocent killed at the 1 GiB limit (runc; red team). Under gVisor (16 processes a
    # sample) the whole sandbox went: UNAVAILABLE for both. The memory guard adds up what each sample's processes
    # hold and kills the sample holding the most.
    # Under gVisor each fork takes a MiB every 20 ms (the 12 together, about 600 MiB/s): this test is about whom the
    # guard kills. How fast it acts is a race the docs state as not covered (explanation/security-defaults.md):
    # gVisor's figures lag the host's, and 12 forks filling 80 MiB at once (a memset each) lost the whole sandbox in
    # 1 to 2 runs of 8, the host's count 200 MiB past gVisor's. Paced so, the host's count peaked at 815-844 MiB of
    # the 1 GiB in 8 runs of 8.
    size, paced = (24, 0) if sandboxes.runtime == "runc" else (0, 80)
    forks = 36 if sandboxes.runtime == "runc" else 12
    hog = textwrap.dedent(f"""
        import os, time
        for _ in range({forks}):
            if os.fork() == 0:
                x = bytearray({size} << 20)
                for i in range(0, len(x), 4096):
                    x[i] = 1
                y = [bytearray(1 << 20) for _ in range({paced}) if not time.sleep(0.02)]
                time.sleep(30)
                os._exit(0)
        time.sleep(4)
        score = 9.0
    """)
    _hog_beside_a_holder(sandboxes, hog)


STOP_GUARD = textwrap.dedent("""
    import os, signal, sys
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/comm").read().strip() == "rbx-supervisor":
                os.kill(int(pid), getattr(signal, sys.argv[1]))
                print(pid)
        except OSError:
            pass
""")


@contextlib.contextmanager
def _guard_stopped(sandboxes, name="run"):
    """The memory guard of reward ``name``'s sandbox stopped (SIGSTOP to its process) while the block runs: a burst
    that outruns its reads, every time."""
    container = sandboxes.replicas[name][0].sandbox.container
    code, out = container.exec_run(["python3", "-c", STOP_GUARD, "SIGSTOP"], user="0")
    assert code == 0 and out.strip(), out
    try:
        yield
    finally:
        with contextlib.suppress(docker.errors.NotFound):  # gVisor: the host's OOM killer took that sandbox
            container.exec_run(["python3", "-c", STOP_GUARD, "SIGCONT"], user="0")


def _spread_hog(forks: int, mib: int, hold_s: float = 30.0) -> str:
    """A sample whose ``forks`` forks take ``mib`` MiB each, a MiB every 20 ms, and hold it for ``hold_s`` (the
    sample itself returns after 4 s, or once they all ended if that is sooner)."""
    return textwrap.dedent(f"""
        import os, time
        for _ in range({forks}):
            if os.fork() == 0:
                y = [bytearray(1 << 20) for _ in range({mib}) if not time.sleep(0.02)]
                for b in y:
                    for i in range(0, len(b), 4096):
                        b[i] = 1
                time.sleep({hold_s})
                os._exit(0)
        end = time.monotonic() + 4
        while time.monotonic() < end:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            time.sleep(0.05)
        score = 9.0
    """)


def test_an_innocent_the_kernels_oom_killer_took_for_a_sample_that_spread_its_memory_is_scored_again(sandboxes):
    # The memory guard kills the sample whose processes hold the most before the limit, but a burst can outrun its
    # reads: the kernel's OOM killer then kills the largest process, an innocent beside a sample that spread its
    # memory over small forks (red team: 32 forks filling 20 MiB each at once beside a 380 MiB sample, 1 batch in
    # 6). Stopping the guard (SIGSTOP to its process) stages that race every time. Under runc the innocent's process
    # died while the kernel's OOM counter moved: it is scored again after the call's other samples (without that, it
    # ends `crash`). Under gVisor the host's OOM killer takes the whole sandbox; the host replaces it and scores both
    # again, where the guard (not stopped there) kills the hog.
    innocent = "import time\ntime.sleep(1.5)\nx = b'\\x01' * (350 << 20)\nscore = 1.0"
    # 600 MiB either way, each fork smaller than the innocent (gVisor: 16 processes a sample)
    hog = _spread_hog(30, 20) if sandboxes.runtime == "runc" else _spread_hog(12, 50)
    with _guard_stopped(sandboxes):
        report = score(sandboxes, "run", [hog, innocent])
    assert (report.values[1], report.statuses[1], report.errors[1]) == (1.0, Status.OK, None), \
        (report.values, report.statuses, report.errors)
    if sandboxes.runtime == "runc":
        assert (report.values[0], report.statuses[0]) == (9.0, Status.OK), (report.statuses, report.errors)
    else:
        assert report.statuses[0] is Status.CRASH, (report.statuses, report.errors)


@pytest.mark.parametrize("sandboxes", ["runc"], indirect=True)  # the kernel's OOM killer acts inside runc only
def test_samples_the_kernels_oom_killer_took_are_scored_again_one_at_a_time(sandboxes):
    # The hog's own process died too (here it kills itself; in CI the guard killed it, late): both had died while
    # the kernel's OOM killer acted, and both were scored again at once. The hog filled the sandbox again beside
    # the innocent, and the kernel took the innocent in both attempts (CI, runc: 15 forks filling socket buffers).
    # Scored again one at a time, the innocent runs alone. Without that, it ends `crash`, killed twice.
    innocent = "import time\ntime.sleep(1.5)\nx = b'\\x01' * (350 << 20)\nscore = 1.0"
    hog = textwrap.dedent("""
        import os, time
        for _ in range(30):
            if os.fork() == 0:
                y = [bytearray(1 << 20) for _ in range(20) if not time.sleep(0.02)]
                for b in y:
                    for i in range(0, len(b), 4096):
                        b[i] = 1
                time.sleep(30)
                os._exit(0)
        time.sleep(2.5)
        os.kill(-1, 9)  # every process of its uid, as the guard kills a slot (its forks hold its answer's socket)
    """)
    with _guard_stopped(sandboxes):
        report = score(sandboxes, "run", [hog, innocent])
    assert (report.values[1], report.statuses[1], report.errors[1]) == (1.0, Status.OK, None), \
        (report.values, report.statuses, report.errors)
    assert report.statuses[0] is Status.CRASH and "killed by SIGKILL" in report.errors[0], report.errors


@pytest.mark.parametrize("sandboxes", ["runc"], indirect=True)  # the kernel's OOM killer acts inside runc only
def test_under_worker_isolation_too_an_innocent_the_kernels_oom_killer_took_is_scored_again(sandboxes):
    # isolation: worker, each sample in a worker of its own (workers: 2): the innocent's worker was the largest
    # process when a burst of small forks filled the sandbox. It is scored again once the call's other samples are
    # done (without that, it ends `crash`). The hog's forks end with it here: a worker's leftovers outlive its
    # sample under isolation: worker, and would fill the sandbox for the second try as well. (gVisor has no OOM
    # killer inside the sandbox: the allocation that finds it full fails, a MemoryError; see
    # docs/how-to/gvisor-apparmor.md.)
    innocent = "import time\ntime.sleep(1.5)\nx = b'\\x01' * (350 << 20)\nscore = 1.0"
    with _guard_stopped(sandboxes, "run_worker"):
        report = score(sandboxes, "run_worker", [_spread_hog(30, 20, hold_s=2.5), innocent])
    assert (report.values[1], report.statuses[1], report.errors[1]) == (1.0, Status.OK, None), \
        (report.values, report.statuses, report.errors)


def test_a_sample_the_kernels_oom_killer_kills_twice_says_so_and_is_not_tried_a_third_time(sandboxes):
    # A sample that fills the sandbox on its own, the guard stopped: the kernel kills it, it is scored again (as an
    # innocent would be), killed again, and then ends `crash`, saying what happened and what to change.
    overfill = "x = [b'\\x01' * (10 << 20) for _ in range(100)]\nscore = 1.0"  # 1,000 MiB of the 1 GiB
    with _guard_stopped(sandboxes):
        report = score(sandboxes, "run", [overfill, "score = 0.5"])
    assert report.values == [-5.0, 0.5] and report.statuses[1] is Status.OK, report.errors
    if sandboxes.runtime == "runc":
        assert report.statuses[0] is Status.CRASH, report.errors
        assert "killed by SIGKILL" in report.errors[0] and pools.OOM_TWICE in report.errors[0], report.errors[0]
    else:  # gVisor refuses the allocation (or the host's OOM killer takes the sandbox, which is replaced)
        assert report.statuses[0] is Status.CRASH or "MemoryError" in report.errors[0], report.errors


def test_what_the_server_keeps_of_a_calls_output_is_bounded_by_the_sandboxs_memory(sandboxes):
    # The server's memory is in no sample's count: 2,600 samples printing 64 KiB each took it to 326 MiB, and the
    # memory guard killed a 300 MiB innocent (red team, runc). A call's output and errors are kept up to a 128th of
    # the sandbox's memory (8 MiB of this 1 GiB: about 125 samples' 64 KiB), counted as each sample's answer arrives
    # (not once a request of hundreds of them ended); later samples' output is a note.
    chatty = "print('x' * 65000)\nscore = 1.0"
    report = asyncio.run(sandboxes["run"].client.score(build_samples(["p"] * 600, [chatty] * 600, {}), details=True))
    assert report.values == [1.0] * 600 and report.statuses == [Status.OK] * 600, report.errors[:3]
    kept = [own for own in report.sample_logs if own == "x" * 65000 + "\n"]
    noted = [own for own in report.sample_logs if own.startswith("[rewardbox dropped this sample's output (65001 "
                                                                  "characters): the call's samples printed more "
                                                                  "than the 8 MiB")]
    assert 100 < len(kept) < 130 and len(kept) + len(noted) == 600, (len(kept), len(noted))
    own = "".join(report.sample_logs)  # the call's output: its samples' own, in order (sent once), then a note
    assert report.logs.startswith(own) and "more characters of output dropped" in report.logs[len(own):]


def test_a_sample_that_fills_socket_buffers_from_many_forks_dies_near_the_limit_not_an_innocent(sandboxes):
    # Socket buffers are in no process's resident set, and the descriptor limit is per process: 15 forks filling
    # about 250 socket pairs each (about 55 MiB of kernel memory a fork) got the innocent killed (runc; red team).
    # Under gVisor paced (a pair every 10 ms a fork, about 330 MiB/s in all), as the spread hog above is and for
    # the same reason (gVisor's figures lag the host's): unpaced, the hog ended `unavailable` (its sandbox lost)
    # instead of `crash` in 1 fresh-clone run of 3, the innocent scored as alone; this test is about whom the
    # guard kills.
    pace = 0.0 if sandboxes.runtime == "runc" else 0.01
    hog = textwrap.dedent(f"""
        import os, socket, time
        def hoard():
            keep = []
            try:
                while True:
                    a, b = socket.socketpair()
                    a.setblocking(False)
                    keep.append((a, b))
                    try:
                        while True:
                            a.send(bytes(65536))
                    except BlockingIOError:
                        pass
                    time.sleep({pace})
            except OSError:
                pass  # out of descriptors
            time.sleep(30)
        for _ in range(15):
            if os.fork() == 0:
                hoard()
                os._exit(0)
        time.sleep(4)
        score = 9.0
    """)
    _hog_beside_a_holder(sandboxes, hog)


CLOSED_SENDERS = """
import os, socket, time
for _ in range(12):
    if os.fork() == 0:
        keep = []
        try:
            for _ in range(400):  # 12 forks: about 1.1 GB, past the limit
                a, b = socket.socketpair()
                a.setblocking(False)
                try:
                    while True:
                        a.send(bytes(65536))
                except BlockingIOError:
                    pass
                a.close()  # what it sent stays queued at b
                keep.append(b)
        except OSError:
            pass  # out of descriptors
        time.sleep(30)
        os._exit(0)
time.sleep(4)
score = 9.0
"""
NOT_ACCEPTED = """
import os, socket, time
listeners, sent = [], 0
try:
    while sent < 900 << 20:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(f"\\0hog-{os.getpid()}-{len(listeners)}")
        listener.listen(4096)
        listeners.append(listener)
        for _ in range(4096):
            client = socket.socket(socket.AF_UNIX)
            client.connect(listener.getsockname())
            client.setblocking(False)
            try:
                while True:
                    sent += client.send(bytes(65536))
            except BlockingIOError:
                pass
            client.close()  # what it sent stays queued at the connection, which no one accepts
except OSError:
    pass
time.sleep(4)
score = 9.0
"""


# gVisor: the sandbox itself ends (docs/explanation/security-defaults.md, open)
@pytest.mark.parametrize("sandboxes", ["runc"], indirect=True)
def test_what_a_closed_sender_left_queued_counts_for_its_receiver_and_the_guard_kills_that_sample(sandboxes):
    # Linux counts what a Unix socket sent and its peer has not read yet as the sender's; once the sender is
    # closed, sock_diag lists it no more. 600 MB hidden so, at the receiving ends of socket pairs or at connections
    # a listener never accepted, were memory no process held: the guard stopped the whole sandbox, and every
    # innocent beside it ended unavailable (red team 14). They count for the receiver's uid now, as much as a
    # send buffer holds (tests/sandbox/test_sockets.py: what the queue's length says is no bound).
    for hog in (CLOSED_SENDERS, NOT_ACCEPTED):
        _hog_beside_a_holder(sandboxes, hog)


def test_a_sample_whose_programs_output_fills_the_runner_dies_near_the_limit_not_an_innocent(sandboxes):
    # The program runner's monitor (root) holds each run's output until the sample's request is answered: a
    # program writing hundreds of MiB held almost nothing itself, and the guard killed the innocent, the biggest
    # slot it saw (red team). A monitor now counts for the slot it serves.
    hog = textwrap.dedent("""
        import time
        from rewardbox.sandbox import run_tests
        program = ("import os, sys, time\\n"
                   "os.write(1, b'o' * (60 << 20)); os.write(2, b'e' * (60 << 20))\\n"
                   "time.sleep(10 if sys.argv[1:] == ['hold'] else 0)\\n")
        run_tests(program, [{"stdout": ""}] * 6 + [{"stdout": "", "args": ["hold"]}], timeout_s=10,
                  max_output_bytes=64 << 20)
        score = 9.0
    """)
    # The run_tests call may end in an error (its runner is gone) as well as the process dying. The innocent holds
    # its 60 MiB while the hog's output piles up (under gVisor, seconds): patient, as a 4.5 s hold within a 5 s
    # timeout ended ``timeout`` in 3 of 3 full-suite runs there. The hog's last program holds 10 s, in that timeout
    # too: only the guard (or its runner's loss) ends it before.
    _hog_beside_a_holder(sandboxes, hog, HOLDS_60_MIB.replace("time.sleep(3)", "time.sleep(8)"),
                         (Status.CRASH, Status.ERROR), name="run_patient")


def test_what_a_samples_own_forks_orphan_is_reaped_while_it_runs(sandboxes):
    # Each grandchild outlives its parent and comes to the slot process (forked samples: their subreaper) or to the
    # template. A zombie still counts toward the uid's process limit (44 here): left unreaped until the sample ended,
    # they stopped the sample's own forks halfway (EAGAIN; seen as a flaky hostile test). (gVisor forks slowly: 60
    # double forks a sample ran past the 5 s timeout on a slow afternoon, and 32 did in 2 of 4 runs on a day this VM
    # forked half as fast; 20 still leave more zombies than its limit of 16 processes. In a full suite's run under
    # gVisor, 2 of 4 such samples still ended ``timeout`` at 5 s: what is tested is the reaping, not the time, so they
    # run under the patient reward.)
    orphans = textwrap.dedent(f"""
        import os, time
        for _ in range({100 if sandboxes.runtime == "runc" else 20}):
            if os.fork() == 0:
                if os.fork() == 0:
                    os._exit(0)
                os._exit(0)
            os.waitpid(-1, 0)
            time.sleep(0.002)
        score = 1.0
    """)
    score(sandboxes, "run_patient", ["score = 0.5"] * 2)  # its samples run forked (runc) from now on
    report = score(sandboxes, "run_patient", [orphans] * 4)
    assert report.values == [1.0] * 4 and report.statuses == [Status.OK] * 4, report.errors


def test_a_sample_cannot_fill_the_kernel_with_empty_files(sandboxes):
    # gVisor ignores a tmpfs's nr_inodes (docs/explanation/security-defaults.md says so): there the files only go
    # with their sample
    limited = sandboxes.runtime == "runc"
    filler = textwrap.dedent(f"""
        import os
        made = 0
        try:
            for i in range({200_000 if limited else 20_000}):
                open(f"f{{i}}", "w").close()
                made += 1
        except OSError:
            pass
        score = float(made)
    """)
    toucher = "buffer = bytearray(200 << 20)\nscore = 0.25"
    report, _ = _innocents_after(sandboxes, [filler] * 3, toucher, 0.25, 3)
    if limited:  # stopped by the slot tmpfs's nr_inodes
        assert all(v is not None and 1000 < v < 10_000 for v in report.values[:3]), report.values[:3]


def _leave_dentries(sandboxes, mib: int) -> list:
    """A sample that looks up missing paths on the image's file system until the cgroup's own kernel memory figure
    grew by ``mib`` (runc, cgroup v1), or for 4 s: each lookup leaves a dentry (with a long name, ~900 bytes of kernel
    memory) that the kernel frees only at the limit. Under gVisor, its own kernel keeps few. Then the memory guard
    reads its figures once in calm times. Returns the MiB the sample saw grow."""
    flooder = textwrap.dedent(f"""
        import os, time
        kernel = "/sys/fs/cgroup/memory/memory.kmem.usage_in_bytes"
        used = lambda: int(open(kernel).read()) if os.path.exists(kernel) else 0
        start, end, looked = used(), time.monotonic() + 4, 0
        name = f"/usr/lib/{{os.getpid()}}" + "y" * 200
        while used() - start < ({mib} << 20) and time.monotonic() < end:
            for _ in range(2000):
                try:
                    os.stat(f"{{name}}{{looked}}")
                except OSError:
                    pass
                looked += 1
        score = (used() - start) / (1 << 20)
    """)
    floods = score(sandboxes, "run", [flooder])
    time.sleep(memory_guard.CALIBRATE_S + 1)
    return floods.values


def _leave_sockets_in_flight(sandboxes, pairs: int) -> list:
    """A sample that sends socket pairs over themselves and closes them: in flight, held by no process (gVisor never
    frees them; Linux collects them once the sample's processes are gone). Then the guard reads its figures."""
    planter = textwrap.dedent(f"""
        import socket
        for _ in range({pairs}):
            a, b = socket.socketpair()
            socket.send_fds(a, [b"x"], [a.fileno(), b.fileno()])
            a.close()
            b.close()
        score = 1.0
    """)
    planted = score(sandboxes, "run", [planter])
    time.sleep(memory_guard.CALIBRATE_S + 1)
    return planted.values


def test_dentries_a_sample_left_by_looking_up_missing_paths_get_no_innocent_killed(sandboxes):
    # 420 MiB of dentries in a 1 GiB sandbox (runc, cgroup v1) got later 200 MiB innocents killed near the mark, 3 of
    # 4 a batch: the memory guard took them for the usual excess of its figures, then for what idle slot processes'
    # descriptors could hold (red teams). They restart the sandbox now, which frees them.
    floods = _leave_dentries(sandboxes, 420)
    toucher = "buffer = b'x' * (200 << 20)\nimport time\ntime.sleep(0.6)\nscore = 0.25"
    for _ in range(3):
        report = score(sandboxes, "run", [toucher] * 4)
        assert report.values == [0.25] * 4 and report.statuses == [Status.OK] * 4, (report.errors, floods)


def test_a_little_memory_no_process_holds_gets_no_innocent_near_the_mark_killed(sandboxes):
    # 30 MiB of dentries, under what the guard then let pass, lowered the mark for good: one of two 380 MiB innocents
    # was killed in every later batch (red team, runc; under gVisor, sockets in flight). What no process holds moves
    # the mark now, up to half the margin. (A gVisor sample's address space is at most 384 MiB here.)
    runc = sandboxes.runtime == "runc"
    left = _leave_dentries(sandboxes, 45) if runc else _leave_sockets_in_flight(sandboxes, 200)
    holder = f"import time\nbuffer = b'x' * ({370 if runc else 250} << 20)\ntime.sleep(1.0)\nscore = 1.25"
    for _ in range(2):
        report = score(sandboxes, "run", [holder] * 2)
        assert report.values == [1.25] * 2 and report.statuses == [Status.OK] * 2, (report.errors, left)


def test_descriptor_tables_excuse_none_of_what_no_process_holds(sandboxes):
    # What no process held (runc: 350 MiB of dentries; gVisor: 500 socket pairs in flight, counted 240 KiB each) was
    # excused by a concurrent sample's forks, each with a dup2 to descriptor 511 (a table of 512 counted 120 MiB),
    # and the guard killed the innocent beside them, the biggest slot (red team). What sockets hold is read as it is
    # now, and what no process holds restarts the sandbox: the innocent is scored again.
    left = _leave_dentries(sandboxes, 350) if sandboxes.runtime == "runc" else _leave_sockets_in_flight(sandboxes, 500)
    tables = textwrap.dedent("""
        import os, time
        children = []
        for _ in range(3):
            child = os.fork()
            if child == 0:
                os.dup2(os.open("/dev/null", os.O_RDONLY), 511)
                time.sleep(2.5)
                os._exit(0)
            children.append(child)
        for child in children:
            os.waitpid(child, 0)
        score = 7.0
    """)
    size = 440 if sandboxes.runtime == "runc" else 340
    innocent = f"import time\ntime.sleep(0.7)\nbuffer = b'x' * ({size} << 20)\ntime.sleep(1.0)\nscore = 1.25"
    report = score(sandboxes, "run", [tables, innocent])
    assert (report.values[1], report.statuses[1]) == (1.25, Status.OK), (report.errors, left)
    later = score(sandboxes, "run", [HOLDS_60_MIB] * 2)
    assert later.values == [0.5] * 2 and later.statuses == [Status.OK] * 2, later.errors


def test_each_sample_runs_in_a_child_of_a_slot_process_that_stays(sandboxes):
    # Under runc, samples run forked (sandbox_image/processes/forked.py): each in a fresh child of a slot process that
    # runs no reward code itself and serves the next sample too.
    lineage = "import os\nprint(f'lineage {os.getppid()} {os.getpid()}')\nscore = 0.5"
    score(sandboxes, "run", [lineage] * 8)
    report = score(sandboxes, "run", [lineage] * 96)
    assert report.values == [0.5] * 96 and report.statuses == [Status.OK] * 96, [e for e in report.errors if e]
    pairs = [tuple(map(int, line.split()[1:])) for line in report.logs.splitlines() if line.startswith("lineage ")]
    assert len(pairs) == 96 and len({child for _, child in pairs}) == 96, pairs  # a fresh process each
    parents = {parent for parent, _ in pairs}
    if sandboxes.runtime == "runc":
        assert len(parents) <= 2, parents  # the two slots' processes served them all
    else:  # gVisor: each sample in a slot process of its own, a fresh child of the template
        assert len(parents) <= 2, parents


def test_half_a_frame_left_to_the_program_runner_reaches_no_later_sample(sandboxes):
    # A sample writes the start of a request to its socket to the runner and ends: the socket is its own (a fresh
    # process's, or a forked child's), so later samples of the slot still run programs.
    half = textwrap.dedent("""
        import struct
        from rewardbox.sandbox.programs import execution
        execution._connect().sock.sendall(struct.pack("<Q", 1 << 20) + b'{"language": "pyth')
        score = 1.0
    """)
    runs = textwrap.dedent("""
        from rewardbox.sandbox import run
        result = run("print(6 * 7)")
        score = 0.75 if result.stdout.strip() == "42" else 0.0
    """)
    report, _ = _innocents_after(sandboxes, [half] * 4, runs, 0.75, 8)
    assert report.values[:4] == [1.0] * 4, report.errors[:4]


RUNS = textwrap.dedent("""
    from rewardbox.sandbox import run
    result = run("print(6 * 7)")
    score = 0.75 if result.stdout.strip() == "42" else 0.0
""")


def test_a_request_whose_files_cannot_be_written_fails_alone_and_the_runner_serves_on(sandboxes):
    # A file and a directory of the same name, either way round: the runner's monitor for that slot died of it, and
    # every later sample of the slot that ran a program waited for its timeout. (Red team.)
    clash = textwrap.dedent("""
        from rewardbox.sandbox import run
        failed = []
        for files in ({"a": "x", "a/b": "y"}, {"a/b": "y", "a": "x"}):
            try:
                run("print(1)", files=files)
            except ValueError as e:
                failed.append("cannot be written" in str(e))
        score = 1.0 if failed == [True, True] else 0.0
    """)
    report, elapsed = _innocents_after(sandboxes, [clash] * 2, RUNS, 0.75, 8)
    assert report.values[:2] == [1.0] * 2, report.errors[:2]
    assert elapsed < TIMEOUT_S + 5, elapsed


def test_what_a_sample_leaves_in_flight_at_the_program_runner_is_gone_before_the_next_sample(sandboxes):
    # A sample holds a file that fills most of its /tmp (unlinked: emptying /tmp does not free it), asks for a
    # program whose reply it never reads, and sends the file and its own socket over that socket: in flight in the
    # runner's receive queue, they outlive the sample's processes. The runner now lets go of a sample's socket before
    # the slot's next sample starts, not once a later sample runs a program. (Red team: a socket left so, set to signal
    # the slot process when it closed, killed it while it ran an innocent.)
    stash = textwrap.dedent("""
        import os, socket, time
        from rewardbox.sandbox.programs import execution
        from rewardbox.sandbox.programs import run_requests
        fd = os.open("/tmp/held", os.O_RDWR | os.O_CREAT)
        os.write(fd, b"x" * (48 << 20))
        os.unlink("/tmp/held")
        sock = execution._connect().sock
        run_requests.write_frame(sock, {  # a reply it never reads: the runner blocks writing it, reading nothing
            "language": "python", "code": "import sys; sys.stdout.write('B' * (1 << 20))", "files": {},
            "runs": [{"stdin": "", "args": []}], "timeout_s": 3, "memory_mb": 256, "max_output_bytes": 2 << 20,
            "compile_timeout_s": 30})
        time.sleep(0.5)
        socket.send_fds(sock, [b"x"], [sock.fileno(), fd])
        score = 1.0
    """)
    # Without the runner (this sample never runs a program): its /tmp has room for what the one before held.
    writes = "open('/tmp/big', 'wb').write(b'y' * (48 << 20))\nscore = 0.5"
    report, _ = _innocents_after(sandboxes, [stash] * 2, writes, 0.5, 8)
    assert report.values[:2] == [1.0] * 2, report.errors[:2]


CYCLE = textwrap.dedent("""
    import os, socket
    fd = os.open("/tmp/held", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"x" * (48 << 20))
    os.unlink("/tmp/held")
    a, b = socket.socketpair()
    socket.send_fds(a, [b"x"], [a.fileno(), b.fileno(), fd])  # each end in the other's queue: a cycle
    score = 1.0
""")


def test_what_rides_in_a_socket_sent_over_itself_never_fills_a_later_samples_tmp(sandboxes):
    # gVisor never frees Unix sockets sent over themselves, nor what rides in them (Linux collects such cycles once
    # their processes are gone): the unlinked file kept the slot's /tmp full, and every later sample of that slot
    # got ENOSPC. Now the slot's next process gets a fresh tmpfs, and once replaced ones could hold a quarter of the
    # sandbox's memory, the sandbox starts afresh: 20 such samples hold 960 MiB of its 1 GiB.
    writes = "open('/tmp/big', 'wb').write(b'y' * (48 << 20))\nscore = 0.5"
    for _ in range(5):
        score(sandboxes, "run", [CYCLE] * 4)
        time.sleep(1.5)  # a restart, if one is due, begins before the next batch
        report = score(sandboxes, "run", [writes] * 6)
        assert report.values == [0.5] * 6 and report.statuses == [Status.OK] * 6, report.errors


def test_a_sample_cannot_have_a_descriptor_signal_the_process_that_forked_it(sandboxes):
    # The red team's trap: the sample makes the runner block writing a reply it never reads, sets its socket to
    # signal its slot process (O_ASYNC, F_SETOWN), and leaves the socket in flight in the runner's receive queue;
    # when the runner closed it, SIGIO killed the slot process while it ran a later innocent (a crash blamed on the
    # innocent, the trap's own sample scored ok). F_SETOWN is refused now, and the runner lets go of the socket
    # before the slot's next sample starts.
    trap = textwrap.dedent("""
        import fcntl, os, socket, time
        from rewardbox.sandbox.programs import execution
        from rewardbox.sandbox.programs import run_requests
        sock = execution._connect().sock
        run_requests.write_frame(sock, {
            "language": "python", "code": "import sys; sys.stdout.write('B' * (1 << 20))", "files": {},
            "runs": [{"stdin": "", "args": []}], "timeout_s": 3, "memory_mb": 256, "max_output_bytes": 2 << 20,
            "compile_timeout_s": 30})
        time.sleep(0.5)  # the runner is blocked writing the rest of the reply
        signalled = 0.0
        try:
            fcntl.fcntl(sock.fileno(), fcntl.F_SETOWN, os.getppid())
            signalled = 1.0
        except PermissionError:
            pass
        fcntl.fcntl(sock.fileno(), fcntl.F_SETFL, fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
        socket.send_fds(sock, [b"x"], [sock.fileno()])
        score = signalled
    """)
    report, _ = _innocents_after(sandboxes, [trap] * 2, RUNS, 0.75, 8)
    assert report.values[:2] == [0.0] * 2, report.errors[:2]
    _innocents_after(sandboxes, [], RUNS, 0.75, 8)


def test_a_lingering_socket_left_at_the_program_runner_holds_up_no_later_sample(sandboxes):
    # The sample fills a TCP connection nobody reads, asks it to linger for an hour on close, and leaves it in flight
    # at the program runner, whose monitor closes what it finds there: that close waited for the hour. Under gVisor
    # it stalled the whole sandbox (every sample of every batch UNAVAILABLE after 118 s, `docker exec` hung; red
    # team). SO_LINGER now succeeds and changes nothing.
    lingerer = textwrap.dedent("""
        import socket, struct
        from rewardbox.sandbox.programs import execution
        from rewardbox.sandbox import run
        run("print(1)")  # the runner serves this process's socket from now on
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        connection = socket.create_connection(server.getsockname())
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
        connection.setblocking(False)
        try:
            while True:
                connection.send(b"x" * 65536)
        except BlockingIOError:
            pass
        socket.send_fds(execution._connect().sock, [b"x"], [connection.fileno(), server.fileno()])
        score = struct.unpack("ii", connection.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))[0]
    """)
    asked = []
    for _ in range(3):  # the stall came in most batches, not all
        report, elapsed = _innocents_after(sandboxes, [lingerer] * 2, RUNS, 0.75, 8)
        assert elapsed < TIMEOUT_S + 5, elapsed
        asked += report.values[:2]
    assert asked == [0.0] * 6  # linger asked for, not taken


def test_bytes_written_to_the_program_runner_while_a_program_runs_end_that_program(sandboxes):
    # A sample's process writes to its runner socket while its own program runs (rewardbox.sandbox.run never does):
    # the runner kills the program and serves that socket no more. Before, it stopped watching the socket, so the
    # program outlived the sample, and the slot's later samples' run() calls waited behind it until they timed out.
    stray = textwrap.dedent("""
        import os, time
        from rewardbox.sandbox.programs import execution
        from rewardbox.sandbox import run
        fd = execution._connect().sock.fileno()
        if os.fork() == 0:
            time.sleep(1.0)
            os.write(fd, b"x")
            os._exit(0)
        run("import time; time.sleep(120)", timeout_s=120)
        score = 1.0
    """)
    runs = textwrap.dedent("""
        from rewardbox.sandbox import run
        result = run("print(6 * 7)")
        score = 0.75 if result.stdout.strip() == "42" else 0.0
    """)
    report, _ = _innocents_after(sandboxes, [stray] * 2, runs, 0.75, 6)
    assert Status.OK not in report.statuses[:2], report.values[:2]  # run() failed: the program was ended early
    report, _ = _innocents_after(sandboxes, [], runs, 0.75, 8)  # the slots the strays ran in serve on


def test_a_sample_that_kills_the_process_that_forked_it_fails_alone(sandboxes):
    # A forked sample shares its uid with the slot process that forked it, so it can signal it: killing it ends the
    # slot process while this sample's own unit runs, and only this sample fails (the server blames it).
    attacker = "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n" \
               "score = 1.0"
    report, elapsed = _innocents_after(sandboxes, [attacker] * 2, "score = 0.5", 0.5, 8)
    assert all(s in {Status.OK, Status.CRASH} for s in report.statuses[:2]), report.errors[:2]
    assert elapsed < 2 * TIMEOUT_S + 10, elapsed


def test_a_sample_that_stops_the_process_that_forked_it_times_out_alone(sandboxes):
    # SIGSTOP cannot be caught: the slot process stays stopped, its own deadline for the child never comes, and the
    # server's does. Every answer before the stopper's had left the slot process before its child started, so the
    # server blames the stopper alone (a timeout, as for a sample that hangs) and the rest of the batch goes on. It
    # used to send the whole remainder back, the stopper included, until the fork budget ran out: 87 s here.
    stopper = "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\nexcept OSError:\n    pass\n" \
              "score = 1.0"
    report, elapsed = _innocents_after(sandboxes, [stopper] * 3, "score = 0.5", 0.5, 8)
    stopped = report.count(Status.TIMEOUT)
    # Only a forked stopper reaches its slot process (under gVisor a sample's process is a slot process, whose
    # parent is the template, another uid's): under runc every one does.
    assert report.statuses[:3].count(Status.OK) + stopped == 3, report.errors[:3]
    assert stopped == (0 if sandboxes.runtime == "runsc" else 3), report.errors[:3]
    assert report.workers_replaced <= stopped, report.workers_replaced
    assert elapsed < 3 * (TIMEOUT_S + 1) + 10, elapsed  # each stopper's own timeout, at worst one after another


SCANNER = textwrap.dedent("""
    import re, sys
    found = set()
    frame = sys._getframe()
    while frame is not None:  # every object the stack reaches that holds completions
        for value in list(frame.f_locals.values()):
            for text in getattr(value, "completions", None) or ():
                found.update(re.findall(r"SECRET-([0-9]+)", text))
        frame = frame.f_back
    import ctypes  # then all its memory that no file backs (it is not dumpable: no /proc/self/mem to read)
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for region in regions:
        start, end = (int(x, 16) for x in region[0].split("-"))
        anonymous = region[4] == "0" and not region[-1].startswith("[v")  # not [vvar], [vdso], ...
        if region[1].startswith("r") and anonymous and end - start < (1 << 30):
            found.update(m.decode() for m in re.findall(rb"SECRET-([0-9]+)", ctypes.string_at(start, end - start)))
    score = float(len(found))
""")


def test_no_sample_finds_the_text_of_its_requests_other_samples_in_its_memory(sandboxes):
    # A request's samples reach a slot process in one memory mapping (codec.Request), decoded one sample at a time;
    # the process that scores a unit (a forked child, or a slot process of its own) unmaps it before the unit runs.
    # So code from a completion finds no other completion of its request to copy: not up the stack, not
    # anywhere in its process's memory. It used to find the rest of its request (the red team of #18).
    innocents = [f"score = 0.5  # SECRET-{i}" for i in range(12)]
    report = score(sandboxes, "run", [SCANNER] + innocents[:6] + [SCANNER] + innocents[6:])
    assert report.statuses[0] == report.statuses[7] == Status.OK, report.errors
    assert [report.values[0], report.values[7]] == [0.0, 0.0]
    assert report.values[1:7] + report.values[8:] == [0.5] * 12


def test_no_sample_finds_what_earlier_samples_of_its_slot_printed_or_raised_in_its_memory(sandboxes):
    # Forked, a child is a copy of its slot process: a child's answer (its output, its error text) goes from a
    # mapping it shares with the slot process straight to the server, never through the slot process's heap, where
    # the next child would find it. It used to: a scanner found the error text of the sample before it.
    printers = [f"print('LEAK-' + str({i} * 7))\nscore = 0.5" for i in range(8)]
    raisers = [f"raise ValueError('LEAK-' + str({i} * 7))" for i in range(8, 12)]
    scanner = SCANNER.replace("SECRET-", "LEAK-")
    report = score(sandboxes, "run", printers + raisers + [scanner] * 4)
    assert report.values[:8] == [0.5] * 8 and report.statuses[8:12] == [Status.ERROR] * 4, report.errors
    assert report.values[12:] == [0.0] * 4, (report.values[12:], report.errors[12:])


def test_code_from_a_completion_never_runs_where_other_samples_were_scored(sandboxes):
    # A reward that runs code only sometimes: its other samples' text must not linger where the code runs. No
    # process scores two samples, and a slot process runs no reward code: the scanners find nothing, and every
    # sample is scored exactly once.
    clean = [f"<answer>1</answer> SECRET-{i} " + "x" * (600 + 97 * i) for i in range(24)]  # sizes malloc keeps apart
    scanner = "code:" + SCANNER
    report = score(sandboxes, "mixed", clean[:12] + [scanner] + clean[12:] + [scanner])
    assert report.values[:12] + report.values[13:25] == [0.5] * 24, report.errors
    assert [report.values[12], report.values[25]] == [0.0, 0.0], (report.errors[12], report.errors[25])
    assert report.statuses[12] == report.statuses[25] == Status.OK


def test_a_sample_cannot_change_the_limits_or_the_scheduling_of_the_process_that_forked_it(sandboxes):
    # Forked, a sample shares its uid with its slot process, whose limits, CPUs and scheduling and I/O classes every
    # later child inherits: the seccomp filter lets prlimit and sched_set* act on the caller alone, and refuses
    # ioprio_set. (A red team lowered its process limit to 0, and every later sample of that slot failed to start.)
    attacker = textwrap.dedent("""
        import ctypes, os, platform, resource
        parent, done = os.getppid(), 0
        libc = ctypes.CDLL(None, use_errno=True)

        def ioprio_idle(pid):  # ioprio_set(IOPRIO_WHO_PROCESS, pid, the idle class)
            if libc.syscall({"x86_64": 251, "aarch64": 30}[platform.machine()], 1, pid, 3 << 13) != 0:
                raise OSError(ctypes.get_errno(), "ioprio_set")

        for attempt in (lambda: resource.prlimit(parent, resource.RLIMIT_NPROC, (0, 0)),
                        lambda: ioprio_idle(parent),
                        lambda: resource.prlimit(parent, resource.RLIMIT_AS, (1 << 20, 1 << 20)),
                        lambda: resource.prlimit(parent, resource.RLIMIT_CPU, (0, 0)),
                        lambda: os.sched_setaffinity(parent, {0}),
                        lambda: os.sched_setscheduler(parent, os.SCHED_IDLE, os.sched_param(0))):
            try:
                attempt()
                done += 1
            except OSError:
                pass
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # its own: allowed
        score = float(done)
    """)
    report, _ = _innocents_after(sandboxes, [attacker] * 3, "score = 0.5", 0.5, 12)
    assert report.values[:3] == [0.0] * 3, report.errors[:3]
    _innocents_after(sandboxes, [], "score = 0.5", 0.5, 16)


def test_a_sample_that_stops_reading_its_program_runner_holds_up_no_later_sample(sandboxes):
    # A sample asks for a program with a large output, never reads the reply, and sends its own end of the socket
    # over the socket itself: that end is in flight in the runner's receive queue, so the socket never closes. A
    # runner that waited to write the reply served that slot no more; a reply that makes no progress now fails.
    wedge = textwrap.dedent("""
        import socket, time
        from rewardbox.sandbox.programs import execution
        from rewardbox.sandbox.programs import run_requests
        sock = execution._connect().sock
        code = "import sys; sys.stdout.write('x' * (1 << 20)); sys.stderr.write('y' * (1 << 20))"
        run_requests.write_frame(sock, {
            "language": "python", "code": code, "files": {}, "runs": [{"stdin": "", "args": []}], "timeout_s": 5,
            "memory_mb": 256, "max_output_bytes": 1 << 20, "compile_timeout_s": 30})
        time.sleep(1.5)
        socket.send_fds(sock, [b"z"], [sock.fileno()])
        score = 1.0
    """)
    runs = textwrap.dedent("""
        from rewardbox.sandbox import run
        result = run("print(6 * 7)")
        score = 0.75 if result.stdout.strip() == "42" else 0.0
    """)
    _innocents_after(sandboxes, [wedge] * 2, runs, 0.75, 6)
    _, elapsed = _innocents_after(sandboxes, [], runs, 0.75, 8)
    assert elapsed < TIMEOUT_S + 5, elapsed


HOLDER = textwrap.dedent("""
    import socket, time
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\\0rbx-test-hold")
    listener.listen(4)
    listener.settimeout(3)
    held = []
    try:
        connection, _ = listener.accept()
        held = [socket.socket(fileno=fd) for fd in socket.recv_fds(connection, 16, 4)[1]] + [connection]
    except OSError:
        pass
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            if SLOW and len(held) > 1:  # a little of the runner's reply each second: its writes never stall long
                held[0].setblocking(False)
                try:
                    held[0].recv(65536)
                except BlockingIOError:
                    pass
            time.sleep(1.0)
        except BaseException:  # its own timeout: it holds on until it is killed
            pass
""")
SENDER = textwrap.dedent("""
    import socket, time
    from rewardbox.sandbox.programs import execution
    from rewardbox.sandbox.programs import run_requests
    sock = execution._connect().sock
    for _ in range(300):
        try:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect("\\0rbx-test-hold")
            break
        except OSError:
            time.sleep(0.01)
    socket.send_fds(connection, [b"x"], [sock.fileno()])
    if SLOW:  # a reply of 8 MiB for the holder to read slowly: this sample ends once the runner writes it
        run_requests.write_frame(sock, {
            "language": "python", "code": "import sys; sys.stdout.write('A' * (8 << 20))", "files": {},
            "runs": [{"stdin": "", "args": []}], "timeout_s": 4, "memory_mb": 256, "max_output_bytes": 16 << 20,
            "compile_timeout_s": 30})
        started = time.monotonic()
        while time.monotonic() - started < 4:
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    break
            except BlockingIOError:
                time.sleep(0.005)
    score = 1.0
""")


@pytest.mark.parametrize("slow", [False, True], ids=["holds", "reads-slowly"])
def test_a_runner_socket_handed_to_a_concurrent_sample_holds_up_no_later_sample(sandboxes, slow):
    # A forked sample hands its socket to the program runner to a concurrent sample of another slot (an abstract
    # Unix socket reaches it), which holds it past the first one's end (and reads the runner's reply to a request
    # it left there, a little each second). The runner serves, reads and writes a child's socket only until the slot
    # process writes again, which it does only once that child is gone. (Red teams: the next sample's run() in that
    # slot timed out, first while the runner waited to read, then while it wrote the slowly read reply.)
    runs = textwrap.dedent("""
        from rewardbox.sandbox import run
        result = run("print(6 * 7)")
        score = 0.75 if result.stdout.strip() == "42" else 0.0
    """)
    flag = f"SLOW = {slow}\n"
    score(sandboxes, "run", [flag + runs] * 4)  # forked from here on (runc)
    batch = [flag + HOLDER] + [flag + runs] * 3 + [flag + SENDER] + [flag + runs] * 3
    report = score(sandboxes, "run", batch)
    others = [(v, s) for i, (v, s) in enumerate(zip(report.values, report.statuses)) if i not in (0, 4)]
    assert others == [(0.75, Status.OK)] * 6, report.errors
