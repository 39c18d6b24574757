"""A private, writable /tmp for every sample and every program it runs, in real containers (runc and gVisor):
rewards that write to /tmp by name work, and nothing one sample puts there reaches another, concurrent or later
(sandbox_image/confine/private_tmp.py).

Each test asserts the innocent samples' exact values and statuses, not only the guilty ones'.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from rewardbox import build_samples
from rewardbox.wire import Status
from tests.docker.conftest import sandboxes_on_runtime

REWARDS = '''
import ctypes, fcntl, os, subprocess, sys, tempfile, time

PROGRAM = "import random, sys; print(getattr(random, 'PLANTED', 0) + len(sys.argv))"


def plain(prompt, completion, example):
    """A reward written for plain Python: a temporary file, a script in /tmp by name, run with python3 from there
    (which puts /tmp first on sys.path). The completion "plant" also leaves a random.py there, and waits, so that
    concurrent samples run while it is in place."""
    fd, name = tempfile.mkstemp(dir="/tmp", suffix=".txt")
    os.write(fd, completion.encode())
    os.close(fd)
    with open(name) as f:
        assert f.read() == completion
    with open("/tmp/solution.py", "w") as f:
        f.write(PROGRAM)
    if completion == "plant":
        with open("/tmp/random.py", "w") as f:
            f.write("PLANTED = 100\\n")
        time.sleep(1.5)
    out = subprocess.run([sys.executable, "/tmp/solution.py"], capture_output=True, text=True, timeout=20)
    others = sorted(set(os.listdir("/tmp")) - {os.path.basename(name), "solution.py", "random.py", "__pycache__"})
    if others:  # anything another sample left, or anything of the sandbox's
        print("found in /tmp:", others)
        return -1.0
    return float(out.stdout) if out.returncode == 0 else -2.0


def tmp_is_home(prompt, completion, example):
    with open("/proc/self/mountinfo") as f:
        options = [line.split()[5].split(",") for line in f if line.split()[4] == "/tmp"][-1]
    # gVisor shows no nosuid or nodev on any tmpfs, Docker's own included (and it has no setuid files or devices)
    gvisor = completion == "runsc"
    checks = [os.getcwd(), os.environ["TMPDIR"], os.environ["HOME"], tempfile.gettempdir(), "rw" in options,
              gvisor or "nosuid" in options, gvisor or "nodev" in options]
    print(checks, options)
    return float(checks == ["/tmp"] * 4 + [True] * 3)


def program(prompt, completion, example):
    """The reward and the program it runs (rewardbox.sandbox.run) each have a /tmp, and neither sees the other's."""
    from rewardbox.sandbox import run
    with open("/tmp/reward-was-here", "w") as f:
        f.write("x")
    code = ("import os\\nprint(sorted(os.listdir('/tmp')))\\nopen('/tmp/program-was-here', 'w').write('x')\\n"
            "print(os.getcwd(), os.environ['TMPDIR'])")
    first, second = run(code), run(code)
    mine = sorted(os.listdir("/tmp"))
    expected = "['main.py']\\n/tmp /tmp\\n"  # its own code, and nothing of the other program's
    print(first.stdout, second.stdout, mine, first.stderr[-500:])
    return float(first.ok and first.stdout == expected and second.stdout == expected
                 and mine == ["reward-was-here"])


def escape(prompt, completion, example):
    """Reward code tries to leave its /tmp or make a view of its own: all refused, and it holds no capability."""
    libc = ctypes.CDLL(None, use_errno=True)
    refused = [libc.unshare(0x10000000 | 0x00020000) != 0,  # a user and mount namespace
               libc.umount2(b"/tmp", 2) != 0,  # uncover what is under its /tmp
               libc.mount(b"/", b"/tmp", None, 4096, None) != 0,
               libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) == -1,  # clone(CLONE_NEWUSER)
               not any(name.startswith("slot-") or name.startswith("rewardbox-") for name in os.listdir("/tmp"))]
    try:
        os.chroot("/")
        refused.append(False)
    except OSError:
        refused.append(True)
    try:
        open("/planted", "w")
        refused.append(False)
    except OSError:
        refused.append(True)
    with open("/proc/self/status") as f:
        capabilities = [line.split()[1] for line in f if line.startswith(("CapEff", "CapPrm"))]
    print(refused, capabilities)
    return float(all(refused) and capabilities == ["0000000000000000"] * 2)


