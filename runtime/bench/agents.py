"""``rewardbox bench`` parts (t) and (v): TRL's tools and environments in sandboxes.

(t) a tool's call through :func:`rewardbox.sandboxed_tools` (under the default ``isolation: sample``: a process
prepared for each call alone) beside the same function called in-process, as TRL calls tools: in turns, each turn
one rollout's calls after another's (TURN calls, fewer than the processes a sandbox keeps prepared), then a pause
while the next turn generates; overhead per call p50 and p99. Then the same calls back to back with no pause (where
each call also pays for preparing a process), and 64 calls at once, wall time per call.

(v) an environment through :func:`rewardbox.sandboxed_environment`: resets as TRL calls them, 1,024 in all: a batch
of 256 rollouts, each step resetting every rollout's instance one after another (each reset ends the instance's
last episode and starts one in a process prepared ahead), then a pause as long as a step's generation, 4 steps; a
method call's overhead beside in-process; the sandbox's memory per idle live episode (256 live, beyond the sandbox
with none); 256 episodes started one after another, then 3 calls each, all at once.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Callable


# The tool as a user's script defines it (exec'd as a module of no installed package, so it ships by value).
TOOL = '''
def lookup(key: str, digits: int = 3) -> str:
    """Looks a constant up.

    Args:
        key: which constant (pi or e)
        digits: how many digits to show
    """
    import math

    return f"{ {'pi': math.pi, 'e': math.e}[key]:.{digits}f}"
'''


WARM_UP = 20
TARGET_P50_MS = 2.0
TURN = 25  # tool calls of a turn (under the default warm, 32: the processes a sandbox keeps prepared)
TURN_PAUSE_S = 1.0  # a turn's generation, when the sandbox prepares processes again (25 take about 0.3 s here)


def _percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def tool_figures(base_image: str, iterations: int, progress: Callable[[str], None], Figure) -> list:
    from ..api.tools import sandboxed_tools

    progress(f"(t) {iterations} tool calls in turns of {TURN}, then back to back, then 64 at once, sandboxed and "
             "in-process")
    namespace: dict = {"__name__": "bench_tool"}
    exec(TOOL, namespace)
    lookup = namespace["lookup"]
    in_process = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        lookup(key="pi", digits=5)
        in_process.append(time.perf_counter() - t0)
    base = statistics.median(in_process)
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_tools([lookup], sandbox=sandbox) as (tool,):
        async def timed() -> float:
            t0 = time.perf_counter()
            assert await tool(key="pi", digits=5) == "3.14159"
            return time.perf_counter() - t0

        async def calls() -> tuple[list, list, float]:
            for _ in range(WARM_UP):
                await timed()
            turns: list = []
            while len(turns) < iterations:
                await asyncio.sleep(TURN_PAUSE_S)
                turns += [await timed() for _ in range(TURN)]
            await asyncio.sleep(TURN_PAUSE_S)
            back_to_back = [await timed() for _ in range(iterations)]
            await asyncio.sleep(TURN_PAUSE_S)
            t0 = time.perf_counter()
            await asyncio.gather(*(tool(key="e", digits=i % 10) for i in range(64)))
            return turns, back_to_back, (time.perf_counter() - t0) / 64

        times, back_to_back, concurrent = asyncio.run(calls())
    p50, p99 = ((_percentile(times, q) - base) * 1000 for q in (0.5, 0.99))
    sustained = (_percentile(back_to_back, 0.5) - base) * 1000
    return [
        Figure("tool call in-process, p50", f"{base * 1e6:.1f} us", "-", None),
        Figure(f"overhead per sandboxed tool call (isolation: sample), turns of {TURN}, p50", f"{p50:.2f} ms",
               f"<= {TARGET_P50_MS:g} ms", p50 <= TARGET_P50_MS),
        Figure("overhead per sandboxed tool call (isolation: sample), p99", f"{p99:.2f} ms", "-", None),
        Figure(f"overhead per sandboxed tool call, {iterations} back to back (each preparing one), p50",
               f"{sustained:.2f} ms", "-", None),
        Figure("64 sandboxed tool calls at once, wall time per call", f"{concurrent * 1000:.2f} ms", "-", None),
    ]


# -- (v) environments -------------------------------------------------------------------------------------------

ENVIRONMENT = '''
class Tally:
    """Counts what the model adds."""

    def reset(self, **kwargs) -> str:
        self.total = 0
        return "ready"

    def add(self, n: int) -> int:
        """Adds to the tally.

        Args:
            n: how much
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total)
'''

LIVE = 256  # TRL's pool: one instance per rollout of a batch
STEPS = 4  # steps of LIVE resets each
RESETS = STEPS * LIVE
# Between two steps' resets TRL generates (and trains): seconds with the CPUs all but idle, when the sandbox prepares
# the processes the next step's episodes start in (256 of them took 2.7 s on our 2-core VM; a step of 256 multi-turn
# rollouts generates far longer than this pause).
STEP_S = 5.0
TARGET_RESET_P50_MS = 2.0
TARGET_IDLE_MIB = 15.0


def _container_memory(client) -> int:
    """Bytes the running rewardbox containers use (their cgroups, as the engine reports them), page cache excluded."""
    total = 0
    for container in client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True):
        stats = container.stats(stream=False, one_shot=True)["memory_stats"]
        total += stats.get("usage", 0) - stats.get("stats", {}).get("inactive_file", 0)
    return total


def environment_figures(client, base_image: str, iterations: int, progress: Callable[[str], None], Figure) -> list:
    from ..api.environments import end_episode, sandboxed_environment

    namespace: dict = {"__name__": "bench_environment"}
    exec(ENVIRONMENT, namespace)
    tally = namespace["Tally"]
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    figures = []
    progress(f"(v) environments: {STEPS} steps of {LIVE} resets in a row, {iterations} calls, {LIVE} live episodes")
    with sandboxed_environment(tally, sandbox=sandbox, max_episodes=LIVE, memory="4g") as factory:
        assert not isinstance(factory, dict)  # one environment: its factory
        pool = [factory() for _ in range(LIVE)]
        resets = []
        for _ in range(STEPS):
            time.sleep(STEP_S)  # the sandbox prepares its processes ahead of demand
            for instance in pool:
                t0 = time.perf_counter()
                instance.reset()
                resets.append(time.perf_counter() - t0)
        env = pool[0]
        in_process = tally()
        in_process.reset()
        base = statistics.median([_timed(lambda: in_process.add(n=1)) for _ in range(iterations)])

        async def calls() -> list:
            times = []
            for _ in range(iterations + WARM_UP):
                t0 = time.perf_counter()
                await env.add(n=1)
                times.append(time.perf_counter() - t0)
            return times[WARM_UP:]

        call_times = asyncio.run(calls())
        for instance in pool:
            end_episode(instance)
        time.sleep(5.0)
        idle = _container_memory(client)
        live = pool
        t0 = time.perf_counter()
        for instance in live:
            instance.reset()
        started_s = time.perf_counter() - t0
        time.sleep(2.0)
        busy = _container_memory(client)

        async def interleaved() -> float:
            t1 = time.perf_counter()
            await asyncio.gather(*(instance.add(n=k) for k in range(3) for instance in live))
            return time.perf_counter() - t1

        together_s = asyncio.run(interleaved())
        rewards = [instance.get_reward() for instance in live]
        assert rewards == [3.0] * LIVE, rewards[:5]
    reset_p50, reset_p99 = (_percentile(resets, q) * 1000 for q in (0.5, 0.99))
    call_p50, call_p99 = ((_percentile(call_times, q) - base) * 1000 for q in (0.5, 0.99))
    per_idle = (busy - idle) / LIVE / 2 ** 20
    figures += [
        Figure(f"reset of a fresh episode, {STEPS} steps of {LIVE} in a row, p50", f"{reset_p50:.2f} ms",
               f"<= {TARGET_RESET_P50_MS:g} ms", reset_p50 <= TARGET_RESET_P50_MS),
        Figure("reset of a fresh episode, p99", f"{reset_p99:.2f} ms", "-", None),
        Figure("overhead per environment method call, p50", f"{call_p50:.2f} ms", "<= 2 ms", call_p50 <= 2.0),
        Figure("overhead per environment method call, p99", f"{call_p99:.2f} ms", "-", None),
        Figure(f"memory per idle live episode ({LIVE} live, beyond a prepared process)", f"{per_idle:.1f} MiB",
               f"<= {TARGET_IDLE_MIB:g} MiB", per_idle <= TARGET_IDLE_MIB),
        Figure(f"sandbox memory with {2 * LIVE} episode processes prepared, none live, per process",
               f"{idle / (2 * LIVE) / 2 ** 20:.1f} MiB", "-", None),
        Figure(f"{LIVE} episodes started one after another", f"{started_s:.2f} s", "-", None),
        Figure(f"{LIVE} live episodes, 3 calls each interleaved, wall", f"{together_s:.2f} s", "-", None),
    ]
    return figures


def _timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0
