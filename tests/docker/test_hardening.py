"""Each hardening setting, proven by what user code can and cannot do, and by inspecting the container."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from rewardbox import build_samples
from tests.conftest import run, until

PROBES = """
import os, socket, time

def write_root(prompt, completion, example):
    try:
        open("/rewardbox-was-here", "w").close()
        return 1.0
    except OSError:
        return 0.0

def write_tmp(prompt, completion, example):
    # /tmp is the sample's own scratch directory (tests/docker/test_private_tmp.py has the rest)
    with open("/tmp/ok", "w") as f:
        f.write("x")
    return 1.0 if os.getcwd() == os.environ["TMPDIR"] == "/tmp" and os.listdir(".") == ["ok"] else -2.0

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


def test_root_is_read_only_and_each_sample_writes_its_own_scratch_directory_on_tmp(docker_sandboxes):
    s = docker_sandboxes([{"name": "write_root", "code": PROBES},
                          {"name": "write_tmp", "file": "write_root.py"}])
    assert score(s, "write_root", ["x"]).values == [0.0]
    assert score(s, "write_tmp", ["x"]).values == [1.0]


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


def test_a_fork_bomb_stops_at_its_samples_process_limit_and_the_next_sample_can_fork(docker_sandboxes):
    s = docker_sandboxes([{"name": "fork_bomb", "code": PROBES, "pids": 96, "warm": 2, "workers": 1,
                           "timeout_s": 20}])
    report = score(s, "fork_bomb", ["x"])
    assert report.statuses == ["ok"]
    # RLIMIT_NPROC of the sample's own uid stops it well before the container's pids limit
    assert 0 < report.values[0] < 96 - 2 * 2
    # what it forked died with its slot: the next sample (a fresh process, or a child of the slot process once the
    # reward's samples run forked, whose parent counts against the uid's limit too) can fork as many again
    again = score(s, "fork_bomb", ["x"])
    assert again.statuses == ["ok"] and report.values[0] - 1 <= again.values[0] <= report.values[0]


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
    s = docker_sandboxes([{"name": "uid", "code": PROBES, "memory": "300m", "cpus": 0.5, "pids": 99, "warm": 4,
                           "workers": 1}])
    container = s.replicas["uid"][0].sandbox.container
    container.reload()
    host = container.attrs["HostConfig"]
    # root in the container holds only what switching to slot uids needs, and SYS_ADMIN only so that Docker's
    # seccomp profile lets the private /tmp's unshare and mount through: the sandbox drops it at once (below)
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETUID", "SYS_ADMIN"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["ReadonlyRootfs"] is True and host["Privileged"] is False
    assert host["NetworkMode"] == "none"
    assert host["PortBindings"] in (None, {})
    assert host["Memory"] == 300 * 1024 ** 2 and host["MemorySwap"] == 300 * 1024 ** 2
    assert host["NanoCpus"] == 500_000_000
    assert host["PidsLimit"] == 99
    assert host["IpcMode"] == "none"  # no /dev/shm that every sample could write
    assert host["LogConfig"]["Config"] == {"max-size": "4m", "max-file": "2"}
    # no SysV IPC, no message queues, no TCP TIME_WAIT; each slot uid has a tmpfs of its own, mode 0700
    assert host["Sysctls"] == {"kernel.shmmni": "0", "kernel.msgmni": "0", "kernel.sem": "0 0 0 0",
                               "fs.mqueue.queues_max": "0", "net.ipv4.tcp_max_tw_buckets": "0"}
    slot_mounts = host["Tmpfs"]
    assert len(slot_mounts) == 16  # two versions x 4 warm processes, each with a run uid for its programs
    assert all("nosuid" in o and "nodev" in o and "mode=0700" in o and f"uid={p.rsplit('-', 1)[1]}" in o
               for p, o in slot_mounts.items())
    # only the programs' directories may hold executables (compiled programs)
    assert sorted("exec" in o.split(",") for o in slot_mounts.values()) == [False] * 8 + [True] * 8
    # the only other mount is the socket's: a volume, not a host directory
    [socket_mount] = [m for m in container.attrs["Mounts"] if m["Destination"] == "/run/rewardbox"]
    assert socket_mount["Type"] == "volume"
    assert len(container.attrs["Mounts"]) == 1  # nothing else: /tmp is the read-only root's
    # who runs as whom: init, the supervisor, the template and its program runner as root (3 capabilities); the
    # server as nobody; the reward code as slot uids
    # (a freshly forked slot process is root for the moment before it drops to its uid, and the template forks its
    # slot processes after its program runner: wait until all settled and some slot process runs)
    deadline = time.monotonic() + 10
    while True:
        uids = [int(p[1]) for p in container.top(ps_args="-eo pid,uid,args")["Processes"]]
        if (uids.count(0) == 4 and set(uids) - {0, 65534}) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert uids.count(0) == 4 and uids.count(65534) == 1
    # no process of the sandbox holds SYS_ADMIN (docker-init, PID 1, keeps what the container started with). A slot
    # process (or a program's monitor) that is being prepared holds every capability inside the user namespace it
    # just made for its private /tmp, for the moment before it drops them (before any reward code runs): a fresh
    # clone's run on a slower machine listed one (0x1ffffffffff), so the look is repeated until every process is
    # settled, and what it finds then must hold none.
    def holding_sys_admin() -> list:
        found = []
        for pid, _, args in (p[:3] for p in container.top(ps_args="-eo pid,uid,args")["Processes"]):
            try:
                with open(f"/proc/{pid}/status") as f:  # the host's view of the container's processes
                    permitted = int(next(line for line in f if line.startswith("CapPrm:")).split()[1], 16)
            except OSError:  # gone since the listing
                continue
            if "docker-init" not in args and permitted & (1 << 21):
                found.append((args, hex(permitted)))
        return found

    until(lambda: not holding_sys_admin(), timeout_s=10.0)
    assert holding_sys_admin() == []
    slot_uids = [u for u in uids if u not in (0, 65534)]
    assert slot_uids and all(f"/tmp/slot-{u}" in slot_mounts for u in slot_uids)  # warm slot processes
    reward_uid = int(score(s, "uid", ["x"]).values[0])
    assert reward_uid >= 100000 and f"/tmp/slot-{reward_uid}" in slot_mounts
    assert container.labels["rewardbox.reward"] == "uid"
    assert not any(option.startswith("apparmor=") for option in host["SecurityOpt"])  # the engine's own profile


