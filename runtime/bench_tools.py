"""``rewardbox bench`` part (t): a TRL tool's call through :func:`rewardbox.sandboxed_tools` (under the default
``isolation: sample``: a process forked for each call) beside the same function called in-process.

- one call at a time (TRL calls a rollout's tools, then the next rollout's): overhead per call, p50 and p99;
- 64 calls at once (one rollout's calls gathered, or several ranks'): wall time per call.
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


def _percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def tool_figures(base_image: str, iterations: int, progress: Callable[[str], None], Figure) -> list:
    from .tools import sandboxed_tools

    progress(f"(t) {iterations} tool calls one at a time, then 64 at once, sandboxed and in-process")
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
        async def calls() -> tuple[list, float]:
            times = []
            for i in range(iterations + WARM_UP):
                t0 = time.perf_counter()
                assert await tool(key="pi", digits=5) == "3.14159"
                if i >= WARM_UP:
                    times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.gather(*(tool(key="e", digits=i % 10) for i in range(64)))
            return times, (time.perf_counter() - t0) / 64

        times, concurrent = asyncio.run(calls())
    p50, p99 = ((_percentile(times, q) - base) * 1000 for q in (0.5, 0.99))
    return [
        Figure("tool call in-process, p50", f"{base * 1e6:.1f} us", "-", None),
        Figure("overhead per sandboxed tool call (isolation: sample), p50", f"{p50:.2f} ms",
               f"<= {TARGET_P50_MS:g} ms", p50 <= TARGET_P50_MS),
        Figure("overhead per sandboxed tool call (isolation: sample), p99", f"{p99:.2f} ms", "-", None),
        Figure("64 sandboxed tool calls at once, wall time per call", f"{concurrent * 1000:.2f} ms", "-", None),
    ]
