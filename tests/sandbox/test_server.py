"""The sandbox server over real gRPC (local backend): styles, async, validation and every failure row."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardbox import ConfigError, RewardLoadError, build_samples
from rewardbox.wire import trainer_state_to_wire
from tests.conftest import run

BEHAVIOURS = """
import ctypes, math, os, signal, sys, time

def behave(prompt, completion, example):
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "exit":
        sys.exit(3)
    if completion == "os_exit":
        os._exit(7)
    if completion == "segfault":
        ctypes.string_at(0)
    if completion == "hang":
        while True:
            pass
    if completion == "hang_uninterruptible":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            pass
    if completion == "nan":
        return math.nan
    if completion == "inf":
        return math.inf
    if completion == "string":
        return "1.0"
    if completion == "print_mb":
        for _ in range(5000):
            print("x" * 1000)
        return 2.0
    if completion == "none":
        return None
    if completion == "bool":
        return completion == "bool"
    return float(len(completion))
"""

EXPECTED = {
    "raise": "error",
    "exit": "error",
    "os_exit": "crash",
    "segfault": "crash",
    "hang": "timeout",
    "hang_uninterruptible": "timeout",
    "nan": "invalid",
    "inf": "invalid",
    "string": "invalid",
}


def score(sandboxes, name, completions, prompts=None, columns=None, state=None):
    prompts = prompts or ["p"] * len(completions)
    return run(sandboxes[name].client.score(build_samples(prompts, completions, columns or {}), state))


def test_each_failure_gets_its_status_and_fallback_while_other_samples_keep_real_scores(sandboxes):
    s = sandboxes([{"name": "behave", "code": BEHAVIOURS, "timeout_s": 1.0, "default_score": -1.0, "workers": 2}])
    completions = ["ab", *EXPECTED, "abcd", "print_mb", "none", "bool"]
    report = score(s, "behave", completions)
    by_completion = dict(zip(completions, zip(report.values, report.statuses, report.errors)))
    for completion, status in EXPECTED.items():
        value, got, error = by_completion[completion]
        assert got == status, (completion, got, error)
        assert value == -1.0
        assert error
    assert by_completion["ab"][:2] == (2.0, "ok")
    assert by_completion["abcd"][:2] == (4.0, "ok")
    assert by_completion["print_mb"][:2] == (2.0, "ok")
    assert by_completion["none"][:2] == (None, "ok")
    assert by_completion["bool"][:2] == (1.0, "ok")  # as TRL itself takes a bool
    assert "ValueError: bad completion" in by_completion["raise"][2]
    assert "SystemExit(3)" in by_completion["exit"][2]
    assert "SIGSEGV" in by_completion["segfault"][2]
    # each sample ran in a process of its own: exactly the three whose process died or was killed were replaced
    assert report.workers_replaced == 3
    # output is captured and bounded (64 KiB default), not megabytes
    assert "xxxx" in report.logs and len(report.logs) < 70_000
    # the sandbox survived all of it
    assert score(s, "behave", ["abc"]).values == [3.0]


def test_timeout_is_per_sample_not_per_batch(sandboxes):
    s = sandboxes([{"name": "behave", "code": BEHAVIOURS, "timeout_s": 0.5, "workers": 2}])
    report = score(s, "behave", ["hang", "a", "bb", "ccc", "hang", "dddd"])
    assert report.statuses == ["timeout", "ok", "ok", "ok", "timeout", "ok"]
    assert report.values == [0.0, 1.0, 2.0, 3.0, 0.0, 4.0]


def test_batch_style_gets_trls_native_columns_in_order_and_completion_ids(sandboxes):
    code = """
    def native(prompts, completions, completion_ids, answer, **kwargs):
        seen = {k: type(v[0]).__name__ for k, v in kwargs.items() if k != "trainer_state"}
        print("ORDER", list(kwargs))
        print("TYPES", seen)
        assert [type(a) for a in answer] == [int, float]
        assert kwargs["meta"][0] == {"tags": ["x", "y"], "n": None} and kwargs["flag"] == [True, False]
        assert kwargs["missing"] == [None, None]
        return [len(c) + a + sum(ids) for c, a, ids in zip(completions, answer, completion_ids)]

    def named_only(prompts, completions, answer):
        return [float(a) for a in answer]

    def wrong_length(prompts, completions, **kwargs):
        return [1.0]
    """
    s = sandboxes([
        {"name": "native", "code": code, "style": "batch"},
        {"name": "named_only", "file": "native.py", "style": "batch"},
        {"name": "wrong_length", "file": "native.py", "style": "batch", "default_score": None},
    ])
    columns = {"answer": [10, 0.5], "meta": [{"tags": ["x", "y"], "n": None}, {}], "flag": [True, False],
               "missing": [None, None]}
    samples = build_samples(["p", "p"], ["a", "bbb"], columns, completion_ids=[[1, 2], [3]])
    report = run(s["native"].client.score(samples))
    assert report.values == [14.0, 6.5] and report.statuses == ["ok", "ok"], report.errors
    assert "ORDER ['meta', 'flag', 'missing', 'trainer_state']" in report.logs, report.logs
    # A function without **kwargs gets only what it names.
    assert run(s["named_only"].client.score(samples)).values == [10.0, 0.5]
    bad = score(s, "wrong_length", ["a", "bb", "ccc"])
    assert bad.statuses == ["invalid"] * 3 and bad.values == [None] * 3
    assert "returned 1 values for" in bad.errors[0]


def test_string_typed_example_recovers_a_list_column_with_literal_eval(sandboxes):
    code = """
    import ast
    def total(prompt, completion, example):
        assert isinstance(example["numbers"], str) and isinstance(example["weight"], str)
        return sum(ast.literal_eval(example["numbers"])) * float(example["weight"]) + len(example["name"])
    """
    s = sandboxes([{"name": "total", "code": code}])
    columns = {"numbers": [[1, 2, 3], [10]], "weight": [0.5, 2], "name": ["ab", "c"]}
    report = score(s, "total", ["x", "y"], columns=columns)
    assert report.statuses == ["ok", "ok"]
    assert report.values == [5.0, 21.0]


def test_async_functions_run_concurrently_with_per_sample_timeouts(sandboxes):
    code = """
    import asyncio, time
    async def judge(prompt, completion, example):
        print(f"start {time.monotonic()}")
        await asyncio.sleep(60 if completion == "slow" else 0.3)
        print(f"end {time.monotonic()}")
        return 1.0
    """
    s = sandboxes([{"name": "judge", "code": code, "workers": 1, "concurrency": 16, "timeout_s": 2}])
    report = score(s, "judge", ["a"] * 12 + ["slow"])
    assert report.statuses == ["ok"] * 12 + ["timeout"]
    # one worker had all 13 calls in flight at once: every call started before the first one ended
    events = sorted((float(t), kind) for kind, t in (line.split() for line in report.logs.splitlines()))
    first_end = next(i for i, (_, kind) in enumerate(events) if kind == "end")
    assert first_end == 13


def test_trainer_state_reaches_functions_that_accept_it_as_in_trl(sandboxes):
    code = """
    def curriculum(prompt, completion, example, trainer_state=None):
        if trainer_state is None:
            return -1.0
        try:
            trainer_state["max_steps"]  # not in TRL either: a TrainerState is not subscriptable
            return -2.0
        except TypeError:
            pass
        return (trainer_state.global_step / trainer_state.max_steps + trainer_state.epoch
                + trainer_state.num_train_epochs * 100 + trainer_state.logging_steps * 1000)

    def batch_curriculum(prompts, completions, trainer_state, **kwargs):
        s = trainer_state
        assert s.best_metric is None and s.trial_name is None and s.is_world_process_zero
        assert s.train_batch_size == 8 and s.save_steps == 500 and s.best_model_checkpoint == "ckpt-3"
        return [float(trainer_state.global_step)] * len(completions)
    """
    s = sandboxes([{"name": "curriculum", "code": code},
                   {"name": "batch_curriculum", "file": "curriculum.py", "style": "batch"}])
    from transformers import TrainerState  # what TRL passes: the real object, converted field by field

    real = TrainerState(global_step=5, max_steps=10, epoch=1.0, num_train_epochs=3, logging_steps=2,
                        train_batch_size=8, best_model_checkpoint="ckpt-3")
    state = trainer_state_to_wire(real)
    assert score(s, "curriculum", ["a"], state=state).values == [2301.5]
    assert score(s, "curriculum", ["a"]).values == [-1.0]
    report = score(s, "batch_curriculum", ["a", "b"], state=state)
    assert report.values == [5.0, 5.0], report.errors


def test_signatures_trl_cannot_satisfy_fail_at_load_naming_the_parameter(sandboxes):
    code = """
    def needs_metric(prompts, completions, log_metric, **kwargs):
        return [1.0] * len(completions)
    """
    with pytest.raises(RewardLoadError, match=r"parameter 'log_metric' has no default.*log_metric=None"):
        sandboxes([{"name": "needs_metric", "code": code, "style": "batch"}])
    code = """
    def sample_needs(prompt, completion, example, answer):
        return 1.0
    """
    with pytest.raises(RewardLoadError, match=r"sample_needs.py:2: .*missing a required argument: 'answer'"):
        sandboxes([{"name": "sample_needs", "code": code}])


def test_conversational_samples_give_text_and_the_message_lists(sandboxes):
    code = """
    def chat(prompt, completion, example, prompt_messages=None, completion_messages=None):
        assert prompt == "What is 2+2?" and completion == "4"
        assert prompt_messages[0]["role"] == "system" and completion_messages[0]["role"] == "assistant"
        return float(len(prompt_messages))

    def chat_batch(prompts, completions, **kwargs):
        return [float(c[0]["content"]) for c in completions]
    """
    s = sandboxes([{"name": "chat", "code": code}, {"name": "chat_batch", "file": "chat.py", "style": "batch"}])
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    assert score(s, "chat", [completion], prompts=[prompt]).values == [2.0]
    assert score(s, "chat_batch", [completion], prompts=[prompt]).values == [4.0]


def test_health_reflection_and_describe_are_served(sandboxes):
    s = sandboxes([{"name": "behave", "code": BEHAVIOURS}])
    replica = s.replicas["behave"][0]
    channel = grpc.insecure_channel(replica.sandbox.endpoint.target)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    services = {s.name for r in responses for s in r.list_services_response.service}
    assert {"rewardbox.v1.RewardSandbox", "grpc.health.v1.Health"} <= services
    described = replica.describe()
    assert [f.name for f in described.functions] == ["behave"]
    assert described.functions[0].signature == "behave(prompt, completion, example)"
    assert any(p.lower().startswith("protobuf==") for p in described.packages)


def test_reload_during_a_batch_lets_the_old_version_finish_it(sandboxes, tmp_path):
    import asyncio

    from rewardbox.scoring.replica import function_source

    code = """
    import time
    def versioned(prompt, completion, example):
        time.sleep(0.2)
        return 1.0
    """
    s = sandboxes([{"name": "versioned", "code": code, "workers": 2}])
    reward, replica = s["versioned"], s.replicas["versioned"][0]
    spec = s.config.rewards[0]
    path = s.config.source_path(spec)

    async def main():
        batch = asyncio.ensure_future(reward.client.score(build_samples(["p"] * 8, ["x"] * 8, {})))
        await asyncio.sleep(0.3)
        path.write_text("def versioned(prompt, completion, example):\n    return 2.0\n")
        await asyncio.to_thread(replica.load, [function_source(spec, path)])
        first = await batch
        second = await reward.client.score(build_samples(["p"] * 4, ["x"] * 4, {}))
        return first, second

    first, second = run(main())
    assert first.statuses == ["ok"] * 8 and first.values == [1.0] * 8
    assert second.values == [2.0] * 4


def test_a_slow_import_does_not_count_against_the_first_calls_timeout(sandboxes):
    code = """
    import time
    time.sleep(4)  # a heavy import (a model, transformers) at module level
    def quick(prompt, completion, example):
        return 1.0
    """
    s = sandboxes([{"name": "quick", "code": code, "workers": 2, "timeout_s": 0.5}])
    report = score(s, "quick", ["a", "b", "c", "d"])
    assert report.statuses == ["ok"] * 4 and report.workers_replaced == 0


def test_a_sandbox_whose_slots_cannot_be_prepared_reports_not_serving(write_config):
    """Self-healing's last resort: when no slot of a reward can be prepared, the server says NOT_SERVING, so the
    host replaces the sandbox. (Here: every slot's scratch directory is a file in the way.)"""
    from rewardbox import load_config
    from rewardbox.backends.local import LocalBackend
    from rewardbox.scoring.replica import Replica, function_source

    config = load_config(write_config([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n",
                                        "warm": 2, "workers": 1}]))
    reward = config.rewards[0]
    sandbox = LocalBackend().create(reward, 0)
    slots = sandbox._dir / "state" / "slots"
    slots.mkdir(parents=True)
    for i in range(256):
        (slots / f"slot-{i}").write_text("in the way")
    replica = Replica(sandbox, [function_source(reward, config.source_path(reward))], start_timeout_s=20)
    try:
        replica.start()  # the module loads; its slots then fail, three times each
        deadline = time.monotonic() + 20
        while replica.healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not replica.healthy() and sandbox.alive()
        assert "no slot process could be prepared (FileExistsError" in sandbox.logs(tail=50)
    finally:
        replica.stop()


