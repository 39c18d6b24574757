"""Each hardening setting, proven by what user code can and cannot do, and by inspecting the container."""

from __future__ import annotations

import socket
import threading

from rewardbox import build_samples
from tests.conftest import run

PROBES = """
import os, socket, time

def write_root(prompt, completion, example):
    try:
        open("/rewardbox-was-here", "w").close()
        return 1.0
    except OSError:
        return 0.0

def write_tmp(prompt, completion, example):
    with open("/tmp/ok", "w") as f:
        f.write("x")
    return 1.0

def uid(prompt, completion, example):
    return float(os.getuid())

def connect(prompt, completion, example):
    host, port = completion.split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return 1.0
    except OSError as e:
        print("connect failed:", e)
        return 0.0

def fork_bomb(prompt, completion, example):
    forked = 0
    try:
        while True:
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
            forked += 1
    except OSError:
        return float(forked)

def memory_bomb(prompt, completion, example):
    if completion == "bomb":
        hog = b"x" * (2 * 1024 ** 3)
        return float(len(hog))
    return 1.0

def secret(prompt, completion, example):
    return float(os.environ.get("RBX_TEST_SECRET", "-1"))
"""


def score(sandboxes, name, completions):
    return run(sandboxes[name].client.score(build_samples(["p"] * len(completions), completions, {})))


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=lambda: [server.accept() for _ in range(10)], daemon=True).start()
    return server, server.getsockname()[1]


def test_root_filesystem_is_read_only_and_tmp_is_writable(docker_sandboxes):
    s = docker_sandboxes([{"name": "write_root", "code": PROBES},
                          {"name": "write_tmp", "file": "write_root.py"}])
    assert score(s, "write_root", ["x"]).values == [0.0]
    assert score(s, "write_tmp", ["x"]).statuses == ["ok"]


def test_reward_code_does_not_run_as_root(docker_sandboxes):
    s = docker_sandboxes([{"name": "uid", "code": PROBES}])
    assert score(s, "uid", ["x"]).values[0] not in (0.0, None)


def test_no_network_unless_the_reward_asks_for_it(docker_sandboxes):
    server, port = _listener()
    try:
        s = docker_sandboxes(
            [{"name": "connect", "code": PROBES},
             {"name": "connect_net", "file": "connect.py", "function": "connect", "network": True}],
            sandbox={"docker": {"network_mode": "host"}},  # the test's listener is on the host's loopback
        )
        target = f"127.0.0.1:{port}"
        closed = score(s, "connect", [target])
        assert closed.values == [0.0] and "connect failed" in closed.logs
        assert score(s, "connect_net", [target]).values == [1.0]
    finally:
        server.close()


def test_fork_bomb_stops_at_the_pids_limit_and_the_sandbox_recovers(docker_sandboxes):
    s = docker_sandboxes([{"name": "fork_bomb", "code": PROBES, "pids": 64, "workers": 1, "timeout_s": 20},
                          {"name": "uid", "file": "fork_bomb.py", "pids": 64}])
    report = score(s, "fork_bomb", ["x"])
    assert report.statuses == ["ok"]
    assert 0 < report.values[0] < 64
    # the bomb's children were killed when the call returned, so the next call can fork again
    again = score(s, "fork_bomb", ["x"])
    assert again.statuses == ["ok"] and again.values[0] > 0


def test_memory_bomb_is_killed_and_scored_crash_while_the_container_recovers(docker_sandboxes):
    s = docker_sandboxes([{"name": "memory_bomb", "code": PROBES, "memory": "256m", "default_score": -1.0}])
    report = score(s, "memory_bomb", ["ok", "bomb", "ok"])
    assert report.statuses == ["ok", "crash", "ok"]
    assert report.values == [1.0, -1.0, 1.0]
    assert "SIGKILL" in report.errors[1]
    assert s.replicas["memory_bomb"][0].restarts == 0  # the server survived; only the worker died
    assert score(s, "memory_bomb", ["ok"]).values == [1.0]


def test_a_secret_reaches_only_the_reward_that_names_it(docker_sandboxes, monkeypatch):
    monkeypatch.setenv("RBX_TEST_SECRET", "42")
    s = docker_sandboxes([{"name": "secret", "code": PROBES, "secrets": ["RBX_TEST_SECRET"]},
                          {"name": "no_secret", "file": "secret.py", "function": "secret"}])
    assert score(s, "secret", ["x"]).values == [42.0]
    assert score(s, "no_secret", ["x"]).values == [-1.0]


def test_container_settings_are_hardened(docker_sandboxes):
    s = docker_sandboxes([{"name": "uid", "code": PROBES, "memory": "300m", "cpus": 0.5, "pids": 99}])
    container = s.replicas["uid"][0].sandbox.container
    container.reload()
    host = container.attrs["HostConfig"]
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["ReadonlyRootfs"] is True
    assert host["NetworkMode"] == "none"
    assert host["PortBindings"] in (None, {})
    assert host["Memory"] == 300 * 1024 ** 2 and host["MemorySwap"] == 300 * 1024 ** 2
    assert host["NanoCpus"] == 500_000_000
    assert host["PidsLimit"] == 99
    assert host["Privileged"] is False
    assert "/tmp" in host["Tmpfs"] and "size=" in host["Tmpfs"]["/tmp"]
    assert container.attrs["Config"]["User"] not in ("", "0", "root", "0:0")
    mounts = container.attrs["Mounts"]
    assert len(mounts) == 1 and mounts[0]["Destination"] == "/run/rewardbox"
    assert container.labels["rewardbox.reward"] == "uid"


def test_network_true_gets_the_bridge_network_and_still_publishes_no_port(docker_sandboxes):
    s = docker_sandboxes([{"name": "uid", "code": PROBES, "network": True}])
    container = s.replicas["uid"][0].sandbox.container
    container.reload()
    assert container.attrs["HostConfig"]["NetworkMode"] == "bridge"
    assert container.attrs["HostConfig"]["PortBindings"] in (None, {})
    assert container.attrs["NetworkSettings"]["Ports"] in (None, {})
