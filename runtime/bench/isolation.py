"""``rewardbox bench`` part (h): ``isolation: sample`` (each sample in a process of its own, forked from the
reward's state after import) at real GRPO batch sizes, against its floor.

- four rewards, 1,024 completions each: a regex (pure), one that ``exec``s each completion, the quickstart's sympy
  ``correct`` reward (in its own image, with sympy) and a math-verify accuracy reward as open-r1 writes it (in its
  own image, with math-verify): the container's CPU per sample under ``isolation:
  sample``, beside that reward's **sample floor** measured in the same run in the same image: a process that
  holds the template's modules and the imported reward forks, its child scores one completion and encodes the
  answer into a shared mapping, and exits, and is waited for (target: at most 1.5x);
- the same regex reward under ``isolation: worker`` (processes reused: the speed a user buys by vouching that the
  reward keeps no state that matters), wall time per batch at 1,024 and 4,096 completions beside ``sample``'s;
- the bare fork floors (a ``python3`` that holds nothing; one that holds the template's modules) and the isolation
  floor (a fork that takes a uid of its own and a private /tmp, as a fresh slot process must);
- a CPU-bound reward (~5 ms a sample): samples per second, sample versus worker;
- the regex reward under gVisor (where each sample gets a slot process of its own), 256 completions: wall time and
  the container's CPU a sample.

CPU time is the container's (its cgroup's ``cpuacct`` counter, read through the engine), so the server, the
template, the slot processes and their forks are all counted.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..api.session import RewardSandboxes
from ..scoring.samples import build_samples

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
QUICKSTART_REWARD = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "rewards" / "correct.py"
# A sample-style accuracy reward with Hugging Face's math-verify, as open-r1's is written (its gold answer from the
# dataset's column, the completion's last boxed or LaTeX answer), warmed at import as the performance page advises.
MATH_VERIFY_PACKAGES = ["math-verify==0.9.0"]
MATH_VERIFY_REWARD = textwrap.dedent(
    r"""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    EXTRACTION = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]

    def accuracy(prompt, completion, example):
        gold = parse(example["answer"], extraction_mode="first_match")
        if not gold:
            return None
        answer = parse(completion, extraction_config=EXTRACTION, extraction_mode="first_match")
        return float(verify(gold, answer))

    for _completion, _gold in ((r"\boxed{12}", "$12$"), (r"\boxed{\frac{1}{2}}", "$0.5$"), ("so $x = 3$", "$3$"),
                               (r"\boxed{2x+1}", "$1+2x$"), ("no answer", "$7$")):
        accuracy("", _completion, {"answer": _gold})
    """
)

# CPU seconds per fork of this process (its children's included) with ``child(i)`` run in the i-th child before it
# exits.
_PER_FORK = textwrap.dedent(
    """
    import os, resource
    def per_fork(n, child):
        def cpu():
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        start = cpu()
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    child(i)
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert status == 0, status
        return (cpu() - start) / n
    """
)
# argv: nothing (a bare python3), "template" (holding the template's modules), or "sample" with a JSON file of the
# reward's source, its function's name and the completions with their example columns: a reward's sample floor, its
# module imported (and frozen, as the template does) before the forks, each child scoring one completion with it and
# encoding the answer into a mapping shared with its parent, and nothing else (no uid, no cleanup, no socket).
FLOOR = _PER_FORK + textwrap.dedent(
    """
    import gc, json, mmap, sys, types
    child = lambda i: None
    if sys.argv[1:]:
        from rewardbox.sandbox.processes import template, slot, worker  # what a template holds
        from rewardbox.sandbox.programs import execution
    if sys.argv[1:2] == ["sample"]:
        from rewardbox.sandbox.protocol import codec
        from rewardbox.wire import Outcome
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        module = types.ModuleType("bench_floor_reward")
        module.__file__ = "/tmp/bench_floor_reward.py"
        sys.modules[module.__name__] = module
        exec(compile(spec["source"], module.__file__, "exec"), module.__dict__)
        fn = getattr(module, spec["function"])
        samples = spec["samples"]
        gc.freeze()
        answer = mmap.mmap(-1, 1 << 16)
        def child(i):
            completion, example = samples[i % len(samples)]
            data = codec.encode_result([Outcome.ok(float(fn("p", completion, example)))], "", 0, 4096, 0.001)
            answer[:len(data)] = data
    n = int(sys.argv[-1]) if sys.argv[-1].isdigit() else 500
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    figure = per_fork(n, child)
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("split", *(f"{((b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)) / n:.6f} {(b.ru_minflt - a.ru_minflt) / n:.1f}"
                     for a, b in zip(before, after)))
    print(figure)
    """
)
# What any fresh process per sample must do with the guarantees of isolation: sample (a uid of its own and a
# private /tmp): fork from a process holding the template's modules, become a uid of its own, take a private /tmp
# (userns mode: a user and mount namespace with a directory bound on /tmp), exit, be waited for. Run as root in a
# running sandbox container (its capabilities and seccomp profile), with a uid no slot uses.
ISOLATION_FLOOR = _PER_FORK + textwrap.dedent(
    """
    from rewardbox.sandbox.processes import template, slot, worker
    from rewardbox.sandbox.programs import execution
    from rewardbox.sandbox.confine import private_tmp
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


