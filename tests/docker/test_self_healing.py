"""A sandbox whose own helper processes are killed heals: a dead template is started again by the server; a dead
supervisor turns health NOT_SERVING and the host replaces the container. No innocent sample is lost either way."""

from __future__ import annotations

import os
import signal
import time

from rewardbox import build_samples
from rewardbox.wire import Status
from tests.conftest import run

REWARD = """
import time

def slow(prompt, completion, example):
    time.sleep(0.2)
    return float(len(completion))
"""


def _processes(container) -> list[dict]:
    rows = container.top(ps_args="-eo pid,ppid,uid,args")["Processes"]
    return [{"pid": int(r[0]), "ppid": int(r[1]), "uid": int(r[2])} for r in rows]


def _helpers(container) -> tuple[int, int]:
    """Host pids of the supervisor (root, child of the server) and of the template (root, child of the supervisor)."""
    processes = _processes(container)
    server = next(p for p in processes if p["uid"] == 65534)
    supervisor = next(p for p in processes if p["ppid"] == server["pid"] and p["uid"] == 0)
    template = next(p for p in processes if p["ppid"] == supervisor["pid"] and p["uid"] == 0)
    return supervisor["pid"], template["pid"]


def _score(s, n=6):
    completions = ["x" * (i + 1) for i in range(n)]
    return run(s["slow"].client.score(build_samples(["p"] * n, completions, {})))


def test_a_killed_template_is_started_again_and_no_sample_is_lost(docker_sandboxes):
    s = docker_sandboxes([{"name": "slow", "code": REWARD, "warm": 4, "workers": 2}])
    container = s.replicas["slow"][0].sandbox.container
    assert _score(s).statuses == [Status.OK] * 6
    _, template = _helpers(container)
    os.kill(template, signal.SIGKILL)
    report = _score(s)
    assert report.statuses == [Status.OK] * 6 and report.values == [float(i + 1) for i in range(6)]
    assert s.replicas["slow"][0].restarts == 0  # healed inside the container
    assert _helpers(container)[1] != template


def test_a_killed_supervisor_turns_health_not_serving_and_the_host_replaces_the_container(docker_sandboxes):
    s = docker_sandboxes([{"name": "slow", "code": REWARD, "warm": 4, "workers": 2}])
    replica = s.replicas["slow"][0]
    old = replica.sandbox.container
    supervisor, template = _helpers(old)
    os.kill(supervisor, signal.SIGKILL)  # the template dies with it (PR_SET_PDEATHSIG)
    deadline = time.monotonic() + 5
    while replica.healthy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not replica.healthy()
    report = _score(s)
    assert report.statuses == [Status.OK] * 6 and report.values == [float(i + 1) for i in range(6)]
    assert replica.restarts == 1 and replica.sandbox.container.id != old.id
