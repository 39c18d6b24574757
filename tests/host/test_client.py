"""Retries, recovery and fallbacks against real local sandboxes."""

from __future__ import annotations

import asyncio
import os
import signal

from rewardbox import build_samples
from tests.conftest import no_sleep, run

SLOW = """
import time
def slow(prompt, completion, example):
    time.sleep(0.25)
    return float(len(completion))
"""


def test_server_killed_mid_batch_is_restarted_and_no_sample_is_lost(sandboxes):
    s = sandboxes([{"name": "slow", "code": SLOW, "workers": 2, "retries": 3}])
    reward = s["slow"]
    replica = s.replicas["slow"][0]
    completions = ["x" * i for i in range(1, 13)]

    async def kill_soon():
        await asyncio.sleep(0.4)
        os.killpg(replica.sandbox.pid(), signal.SIGKILL)

    async def main():
        killer = asyncio.ensure_future(kill_soon())
        report = await reward.client.score(build_samples(["p"] * 12, completions, {}))
        await killer
        return report

    pid_before = replica.sandbox.pid()
    report = run(main())
    assert report.statuses == ["ok"] * 12
    assert report.values == [float(i) for i in range(1, 13)]
    assert replica.restarts == 1 and replica.sandbox.pid() != pid_before
    assert report.attempts == 2
    assert len(no_sleep.calls) == 1  # one backoff before the retry


def test_deterministic_errors_are_not_retried(sandboxes, tmp_path):
    calls = tmp_path / "calls"
    code = f"""
    def broken(prompt, completion, example):
        with open({str(calls)!r}, "a") as f:
            f.write("x")
        raise RuntimeError("always fails")
    """
    s = sandboxes([{"name": "broken", "code": code, "retries": 5, "default_score": -0.5}])
    report = run(s["broken"].client.score(build_samples(["p"] * 4, ["a", "b", "c", "d"], {})))
    assert report.statuses == ["error"] * 4 and report.values == [-0.5] * 4
    assert calls.read_text() == "xxxx"  # each sample ran once
    assert report.attempts == 1 and no_sleep.calls == []


def test_a_sandbox_that_stays_down_falls_back_after_the_retries(write_config):
    from rewardbox import RewardSandboxes, load_config
    from tests.fakes import UnrestartableBackend, UnrestartableSandbox

    no_sleep.calls = []
    config = load_config(write_config([{"name": "slow", "code": SLOW, "retries": 2, "default_score": None}]))
    with RewardSandboxes(config, backend=UnrestartableBackend(), sleep=no_sleep) as s:
        replica = s.replicas["slow"][0]
        os.killpg(replica.sandbox.pid(), signal.SIGKILL)
        replica.sandbox._proc.wait()
        report = run(s["slow"].client.score(build_samples(["p"] * 3, ["a", "b", "c"], {})))
    assert report.statuses == ["unavailable"] * 3
    assert report.values == [None] * 3
    assert "after 3 attempt(s)" in report.errors[0]
    assert UnrestartableSandbox.restart_calls == 3  # one recovery try per attempt
    # exponential backoff with jitter: every wait within [0, initial * 2**attempt], capped
    assert len(no_sleep.calls) == 2
    assert all(0 <= d <= 0.2 * 2 ** (i + 1) for i, d in enumerate(no_sleep.calls))


def test_a_batch_is_split_across_replicas_in_order(sandboxes):
    code = """
    import os
    def pid(prompt, completion, example):
        print(os.getppid())
        return float(completion)
    """
    s = sandboxes([{"name": "pid", "code": code, "replicas": 2, "workers": 1}])
    completions = [str(i) for i in range(10)]
    report = run(s["pid"].client.score(build_samples(["p"] * 10, completions, {})))
    assert report.values == [float(i) for i in range(10)]
    assert len(set(report.logs.split())) == 2  # two different servers' workers answered


def test_a_local_sandbox_exits_when_the_process_that_started_it_is_killed(tmp_path, write_config):
    import subprocess
    import sys
    import time

    path = write_config([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n"}])
    script = (
        "import sys, time\n"
        "from rewardbox import RewardSandboxes, load_config\n"
        f"s = RewardSandboxes(load_config({str(path)!r})); s.start()\n"
        "print(s.replicas['r'][0].sandbox.pid(), flush=True)\n"
        "time.sleep(300)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    os.kill(server_pid, 0)  # running
    owner.kill()  # SIGKILL: no cleanup code runs in the owner
    owner.wait()
    for _ in range(100):
        try:
            with open(f"/proc/{server_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # exited; only not yet reaped by whoever inherited it
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"sandbox server {server_pid} outlived the process that started it")