# A sandbox's processes by their names (tree.set_name); a forked sample's child is named after the slot
# process until its first steps, which are counted with it.
_ROLES = {"rbx-server": "server", "rbx-slot": "slot processes", "rbx-sample": "samples' processes"}


def _process_counters() -> dict:
    """{pid: (role, CPU seconds, minor page faults)} of the sandbox processes this host's /proc shows (runc; none
    under gVisor, whose processes live in its own kernel). A process that exits takes its counters with it, so the
    split is read while the pool is warm and its processes live on."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        role = _ROLES.get(text[text.index("(") + 1:text.rindex(")")])
        if role is None:
            continue
        fields = text[text.rindex(")") + 2:].split()
        # minflt, cminflt, utime, stime, cutime, cstime: a slot process's reaped children count in the c- fields
        minflt, cminflt = int(fields[7]), int(fields[8])
        own, reaped = (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks
        found[int(entry.name)] = (role, own, minflt, reaped, cminflt)
    return found


def _split(before: dict, after: dict, samples: int) -> dict:
    """{role: (CPU ms, page faults) per sample} between two :func:`_process_counters`; a slot process's reaped
    children are the samples' processes."""
    totals: dict = {}
    for pid, (role, own, minflt, reaped, cminflt) in after.items():
        _, own0, minflt0, reaped0, cminflt0 = before.get(pid, (role, 0.0, 0, 0.0, 0))
        for name, cpu, faults in ((role, own - own0, minflt - minflt0),
                                  ("samples' processes", reaped - reaped0, cminflt - cminflt0)):
            if cpu or faults:
                t = totals.setdefault(name, [0.0, 0])
                t[0] += cpu
                t[1] += faults
    return {role: (cpu / samples * 1000, faults / samples) for role, (cpu, faults) in totals.items()}


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


GVISOR_SAMPLES = 256  # under gVisor, each sample in a slot process of its own: tens of milliseconds each


def _measure(client, config, backend, name: str, completions: list, batches: int = BATCHES,
             then: Optional[Callable] = None, columns: Optional[dict] = None,
             split: Optional[dict] = None) -> tuple[float, float]:
    """(median wall seconds per batch, container CPU seconds per 1,000 samples) after a warm-up batch (``columns``:
    the samples' dataset columns). ``then`` is called with the sandbox's container after the batches, while it
    still runs. ``split``, where given, is filled with the CPU and page faults per sample of each kind of process
    (:func:`_split`; empty where the host cannot see them)."""
    samples = build_samples(["p"] * len(completions), completions, columns or {})
    with RewardSandboxes(config, backend=backend) as sandboxes:
        client_ = sandboxes[name].client

        async def run() -> tuple[float, float]:
            report = await client_.score(samples)  # warm-up
            assert all(s.value == "ok" for s in report.statuses), report.errors[:3]
            await _settled(client)
            walls = []
            counters = _process_counters() if split is not None else {}
            cpu0 = _container_cpu_s(client)
            for _ in range(batches):
                t0 = time.perf_counter()
                await client_.score(samples)
                walls.append(time.perf_counter() - t0)
            cpu = _container_cpu_s(client) - cpu0
            if split is not None and counters:
                split.update(_split(counters, _process_counters(), batches * len(completions)))
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


def _fork_floors(client, image: str) -> tuple[float, float]:
    """(bare python3, python3 holding the template's modules): CPU seconds per fork+exit+wait, in ``image``."""
    floors = []
    for extra in ([], ["template"]):
        out = client.containers.run(image, ["python3", "-c", FLOOR, *extra], entrypoint=[], remove=True,
                                    network_mode="none", user="65534")
        floors.append(float(out.decode().strip().splitlines()[-1]))
    return floors[0], floors[1]


