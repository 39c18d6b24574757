"""Docker tests run against a real engine. A missing engine FAILS these tests (never skips): the README's test
command (scripts/test.sh) installs and starts one, and CI must prove the Docker backend works."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from rewardbox import RewardSandboxes, load_config
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


def sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, code: str, rewards: list,
                         **docker):
    """Started RewardSandboxes for a module's rewards (``code`` as rewards.py, each of ``rewards`` a reward entry
    of the config) under the runtime ``request.param`` names (runc or runsc); ``.runtime`` says which. A missing
    runsc fails (never skips)."""
    if request.param == "runsc" and "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: start it as scripts/setup.sh does")
    root = tmp_path_factory.mktemp(f"{request.module.__name__.rsplit('.', 1)[-1]}-{request.param}")
    (root / "rewards.py").write_text(textwrap.dedent(code))
    (root / "config.yaml").write_text(yaml.safe_dump({
        "sandbox": {"backend": "docker", "docker": {
            "base_image": base_image, "runtime": None if request.param == "runc" else "runsc", **docker}},
        "rewards": [{"source": "rewards.py", **reward} for reward in rewards],
    }))
    config = load_config(root / "config.yaml")
    started = RewardSandboxes(config, backend=docker_backend(config, docker_client))
    started.start()
    started.runtime = request.param
    return started
