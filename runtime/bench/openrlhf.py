"""``rewardbox bench`` part (o): OpenRLHF's HTTP route (``rewardbox serve --openrlhf``'s endpoint, on loopback)
beside the gRPC path, in the same run over the same sandbox: the trivial reward (``isolation: worker``), one
rollout a request, p50 latency per rollout with 1 and 256 requests in flight. Over HTTP the 256 gather into a few
batches; over gRPC each is a call of its own."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Callable

from ..api.session import RewardSandboxes
from ..scoring.samples import build_samples
from ..serve.openrlhf import Endpoint, listening
from ..serve.service import ServiceSecurity

ROUNDS = 200  # one in flight
WAVES = 5  # of 256 in flight


async def _http(url: str, in_flight: int, rounds: int) -> list[float]:
    import aiohttp

    times: list[float] = []
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            body = {"query": [f"p{i} <answer>{i}</answer>"], "prompts": [f"p{i} "], "labels": [str(i)]}
            t0 = time.perf_counter()
            async with session.post(url, json=body) as response:
                await response.json()
            times.append(time.perf_counter() - t0)

        for _ in range(rounds):
            await asyncio.gather(*(one(i) for i in range(in_flight)))
    return times


async def _grpc(client, in_flight: int, rounds: int) -> list[float]:
    times: list[float] = []

    async def one(i: int) -> None:
        samples = build_samples([f"p{i} "], [f"<answer>{i}</answer>"], {"label": [str(i)]})
        t0 = time.perf_counter()
        await client.score(samples)
        times.append(time.perf_counter() - t0)

    for _ in range(rounds):
        await asyncio.gather(*(one(i) for i in range(in_flight)))
    return times


def openrlhf_figures(client, directory: Path, base_image: str, make_config: Callable, make_backend: Callable,
                     progress: Callable[[str], None], figure: Callable) -> list:
    """Part (o). ``make_config``, ``make_backend`` and ``figure`` are the bench's own."""
    progress("(o) OpenRLHF's HTTP route beside the gRPC path")
    config = make_config(directory, base_image, [{"name": "trivial", "workers": 2, "cpus": 2, "isolation": "worker"}])
    with RewardSandboxes(config, backend=make_backend(config, client)) as sandboxes:
        reward_client = sandboxes["trivial"].client

        async def run() -> dict:
            endpoint = Endpoint(sandboxes, ServiceSecurity())
            async with listening(endpoint, "127.0.0.1", 0) as port:
                url = f"http://127.0.0.1:{port}/get_reward"
                await _http(url, 16, 3)  # warm-up of both paths
                await _grpc(reward_client, 16, 3)
                out: dict = {}
                for in_flight, rounds in ((1, ROUNDS), (256, WAVES)):
                    batches = endpoint.gatherer.batches
                    out[("http", in_flight)] = await _http(url, in_flight, rounds)
                    out[("batches", in_flight)] = (endpoint.gatherer.batches - batches) / rounds
                    out[("grpc", in_flight)] = await _grpc(reward_client, in_flight, rounds)
                return out

        measured = asyncio.run(run())
    figures = []
    for in_flight in (1, 256):
        http, grpc_ = statistics.median(measured[("http", in_flight)]), statistics.median(measured[("grpc", in_flight)])
        figures.append(figure(f"OpenRLHF HTTP route, {in_flight} request(s) in flight: p50 per rollout (gRPC path)",
                              f"{http * 1000:.2f} ms ({grpc_ * 1000:.2f} ms); {measured[('batches', in_flight)]:.1f} "
                              "batches a wave", "-", None))
    return figures
