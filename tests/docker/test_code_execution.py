"""``rewardbox.sandbox.run`` / ``run_tests`` in real containers (runc and gVisor): model-written programs in
several languages, each with the status it earned, while the other samples of the same batch keep their exact
scores; programs that plant files or processes, try the network, or go after the reward's own process and files.

One container per runtime serves every test: its image has ``system_packages: [g++, gcc, nodejs]`` (downloaded on
the host, installed offline) and the reward has ``network: true``, so a program's lack of network is the runner's
doing, not the container's.
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest
import yaml

from rewardbox import RewardSandboxes, build_samples, load_config
from rewardbox.wire import Status
from tests.docker.conftest import docker_backend

REWARD = '''
import json, os, socket
from rewardbox.sandbox import run, run_tests

CODES = {"ok": 1, "runtime_error": 2, "timeout": 3, "memory": 4, "compile_error": 5, "output_limit": 6}
SENTINEL = "sentinel.txt"


def judge(prompt, completion, example):
    """completion: a JSON spec of what to run. Returns the status's code, + 0.5 when stdout is the one expected."""
    spec = json.loads(completion)
    if spec.get("kind") == "tests":
        t = run_tests(spec["code"], spec["tests"], language=spec["language"], timeout_s=spec.get("timeout_s", 3))
        print("TESTS", t.passed, t.total, [r.status for r in t.results], t.compile and t.compile.stderr[-500:])
        return t.fraction
    if spec.get("kind") == "tamper":
        return tamper(spec)
    if spec.get("kind") == "forked":
        return from_a_fork(spec)
    if spec.get("kind") == "twice":  # two programs in a row: the second is the same slot's next program
        first = run(spec["code"], timeout_s=spec.get("timeout_s", 3))
        second = run(spec["then"], timeout_s=3)
        print("FIRST", first.status, first.stdout[-2000:], first.stderr[-2000:])
        print("SECOND", second.status, second.stdout[-2000:], second.stderr[-2000:])
        return 1.5 if second.ok and second.stdout.strip() == spec["expect"] else -1.0
    r = run(spec["code"], language=spec.get("language", "python"), stdin=spec.get("stdin", ""),
            timeout_s=spec.get("timeout_s", 3), memory_mb=spec.get("memory_mb", 256),
            max_output_bytes=spec.get("max_output_bytes", 1 << 20))
    print("RESULT", r.status, r.exit_code, r.signal, repr(r.stdout[-300:]), r.stderr[-1500:], r.wall_s, r.cpu_s)
    return CODES[r.status] + (0.5 if "expect" in spec and r.stdout.strip() == spec["expect"] else 0.0)


def tamper(spec):
    """Runs a program that goes after this process and its files; 1.5 only when everything it tried was refused
    and this process, its files and its environment are as they were."""
    with open(SENTINEL, "w") as f:
        f.write("mine")
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()  # the reward itself has network
    with open(SENTINEL, "r+") as held:  # open while the program runs: /proc/<pid>/fd/<n> leads to it
        # its directory is the program's /tmp too, by name: the program gets the ways that could lead to this one
        r = run(spec["code"], args=[str(os.getuid()), str(os.getpid()), f"/proc/{os.getpid()}/cwd"], timeout_s=5)
        held.seek(0)
        intact = held.read() == "mine"
    print("TAMPER", r.status, r.stdout[-3000:], r.stderr[-2000:])
    attempts = json.loads(r.stdout.strip().splitlines()[-1])
    did = {k: v for k, v in attempts.items() if not str(v).startswith("refused")}
    with open(SENTINEL) as f:
        intact = intact and f.read() == "mine" and os.listdir(".") == [SENTINEL]
    if did or not intact or os.environ.get("RBX_SECRET") != "s3cret":
        print("TAMPERED", did, intact)
        return -1.0
    return 1.5


