"""`sandbox.runtime: runsc`: the same sandbox under gVisor, whose kernel is not the host's."""

from __future__ import annotations

import os

import pytest

from rewardbox import build_samples
from tests.conftest import run

PROBE = """
import os, platform

def kernel(prompt, completion, example):
    print(platform.release())
    return float(os.getuid())
"""


def test_rewards_run_under_gvisor_when_the_runtime_is_runsc(docker_sandboxes, docker_client):
    if "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: install runsc (Debian package) and register it as "
                    "scripts/setup.sh does (dockerd --config-file scripts/dockerd.json)")
    s = docker_sandboxes([{"name": "kernel", "code": PROBE, "workers": 2}], sandbox={"docker": {"runtime": "runsc"}})
    container = s.replicas["kernel"][0].sandbox.container
    container.reload()
    assert container.attrs["HostConfig"]["Runtime"] == "runsc"
    assert container.attrs["HostConfig"]["CapDrop"] == ["ALL"]  # the hardening applies under gVisor as well
    report = run(s["kernel"].client.score(build_samples(["p"] * 4, ["a", "b", "c", "d"], {})))
    assert report.statuses == ["ok"] * 4 and report.values[0] not in (0.0, None)
    kernels = set(report.logs.split())
    assert len(kernels) == 1 and kernels != {os.uname().release}  # gVisor's sentry answered, not the host kernel
