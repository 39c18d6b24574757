"""``rewardbox.sandbox.run`` / ``run_tests`` without containers: in plain Python (a helper process runs the
programs) and through the local backend's sandbox server (the template's runner). Statuses, limits, cleanup between
runs, the no-network filter, and the checks on what reward code asks for. The same in real containers, under uids
of their own: tests/docker/test_code_execution.py."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from rewardbox import build_samples
from rewardbox.sandbox import run, run_tests
from rewardbox.sandbox.programs import run_requests
from tests.conftest import run as run_async


def test_a_program_reads_stdin_args_and_files_and_writes_stdout():
    r = run("import sys\nprint(input()[::-1], sys.argv[1:], open('data/x.txt').read())", stdin="abc",
            args=["-v", "2"], files={"data/x.txt": b"bytes"})
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "cba ['-v', '2'] bytes\n"), r.stderr
    assert r.ok and r.wall_s > 0 and r.cpu_s > 0


@pytest.mark.parametrize("code, kwargs, status", [
    ("while True:\n    pass", {"timeout_s": 1}, "timeout"),
    ("import time\ntime.sleep(60)", {"timeout_s": 1}, "timeout"),
    ("x = bytearray(4 << 30)", {"memory_mb": 128}, "memory"),
    ("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", {"memory_mb": 128}, "memory"),
    ("import sys\nsys.exit(3)", {}, "runtime_error"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", {}, "runtime_error"),
    ("while True:\n    print('x' * 1000)", {"max_output_bytes": 10000}, "output_limit"),
    ("import sys\nsys.stderr.write('y' * 100000)", {"max_output_bytes": 10000}, "output_limit"),
    ("open('big', 'wb').write(b'x' * (200 << 20))", {"max_output_bytes": 1000}, "runtime_error"),  # file size
])
def test_each_way_a_program_can_end_has_its_status(code, kwargs, status):
    r = run(code, **kwargs)
    assert r.status == status, (r, code)


def test_statuses_carry_what_the_program_printed_and_how_it_ended():
    r = run("import sys\nprint('partial')\nsys.stderr.write('boom')\nsys.exit(4)")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("runtime_error", 4, "partial\n", "boom")
    r = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (r.exit_code, r.signal) == (-9, "SIGKILL")
    r = run("print('x' * 5000)", max_output_bytes=100)
    assert r.status == "output_limit" and r.stdout == "x" * 100


def test_a_program_has_no_sockets_but_socket_pairs():
    r = run("import socket\n"
            "socket.socketpair()\n"
            "for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_UNIX):\n"
            "    try:\n"
            "        socket.socket(family, socket.SOCK_DGRAM)\n"
            "        print('opened', family)\n"
            "    except PermissionError:\n"
            "        print('refused')\n")
    assert r.stdout.split() == ["refused"] * 4, r


def test_every_run_starts_in_an_empty_directory_and_leaves_no_process():
    first = run("import os, time\nopen('left', 'w').write('x')\n"
                "if os.fork() == 0:\n    time.sleep(30)\nprint(os.getcwd())")
    assert first.ok
    second = run("import os\nprint(sorted(os.listdir('.')))")
    assert second.stdout == "['main.py']\n"
    import os

    assert not os.path.exists(os.path.join(first.stdout.strip(), "left"))


def test_the_environment_is_clean():
    import os

    os.environ["RBX_TEST_SECRET"] = "hidden"
    try:
        r = run("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["RBX_TEST_SECRET"]
    assert "RBX_TEST_SECRET" not in r.stdout and "HOME" in r.stdout


def test_run_tests_counts_passes_and_compares_by_lines_tokens_or_exactly():
    code = "n = int(input())\nprint(n * 2, ' ')\nprint()"
    tests = [{"stdin": "1", "stdout": "2"}, {"stdin": "5", "stdout": "10\n"}, {"stdin": "3", "stdout": "7"}]
    t = run_tests(code, tests)
    assert (t.passed, t.total, t.fraction, t.status) == (2, 3, 2 / 3, "wrong_answer")
    assert [r.passed for r in t.results] == [True, True, False]
    assert run_tests(code, tests, compare="exact").passed == 0
    assert run_tests("print(' 2 ')", [{"stdout": "2"}], compare="tokens").passed == 1
    stopped = run_tests(code, [tests[2], tests[0]], stop_on_failure=True)
    assert (stopped.passed, stopped.total, len(stopped.results)) == (0, 2, 1)
    assert run_tests("import sys\nsys.exit(1)", tests[:1]).status == "runtime_error"
    assert run_tests(code, []).fraction == 0.0


def test_one_test_cannot_leave_anything_for_the_next():
    code = "import os\nprint(len(os.listdir('.')))\nopen(f'x{os.getpid()}', 'w').write('x')"
    t = run_tests(code, [{"stdout": "1"}] * 3)
    assert t.passed == 3, t.results


def test_bash_programs_run_too():
    assert run("read a b\necho $((a + b))", language="bash", stdin="2 3").stdout == "5\n"


@pytest.mark.parametrize("call, message", [
    (lambda: run("print(1)", language="cobol"), "language 'cobol'"),
    (lambda: run("print(1)", files={"../x": "y"}), "relative path"),
    (lambda: run("print(1)", files={"main.py": "y"}), "where python code goes"),
    (lambda: run("print(1)", timeout_s=-1), "timeout_s"),
    (lambda: run("print(1)", memory_mb=1), "memory_mb"),
    (lambda: run_tests("print(1)", [{"stdin": ""}]), "expected 'stdout'"),
])
def test_bad_requests_fail_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_runner_checks_every_field_it_is_sent():
    good = {"language": "python", "code": "x", "runs": [{"stdin": ""}], "timeout_s": 1, "memory_mb": 64,
            "max_output_bytes": 10, "compile_timeout_s": 1}
    assert run_requests.parse(good).timeout_s == 1.0
    for field, value in [("runs", []), ("runs", [{"args": "notalist"}]), ("timeout_s", float("nan")),
                         ("timeout_s", True), ("files", {"/etc/passwd": "x"}), ("files", {"a/../../b": "x"}),
                         ("code", 3), ("compare", "fuzzy"), ("memory_mb", 10 ** 9)]:
        with pytest.raises(run_requests.RequestError):
            run_requests.parse(dict(good, **{field: value}))


PROBE = """
import ctypes, errno, platform
from rewardbox.sandbox.confine import seccomp
libc = ctypes.CDLL(None, use_errno=True)
numbers = seccomp._TABLES[platform.machine()][2]

