"""The ray backend on a real multi-node Ray cluster on this machine (tests/conftest.py: a head and three worker
nodes): placement across nodes, and a node lost in the middle of scoring. The conformance suite
(tests/backends/test_conformance.py) checks the rest of the backend contract for ray as for every backend."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from rewardbox import build_samples
from rewardbox.backends.containers import LABEL
from rewardbox.errors import TransportError
from rewardbox.scoring.transport import GrpcTransport
from tests.conftest import run, started_sandboxes

SLOW = """
import time

def slow(prompt, completion, example):
    time.sleep(0.05)
    return float(len(completion)) + 0.5
"""


@pytest.fixture
def start_on_ray(ray_cluster, base_image, write_config):
    yield from started_sandboxes(write_config, {"backend": "ray", "ray": {"docker": {"base_image": base_image}}})


def _nodes(sandboxes, name):
    return [r.sandbox.node_id for r in sandboxes.replicas[name]]


def test_replicas_of_a_reward_go_to_different_nodes(start_on_ray):
    s = start_on_ray([{"name": "slow", "code": SLOW, "replicas": 3, "workers": 1, "cpus": 1}])
    assert len(set(_nodes(s, "slow"))) == 3
    completions = ["a" * i for i in range(12)]
    report = run(s["slow"].client.score(build_samples(["p"] * 12, completions, {})))
    assert report.statuses == ["ok"] * 12 and report.values == [i + 0.5 for i in range(12)]
    # the actors require the run's client certificate: with the token and the CA but without it, nothing answers
    endpoint = s.replicas["slow"][0].sandbox.endpoint
    assert endpoint.client_certificate and endpoint.client_key
    stranger = GrpcTransport().connect(dataclasses.replace(endpoint, client_certificate=None, client_key=None))
    with pytest.raises(TransportError) as refused:
        stranger.describe(10)
    stranger.close()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_node_lost_in_the_middle_of_scoring_loses_no_sample(start_on_ray, ray_cluster, docker_client):
    s = start_on_ray([{"name": "slow", "code": SLOW, "replicas": 2, "workers": 2, "cpus": 1, "timeout_s": 10}])
    doomed = s.replicas["slow"][0].sandbox
    doomed_node, doomed_pid = doomed.node_id, doomed.pid
    node = next(n for n in ray_cluster.worker_nodes if n.node_id == doomed_node)
    n = 160  # about 2 s of work for the two replicas together
    completions = ["b" * (i % 13) for i in range(n)]
    result = {}
    scoring = threading.Thread(target=lambda: result.update(
        report=run(s["slow"].client.score(build_samples(["p"] * n, completions, {})))))
    scoring.start()
    time.sleep(0.6)
    assert scoring.is_alive(), "the batch ended before the node could be lost: make it longer"
    ray_cluster.remove_node(node, allow_graceful=False)  # its raylet and every process of it, killed
    try:
        scoring.join(timeout=300)
        report = result["report"]
        assert report.statuses == ["ok"] * n, [e for e in report.errors if e][:3]
        assert report.values == [(i % 13) + 0.5 for i in range(n)]  # each sample once, with its exact value
        replica = s.replicas["slow"][0]
        assert replica.restarts == 1 and replica.sandbox.node_id != doomed_node
        assert replica.sandbox.node_id in {w.node_id for w in ray_cluster.worker_nodes}
        # the dead actor's container is gone (the replacement removed what a dead owner left on its machine)
        deadline = time.monotonic() + 30
        while docker_client.containers.list(all=True, filters={"label": f"{LABEL}.pid={doomed_pid}"}):
            assert time.monotonic() < deadline, "the lost node's container was left behind"
            time.sleep(0.5)
    finally:
        # Until Ray's health checks mark the lost node dead, it may be given the next test's actors, which are then
        # cancelled before they run (a fresh-clone CI run: "The actor never ran").
        import ray
        deadline = time.monotonic() + 120
        while any(n["NodeID"] == doomed_node and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "Ray never marked the lost node dead"
            time.sleep(0.5)
        ray_cluster.add_node(num_cpus=2)  # the session's cluster keeps its three worker nodes
        ray_cluster.wait_for_nodes()


def test_the_quickstarts_rewards_score_on_the_cluster_as_in_process(ray_cluster, base_image):
    from rewardbox import RewardSandboxes, in_process_rewards, load_config
    from tests.conftest import ROOT

    config = load_config(ROOT / "examples" / "quickstart" / "config.yaml")
    config.sandbox = type(config.sandbox).model_validate(
        {"backend": "ray", "ray": {"docker": {"base_image": base_image}}})
    completions = ["<think>8 + 7</think> <answer>15</answer>", "<answer>14</answer>", "15", "<think>x</think>",
                   "<think>5 - 2 is 3</think>\n<answer>3</answer>", "<answer>3.0</answer>"]
    prompts = ["Tom has 8 apples and buys 7 more. How many apples does Tom have?"] * 3 + \
              ["Sara has 5 pens and gives away 2. How many pens does she have left?"] * 3
    columns = {"answer": [15, 15, 15, 3, 3, 3], "operands": [[8, 7]] * 3 + [[5, 2]] * 3}
    plain = [f(prompts=prompts, completions=completions, **columns) for f in in_process_rewards(config)]
    with RewardSandboxes(config) as sandboxes:
        nodes = {r.sandbox.node_id for rs in sandboxes.replicas.values() for r in rs}
        boxed = [run(f(prompts=prompts, completions=completions, **columns)) for f in sandboxes.rewards]
    assert boxed == plain and any(v for values in plain for v in values)
    assert len(nodes) >= 2  # the three rewards' replicas spread over the worker nodes


def test_no_cluster_at_the_address_is_an_error_saying_how_to_start_one():
    import subprocess
    import sys

    check = ("from rewardbox.backends.ray_cluster import RayBackend, RaySettings\n"
             "try:\n    RayBackend(RaySettings(address='127.0.0.1:1'))\n"
             "except Exception as e:\n    print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("BackendError sandbox.ray.address is '127.0.0.1:1', and nothing answers there")
    assert "ray start --head" in done.stdout


class Tally:
    """An environment whose state lives across an episode's calls."""

    def __init__(self):
        self.total = 0

    def reset(self, **kwargs) -> None:
        self.total = 0

    def add(self, n: int) -> dict:
        """Adds.

        Args:
            n: how much
        """
        import os

        self.total += n
        return {"total": self.total, "pid": os.getpid()}

    def get_reward(self) -> float:
        return float(self.total)