def _sample_floor(client, image: str, directory: Path, source: str, function: str, samples: list,
                  forks: int = 500) -> tuple[float, str]:
    """A reward's sample floor (:data:`FLOOR` "sample") in its own ``image``: CPU seconds per fork whose child scores
    one of ``samples`` ((completion, example) pairs, in turn), and its split between the parent and the children
    (CPU and page faults per fork, as text)."""
    spec = directory / f"floor_{function}.json"
    spec.write_text(json.dumps({"source": source, "function": function, "samples": samples}))
    out = client.containers.run(image, ["python3", "-c", FLOOR, "sample", "/floor/" + spec.name, str(forks)],
                                entrypoint=[], remove=True, network_mode="none", user="65534",
                                volumes={str(directory.resolve()): {"bind": "/floor", "mode": "ro"}})
    lines = out.decode().strip().splitlines()
    split = ""
    if len(lines) >= 2 and lines[-2].startswith("split "):
        parent_s, parent_faults, child_s, child_faults = lines[-2].split()[1:5]
        split = (f"parent {float(parent_s) * 1000:.2f} ms ({float(parent_faults):.0f} page faults), "
                 f"child {float(child_s) * 1000:.2f} ms ({float(child_faults):.0f})")
    return float(lines[-1]), split


def _image(config, backend) -> Optional[str]:
    (image, _), = backend.builder.ensure_images(config.rewards, backend.settings).values()
    return image or None


def _quickstart_samples(n: int) -> tuple[list, list]:
    """(completions, answers) like the quickstart's: numbers and small expressions, right and wrong, some without
    the answer tags."""
    completions, answers = [], []
    for i in range(n):
        answer = str(i % 50)
        shown = [answer, f"{i % 50} + 0", f"x + {i % 7}", f"2*{i % 25}", str(i % 50 + 1)][i % 5]
        completions.append(f"<think>adding</think> <answer>{shown}</answer>" if i % 3 else f"it is {i % 50}")
        answers.append(answer)
    return completions, answers


def _math_samples(n: int) -> tuple[list, list]:
    """(completions, gold answers) as a math dataset's: boxed numbers, fractions and small expressions, right and
    wrong, and some with no boxed answer."""
    completions, answers = [], []
    for i in range(n):
        value = i % 50
        shown = [f"\\boxed{{{value}}}", f"\\boxed{{\\frac{{{2 * value}}}{{2}}}}", f"the answer is ${value}$",
                 f"\\boxed{{{value} + x - x}}", f"\\boxed{{{value + 1}}}"][i % 5]
        completions.append(f"Adding the two numbers. {shown}" if i % 7 else f"I think it is {value}")
        answers.append(f"${value}$")
    return completions, answers


