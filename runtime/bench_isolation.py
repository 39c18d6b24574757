"""``rewardbox bench`` part (h): ``isolation: sample`` at real GRPO batch sizes (1,024 and 4,096 completions).

- a pure reward (a regex): ``isolation: sample`` (processes reused while nothing could leave state behind) versus
  ``isolation: worker``, wall time per batch and the container's CPU seconds per 1,000 samples;
- a reward that ``exec``s each completion (so every sample needs a fresh process): ``isolation: sample`` and
  ``isolation: process``, CPU per sample beside the fork floor measured in the same image in the same run (a bare
  ``python3`` forking, exiting and being waited for; and the same with the sandbox's template modules imported);
- a CPU-bound reward (~5 ms a sample): samples per second, sample versus worker.

CPU time is the container's (its cgroup's ``cpuacct`` counter, read through the engine), so the server, the
template, the slot processes and their forks are all counted.
"""

from __future__ import annotations

import asyncio
import statistics
import textwrap
import time
from pathlib import Path
from typing import Callable, Optional

from .samples import build_samples
from .session import RewardSandboxes

# Beside the bench's own rewards (its cpu_bound among them), in the same file.
REWARDS = textwrap.dedent(
    """
    import re

    PATTERN = re.compile(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", re.DOTALL)

    def regex(prompt, completion, example):
        return 1.0 if PATTERN.match(completion) else 0.0

    def run_it(prompt, completion, example):
        namespace = {}
        exec(completion, namespace)
        return float(namespace.get("score", 0.0))
    """
)

# CPU seconds per fork of this process (its children's included) with ``child`` run in each child before it exits.
_PER_FORK = textwrap.dedent(
    """
    import os, resource
    def per_fork(n, child):
        def cpu():
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        start = cpu()
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    child()
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert status == 0, status
        return (cpu() - start) / n
    """
)
FLOOR = _PER_FORK + textwrap.dedent(
    """
    import mmap, sys
    if sys.argv[1:]:
        from rewardbox.sandbox import template, slot, worker, execution  # what a template holds
    child = lambda: None
    if sys.argv[1:] == ["sample"]:
        # The least a forked exec sample can cost: the child runs the bench's exec reward on one completion and
        # writes its encoded answer into a mapping shared with its parent, and nothing else (no uid, no cleanup,
        # no socket, no answer sent).
        from rewardbox.sandbox import codec
        from rewardbox.wire import Outcome
        answer = mmap.mmap(-1, 1 << 16)
        def run_it(completion):
            namespace = {}
            exec(completion, namespace)
            return float(namespace.get("score", 0.0))
        def child():
            data = codec.encode_result([Outcome.ok(run_it("score = 3 / 7"))], "", 0, 4096, 0.001)
            answer[:len(data)] = data
    print(per_fork(500, child))
    """
)
# What any fresh process per sample must do with the guarantees of isolation: sample (a uid of its own and a
# private /tmp): fork from a process holding the template's modules, become a uid of its own, take a private /tmp
# (userns mode: a user and mount namespace with a directory bound on /tmp), exit, be waited for. Run as root in a
# running sandbox container (its capabilities and seccomp profile), with a uid no slot uses.
ISOLATION_FLOOR = _PER_FORK + textwrap.dedent(
    """
    from rewardbox.sandbox import template, slot, worker, execution, private_tmp
    private_tmp.prewarm()
    UID = 64999
    def isolated():
        os.setgroups([])
        os.setresgid(UID, UID, UID)
        private_tmp.become("userns", UID, "/usr/share")
    print(per_fork(300, isolated))
    """
)
BATCHES = 11  # a regex batch takes milliseconds: the median of 11 moves less than that of 5 between runs


def _container_cpu_s(client) -> float:
    """CPU seconds used so far by the running rewardbox containers (the bench runs one sandbox at a time)."""
    total = 0
    for container in client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True):
        total += container.stats(stream=False, one_shot=True)["cpu_stats"]["cpu_usage"]["total_usage"]
    return total / 1e9


