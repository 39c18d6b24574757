"""``rewardbox bench`` part (r): the run record and its report.

- what recording 1,024 completions costs (on the training thread, and in all) beside the time the quickstart's
  three rewards take to score them in their sandboxes (target: under 5 %);
- the record's size on disk per 1,000 completions (the quickstart's completions, prompts and prints);
- on a synthetic record of 100,000 completions (3 rewards, 12,500 prompts, printed output and some errors):
  the time to open it, and every view's query (target: open under 1 s, each view under 300 ms).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import yaml

from ..api.session import RewardSandboxes
from ..report.app import Record
from ..report.record import RunRecorder
from ..scoring.client import ScoreReport
from ..spec import load_config
from ..wire import Status

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "config.yaml"
SYSTEM = "Think inside <think></think>, then give the number inside <answer></answer>."


def _batch(n: int, seed: int = 0) -> tuple[list, list, dict]:
    """Quickstart-like prompts (8 completions each) and completions."""
    rng = random.Random(seed)
    prompts, completions, answers, operands = [], [], [], []
    for i in range(n // 8):
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}? ({i})"}]
        for _ in range(8):
            guess = a + b + rng.choice([0, 0, 1, -1, 3])
            prompts.append(prompt)
            completions.append([{"role": "assistant", "content": f"<think>{a} + {b}</think><answer>{guess}</answer>"}])
            answers.append(a + b)
            operands.append([a, b])
    return prompts, completions, {"answer": answers, "operands": operands}


def _report(name: str, n: int, rng: random.Random) -> ScoreReport:
    statuses = [Status.OK if rng.random() > 0.02 else Status.ERROR for _ in range(n)]
    return ScoreReport(name=name, values=[rng.choice([0.0, 0.5, 1.0]) if s == Status.OK else 0.0 for s in statuses],
                       statuses=statuses,
                       errors=[None if s == Status.OK else "Traceback (most recent call last):\n  ...\nValueError: "
                               "bad answer" for s in statuses],
                       logs="", latency_s=0.02,
                       sample_logs=[f"checked sample {i}: answer parsed\n" for i in range(n)])


def _record_synthetic(path: Path, completions: int) -> float:
    """Writes a synthetic record; returns the seconds it took."""
    rng = random.Random(1)
    names = ["format", "partial_format", "correct"]
    recorder = RunRecorder(path, [(n, w) for n, w in zip(names, (1.0, 0.5, 2.0))], num_generations=8)
    started = time.perf_counter()
    step, per_step = 0, 64
    while step * per_step < completions:
        prompts, texts, columns = _batch(per_step, seed=step % 1563)
        state = SimpleNamespace(global_step=step, epoch=step / 200)
        for name in names:
            recorder.observe(name, _report(name, per_step, rng), state, prompts, texts, columns)
        step += 1
    recorder.close()
    return time.perf_counter() - started


def _timed(call: Callable, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report_figures(directory: Path, base_image: str, progress: Callable[[str], None], figure) -> list:
    directory.mkdir(parents=True, exist_ok=True)
    figures = []
    progress("(r) the quickstart's rewards on 1,024 completions, and recording them")
    quickstart = yaml.safe_load(QUICKSTART.read_text())
    for reward in quickstart["rewards"]:
        reward["source"] = str(QUICKSTART.parent / reward["source"])
    (directory / "rewards.yaml").write_text(yaml.safe_dump({
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image}}, "rewards": quickstart["rewards"]}))
    config = load_config(directory / "rewards.yaml")
    prompts, completions, columns = _batch(1024)
    state = SimpleNamespace(global_step=0, epoch=0.0)
    with RewardSandboxes(config) as sandboxes:
        rewards = sandboxes.rewards

        async def score_all():
            return await asyncio.gather(*(r(prompts=prompts, completions=completions, trainer_state=state,
                                            **columns) for r in rewards))

        asyncio.run(score_all())  # warm
        scoring = _timed(lambda: asyncio.run(score_all()))
        reports = [r.last_report for r in rewards]
    path = directory / "quickstart.sqlite"
    recorder = RunRecorder(path, [(r.name, r.weight) for r in rewards], num_generations=8)
    on_thread, total = [], []
    for step in range(5):
        t0 = time.perf_counter()
        s = SimpleNamespace(global_step=step, epoch=0.0)
        for r, report in zip(rewards, reports):
            recorder.observe(r.name, report, s, prompts, completions, columns)
        t1 = time.perf_counter()
        recorder.flush()
        on_thread.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    recorder.close()
    size = path.stat().st_size / (5 * 1024) * 1000
    share = statistics.median(total) / scoring * 100
    figures.append(figure("quickstart's 3 rewards, 1,024 completions: scoring (sandboxed, median of 3)",
                          f"{scoring * 1000:.0f} ms", "-", None))
    figures.append(figure("recording those 1,024 completions: on the training thread",
                          f"{statistics.median(on_thread) * 1000:.2f} ms", "-", None))
    figures.append(figure("recording those 1,024 completions: in all (writer thread, committed)",
                          f"{statistics.median(total) * 1000:.1f} ms ({share:.1f} % of scoring)", "< 5 %",
                          share < 5))
    figures.append(figure("record size per 1,000 completions (quickstart: 3 rewards, prints)",
                          f"{size / 1e6:.2f} MB", "-", None))

    progress("(r) a synthetic record of 100,000 completions, and the report's queries over it")
    big = directory / "big.sqlite"
    written = _record_synthetic(big, 100_000)
    figures.append(figure("synthetic record: 100,000 completions written", f"{written:.1f} s, "
                          f"{big.stat().st_size / 1e6:.0f} MB", "-", None))
    opened = _timed(lambda: Record(big).meta(), repeat=3)
    figures.append(figure("report: open a 100,000-completion record", f"{opened * 1000:.0f} ms", "< 1 s",
                          opened < 1.0))
    record = Record(big)
    some_prompt = record.prompts(limit=1)["rows"][0]["id"]
    views = {
        "graphs": record.graphs,
        "prompts (first page, by last step)": lambda: record.prompts(),
        "prompts (search, by mean total)": lambda: record.prompts(q="What is 7", sort="mean_total"),
        "one prompt with all its completions": lambda: record.prompt(some_prompt),
        "completions (text search, total >= 2)": lambda: record.completions({"q": "<answer>13<", "min_total": 2}),
        "reward logs (errors of one reward)": lambda: record.logs({"reward": "correct", "status": "error"}),
        "reward logs (text search)": lambda: record.logs({"q": "sample 4242"}),
        "reward-hacking signals": record.signals,
    }
    for name, call in views.items():
        took = _timed(call)
        figures.append(figure(f"report view on 100,000 completions: {name}", f"{took * 1000:.0f} ms", "< 300 ms",
                              took < 0.3))
    json.dumps(record.meta())  # the views answer JSON
    return figures