def double(n: int) -> int:
    """Doubles.

    Args:
        n: the number
    """
    if n < 0:
        raise ValueError("no negatives")
    return 2 * n


def test_tools_and_environments_run_on_the_cluster_each_episode_on_the_actor_holding_it(ray_cluster, base_image):
    import asyncio

    from rewardbox import ToolError, sandboxed_environment, sandboxed_tools

    sandbox = {"backend": "ray", "ray": {"docker": {"base_image": base_image}}}
    with sandboxed_tools([double], sandbox=sandbox) as tools:
        assert run(tools[0](n=4)) == 8
        with pytest.raises(ToolError, match="^no negatives$"):
            run(tools[0](n=-1))
    with sandboxed_environment(Tally, sandbox=sandbox, replicas=2, max_episodes=4) as factory:
        instances = [factory() for _ in range(4)]
        for _ in range(2):
            for env in instances:
                env.reset()

            async def calls():
                return await asyncio.gather(*(env.add(n=k) for env in instances for k in (1, 2)))

            results = run(calls())
            assert [r["total"] for r in results] == [1, 3] * 4  # each episode's state, in the order of its calls
            assert all(results[2 * i]["pid"] == results[2 * i + 1]["pid"] for i in range(4))
            assert [env.get_reward() for env in instances] == [3.0] * 4
