"""The sandbox server over real gRPC (local backend): styles, async, validation and every failure row."""

from __future__ import annotations


import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardbox import build_samples
from rewardbox.wire.pb import reward_pb2 as pb
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


def test_batch_style_gets_lists_and_string_columns(sandboxes):
    code = """
    def lengths(prompts, completions, answer, **kwargs):
        assert all(isinstance(a, str) for a in answer)
        return [len(c) + float(a) for c, a in zip(completions, answer)]

    def wrong_length(prompts, completions, **kwargs):
        return [1.0]
    """
    s = sandboxes([
        {"name": "lengths", "code": code, "style": "batch"},
        {"name": "wrong_length", "file": "lengths.py", "style": "batch", "default_score": None},
    ])
    report = score(s, "lengths", ["a", "bbb"], columns={"answer": [10, 0.5]})
    assert report.values == [11.0, 3.5] and report.statuses == ["ok", "ok"]
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


def test_trainer_state_reaches_functions_that_accept_it(sandboxes):
    code = """
    def curriculum(prompt, completion, example, trainer_state=None):
        if trainer_state is None:
            return -1.0
        return trainer_state.global_step / trainer_state["max_steps"] + trainer_state.epoch

    def batch_curriculum(prompts, completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)
    """
    s = sandboxes([{"name": "curriculum", "code": code},
                   {"name": "batch_curriculum", "file": "curriculum.py", "style": "batch"}])
    state = pb.TrainerState(global_step=5, max_steps=10, epoch=1.0)
    assert score(s, "curriculum", ["a"], state=state).values == [1.5]
    assert score(s, "curriculum", ["a"]).values == [-1.0]
    assert score(s, "batch_curriculum", ["a", "b"], state=state).values == [5.0, 5.0]


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
    assert any(p.lower().startswith("pebble==") for p in described.packages)


def test_reload_during_a_batch_lets_the_old_version_finish_it(sandboxes, tmp_path):
    import asyncio

    from rewardbox.replica import function_source

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
    from rewardbox.replica import Replica, function_source

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