def test_the_apparmor_profile_setting_reaches_the_engine_and_samples_keep_a_private_writable_tmp(
        docker_sandboxes, docker_client, tmp_path):
    # Where the engine enforces AppArmor, the profile is loaded first (and removed after), and the samples' writes
    # to /tmp test it. This machine's kernel has no AppArmor and its engine ignores the profile: here this checks
    # what the engine is asked and that the sandbox serves (tests/host/test_apparmor compiles the profile).
    from rewardbox.deploy import apparmor
    from rewardbox.backends.docker import confines_with_apparmor

    enforced = confines_with_apparmor(docker_client.info())
    if enforced:
        apparmor.install(apparmor.profile(), apparmor.NAME, tmp_path)
    try:
        code = ("import os\n"
                "def tmp(prompt, completion, example):\n"
                "    left = os.listdir('/tmp')\n"
                "    with open('/tmp/' + completion, 'w') as f:\n"
                "        f.write(completion)\n"
                "    return float(len(left))\n")
        s = docker_sandboxes([{"name": "tmp", "code": code, "warm": 2, "workers": 1}],
                             sandbox={"docker": {"apparmor_profile": "rewardbox-sandbox", "private_tmp": "on"}})
        container = s.replicas["tmp"][0].sandbox.container
        container.reload()
        assert container.attrs["HostConfig"]["SecurityOpt"] == ["no-new-privileges", "apparmor=rewardbox-sandbox"]
        report = score(s, "tmp", ["a", "b", "c"])
        assert report.statuses == ["ok"] * 3 and report.values == [0.0] * 3, report.errors  # writable, private
    finally:
        if enforced:
            subprocess.run([apparmor.parser(), "--remove", str(tmp_path / apparmor.NAME)], check=False)


def test_a_profile_the_engines_host_has_not_loaded_is_an_error_saying_how_to_load_it(docker_client, base_image,
                                                                                     monkeypatch):
    # An engine on an AppArmor host refuses a container whose profile is not loaded; this engine's kernel has no
    # AppArmor, so its refusal is the one such engines give (moby/moby#25488, NixOS/nixpkgs#22953), raised where
    # the engine's would be.
    import docker
    import docker.models.containers

    from rewardbox.backends.containers import ContainerSpec, DockerSandbox
    from rewardbox.errors import BackendError

    said = ('OCI runtime create failed: container_linux.go:247: starting container process caused "process_linux.go:'
            '359: container init caused \\"apparmor failed to apply profile: no such file or directory\\""')

    def refuse(containers, **kwargs):
        assert "apparmor=rbx-not-loaded" in kwargs["security_opt"]
        raise docker.errors.APIError("500 Server Error", explanation=said)

    monkeypatch.setattr(docker.models.containers.ContainerCollection, "run", refuse)
    sandbox = DockerSandbox(docker_client, ContainerSpec(image=base_image, name=f"rbx-aa-{os.getpid()}",
                                                         apparmor_profile="rbx-not-loaded"))
    try:
        with pytest.raises(BackendError, match=r"apparmor failed to apply profile.*'rbx-not-loaded': is it loaded "
                                               r"on the engine's host\? `sudo rewardbox apparmor --install`"):
            sandbox.start()
    finally:
        sandbox.socket_volume.remove()


def test_the_socket_lives_on_a_small_nosuid_tmpfs_that_only_the_server_uid_may_enter(docker_sandboxes):
    import os
    import stat

    s = docker_sandboxes([{"name": "uid", "code": PROBES, "warm": 2, "workers": 1}])
    sandbox = s.replicas["uid"][0].sandbox
    path = os.path.realpath(sandbox.socket_volume.path)
    mount = next(line for line in open("/proc/self/mounts").read().splitlines() if f" {path} " in line)
    fs, options = mount.split()[2], mount.split()[3].split(",")
    assert fs == "tmpfs" and {"nosuid", "nodev", "noexec", "size=1024k", "mode=700"} <= set(options)
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == 65534
    socket_info = os.stat(os.path.join(path, "grpc.sock"))
    assert stat.S_IMODE(socket_info.st_mode) & 0o077 == 0  # the socket itself: its owner only


def test_network_true_gets_the_bridge_network_and_still_publishes_no_port(docker_sandboxes):
    s = docker_sandboxes([{"name": "uid", "code": PROBES, "network": True}])
    container = s.replicas["uid"][0].sandbox.container
    container.reload()
    assert container.attrs["HostConfig"]["NetworkMode"] == "bridge"
    assert container.attrs["HostConfig"]["PortBindings"] in (None, {})
    assert container.attrs["NetworkSettings"]["Ports"] in (None, {})