def syscall(name, *args):
    if libc.syscall(numbers[name], *args) < 0:
        raise OSError(ctypes.get_errno(), name)

def outcomes(calls):
    \"\"\"'name: ok', or 'name: ' and the error's name, for each (name, call), in order.\"\"\"
    said = []
    for name, call in calls:
        try:
            call()
            said.append(f"{name}: ok")
        except OSError as e:
            said.append(f"{name}: {errno.errorcode[e.errno]}")
    return "; ".join(said)
"""  # what both filter probes below share (each runs in a fresh process: the filter stays with it)
SOCKETS_PROBE = PROBE + """
import os, socket, sys
seccomp.install(network=sys.argv[1] == "network")
pipe_r, pipe_w = os.pipe()
print(outcomes([
    ("tcp", lambda: socket.socket()),
    ("unix stream", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)),
    ("unix datagram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
    ("unix raw", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_RAW)),
    ("unix seqpacket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)),
    ("pair stream", lambda: socket.socketpair()),
    ("pair datagram", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)),
    ("pair seqpacket", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)),
    ("vmsplice", lambda: syscall("vmsplice", pipe_w, 0, 0, 0)),
    ("io_uring_setup", lambda: syscall("io_uring_setup", 8, bytes(120)))]))
"""


@pytest.mark.parametrize("filter_, tcp", [("network", "ok"), ("programs", "EPERM")])
def test_unix_sockets_are_stream_only_programs_have_no_socket_and_both_refuse_vmsplice_and_io_uring(filter_, tcp):
    # Unix datagram and seqpacket sockets, and vmsplice, let a sample hide memory from the guard (red team 15).
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.fail(f"no seccomp table for {platform.machine()}")
    out = subprocess.run([sys.executable, "-c", SOCKETS_PROBE, filter_], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"tcp: {tcp}; unix stream: {tcp}; unix datagram: EPERM; unix raw: EPERM; unix seqpacket: EPERM; "
        "pair stream: ok; pair datagram: EPERM; pair seqpacket: EPERM; vmsplice: EPERM; io_uring_setup: EPERM")


def test_the_samples_filter_lets_no_descriptor_signal_another_process_nor_memory_grow_outside_processes():
    # In a fresh process (the filter stays with it): what a descriptor that outlives its sample could do to the
    # slot process that forked it, and memory that no process holds (memory files, socket and pipe buffers grown),
    # refused; the same calls' everyday uses kept.
    code = PROBE + textwrap.dedent("""
        import fcntl, os, socket, struct, termios
        seccomp.install()

        a, b = socket.socketpair()
        tcp = socket.socket()
        pipe_r, pipe_w = os.pipe()
        print(outcomes([
                ("F_SETOWN", lambda: fcntl.fcntl(a, fcntl.F_SETOWN, os.getppid())),
                ("F_SETOWN_EX", lambda: fcntl.fcntl(a, 15, struct.pack("ii", 1, os.getppid()))),
                ("FIOSETOWN", lambda: fcntl.ioctl(a, 0x8901, struct.pack("i", os.getppid()))),
                ("SIOCSPGRP", lambda: fcntl.ioctl(a, 0x8902, struct.pack("i", os.getppid()))),
                ("memfd_create", lambda: os.memfd_create("x")),
                ("io_uring_setup", lambda: syscall("io_uring_setup", 8, bytes(120))),
                ("F_SETPIPE_SZ", lambda: fcntl.fcntl(pipe_w, 1031, 1 << 20)),
                ("F_GETPIPE_SZ", lambda: fcntl.fcntl(pipe_w, 1032)),
                ("F_SETFL O_ASYNC", lambda: fcntl.fcntl(a, fcntl.F_SETFL, fcntl.fcntl(a, fcntl.F_GETFL) | os.O_ASYNC)),
                ("F_GETOWN", lambda: fcntl.fcntl(a, fcntl.F_GETOWN)),
                ("FIONREAD", lambda: fcntl.ioctl(a, termios.FIONREAD, bytes(4))),
                ("F_SETFD", lambda: fcntl.fcntl(a, fcntl.F_SETFD, fcntl.FD_CLOEXEC)),
                ("SO_SNDBUF", lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)),
                ("SO_RCVBUF", lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)),
                ("SO_LINGER", lambda: tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))),
                ("SO_PASSCRED", lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1))]))
        print(a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == b.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
              a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
              a.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED),
              struct.unpack("ii", tcp.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "F_SETOWN: EPERM; F_SETOWN_EX: EPERM; FIOSETOWN: EPERM; SIOCSPGRP: EPERM; memfd_create: EPERM; "
        "io_uring_setup: EPERM; F_SETPIPE_SZ: EPERM; F_GETPIPE_SZ: ok; F_SETFL O_ASYNC: ok; F_GETOWN: ok; FIONREAD: ok; F_SETFD: ok; SO_SNDBUF: ok; "
        "SO_RCVBUF: ok; SO_LINGER: ok; SO_PASSCRED: ok",
        "True True 1 (0, 0)"]  # buffer sizes and linger asked for are taken and change nothing: defaults stay


REWARD = """
from rewardbox.sandbox import run_tests

def judge(prompt, completion, example):
    return run_tests(completion, [{"stdin": "2", "stdout": "4"}, {"stdin": "3", "stdout": "6"}]).fraction
"""


def test_a_reward_runs_programs_through_the_local_sandbox_server(sandboxes):
    s = sandboxes([{"name": "judge", "code": REWARD, "timeout_s": 20}])
    report = run_async(s["judge"].client.score(build_samples(
        ["p"] * 3, ["print(int(input()) * 2)", "print(4)", "while True: pass"], {})))
    assert report.values == [1.0, 0.5, 0.0], report.errors


def test_a_reward_module_cannot_run_programs_while_it_is_imported(sandboxes):
    from rewardbox import RewardLoadError

    with pytest.raises(RewardLoadError, match="cannot run while the reward module is imported"):
        sandboxes([{"name": "eager", "code": "from rewardbox.sandbox import run\nrun('print(1)')\n"
                                             "def eager(prompt, completion, example):\n    return 1.0\n"}])
