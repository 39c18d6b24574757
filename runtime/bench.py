"""``rewardbox bench``: the figures behind our speed targets, measured in one run on one machine.

(a) per-batch overhead of a trivial reward (64 samples) in a warm container versus the same function in-process,
    for ``isolation: worker`` and ``isolation: sample`` (paced as in training, and back to back: the worst case);
(b) samples per second of a CPU-bound reward (~5 ms per sample) with 1 and 2 replicas, both isolation levels;
(c) cold start from ``start()`` to the first score, with a cached image;
(d) image build time, cached (tag exists) and uncached (image removed and wheelhouse emptied);
(e) 256 LLM-judge calls (``examples/llm_judge/judge.py``, one module-level AsyncOpenAI client) against a local
    OpenAI-compatible endpoint that answers after 200 ms: sandboxed (``isolation: worker``) versus in-process
    ``asyncio.gather`` of the same function with its one client.
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


PACE_S = 0.2


def _overhead(client, directory: Path, base_image: str, isolation: str, samples: list, iterations: int,
              pace_s: float) -> list[float]:
    """Seconds per 64-sample batch on a warm container, after 20 batches of warm-up; ``pace_s`` between batches."""
    config = _config(directory, base_image, [{"name": "trivial", "workers": 2, "cpus": 2, "isolation": isolation}])
    with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
        reward = sandboxes.rewards[0]

        async def batches():
            times = []
            for i in range(iterations + 20):
                if pace_s:
                    await asyncio.sleep(pace_s)
                t0 = time.perf_counter()
                await reward.client.score(samples)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            return times

        return asyncio.run(batches())


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

        # (a) overhead per 64-sample batch, warm container vs in-process, for both isolation levels
        prompts, completions = ["p"] * 64, [f"completion {i}" for i in range(64)]
        samples = build_samples(prompts, completions, {})
        fn = namespace["trivial"]
        in_process = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            [fn(p, c, {}) for p, c in zip(prompts, completions)]
            in_process.append(time.perf_counter() - t0)
        base = statistics.median(in_process)
        figures.append(Figure("in-process call of 64 samples, p50", f"{base * 1e6:.0f} us", "-", None))
        for isolation, pace_s, target_ms, label in (
            ("worker", 0.0, 2.0, "isolation: worker"),
            ("sample", PACE_S, 5.0, f"isolation: sample, a batch every {PACE_S * 1000:.0f} ms (as in training)"),
            ("sample", 0.0, None, "isolation: sample, back to back"),
        ):
            progress(f"(a) overhead, {label}, {iterations} batches of 64")
            sandboxed = _overhead(client, directory, base_image, isolation, samples, iterations, pace_s)
            p50 = (_percentile(sandboxed, 0.5) - base) * 1000
            p95 = (_percentile(sandboxed, 0.95) - base) * 1000
            target = f"<= {target_ms:g} ms" if target_ms else "-"
            figures.append(Figure(f"overhead per 64-sample batch, p50, {label}", f"{p50:.2f} ms", target,
                                  None if target_ms is None else p50 <= target_ms))
            figures.append(Figure(f"overhead per 64-sample batch, p95, {label}", f"{p95:.2f} ms", "-", None))

        # (b) throughput of a ~5 ms CPU-bound reward: 1 and 2 replicas, both isolation levels
        rates = {}
        for isolation, replicas in (("worker", 1), ("worker", 2), ("sample", 1), ("sample", 2)):
            progress(f"(b) throughput, isolation: {isolation}, {replicas} replica(s)")
            config = _config(directory, base_image, [{"name": "cpu_bound", "replicas": replicas, "workers": 1,
                                                      "cpus": 1, "isolation": isolation}])
            with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
                reward = sandboxes.rewards[0]
                batch = build_samples(["p"] * 64, ["c"] * 64, {})

                async def throughput():
                    await reward.client.score(batch)  # warm-up
                    t0 = time.perf_counter()
                    for _ in range(5):
                        await reward.client.score(batch)
                    return 5 * 64 / (time.perf_counter() - t0)

                rates[isolation, replicas] = asyncio.run(throughput())
            figures.append(Figure(f"CPU-bound (5 ms/sample) samples/s, {replicas} replica(s), isolation: {isolation}",
                                  f"{rates[isolation, replicas]:.0f}", "-", None))
        speedup = rates["worker", 2] / rates["worker", 1]
        figures.append(Figure("speed-up, 2 replicas vs 1 (isolation: worker)", f"{speedup:.2f}x", ">= 1.8x",
                              speedup >= 1.8))
        ratio = rates["sample", 1] / rates["worker", 1]
        figures.append(Figure("CPU-bound throughput, isolation: sample vs worker (1 replica)", f"{ratio:.0%}",
                              ">= 90%", ratio >= 0.9))

        # (e) an I/O-bound async judge, sandboxed vs in-process
        progress("(e) 256 judge calls at 200 ms latency, sandboxed and in-process")
        figures.extend(_judge(client, directory, base_image))
    return figures


JUDGE_CALLS = 256
JUDGE_LATENCY_S = 0.2


def _serve_slow_judge(ready) -> None:
    """An OpenAI-compatible chat endpoint that answers "Score: 7" after JUDGE_LATENCY_S (a thread per request)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class SlowJudge(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(JUDGE_LATENCY_S)
            data = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": "Score: 7"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer.request_queue_size = 1024
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowJudge)
    server.daemon_threads = True
    ready.put(server.server_address[1])
    server.serve_forever()


