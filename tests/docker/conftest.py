"""Docker tests run against a real engine. A missing engine FAILS these tests (never skips): the README's test
command (scripts/test.sh) installs and starts one, and CI must prove the Docker backend works."""

from __future__ import annotations

import pytest

from runtime import RewardSandboxes, load_config
from runtime.backends.docker import DockerBackend
from tests.conftest import no_sleep


@pytest.fixture
def docker_sandboxes(write_config, docker_client, base_image):
    """docker_sandboxes(rewards, sandbox=...) -> started RewardSandboxes on the docker backend."""
    started = []

    def start(rewards: list[dict], sandbox: dict | None = None) -> RewardSandboxes:
        no_sleep.calls = []
        path = write_config(rewards, {"backend": "docker", "base_image": base_image, **(sandbox or {})})
        s = RewardSandboxes(load_config(path), backend=DockerBackend(docker_client), sleep=no_sleep)
        s.start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
