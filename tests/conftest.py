"""Shared fixtures: reward files written into tmp_path, configs around them, and real sandboxes."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest
import yaml

from rewardbox import BackendError, RewardSandboxes, load_config

ROOT = Path(__file__).resolve().parent.parent

# A sample that leaves a listening socket in flight in a cycle of Unix sockets: it keeps its port until the kernel's
# collector frees the cycle (red team 13). Run as a sample (tests/docker) and in a child of a uid (tests/sandbox).
LISTENER_IN_FLIGHT = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", {port}))
server.listen()
a, b = socket.socketpair()
c, d = socket.socketpair()
# a cycle: a, b and the listener ride in c and d, which ride in a and b; nothing holds any of them once this ends
socket.send_fds(a, [b"x"], [a.fileno(), b.fileno(), server.fileno()])
socket.send_fds(c, [b"x"], [c.fileno(), d.fileno(), server.fileno()])
socket.send_fds(b, [b"y"], [c.fileno(), d.fileno()])
socket.send_fds(d, [b"y"], [a.fileno(), b.fileno()])
for s in (a, b, c, d, server):
    s.close()
score = 0.0
"""


# The fast tier (`pytest -m fast -n 4`, docs/how-to/run-the-tests.md): every test that needs none of the Docker engine,
# Ray, a browser, verl's environment or a GRPOTrainer run. Decided from what a test uses (its fixtures, transitively),
# so a new test lands in the right tier without a marker of its own.
HEAVY_FIXTURES = {"docker_client": "docker", "ray_cluster": "ray", "browser": "browser", "tiny_model": "train",
                  "tiny_tool_model": "train"}
HEAVY_FOLDERS = {"verl": "verl", "trainer": "train", "ray": "ray"}
# Real parts that start without those fixtures: a wheel build, a local Ray instance (the backends' conformance
# suite run on Ray), and the shared service under load (minutes of hostile peers).
HEAVY_FILES = {"test_packaging.py": "wheel build", "test_hostile_peers.py": "load"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        heavy = {why for name, why in HEAVY_FIXTURES.items() if name in getattr(item, "fixturenames", ())}
        path = Path(str(item.fspath)).relative_to(ROOT / "tests")
        if path.parts[0] in HEAVY_FOLDERS:
            heavy.add(HEAVY_FOLDERS[path.parts[0]])
        if path.name in HEAVY_FILES:
            heavy.add(HEAVY_FILES[path.name])
        if "ray" in getattr(getattr(item, "callspec", None), "id", "").split("-"):
            heavy.add("ray")
        if not heavy:
            item.add_marker(pytest.mark.fast)


# Docker tests run against a real engine. A missing engine FAILS them (never skips): the README's test command
# (scripts/test.sh) installs and starts one, and CI must prove the Docker backend works.
@pytest.fixture(scope="session")
def docker_client():
    from rewardbox.backends.docker import engine_client

    try:
        return engine_client()
    except BackendError as e:
        pytest.fail(f"these tests need a running Docker engine; run `bash scripts/setup.sh`. {e}")


@pytest.fixture(scope="session")
def base_image(docker_client) -> str:
    """The offline base (debootstrap + import), built once when missing: no registry is needed."""
    from rewardbox.images.base_image import OFFLINE_BASE, BaseImageResolver

    BaseImageResolver(docker_client).ensure(OFFLINE_BASE)
    return OFFLINE_BASE


# A real multi-node Ray cluster on this machine: a head that runs nothing (num_cpus=0: every actor goes to a
# worker node) and three worker nodes, each its own raylet and object store. Missing Ray FAILS (never skips).
RAY_WORKERS = 3


@pytest.fixture(scope="session")
def ray_cluster():
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as e:
        pytest.fail(f"these tests need Ray; run `bash scripts/setup.sh` (it installs rewardbox[ray]). {e}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(RAY_WORKERS):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rewardbox", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny local causal LM and tokenizer (random weights): no model hub is needed."""
    from rewardbox.trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), warm_up=False)


@pytest.fixture(scope="session")
def tiny_tool_model(tmp_path_factory):
    """A tiny local model that calls tools (TRL's Qwen3 chat template, trained briefly to call ``add``)."""
    from rewardbox.trainer.tiny import build_tiny_tool_model

    return build_tiny_tool_model(tmp_path_factory.mktemp("tiny-tool-model"))


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """write_config(rewards=[{name, code, ...spec}], sandbox={...}) -> path of a YAML config in tmp_path.

    Each reward's ``code`` is dedented and written to ``rewards/<name>.py`` (or ``file``, if given).
    """

    def write(rewards: list[dict], sandbox: dict | None = None, extra: dict | None = None) -> Path:
        (tmp_path / "rewards").mkdir(exist_ok=True)
        entries = []
        for r in rewards:
            r = dict(r)
            code = r.pop("code", None)
            filename = r.pop("file", f"{r['name']}.py")
            if code is not None:
                (tmp_path / "rewards" / filename).write_text(textwrap.dedent(code))
            entries.append({"source": f"rewards/{filename}", **r})
        data = {"sandbox": {"backend": "local", **(sandbox or {})}, "rewards": entries, **(extra or {})}
        path = tmp_path / "rewardbox.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


def merged(base: dict, extra: dict | None) -> dict:
    """``base`` updated with ``extra``, one level of sections deep (``{"docker": {...}}`` adds to base's docker)."""
    out = dict(base)
    for key, value in (extra or {}).items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def no_sleep(seconds: float) -> None:
    """Tenacity's sleep in tests: record, do not wait."""
    no_sleep.calls.append(seconds)


no_sleep.calls = []


def started_sandboxes(write_config, sandbox_defaults: dict, backend_factory=lambda config: None):
    """Yields start(rewards, sandbox=None) -> started RewardSandboxes; stops every one of them afterwards.
    ``backend_factory(config)`` makes the backend (None: the one the config names)."""
    started = []

    def start(rewards: list[dict], sandbox: dict | None = None) -> RewardSandboxes:
        no_sleep.calls = []
        path = write_config(rewards, merged(sandbox_defaults, sandbox))
        config = load_config(path)
        s = RewardSandboxes(config, backend=backend_factory(config), sleep=no_sleep)
        s.start()
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop()


@pytest.fixture
def sandboxes(write_config):
    """sandboxes(rewards, sandbox=...) -> started RewardSandboxes (local backend), stopped after the test."""
    yield from started_sandboxes(write_config, {"backend": "local"})


def run(coro):
    import asyncio

    return asyncio.run(coro)


def until(check: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Calls ``check`` every ``interval_s`` until it is true; returns whether it became true within ``timeout_s``
    (the caller asserts, with what it knows of the failure)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: a shell that runs the tests in the background
    (``cmd &`` without job control) starts them with SIGINT ignored, and children would inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