def test_startup_check_names_a_required_parameter_the_dataset_lacks_and_a_column_that_cannot_travel(sandboxes):
    code = """
    def needs_answer(prompts, completions, answer, level=1, **kwargs):
        return [float(a) for a in answer]
    """
    s = sandboxes([{"name": "needs_answer", "code": code, "style": "batch"}])
    with pytest.raises(ConfigError, match=r"reward 'needs_answer' .*needs_answer\.py.*parameter 'answer' has no "
                                          r"default, but TRL passes no such keyword: dataset d\.jsonl has the "
                                          r"columns question, level"):
        s.check_columns(["question", "level"], source="dataset d.jsonl")
    s.check_columns(["answer"], {"answer": 3})  # required ones present, optional ones may be missing
    with pytest.raises(ConfigError, match=r"column 'answer' holds a bytes .*cannot reach a sandbox unchanged"):
        s.check_columns(["answer"], {"answer": b"\x00"})
    # At call time the same column is refused with the same words rather than sent changed.
    with pytest.raises(ValueError, match=r"column 'answer' holds a bytes"):
        run(s["needs_answer"](prompts=["p"], completions=["c"], answer=[b"\x00"]))
    # What TRL passes in-process reaches it: a real call with TRL's keywords, its own objects included.
    values = run(s["needs_answer"](prompts=["p", "p"], completions=["c", "d"], completion_ids=[[1], [2]],
                                   answer=[1, 2.5], trainer_state=None, log_metric=lambda *a: None,
                                   log_extra=lambda *a: None))
    assert values == [1.0, 2.5]