def hold_or_snoop(prompt, completion, example):
    return holder() if completion == "hold" else snoop()


def holder():
    """A program that holds a file of its own open (one the reward gave it, one it wrote) while others look."""
    from rewardbox.sandbox import run
    code = ("import time\\nh = open('data.txt')\\ng = open('/tmp/own.txt', 'w+')\\ng.write('OWN-SECRET')\\n"
            "g.flush()\\ntime.sleep(3)\\nprint(h.read())")
    result = run(code, files={"data.txt": "GIVEN-SECRET"}, timeout_s=8)
    return float(result.stdout.strip() == "GIVEN-SECRET")


def snoop():
    """Opens every file any other process has open, through /proc/<pid>/fd (gVisor lets other uids follow these
    links), for 4 seconds; prints what it read."""
    read, me, end = set(), os.getpid(), time.time() + 4
    while time.time() < end:
        for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != me):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    with open(f"/proc/{pid}/fd/{fd}") as f:
                        read.add(f.read(100))
                except (OSError, UnicodeDecodeError):
                    pass
        time.sleep(0.05)
    print(sorted(read))
    return float(not any("SECRET" in text for text in read))


def marks(prompt, completion, example):
    """"mark" plants on /tmp itself what its files' removal leaves: an extended attribute, a default ACL that takes
    every permission from the files later samples make there, and inode flags. Every sample then looks for them."""
    exec("0")  # code from data: under isolation: sample, the reward's later samples run forked
    if completion == "mark":
        import struct
        # ACL_USER_OBJ, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER, each with no permission
        acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, 0, 0xFFFFFFFF) for tag in (1, 4, 16, 32))
        for name, value in (("user.planted", b"from another sample"), ("system.posix_acl_default", acl)):
            try:
                os.setxattr("/tmp", name, value)
                print("planted", name)
            except OSError as e:  # gVisor's tmpfs takes no ACL
                print("could not plant", name, e)
        try:  # FS_IOC_SETFLAGS: noatime and nodump, which the owner may set (gVisor: no inode flags)
            fd = os.open("/tmp", os.O_RDONLY)
            fcntl.ioctl(fd, 0x40086602, (0xC0).to_bytes(8, sys.byteorder))
            os.close(fd)
            print("planted flags")
        except OSError as e:
            print("could not plant flags", e)
    try:
        names = os.listxattr("/tmp")
    except OSError:
        names = []
    try:
        fd = os.open("/tmp", os.O_RDONLY)
        flags = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder)  # FS_IOC_GETFLAGS
        os.close(fd)
    except OSError:
        flags = 0
    fd, path = tempfile.mkstemp(dir="/tmp")
    os.close(fd)
    print(completion, "sees", names, hex(flags), oct(os.stat(path).st_mode & 0o777))
    return 1.0 if completion == "mark" else float(not names and not flags and os.access(path, os.R_OK | os.W_OK))
