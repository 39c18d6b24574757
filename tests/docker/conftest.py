"""Docker tests run against a real engine. A missing engine FAILS these tests (never skips): the README's test
command (scripts/test.sh) installs and starts one, and CI must prove the Docker backend works."""

from __future__ import annotations

import pytest

from runtime import BackendError, RewardSandboxes, load_config
from runtime.backends.docker import DockerBackend, engine_client
from runtime.image import OFFLINE_BASE, ImageBuilder
from tests.conftest import no_sleep

pytestmark = pytest.mark.docker


@pytest.fixture(scope="session")
def docker_client():
    try:
        return engine_client()
    except BackendError as e:
        pytest.fail(f"these tests need a running Docker engine; run `bash scripts/setup.sh`. {e}")


@pytest.fixture(scope="session")
def base_image(docker_client) -> str:
    """The offline base (debootstrap + import), built once when missing: no registry is needed."""
    ImageBuilder(docker_client).base_image_id(OFFLINE_BASE)
    return OFFLINE_BASE


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