def _judge(client, directory: Path, base_image: str) -> list[Figure]:
    import importlib.util
    import multiprocessing
    import os
    import shutil

    # The endpoint runs in a process of its own: in this one, its threads would slow the in-process side.
    ready = multiprocessing.get_context("fork").Queue()
    server = multiprocessing.get_context("fork").Process(target=_serve_slow_judge, args=(ready,), daemon=True)
    server.start()
    port = ready.get(timeout=30)
    url = f"http://127.0.0.1:{port}/v1"
    source = Path(__file__).resolve().parents[1] / "examples" / "llm_judge" / "judge.py"
    if not source.is_file():  # an installed wheel has no examples folder
        return [Figure("256 judge calls: needs examples/llm_judge/judge.py (a source checkout)", "-", "-", None)]
    shutil.copy(source, directory / "judge.py")
    env = {"JUDGE_BASE_URL": url, "JUDGE_MODEL": "bench", "JUDGE_API_KEY": "sk-bench", "JUDGE_TIMEOUT_S": "30"}
    samples = build_samples(["What is 1 + 1?"] * JUDGE_CALLS, ["2"] * JUDGE_CALLS, {"answer": ["2"] * JUDGE_CALLS})
    try:
        config = parse_config({"sandbox": {"backend": "docker", "docker": {"base_image": base_image,
                                                                            "network_mode": "host"}},
                               "rewards": [{"name": "judge", "source": "judge.py", "packages": ["openai>=1.40"],
                                            "network": True, "env": env, "isolation": "worker",
                                            "timeout_s": 30}]}, directory)
        with RewardSandboxes(config, backend=_backend(config, client)) as sandboxes:
            reward = sandboxes.rewards[0]

            async def sandboxed():
                await reward.client.score(samples[:8])  # warm-up: the client and its connections exist
                t0 = time.perf_counter()
                report = await reward.client.score(samples)
                return time.perf_counter() - t0, report.fallbacks

            boxed, fallbacks = asyncio.run(sandboxed())

        os.environ.update(env)
        spec = importlib.util.spec_from_file_location("rewardbox_bench_judge", directory / "judge.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

        async def in_process():
            await asyncio.gather(*(module.judge("q", "2", {"answer": "2"}) for _ in range(8)))
            t0 = time.perf_counter()
            await asyncio.gather(*(module.judge("What is 1 + 1?", "2", {"answer": "2"}) for _ in range(JUDGE_CALLS)))
            return time.perf_counter() - t0

        plain = asyncio.run(in_process())
    finally:
        server.kill()
    ratio = boxed / plain
    return [
        Figure(f"{JUDGE_CALLS} judge calls at {JUDGE_LATENCY_S * 1000:.0f} ms, in-process asyncio.gather",
               f"{plain * 1000:.0f} ms", "-", None),
        Figure(f"{JUDGE_CALLS} judge calls at {JUDGE_LATENCY_S * 1000:.0f} ms, sandboxed (isolation: worker)",
               f"{boxed * 1000:.0f} ms ({fallbacks} fell back)", "-", None),
        Figure("judge calls, sandboxed vs in-process", f"{ratio:.2f}x", "<= 1.5x", ratio <= 1.5 and not fallbacks),
    ]