async def _settled(client, window_s: float = 0.25, idle: float = 0.05, at_most_s: float = 10.0) -> None:
    """Waits until the sandbox is idle (under ``idle`` of a core over ``window_s``, for at most ``at_most_s``): the
    slot processes it forks ahead of demand after its first batch are its start-up, not the batches' cost."""
    deadline = time.monotonic() + at_most_s
    while time.monotonic() < deadline:
        before = _container_cpu_s(client)
        await asyncio.sleep(window_s)
        if _container_cpu_s(client) - before < idle * window_s:
            return


def _measure(client, config, backend, name: str, completions: list, batches: int = BATCHES,
             then: Optional[Callable] = None) -> tuple[float, float]:
    """(median wall seconds per batch, container CPU seconds per 1,000 samples) after a warm-up batch. ``then``
    is called with the sandbox's container after the batches, while it still runs."""
    samples = build_samples(["p"] * len(completions), completions, {})
    with RewardSandboxes(config, backend=backend) as sandboxes:
        client_ = sandboxes[name].client

        async def run() -> tuple[float, float]:
            report = await client_.score(samples)  # warm-up
            assert all(s.value == "ok" for s in report.statuses), report.errors[:3]
            await _settled(client)
            walls = []
            cpu0 = _container_cpu_s(client)
            for _ in range(batches):
                t0 = time.perf_counter()
                await client_.score(samples)
                walls.append(time.perf_counter() - t0)
            cpu = _container_cpu_s(client) - cpu0
            return statistics.median(walls), cpu / (batches * len(completions)) * 1000

        figures = asyncio.run(run())
        if then is not None:
            container, = client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)
            then(container)
        return figures


def _isolation_floor(container) -> Optional[float]:
    """CPU seconds per fresh isolated process (:data:`ISOLATION_FLOOR`) in a running sandbox container, or None
    where its /tmp is not private by user namespaces (gVisor, or private_tmp off)."""
    code, out = container.exec_run(["python3", "-c", ISOLATION_FLOOR], user="0")
    if code != 0:
        return None
    return float(out.decode().strip().splitlines()[-1])


def _fork_floor(client, image: str) -> tuple[float, float, float]:
    """(bare python3, python3 holding the template's modules, the same whose child also scores one exec sample and
    encodes its answer): CPU seconds per fork+exit+wait, in ``image``."""
    floors = []
    for extra in ([], ["template"], ["sample"]):
        out = client.containers.run(image, ["python3", "-c", FLOOR, *extra], entrypoint=[], remove=True,
                                    network_mode="none", user="65534")
        floors.append(float(out.decode().strip().splitlines()[-1]))
    return floors[0], floors[1], floors[2]


