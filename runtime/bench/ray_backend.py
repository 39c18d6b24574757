"""``rewardbox bench`` part (y): the trivial reward of part (a) (``isolation: worker``, 64-sample batches) through
the ray backend, on a Ray cluster the bench starts on this machine (a head and two worker nodes,
``ray.cluster_utils.Cluster``), beside the local Unix-socket path of part (a). The replica serves from its node
over TCP with the run's TLS and token, as on a real cluster; here the nodes share this machine's loopback."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable


def ray_figures(directory: Path, base_image: str, samples: list, iterations: int, base: float, local: list,
                batch_times: Callable, progress: Callable[[str], None], figure: Callable) -> list:
    """``batch_times(reward, samples, iterations, pace_s)`` and ``figure`` are the bench's own; ``local`` are part
    (a)'s batch times of the same reward on the docker backend; ``base`` the in-process time of a batch."""
    import ray
    from ray.cluster_utils import Cluster

    from ..api.session import RewardSandboxes
    from ..spec import parse_config

    progress(f"(y) overhead through the ray backend (head + 2 worker nodes here), {iterations} batches of 64")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rewardbox", log_to_driver=False)
        config = parse_config({"sandbox": {"backend": "ray", "ray": {"docker": {"base_image": base_image}}},
                               "rewards": [{"name": "trivial", "source": "bench_rewards.py", "workers": 2, "cpus": 2,
                                            "isolation": "worker"}]}, directory)
        with RewardSandboxes(config) as sandboxes:
            times = batch_times(sandboxes.rewards[0], samples, iterations, 0.0)
    finally:
        ray.shutdown()
        cluster.shutdown()
    ray_p50 = (statistics.median(times) - base) * 1000
    local_p50 = (statistics.median(local) - base) * 1000
    return [
        figure("overhead per 64-sample batch, p50, ray backend (TLS + token over TCP)", f"{ray_p50:.2f} ms", "-", None),
        figure("overhead per 64-sample batch, p50, docker backend (Unix socket), same run", f"{local_p50:.2f} ms", "-",
               None),
    ]