def from_a_fork(spec):
    """Calls run() in a process this reward forks: 1.5 only when it is refused there (a runner started there would
    run the program as the reward's own uid) and still works here."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            r = run(spec["code"], timeout_s=3)
            said = f"ran: uid {r.stdout.strip()}, the reward's {os.getuid()}"
        except Exception as e:  # noqa: BLE001 - the refusal, or anything else, is reported
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode()[:4000])
        os._exit(0)
    os.close(write)
    said = os.read(read, 4000).decode()
    os.waitpid(pid, 0)
    here = run(spec["code"], timeout_s=3)
    print("FORKED", said, "HERE", here.status, here.stdout.strip(), os.getuid())
    refused = said.startswith("RunnerUnavailable: rewardbox.sandbox.run works in the reward's own process")
    return 1.5 if refused and here.ok and here.stdout.strip() != str(os.getuid()) else -1.0
'''

SUM = {  # a + b from stdin, in each language
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "c": "#include <stdio.h>\nint main(void) { long a, b; scanf(\"%ld %ld\", &a, &b); printf(\"%ld\\n\", a + b); }\n",
    "javascript": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                  "console.log(a + b);\n",
    "bash": "read a b\necho $((a + b))\n",
}
GOOD = json.dumps({"code": SUM["python"], "stdin": "20 22", "expect": "42"})
TIMEOUT_S = 2.0


@pytest.fixture(scope="module", params=["runc", "runsc"])
def sandboxes(request, tmp_path_factory, docker_client, base_image):
    if request.param == "runsc" and "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: start it as scripts/setup.sh does")
    root = tmp_path_factory.mktemp(f"code-{request.param}")
    (root / "judge.py").write_text(textwrap.dedent(REWARD))
    (root / "config.yaml").write_text(yaml.safe_dump({
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image,
                                                    "runtime": None if request.param == "runc" else "runsc"}},
        "rewards": [{"name": "judge", "source": "judge.py", "timeout_s": 30, "workers": 2, "warm": 4,
                     "default_score": -5.0, "memory": "2g", "pids": 256, "network": True,
                     "env": {"RBX_SECRET": "s3cret"}, "system_packages": ["g++", "gcc", "nodejs"]}],
    }))
    config = load_config(root / "config.yaml")
    started = RewardSandboxes(config, backend=docker_backend(config, docker_client))
    started.start()
    yield started
    started.stop()


def score(sandboxes, completions: list):
    reward = sandboxes["judge"]
    texts = [c if isinstance(c, str) else json.dumps(c) for c in completions]
    report = asyncio.run(reward.client.score(build_samples(["p"] * len(texts), texts, {})))
    assert report.statuses == [Status.OK] * len(texts), (report.statuses, report.errors, report.logs[-3000:])
    return report


def test_a_correct_program_in_each_language(sandboxes):
    report = score(sandboxes, [{"code": code, "language": language, "stdin": "20 22", "expect": "42"}
                               for language, code in SUM.items()])
    assert report.values == [1.5] * len(SUM), report.logs[-4000:]


def test_run_tests_builds_once_and_counts_passed_tests(sandboxes):
    tests = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "-5 5", "stdout": "0"}, {"stdin": "2 2", "stdout": "5"}]
    report = score(sandboxes, [{"kind": "tests", "code": SUM["cpp"], "language": "cpp", "tests": tests},
                               {"kind": "tests", "code": "int main( {", "language": "cpp", "tests": tests},
                               {"kind": "tests", "code": SUM["javascript"], "language": "js", "tests": tests}])
    assert report.values == [2 / 3, 0.0, 2 / 3], report.logs[-4000:]
    assert "compile_error" in report.logs


BAD = {  # program -> the status code the reward returns for it
    "infinite loop": ({"code": "while True:\n    pass\n", "timeout_s": TIMEOUT_S}, 3),
    "sleeps forever": ({"code": "import time\ntime.sleep(1000)\n", "timeout_s": TIMEOUT_S}, 3),
    "memory bomb": ({"code": "x = []\nwhile True:\n    x.append(bytearray(10 << 20))\n", "memory_mb": 256}, 4),
    "C++ memory bomb": ({"code": "#include <vector>\nint main(){ std::vector<std::vector<char>> v; "
                                 "for(;;) v.emplace_back(10 << 20, 1); }", "language": "cpp", "memory_mb": 256}, 4),
    # many processes, each under its own limit, together far over it (they could get a concurrent program of another
    # sample OOM-killed): the runner adds them up
    "forked memory hogs": ({"code": "import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n"
                                    "        x = bytearray(60 << 20)\n        time.sleep(10)\ntime.sleep(10)\n",
                            "memory_mb": 256, "timeout_s": 8}, 4),
    "non-zero exit": ({"code": "import sys\nsys.exit(3)\n"}, 2),
    "exception": ({"code": "raise ValueError('no')\n"}, 2),
    "segfault": ({"code": "int main(){ volatile int *p = 0; return *p; }", "language": "c"}, 2),
    "C++ syntax error": ({"code": "int main( { return 0 }", "language": "cpp"}, 5),
    "fork bomb": ({"code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                   "timeout_s": TIMEOUT_S}, 3),
    "stdout flood": ({"code": "while True:\n    print('x' * 4096)\n", "max_output_bytes": 65536}, 6),
    "stderr flood in C": ({"code": "#include <stdio.h>\nint main(){ for(;;) fputs(\"yyyyyyyy\", stderr); }",
                           "language": "c", "max_output_bytes": 65536}, 6),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_program_gets_its_status_and_the_rest_of_the_batch_keeps_exact_scores(sandboxes, name):
    spec, code = BAD[name]
    batch = [GOOD, GOOD, spec, GOOD, GOOD]
    report = score(sandboxes, batch)
    assert report.values == [1.5, 1.5, code, 1.5, 1.5], (name, report.logs[-4000:])
    # and the next batch is entirely healthy
    assert score(sandboxes, [GOOD] * 4).values == [1.5] * 4


PLANT = r'''
import os, time
open("planted.txt", "w").write("x")
os.makedirs("deep/er", exist_ok=True)
open("deep/er/planted", "w").write("x")
open("/tmp/planted", "w").write("x")  # its /tmp is its own directory: gone for the next program too
tried = []
for path in ("/var/tmp/planted", "/dev/shm/planted", "/run/planted", "/opt/planted", "/planted",
             os.path.expanduser("~/../planted")):
    try:
        open(path, "w").write("x")
        tried.append(path)
    except OSError:
        pass
if os.fork() == 0:  # a daemon that outlives the program
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.01)
    os._exit(0)
print("written outside:", tried)
'''
LOOK = r'''
import os
def status(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read()
    except OSError:  # it exited after the listing (another uid's process, most often): gone, so not left behind
        return ""
# live processes of this uid: a zombie holds nothing and is only waiting for its subreaper
mine = [p for p, s in ((p, status(p)) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
        if f"\nUid:\t{os.getuid()}\t" in s and "\nState:\tZ" not in s]
outside = [p for p in ("/tmp/planted", "/var/tmp/planted", "/dev/shm/planted", "/run/planted", "/opt/planted")
           if os.path.exists(p)]
print(sorted(os.listdir(".")), mine, outside)
'''


def test_what_a_program_leaves_is_gone_for_the_next_program(sandboxes):
    twice = {"kind": "twice", "code": PLANT, "then": LOOK, "expect": "['main.py'] [] []"}
    report = score(sandboxes, [twice, GOOD, twice])
    assert report.values == [1.5, 1.5, 1.5], report.logs[-4000:]
    assert "written outside: []" in report.logs  # and it could write nowhere outside its directory at all


# Processes that never stay put: each forks and exits at once, so that a kill that lists them misses the newest.
# gVisor's kill(-1) is not atomic (processes.tree.kill_uid): a process forked between its listing and its signal
# survives one, and a kill that stopped at its first kill(-1) left two of these behind.
CHAINS = {
    "a chain that forks and exits": "import os\nwhile True:\n    if os.fork():\n        os._exit(0)\n",
    "a chain whose processes ignore SIGCHLD": (
        "import os, signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\nwhile True:\n    if os.fork():\n"
        "        os._exit(0)\n"),
    "eight chains under a subreaper of their own": (
        "import ctypes, os, time\nctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\nfor _ in range(8):\n"
        "    if os.fork() == 0:\n        while True:\n            if os.fork():\n                os._exit(0)\n"
        "time.sleep(0.2)\n"),
    "threads starting chains as the program exits": (
        "import os, threading, time\ndef chain():\n    while True:\n        try:\n            if os.fork() == 0:\n"
        "                while True:\n                    if os.fork():\n                        os._exit(0)\n"
        "        except OSError:\n            pass\nfor _ in range(4):\n    threading.Thread(target=chain, daemon=True).start()\n"
        "time.sleep(0.3)\nos._exit(0)\n"),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_processes_that_fork_and_exit_without_end_are_gone_for_the_next_program(sandboxes, name):
    twice = {"kind": "twice", "code": CHAINS[name], "then": LOOK, "expect": "['main.py'] [] []", "timeout_s": 1}
    report = score(sandboxes, [twice, GOOD, twice, twice])
    assert report.values == [1.5, 1.5, 1.5, 1.5], (name, report.logs[-4000:])


def test_a_program_has_no_network_even_in_a_reward_that_has(sandboxes):
    # nor Unix sockets, named or abstract: concurrent programs of other samples could meet there
    connect = ("import socket\n"
               "for family in (socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK, socket.AF_UNIX):\n"
               "    try:\n"
               "        socket.socket(family, socket.SOCK_DGRAM)\n"
               "        print('opened', family)\n"
               "    except OSError as e:\n"
               "        print('refused', family, e.errno)\n"
               "socket.create_connection(('172.17.0.1', 53), timeout=1)\n")
    curl = "const s = require('net').connect(53, '172.17.0.1'); s.on('error', e => { console.log(e.code); });"
    report = score(sandboxes, [{"code": connect}, {"code": curl, "language": "js", "expect": "EPERM"}, GOOD])
    assert report.values == [2.0, 1.5, 1.5], report.logs[-4000:]  # python: PermissionError, a runtime_error
    assert "opened" not in report.logs


TAMPER = r'''
import ctypes, json, os, signal, sys
reward_uid, reward_pid, reward_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tried = {}
def attempt(name, fn):
    try:
        tried[name] = "did: " + repr(fn())[:100]
    except BaseException as e:
        tried[name] = "refused: " + type(e).__name__
attempt("kill", lambda: os.kill(reward_pid, signal.SIGKILL))
attempt("stop", lambda: os.kill(reward_pid, signal.SIGSTOP))
attempt("ptrace", lambda: ctypes.CDLL(None, use_errno=True).ptrace(16, reward_pid, 0, 0) == 0
        or (_ for _ in ()).throw(PermissionError()))
attempt("read memory", lambda: open(f"/proc/{reward_pid}/mem", "rb").read(1))
attempt("write memory", lambda: open(f"/proc/{reward_pid}/mem", "wb").write(b"x"))
def secret_in_environ():
    data = open(f"/proc/{reward_pid}/environ", "rb").read()  # gVisor lets it read: it must hold nothing
    if b"s3cret" not in data:
        raise PermissionError("nothing there")
    return data
def through_its_descriptors():  # gVisor lists them: none may open
    opened = []
    for fd in os.listdir(f"/proc/{reward_pid}/fd"):
        target = os.readlink(f"/proc/{reward_pid}/fd/{fd}")
        if target.startswith("/dev/null") or target.startswith("socket:") or target.startswith("pipe:"):
            continue
        for mode in ("rb", "r+b"):
            try:
                with open(f"/proc/{reward_pid}/fd/{fd}", mode) as f:
                    opened.append((target, mode, f.read(10)))
            except OSError:
                pass
    if not opened:
        raise PermissionError("none")
    return opened
attempt("environment", secret_in_environ)
attempt("its open files", through_its_descriptors)
attempt("its directory", lambda: os.listdir(reward_dir))
attempt("its slot's tmpfs", lambda: os.listdir(f"/tmp/slot-{reward_uid}"))
attempt("its root", lambda: os.listdir(f"/proc/{reward_pid}/root/tmp"))
attempt("its sentinel", lambda: open(os.path.join(reward_dir, "sentinel.txt")).read())
attempt("overwrite sentinel", lambda: open(os.path.join(reward_dir, "sentinel.txt"), "w").write("forged"))
attempt("plant in its directory", lambda: open(os.path.join(reward_dir, "planted.py"), "w").write("x"))
attempt("become it", lambda: os.setuid(reward_uid))
attempt("become root", lambda: os.setuid(0))
attempt("the server's socket", lambda: __import__("socket").socket(1).connect("/run/rewardbox/grpc.sock"))
attempt("the secret", lambda: os.environ["RBX_SECRET"])
print(json.dumps(tried))
'''


def test_a_program_cannot_change_or_read_the_reward_that_runs_it(sandboxes):
    report = score(sandboxes, [GOOD, {"kind": "tamper", "code": TAMPER}, GOOD])
    assert report.values == [1.5, 1.5, 1.5], report.logs[-5000:]


def test_a_process_the_reward_forks_cannot_run_programs_as_the_rewards_own_uid(sandboxes):
    # red team (runc): run() in a process the reward forked started a runner of its own there, and the program ran
    # under the reward's uid, able to reach the reward's files and process
    uid = "import os; print(os.getuid())"
    report = score(sandboxes, [GOOD, {"kind": "forked", "code": uid}, GOOD])
    assert report.values == [1.5, 1.5, 1.5], report.logs[-3000:]