def test_processes_or_threads_an_import_leaves_running_fail_the_load_and_the_processes_are_killed(sandboxes,
                                                                                                  tmp_path):
    # The template imports the reward as the sandbox's root: whatever the import leaves running (a multiprocessing
    # manager, a server) would run as root beside every sample, reachable by model-written code (red team of #40).
    pid_file = tmp_path / "helper.pid"
    code = f"""
    import subprocess, sys
    HELPER = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({str(pid_file)!r}, "w").write(str(HELPER.pid))
    def helper(prompt, completion, example):
        return 1.0
    """
    with pytest.raises(RewardLoadError, match=r"helper.py: importing it left 1 process\(es\) running .*inside the "
                                              r"reward function"):
        sandboxes([{"name": "helper", "code": code}])
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed (and reaped) by the template
    code = """
    import threading, time
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    def threaded(prompt, completion, example):
        return 1.0
    """
    with pytest.raises(RewardLoadError, match=r"importing it left 1 thread\(s\) running"):
        sandboxes([{"name": "threaded", "code": code}])
    code = """
    import subprocess
    subprocess.run(["true"], check=True)  # what an import ran and waited for is no concern
    def probes(prompt, completion, example):
        return 1.0
    """
    s = sandboxes([{"name": "probes", "code": code}])
    assert asyncio.run(s["probes"].client.score(build_samples(["p"], ["c"], {}))).values == [1.0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_what_a_failed_import_or_a_respawning_thread_leaves_running_is_killed(sandboxes, tmp_path):
    # Neither a process started by an import that then raises, nor one that a thread of the import starts again as
    # fast as it is killed, outlives the template: its orphans come to the supervisor, which kills every process it
    # did not start itself (review of #40: both ran on as the sandbox's root while the sandbox served). Loaded as new
    # versions of a reward in a running sandbox, which keeps serving the old one.
    from rewardbox.scoring.replica import function_source

    s = sandboxes([{"name": "versioned", "code": "def versioned(prompt, completion, example):\n    return 1.0\n"}])
    replica, spec = s.replicas["versioned"][0], s.config.rewards[0]
    path = s.config.source_path(spec)
    pids = tmp_path / "pids"
    failing = f"""
import subprocess, sys
HELPER = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pids)!r}, "a").write(f"{{HELPER.pid}}\\n")
raise RuntimeError("the import fails after it started a process")
"""
    respawning = f"""
import subprocess, sys, threading, time
def respawn():
    while True:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{child.pid}}\\n")
        time.sleep(0.01)
threading.Thread(target=respawn, daemon=True).start()
time.sleep(0.2)
def versioned(prompt, completion, example):
    return 2.0
"""
    for code, error in ((failing, "the import fails after it started a process"),
                        (respawning, r"importing it left \d+ process\(es\) running .* and 1 thread\(s\)")):
        path.write_text(code)
        with pytest.raises(RewardLoadError, match=error):
            replica.load([function_source(spec, path)])
    assert asyncio.run(s["versioned"].client.score(build_samples(["p"], ["c"], {}))).values == [1.0]
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) > 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(pid) for pid in started):
        time.sleep(0.05)
    assert [pid for pid in started if not _gone(pid)] == []


def test_the_memory_guard_hears_when_calls_pause_and_when_they_start_again_but_not_between_calls_back_to_back():
    from rewardbox.sandbox.server import server

    class Supervisor:
        def __init__(self):
            self.told = []

        def tell(self, message):
            self.told.append(message["quiet"])

    async def scenario(held_open: bool) -> list:
        supervisor = Supervisor()
        activity = server._Activity(supervisor, lambda: held_open)
        for _ in range(20):  # calls back to back, one at a time, with the gaps a client leaves between them
            with activity.call():
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.001)
        with activity.call(), activity.call():  # two at once: quiet only once both ended
            await asyncio.sleep(0.001)
        assert supervisor.told == []
        await asyncio.sleep(server.QUIET_AFTER_S * 2)  # a pause: quiet, once
        await asyncio.sleep(server.QUIET_AFTER_S * 2)
        with activity.call():
            pass
        return supervisor.told

    assert run(scenario(held_open=False)) == [True, False]
    assert run(scenario(held_open=True)) == []  # an environment's episodes live between their calls
