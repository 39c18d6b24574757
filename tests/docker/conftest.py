"""Docker tests run against a real engine. A missing engine FAILS these tests (never skips): the README's test
command (scripts/test.sh) installs and starts one, and CI must prove the Docker backend works."""

from __future__ import annotations

import pytest

from rewardbox.backends.docker import DockerBackend
from tests.conftest import started_sandboxes


def docker_backend(config, docker_client) -> DockerBackend:
    """The config's docker backend on the tests' one engine client."""
    return DockerBackend(config.sandbox.backend_settings("docker"), client=docker_client)


@pytest.fixture
def docker_sandboxes(write_config, docker_client, base_image):
    """docker_sandboxes(rewards, sandbox=...) -> started RewardSandboxes on the docker backend."""
    yield from started_sandboxes(write_config, {"backend": "docker", "docker": {"base_image": base_image}},
                                 lambda config: docker_backend(config, docker_client))