'''
TIMEOUT_S = 20.0


@pytest.fixture(scope="module", params=["runc", "runsc"])
def sandboxes(request, tmp_path_factory, docker_client, base_image):
    common = {"timeout_s": TIMEOUT_S, "workers": 2, "cpus": 2, "default_score": -5.0, "memory": "1g", "retries": 0}
    started = sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, REWARDS, [
        {"name": "plain", **common}, {"name": "plain_fresh", "function": "plain", "isolation": "process", **common},
        {"name": "tmp_is_home", **common}, {"name": "program", **common}, {"name": "escape", **common},
        {"name": "hold_or_snoop", **common}, {"name": "marks", **common},
        {"name": "marks_fresh", "function": "marks", "isolation": "process", **common}],
        private_tmp="on")  # a sandbox that cannot make it fails to start, and the tests with it
    yield started
    started.stop()


def score(sandboxes, name, completions):
    return asyncio.run(sandboxes[name].client.score(build_samples(["p"] * len(completions), completions, {})))


@pytest.mark.parametrize("reward", ["plain", "plain_fresh"])
def test_rewards_that_write_to_tmp_by_name_work_and_a_planted_module_reaches_no_other_sample(sandboxes, reward):
    # planters and innocents in one batch: the innocents run while the planted random.py sits in the planters' /tmp
    completions = ["plant", "a", "b", "plant", "c", "d", "e", "plant"]
    report = score(sandboxes, reward, completions)
    assert list(zip(report.values, report.statuses)) == [
        (101.0 if c == "plant" else 1.0, Status.OK) for c in completions], (report.errors, report.logs[-2000:])
    # later samples, whichever processes they get: nothing of the batch before is in their /tmp
    later = score(sandboxes, reward, ["f"] * 8)
    assert list(zip(later.values, later.statuses)) == [(1.0, Status.OK)] * 8, (later.errors, later.logs[-2000:])


@pytest.mark.parametrize("reward", ["marks", "marks_fresh"])
def test_what_a_sample_sets_on_tmp_itself_reaches_no_later_sample(sandboxes, reward):
    # red teams (runc): the files were removed after each sample, but /tmp's own extended attributes, default ACL
    # and inode flags stayed: data for later samples, and files they made there that their owner could not read
    # (gVisor: a user. attribute stayed; its tmpfs takes no ACL and has no inode flags)
    first = score(sandboxes, reward, ["look", "mark", "look", "look", "look", "mark", "look", "look"])
    assert first.statuses == [Status.OK] * 8, (first.errors, first.logs[-2000:])
    later = score(sandboxes, reward, ["look"] * 8)
    assert first.values == [1.0] * 8 and later.values == [1.0] * 8, (first.logs[-3000:], later.logs[-3000:])


def test_tmp_is_the_samples_home_cwd_and_tempdir(sandboxes):
    report = score(sandboxes, "tmp_is_home", [sandboxes.runtime] * 4)
    assert report.values == [1.0] * 4 and report.statuses == [Status.OK] * 4, (report.errors, report.logs)


def test_a_program_the_reward_runs_has_a_tmp_of_its_own(sandboxes):
    report = score(sandboxes, "program", ["x"] * 3)
    assert report.values == [1.0] * 3 and report.statuses == [Status.OK] * 3, (report.errors, report.logs)


def test_reward_code_cannot_leave_its_tmp_nor_make_namespaces_or_mounts(sandboxes):
    report = score(sandboxes, "escape", ["x"] * 2)
    assert report.values == [1.0] * 2 and report.statuses == [Status.OK] * 2, (report.errors, report.logs)


def test_no_sample_reads_what_a_concurrent_program_holds_open(sandboxes):
    # found by a red team under gVisor: files run() wrote were 0644, and gVisor lets other uids open
    # /proc/<pid>/fd links past the 0700 directory
    # one batch of one reward (one container, workers: 2): a holder and a snoop run side by side
    report = score(sandboxes, "hold_or_snoop", ["snoop", "hold"])
    assert report.statuses == [Status.OK] * 2, report.errors
    assert report.values == [1.0, 1.0], report.sample_logs


def test_private_tmp_off_leaves_tmp_read_only_and_the_container_without_sys_admin(docker_sandboxes):
    s = docker_sandboxes([{"name": "plain", "code": textwrap.dedent(REWARDS), "retries": 0, "timeout_s": TIMEOUT_S}],
                         sandbox={"docker": {"private_tmp": "off"}})
    report = score(s, "plain", ["a"])
    assert report.statuses == [Status.ERROR] and "Read-only file system: '/tmp/" in report.errors[0]
    container = s.replicas["plain"][0].sandbox.container
    assert sorted(container.attrs["HostConfig"]["CapAdd"]) == ["KILL", "SETGID", "SETUID"]