def isolation_figures(client, directory: Path, base_image: str, make_config: Callable, make_backend: Callable,
                      progress: Callable[[str], None], figure: Callable, bench_rewards: str) -> list:
    """Part (h). ``make_config(directory, base_image, rewards)`` and ``make_backend(config, client)`` are the bench's
    own; ``figure(name, value, target, met)`` makes one of its figures; ``bench_rewards`` is the source of its
    rewards (``cpu_bound`` among them), which part (h)'s are added to."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "bench_rewards.py").write_text(bench_rewards + REWARDS)
    figures = []

    def config_for(function: str, isolation: str, **extra):
        return make_config(directory, base_image, [{"name": f"{function}_{isolation}", "function": function,
                                                     "workers": 2, "cpus": 2, "isolation": isolation,
                                                     "memory": "2g", "timeout_s": 30, **extra}])

    for n in (1024, 4096):
        completions = [f"<think>{i}</think><answer>{i}</answer>" if i % 2 else f"no tags {i}" for i in range(n)]
        measured = {}
        for isolation in ("worker", "sample"):
            progress(f"(h) regex reward, {n} completions, isolation: {isolation}")
            config = config_for("regex", isolation)
            measured[isolation] = _measure(client, config, make_backend(config, client), f"regex_{isolation}",
                                           completions)
        (w_wall, w_cpu), (s_wall, s_cpu) = measured["worker"], measured["sample"]
        ratio = s_wall / w_wall
        figures += [
            figure(f"regex reward, {n} completions, isolation: worker (median of {BATCHES})",
                   f"{w_wall * 1000:.1f} ms, {w_cpu:.3f} CPU s/1k", "-", None),
            figure(f"regex reward, {n} completions, isolation: sample (median of {BATCHES})",
                   f"{s_wall * 1000:.1f} ms, {s_cpu:.3f} CPU s/1k", "-", None),
            figure(f"regex reward, {n} completions: sample / worker (wall)", f"{ratio:.2f}x", "<= 1.5x",
                   ratio <= 1.5),
        ]

    completions = [f"score = {i % 7} / 7" for i in range(1024)]
    per_sample = {}
    floors: dict = {}
    for isolation in ("sample", "process"):
        progress(f"(h) exec reward, 1024 completions, isolation: {isolation}")
        config = config_for("run_it", isolation)
        then = (lambda c: floors.update(isolated=_isolation_floor(c))) if isolation == "sample" else None
        wall, cpu = _measure(client, config, make_backend(config, client), f"run_it_{isolation}", completions, 3,
                             then)
        per_sample[isolation] = cpu / 1000
        figures.append(figure(f"exec reward, 1024 completions, isolation: {isolation} (median of 3)",
                              f"{wall * 1000:.0f} ms, {cpu:.2f} CPU s/1k", "-", None))
    progress("(h) fork floor in the sandbox image")
    backend = make_backend(config, client)
    (image, _), = backend.builder.ensure_images(config.rewards, backend.settings).values()
    if image:
        bare, template, sample = _fork_floor(client, image)
        ratio = per_sample["sample"] / bare
        figures += [
            figure("fork floor: bare python3 fork+exit+wait, CPU per fork (same image)", f"{bare * 1000:.2f} ms",
                   "-", None),
            figure("fork floor: python3 holding the template's modules, CPU per fork", f"{template * 1000:.2f} ms",
                   "-", None),
            figure("sample floor: the same, its child exec'ing one completion and encoding the answer, CPU per "
                   f"fork ({sample / bare:.1f}x the bare floor)", f"{sample * 1000:.2f} ms", "-", None),
            figure("exec reward, isolation: sample, CPU per sample / bare fork floor", f"{ratio:.1f}x", "<= 2x",
                   ratio <= 2.0),
            figure("exec reward, isolation: sample, CPU per sample / fork floor holding the template's modules",
                   f"{per_sample['sample'] / template:.1f}x", "-", None),
            figure("exec reward, isolation: sample, CPU per sample / sample floor",
                   f"{per_sample['sample'] / sample:.1f}x", "<= 2x", per_sample["sample"] / sample <= 2.0),
        ]
    if floors.get("isolated"):
        isolated = floors["isolated"]
        figures += [
            figure("isolation floor: template fork + own uid + private /tmp + exit, CPU per process (sandbox "
                   "container)", f"{isolated * 1000:.2f} ms", "-", None),
            figure("exec reward, isolation: sample, CPU per sample / isolation floor",
                   f"{per_sample['sample'] / isolated:.1f}x", "-", None),
        ]

    rates = {}
    batch = ["c"] * 1024
    for isolation in ("worker", "sample"):
        progress(f"(h) CPU-bound reward, 1024 completions, isolation: {isolation}")
        config = config_for("cpu_bound", isolation)
        wall, _ = _measure(client, config, make_backend(config, client), f"cpu_bound_{isolation}", batch, 2)
        rates[isolation] = len(batch) / wall
    ratio = rates["sample"] / rates["worker"]
    figures.append(figure("CPU-bound (5 ms/sample), 1024 completions: samples/s, sample vs worker",
                          f"{rates['sample']:.0f} vs {rates['worker']:.0f} ({ratio:.0%})", ">= 90%", ratio >= 0.9))
    return figures
