"""``rewardbox bench``: the figures behind our speed targets, measured in one run on one machine.

(a) per-batch overhead of a trivial reward (64 samples) in a warm container versus the same function in-process;
(b) samples per second of a CPU-bound reward (~5 ms per sample) with 1 and 2 replicas;
(c) cold start from ``start()`` to the first score, with a cached image;
(d) image build time, cached (tag exists) and uncached (image removed and wheelhouse emptied).
Targets are printed beside the figures, never asserted.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker.errors

from .backends.docker import DockerBackend, engine_client
from .image import ImageBuilder
from .samples import build_samples
from .session import RewardSandboxes
from .spec import parse_config

REWARDS = textwrap.dedent(
    """
    import time

    def trivial(prompt, completion, example):
        return float(len(completion))

    def cpu_bound(prompt, completion, example):
        end = time.perf_counter() + 0.005
        x = 0
        while time.perf_counter() < end:
            x += 1
        return 1.0
    """
)


@dataclass
class Figure:
    name: str
    value: str
    target: str
    met: bool | None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _config(directory: Path, base_image: str, rewards: list[dict]):
    return parse_config({"sandbox": {"backend": "docker", "docker": {"base_image": base_image}},
                         "rewards": [{"source": "bench_rewards.py", **r} for r in rewards]}, directory)


def _backend(config, client) -> DockerBackend:
    return DockerBackend(config.sandbox.backend_settings("docker"), client=client)


def run_bench(base_image: str, iterations: int = 200, progress: Callable[[str], None] = print) -> list[Figure]:
    client = engine_client()
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="rbx-bench-") as tmp:
        directory = Path(tmp)
        (directory / "bench_rewards.py").write_text(REWARDS)
        namespace: dict = {}
        exec(REWARDS, namespace)

        # (d) builds first: uncached (image removed, fresh wheelhouse), then cached.
        progress("(d) image builds")
        builder = ImageBuilder(client, cache_dir=directory / "cache", on_output=lambda line: None)
        base_image = builder.base_images.resolve(base_image)
        builder.base_image_id(base_image)
        tag = builder.tag_for(base_image, [])
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass
        t0 = time.perf_counter()
        builder.ensure(base_image, [])
        uncached = time.perf_counter() - t0
        t0 = time.perf_counter()
        builder.ensure(base_image, [])
        cached = time.perf_counter() - t0
        figures.append(Figure("image build, uncached (wheels + engine build)", f"{uncached:.1f} s", "-", None))
        figures.append(Figure("image build, cached", f"{cached * 1000:.0f} ms", "< 1 s", cached < 1.0))

        # (c) cold start with a cached image
        progress("(c) cold start")
        cold = []
        for _ in range(3):
            config = _config(directory, base_image, [{"name": "trivial", "workers": 1}])
            t0 = time.perf_counter()
            with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
                asyncio.run(sandboxes.rewards[0].client.score(build_samples(["p"], ["x"], {})))
                cold.append(time.perf_counter() - t0)
        figures.append(Figure("cold start: start() to first score (median of 3)",
                              f"{statistics.median(cold) * 1000:.0f} ms", "<= 1 s", statistics.median(cold) <= 1.0))

        # (a) overhead per 64-sample batch, warm container vs in-process
        progress(f"(a) overhead, {iterations} batches of 64")
        prompts, completions = ["p"] * 64, [f"completion {i}" for i in range(64)]
        samples = build_samples(prompts, completions, {})
        fn = namespace["trivial"]
        in_process = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            [fn(p, c, {}) for p, c in zip(prompts, completions)]
            in_process.append(time.perf_counter() - t0)
        config = _config(directory, base_image, [{"name": "trivial", "workers": 2, "cpus": 2}])
        with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
            reward = sandboxes.rewards[0]

            async def batches():
                times = []
                for i in range(iterations + 20):
                    t0 = time.perf_counter()
                    await reward.client.score(samples)
                    if i >= 20:  # warm-up
                        times.append(time.perf_counter() - t0)
                return times

            sandboxed = asyncio.run(batches())
        base = statistics.median(in_process)
        p50 = (_percentile(sandboxed, 0.5) - base) * 1000
        p95 = (_percentile(sandboxed, 0.95) - base) * 1000
        figures.append(Figure("in-process call of 64 samples, p50", f"{base * 1e6:.0f} us", "-", None))
        figures.append(Figure("sandbox overhead per 64-sample batch, p50", f"{p50:.2f} ms", "<= 2 ms", p50 <= 2.0))
        figures.append(Figure("sandbox overhead per 64-sample batch, p95", f"{p95:.2f} ms", "-", None))

        # (b) throughput of a ~5 ms CPU-bound reward with 1 and 2 replicas
        rates = {}
        for replicas in (1, 2):
            progress(f"(b) throughput, {replicas} replica(s)")
            config = _config(directory, base_image,
                             [{"name": "cpu_bound", "replicas": replicas, "workers": 1, "cpus": 1}])
            with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
                reward = sandboxes.rewards[0]
                batch = build_samples(["p"] * 64, ["c"] * 64, {})

                async def throughput():
                    await reward.client.score(batch)  # warm-up
                    t0 = time.perf_counter()
                    for _ in range(5):
                        await reward.client.score(batch)
                    return 5 * 64 / (time.perf_counter() - t0)

                rates[replicas] = asyncio.run(throughput())
            figures.append(Figure(f"CPU-bound (5 ms/sample) samples/s, {replicas} replica(s)",
                                  f"{rates[replicas]:.0f}", "-", None))
        speedup = rates[2] / rates[1]
        figures.append(Figure("speed-up, 2 replicas vs 1", f"{speedup:.2f}x", ">= 1.8x", speedup >= 1.8))
    return figures