def isolation_figures(client, directory: Path, base_image: str, make_config: Callable, make_backend: Callable,
                      progress: Callable[[str], None], figure: Callable, bench_rewards: str) -> list:
    """Part (h). ``make_config(directory, base_image, rewards)`` and ``make_backend(config, client)`` are the bench's
    own; ``figure(name, value, target, met)`` makes one of its figures; ``bench_rewards`` is the source of its
    rewards (``cpu_bound`` among them), which part (h)'s are added to."""
    directory.mkdir(parents=True, exist_ok=True)
    rewards_source = bench_rewards + REWARDS
    (directory / "bench_rewards.py").write_text(rewards_source)
    quickstart = QUICKSTART_REWARD.read_text()
    (directory / "correct.py").write_text(quickstart)
    (directory / "math_rewards.py").write_text(MATH_VERIFY_REWARD)
    figures = []

    def config_for(function: str, isolation: str, *, runtime: Optional[str] = None, **extra):
        return make_config(directory, base_image, [{"name": f"{function}_{isolation}", "function": function,
                                                     "workers": 2, "cpus": 2, "isolation": isolation,
                                                     "memory": "2g", "timeout_s": 30, **extra}], runtime=runtime)

    regex_completions = [f"<think>{i}</think><answer>{i}</answer>" if i % 2 else f"no tags {i}" for i in range(1024)]
    qs_completions, qs_answers = _quickstart_samples(1024)
    math_completions, math_answers = _math_samples(1024)
    cases: list[tuple[str, str, dict[str, Any], list, dict, str]] = [  # (label, function, extra reward settings,
        # completions, columns, source)
        ("regex reward", "regex", {}, regex_completions, {}, rewards_source),
        ("exec reward", "run_it", {}, [f"score = {i % 7} / 7" for i in range(1024)], {}, rewards_source),
        ("quickstart's sympy reward", "correctness_reward", {"source": "correct.py", "packages": ["sympy>=1.12"]},
         qs_completions, {"answer": qs_answers}, quickstart),
        ("math-verify reward", "accuracy", {"source": "math_rewards.py", "packages": MATH_VERIFY_PACKAGES},
         math_completions, {"answer": math_answers}, MATH_VERIFY_REWARD),
    ]
    floors: dict = {}
    image = None
    for label, function, extra, completions, columns, source in cases:
        progress(f"(h) {label}, 1024 completions, isolation: sample")
        config = config_for(function, "sample", **extra)
        then = (lambda c: floors.update(isolated=_isolation_floor(c))) if function == "run_it" else None
        split: dict = {}
        wall, cpu = _measure(client, config, make_backend(config, client), f"{function}_sample", completions, 3,
                             then, columns, split)
        progress(f"(h) {label}: its sample floor in its own image")
        reward_image = _image(config, make_backend(config, client))
        image = image or reward_image
        samples = [(c, {k: str(v[i]) for k, v in columns.items()}) for i, c in enumerate(completions)]
        floor, floor_split = (_sample_floor(client, reward_image, directory, source, function, samples)
                              if reward_image else (None, ""))
        per_sample = cpu / 1000
        figures.append(figure(f"{label}, 1024 completions, isolation: sample (median of 3)",
                              f"{wall * 1000:.0f} ms, {per_sample * 1000:.2f} ms CPU a sample", "-", None))
        if split:
            shown = ", ".join(f"{role} {ms:.2f} ms ({faults:.0f} page faults)" for role, (ms, faults) in
                              sorted(split.items(), key=lambda kv: -kv[1][0]))
            figures.append(figure(f"{label}, isolation: sample, CPU a sample by process", shown, "-", None))
        if floor:
            ratio = per_sample / floor
            figures += [
                figure(f"{label}: sample floor (fork of the imported reward, child scores one and answers)",
                       f"{floor * 1000:.2f} ms CPU" + (f": {floor_split}" if floor_split else ""), "-", None),
                figure(f"{label}, isolation: sample, CPU per sample / its sample floor", f"{ratio:.2f}x",
                       "<= 1.5x", ratio <= 1.5),
            ]
        if function == "run_it":
            floors["exec"] = per_sample

    for n in (1024, 4096):
        completions = [f"<think>{i}</think><answer>{i}</answer>" if i % 2 else f"no tags {i}" for i in range(n)]
        measured = {}
        for isolation in ("worker", "sample"):
            progress(f"(h) regex reward, {n} completions, isolation: {isolation}")
            config = config_for("regex", isolation)
            measured[isolation] = _measure(client, config, make_backend(config, client), f"regex_{isolation}",
                                           completions, BATCHES if isolation == "worker" else 3)
        (w_wall, w_cpu), (s_wall, s_cpu) = measured["worker"], measured["sample"]
        figures += [
            figure(f"regex reward, {n} completions, isolation: worker (median of {BATCHES})",
                   f"{w_wall * 1000:.1f} ms, {w_cpu:.3f} CPU s/1k", "-", None),
            figure(f"regex reward, {n} completions, isolation: sample (median of 3)",
                   f"{s_wall * 1000:.1f} ms, {s_cpu:.3f} CPU s/1k ({s_wall / w_wall:.0f}x worker's wall)", "-",
                   None),
        ]

    if "runsc" in client.info().get("Runtimes", {}):
        n = GVISOR_SAMPLES
        progress(f"(h) regex reward, {n} completions, isolation: sample, gVisor")
        config = config_for("regex", "sample", runtime="runsc")
        wall, cpu = _measure(client, config, make_backend(config, client), "regex_sample",
                             [f"<think>{i}</think><answer>{i}</answer>" for i in range(n)], 3)
        figures.append(figure(f"regex reward, {n} completions, isolation: sample, gVisor (a slot process a sample; "
                              "median of 3)", f"{wall / n * 1000:.1f} ms a sample, {cpu:.1f} ms CPU a sample",
                              "-", None))

    if image:
        progress("(h) fork floors in the sandbox image")
        bare, template = _fork_floors(client, image)
        figures += [
            figure("fork floor: bare python3 fork+exit+wait, CPU per fork (same image)", f"{bare * 1000:.2f} ms",
                   "-", None),
            figure("fork floor: python3 holding the template's modules, CPU per fork", f"{template * 1000:.2f} ms",
                   "-", None),
        ]
        if floors.get("exec"):
            figures.append(figure("exec reward, isolation: sample, CPU per sample / bare fork floor",
                                  f"{floors['exec'] / bare:.1f}x", "-", None))
    if floors.get("isolated"):
        isolated = floors["isolated"]
        figures.append(figure("isolation floor: template fork + own uid + private /tmp + exit, CPU per process "
                              "(sandbox container)", f"{isolated * 1000:.2f} ms", "-", None))

    rates = {}
    batch = ["c"] * 1024
    for isolation in ("worker", "sample"):
        progress(f"(h) CPU-bound reward, 1024 completions, isolation: {isolation}")
        config = config_for("cpu_bound", isolation)
        wall, _ = _measure(client, config, make_backend(config, client), f"cpu_bound_{isolation}", batch, 2)
        rates[isolation] = len(batch) / wall
    ratio = rates["sample"] / rates["worker"]
    figures.append(figure("CPU-bound (5 ms/sample), 1024 completions: samples/s, sample vs worker",
                          f"{rates['sample']:.0f} vs {rates['worker']:.0f} ({ratio:.0%})", "-", None))
    return figures
