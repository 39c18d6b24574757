"""The backend conformance suite: every registered backend passes it against real sandboxes (local: processes,
docker: containers). A new backend adds a harness here; a registered backend without one fails the first test.

A harness knows how to make the backend from a config, how to kill one of its sandboxes from outside (as a crash
or the OOM killer would), and whether anything of a sandbox is left after stop().
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import docker.errors
import pytest

from rewardbox import BackendError, RewardLoadError, RewardSandboxes, build_samples, load_config
from rewardbox.backends import backend_names
from rewardbox.backends.docker import DockerBackend
from rewardbox.backends.local import LocalBackend
from tests.conftest import merged, no_sleep, run

REWARD = """
import os, socket

def probe(prompt, completion, example):
    print(f"server={socket.gethostname()}:{os.getppid()}")  # a container's name, or the local server's template
    if completion == "env":
        env = os.environ
        return float("RBX_A" in env) + 10 * float("RBX_B" in env) + 100 * float(env.get("PLAIN") == "1")
    return float(len(completion))
"""


@dataclass
class Harness:
    sandbox: dict  # the config's sandbox section for this backend
    make: Callable  # (config) -> Backend
    kill: Callable  # (sandbox) -> None: it dies from outside
    leftover: Callable  # (sandbox) -> str | None: what is left of it after stop(), if anything
    stable_endpoint: bool = True  # a restarted sandbox answers where it did (ray: a replacement may move nodes)


def _local(request) -> Harness:
    def kill(sandbox):
        os.killpg(sandbox.pid(), signal.SIGKILL)
        sandbox._proc.wait()

    def leftover(sandbox):
        return f"its directory {sandbox._dir}" if sandbox._dir.exists() else None

    return Harness({"backend": "local"}, lambda config: LocalBackend(), kill, leftover)


def _docker(request) -> Harness:
    client = request.getfixturevalue("docker_client")
    base_image = request.getfixturevalue("base_image")
    remembered = {}

    def make(config):
        return DockerBackend(config.sandbox.backend_settings("docker"), client=client)

    def kill(sandbox):
        remembered[sandbox.name] = sandbox.container.id
        sandbox.container.kill()

    def leftover(sandbox):
        name = sandbox.spec.name
        with contextlib.suppress(docker.errors.NotFound):
            return f"container {client.containers.get(name).name}"
        volume = sandbox.socket_volume
        with contextlib.suppress(docker.errors.NotFound):
            return f"socket volume {client.volumes.get(volume.name).name}"
        return f"its socket link {volume.link_dir}" if volume.link_dir.exists() else None

    return Harness({"backend": "docker", "docker": {"base_image": base_image}}, make, kill, leftover)


def _ray(request) -> Harness:
    import ray

    from rewardbox.backends.containers import LABEL
    from rewardbox.backends.ray_cluster import RayBackend

    request.getfixturevalue("ray_cluster")
    client = request.getfixturevalue("docker_client")
    base_image = request.getfixturevalue("base_image")

    def make(config):
        return RayBackend(config.sandbox.backend_settings("ray"))

    def kill(sandbox):
        ray.kill(sandbox.actor, no_restart=True)  # as a crash or a lost node ends it: no stop(), nothing cleaned

    def leftover(sandbox):
        containers = client.containers.list(all=True, filters={"label": f"{LABEL}.pid={sandbox.pid}"})
        return f"container {containers[0].name}" if containers else None

    return Harness({"backend": "ray", "ray": {"docker": {"base_image": base_image}}}, make, kill, leftover,
                   stable_endpoint=False)


HARNESSES = {"local": _local, "docker": _docker, "ray": _ray}
# Backends that reach sandbox servers someone else runs (they start, restart and stop nothing, and the servers'
# environment is not theirs to give): their contract is tested against real services in tests/remote.
ATTACHING = {"remote", "attached"}


def test_every_registered_backend_is_in_the_conformance_suite():
    assert set(backend_names()) == set(HARNESSES) | ATTACHING, "add a harness for each registered backend"


@pytest.fixture(params=sorted(HARNESSES))
def harness(request) -> Harness:
    return HARNESSES[request.param](request)


class Recording:
    """The backend under test, remembering every sandbox it made."""

    def __init__(self, backend):
        self.backend, self.made = backend, []
        self.name, self.isolated = backend.name, backend.isolated

    def prepare(self, rewards):
        self.backend.prepare(rewards)

    def create(self, reward, replica):
        sandbox = self.backend.create(reward, replica)
        self.made.append(sandbox)
        return sandbox

    def close(self):
        self.backend.close()


@pytest.fixture
def backends():
    return []


@pytest.fixture
def start(harness, write_config, backends):
    started = []

    def start(rewards: list[dict], sandbox: dict | None = None) -> RewardSandboxes:
        config = load_config(write_config(rewards, merged(harness.sandbox, sandbox)))
        backend = Recording(harness.make(config))
        backends.append(backend)
        s = RewardSandboxes(config, backend=backend, sleep=no_sleep)
        started.append(s)
        s.start()
        return s

    yield start
    for s in started:
        s.stop()
    for backend in backends:
        backend.close()


def score(s, completions):
    return run(s["probe"].client.score(build_samples(["p"] * len(completions), completions, {})))


def test_a_sandbox_serves_its_reward_at_its_endpoint(start):
    s = start([{"name": "probe", "code": REWARD}])
    replica = s.replicas["probe"][0]
    assert replica.sandbox.alive() and replica.healthy()
    assert replica.sandbox.endpoint.target
    report = score(s, ["a", "bb", "ccc"])
    assert report.statuses == ["ok"] * 3 and report.values == [1.0, 2.0, 3.0]
    assert [f.name for f in replica.describe().functions] == ["probe"]


def test_replicas_are_separate_sandboxes(start):
    s = start([{"name": "probe", "code": REWARD, "replicas": 2, "workers": 1}])
    a, b = s.replicas["probe"]
    assert a.sandbox.endpoint != b.sandbox.endpoint and a.sandbox.name != b.sandbox.name
    report = score(s, ["a", "bb", "ccc", "dddd"])
    assert report.values == [1.0, 2.0, 3.0, 4.0]
    servers = set(report.logs.split())
    hosts = {server.split(":")[0] for server in servers}
    # two servers answered: two containers (their names; a forked sample's parent is its slot process, not the
    # template), or two local servers (their templates)
    assert len(hosts if len(hosts) > 1 else servers) == 2, servers


def test_a_killed_sandbox_is_seen_dead_and_restarts_at_the_same_endpoint(start, harness):
    s = start([{"name": "probe", "code": REWARD}])
    replica = s.replicas["probe"][0]
    endpoint = replica.sandbox.endpoint
    harness.kill(replica.sandbox)
    deadline = time.monotonic() + 10  # an engine reports a killed container's state a moment later
    while replica.sandbox.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not replica.sandbox.alive()
    report = score(s, ["a", "bb"])  # the client restarts it and retries: nothing is lost
    assert report.statuses == ["ok", "ok"] and report.values == [1.0, 2.0]
    assert replica.restarts == 1 and replica.sandbox.alive()
    assert (replica.sandbox.endpoint == endpoint) == harness.stable_endpoint


def test_stop_leaves_nothing_and_may_be_called_again(start, harness):
    s = start([{"name": "probe", "code": REWARD, "replicas": 2}])
    sandboxes = [r.sandbox for r in s.replicas["probe"]]
    s.stop()
    for sandbox in sandboxes:
        assert not sandbox.alive()
        assert harness.leftover(sandbox) is None
        sandbox.stop()  # idempotent


def test_logs_carry_the_servers_output(start):
    s = start([{"name": "probe", "code": REWARD}])
    assert "serving on" in s.replicas["probe"][0].sandbox.logs()


def test_only_the_named_secrets_and_the_plain_env_reach_reward_code(start, monkeypatch):
    monkeypatch.setenv("RBX_A", "secret-a")
    monkeypatch.setenv("RBX_B", "secret-b")
    s = start([{"name": "probe", "code": REWARD, "secrets": ["RBX_A"], "env": {"PLAIN": "1"}}])
    assert score(s, ["env"]).values == [101.0]  # RBX_A and PLAIN, not RBX_B


def test_a_missing_secret_fails_the_start_naming_it(start, monkeypatch):
    monkeypatch.delenv("RBX_MISSING", raising=False)
    with pytest.raises(BackendError, match=r"reward 'probe': secret 'RBX_MISSING' is not set"):
        start([{"name": "probe", "code": REWARD, "secrets": ["RBX_MISSING"]}])


def test_a_reward_that_does_not_load_leaves_nothing_running(start, harness, backends):
    with pytest.raises(RewardLoadError, match=r"probe\.py:2: SyntaxError"):
        start([{"name": "probe", "code": "def probe(prompt, completion, example):\n    return (\n",
                "replicas": 2}])
    [backend] = backends
    assert len(backend.made) == 2
    assert [harness.leftover(sandbox) for sandbox in backend.made] == [None, None]


# rewardbox.sandboxed on every backend: functions of this (not installed) module go by value, as a script's would.
_OFFSET = 0.25


def _shipped_length(completions, **kwargs):
    return [len(c) + _OFFSET for c in completions]


def _scaled(scale):
    def scaled(prompt, completion, example):
        return scale * float(example["n"])
    return scaled


def test_sandboxed_runs_a_modules_function_and_a_factory_closure(harness, request):
    from rewardbox import sandboxed

    config = load_config(request.getfixturevalue("write_config")([{"name": "probe", "code": REWARD}],
                                                                 harness.sandbox))
    backend = Recording(harness.make(config))
    try:
        with sandboxed([_shipped_length, _scaled(3)], backend=backend, sandbox=harness.sandbox) as funcs:
            assert [f.__name__ for f in funcs] == ["_shipped_length", "scaled"]
            assert len(backend.made) == 2  # each in a sandbox of this backend
            completions, n = ["a", "bbb"], [2, 5]
            assert run(funcs[0](prompts=["p", "p"], completions=completions, n=n)) == [1.25, 3.25]
            assert run(funcs[1](prompts=["p", "p"], completions=completions, n=n)) == [6.0, 15.0]
    finally:
        backend.close()
    assert [harness.leftover(sandbox) for sandbox in backend.made] == [None, None]
