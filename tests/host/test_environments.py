"""rewardbox.sandboxed_environment: what TRL sees of a sandboxed environment (its tools, reset, get_reward) is what
it sees of the original in-process, and each episode is a process of its own. Sandboxes run on the local backend
here (real processes, real gRPC, the real template routing an episode's calls); tests/docker/test_environments.py
attacks episodes in real containers, tests/trainer/test_tools_trainer.py trains with one."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os

import pytest
from transformers.utils import get_json_schema

from rewardbox import ConfigError, ToolError, sandboxed_environment
from rewardbox.wire import Status
from tests.conftest import run

LOCAL = {"backend": "local"}


class Counter:
    """Counts what the model adds."""

    made = 0  # class state: how many instances this process made

    def __init__(self, start: int = 0):
        Counter.made += 1
        self.start, self.n, self.log = start, start, []

    def reset(self, offset: int = 0, **kwargs) -> str:
        self.n = self.start + offset
        return f"counting from {self.n}"

    def bump(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: how much to add
        """
        self.n += by
        self.log.append(by)
        return self.n

    async def history(self) -> dict:
        """What was added in this episode, and by which process."""
        return {"log": self.log, "made": Counter.made, "pid": os.getpid()}

    def fail(self, text: str) -> str:
        """Raises.

        Args:
            text: the message
        """
        raise KeyError(text)

    def stall(self, seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: how long
        """
        import time

        time.sleep(seconds)
        return "awake"

    def _private(self) -> None:
        raise AssertionError("never a tool")

    def get_reward(self) -> float:
        return 10 ** 400 if self.n == 400 else float(self.n)  # 400: a number past a float's range


class AsyncReward(Counter):
    async def get_reward(self) -> float:
        return self.n / 2


def _tools(instance) -> dict:
    """The tools TRL takes from an environment instance (grpo_trainer: public functions but reset, get_reward)."""
    return {name: method for name, method in inspect.getmembers(instance, inspect.ismethod)
            if name in {n for n, _ in inspect.getmembers(type(instance), inspect.isfunction)}
            and not name.startswith("_") and name not in ("reset", "get_reward")}


def test_trl_sees_the_same_tools_and_an_episode_keeps_its_state_across_calls():
    with sandboxed_environment(functools.partial(Counter, start=10), sandbox=LOCAL, timeout_s=2) as factory:
        env, other = factory(), factory()
        assert type(env).__name__ == "Counter"
        original = _tools(Counter())
        mine = _tools(env)
        assert sorted(mine) == sorted(original) == ["bump", "fail", "history", "stall"]
        for name in mine:
            assert get_json_schema(mine[name]) == get_json_schema(original[name])
            assert asyncio.iscoroutinefunction(mine[name])
        assert not asyncio.iscoroutinefunction(env.reset) and not asyncio.iscoroutinefunction(env.get_reward)
        assert env.reset(offset=1) == "counting from 11" and other.reset() == "counting from 10"

        async def calls():
            return await asyncio.gather(env.bump(by=2), other.bump(by=5), env.bump(3))

        assert run(calls()) == [13, 15, 16]
        first = run(env.history())
        assert first["log"] == [2, 3] and first["made"] == 1  # its own instance, in a process of its own
        assert (env.get_reward(), other.get_reward()) == (16.0, 15.0)
        env.reset()  # a new episode: a fresh process, a fresh instance
        second = run(env.history())
        assert second == {"log": [], "made": 1, "pid": second["pid"]} and second["pid"] != first["pid"]
        assert env.get_reward() == 10.0


def test_errors_are_the_originals_and_an_ended_episode_fails_until_reset():
    with sandboxed_environment(AsyncReward, sandbox=LOCAL, timeout_s=1, default_score=-1.0) as factory:
        env = factory()
        with pytest.raises(ToolError, match=r"no episode: reset\(\) starts one"):
            run(env.bump(by=1))
        env.reset(offset=4)
        with pytest.raises(ToolError) as raised:
            run(env.fail(text="no such key"))
        with pytest.raises(KeyError) as in_process:
            Counter().fail(text="no such key")
        assert str(raised.value) == str(in_process.value) and raised.value.status is Status.ERROR
        assert run(env.bump(by=2)) == 6  # its own exception does not end the episode
        assert asyncio.iscoroutinefunction(env.get_reward) and run(env.get_reward()) == 3.0
        with pytest.raises(ToolError, match=r"^rewardbox: environment 'AsyncReward': stall\(\) timed out: exceeded "
                                            r"timeout_s=1"):
            run(env.stall(seconds=5))
        with pytest.raises(ToolError, match=r"its episode ended when stall\(\) timed out .*; reset\(\) starts a "
                                            r"new one"):
            run(env.bump(by=1))
        assert run(env.get_reward()) == -1.0  # the environment's fallback
        env.reset()
        assert run(env.bump(by=1)) == 1


def test_reuse_process_keeps_an_instances_process_across_episodes_and_no_other_instances():
    with sandboxed_environment(Counter, sandbox=LOCAL, timeout_s=1, reuse_process=True) as factory:
        env, other = factory(), factory()
        env.reset()
        other.reset()
        run(env.bump(by=2))
        first = run(env.history())
        assert env.reset(offset=5) == "counting from 5"  # the same instance's own reset, in the same process
        again = run(env.history())
        # what its last episode left is there, in the one instance its process made
        assert again == {"log": [2], "made": first["made"], "pid": first["pid"]}
        assert run(other.history())["pid"] != first["pid"]  # another instance: a process of its own
        with pytest.raises(ToolError, match="timed out"):
            run(env.stall(seconds=5))  # ends the process
        env.reset()
        fresh = run(env.history())
        assert fresh["log"] == [] and fresh["pid"] != first["pid"]  # a gone process is replaced
        with pytest.raises(ToolError) as raised:
            run(env.fail(text="x"))
        assert env.reset(offset=1) == "counting from 1" and run(env.history())["pid"] == fresh["pid"]
        assert raised.value.status is Status.ERROR


def test_a_call_whose_arguments_exceed_the_call_bound_fails_alone_naming_the_bound():
    with sandboxed_environment(Counter, sandbox=LOCAL, memory="256m", max_episodes=8) as factory:  # 8 MiB a call
        env = factory()
        env.reset()
        with pytest.raises(ToolError, match=r"^fail\(\)'s arguments are 9\.0 MiB, more than one call to environment "
                                            r"'Counter' may carry \(8\.0 MiB, 1/32 of its `memory: 256m`"):
            run(env.fail(text="x" * (9 << 20)))
        assert run(env.bump(by=2)) == 2  # the episode lives on


def test_more_live_episodes_than_max_episodes_fail_their_own_calls_only():
    with sandboxed_environment(Counter, sandbox=LOCAL, max_episodes=2) as factory:
        a, b, c = factory(), factory(), factory()
        assert a.reset() == b.reset() == "counting from 0"
        assert c.reset() is None  # never raises: TRL calls it in its own loop
        with pytest.raises(ToolError, match="more than max_episodes=2 episodes of Counter are live"):
            run(c.bump(by=1))
        assert c.get_reward() == 0.0
        a.reset()  # a's next episode: its last one ended first
        assert run(a.bump(by=1)) == 1 and run(b.bump(by=2)) == 2


def test_several_environments_by_name_and_bad_factories():
    with sandboxed_environment({"count": Counter, "half": AsyncReward}, sandbox=LOCAL) as factories:
        assert sorted(factories) == ["count", "half"]
        env = factories["half"]()
        env.reset(offset=3)
        assert run(env.get_reward()) == 1.5
    with pytest.raises(ConfigError, match=r"environment_factory \(.*\) is a function: pass the environment's class"):
        with sandboxed_environment(lambda: Counter(), sandbox=LOCAL):
            pass
    with pytest.raises(ConfigError, match=r"'isolation', 'workers' are fixed for an environment"):
        with sandboxed_environment(Counter, sandbox=LOCAL, workers=3, isolation="sample"):
            pass


def test_hostile_or_odd_resets_and_rewards_never_raise_nor_leak_a_process():
    import datetime

    with sandboxed_environment(Counter, sandbox=LOCAL, max_episodes=2, default_score=-2.0) as factory:
        env, other = factory(), factory()
        other.reset()
        for _ in range(4):  # each would hold a process no one ends, were its last episode not ended
            env.reset()
            assert env.reset(when=datetime.date(2026, 1, 1)) is None  # not JSON: no episode, the last one ended
            with pytest.raises(ToolError, match=r"reset\(\) takes JSON values as arguments"):
                run(env.bump(by=1))
        assert env.reset("a", "b", "c") is None  # positional arguments that do not fit: no episode, no exception
        assert env.reset(offset=400) == "counting from 400"
        assert env.get_reward() == -2.0  # 10**400: not a float; the fallback
        assert env.reward_outcome[:2] == (-2.0, Status.INVALID) and "not a finite number" in env.reward_outcome.error
        assert run(other.bump(by=1)) == 1


def test_trls_environment_reward_reaches_the_run_record_with_each_episodes_status(tmp_path):
    # What RunRecordCallback.record_environment_rewards puts around the get_reward function TRL adds: the values
    # TRL gets, unchanged, and the record's report of them
    from rewardbox.api.environments import RewardOutcome, reward_report
    from rewardbox.trainer.callbacks import RunRecordCallback

    class Counter:  # stands for the proxy class sandboxed_environment makes, named after the environment
        def __init__(self, outcome):
            self.reward_outcome = outcome

    class Other:
        pass

    environments = [Counter(RewardOutcome(2.0, Status.OK, "", 0.01)),
                    Counter(RewardOutcome(-1.0, Status.TIMEOUT, "get_reward() exceeded timeout_s=5", 5.0)),
                    Other()]
    trainer = type("Trainer", (), {})()

    def get_reward(environments, **kwargs):  # as TRL 1.16 writes it for a sync get_reward
        return [e.reward_outcome.value if type(e) is Counter else None for e in environments]

    trainer.reward_funcs, trainer.reward_func_names, trainer.reward_weights = ["own", get_reward], ["own", "Counter"], \
        [1.0, 1.0]
    callback = RunRecordCallback(sandboxes=None)
    seen = []
    callback._observe = lambda *args: seen.append(args)
    callback.record_environment_rewards(trainer, first=1)
    assert callback.environment_rewards == [("Counter", 1.0)] and trainer.reward_funcs[0] == "own"
    values = trainer.reward_funcs[1](prompts=["p"] * 3, completions=["c"] * 3, environments=environments,
                                     trainer_state=None, solution=["a", "b", "c"])
    assert values == [2.0, -1.0, None] and trainer.reward_funcs[1].__name__ == "get_reward"
    [(name, report, state, prompts, completions, columns, ids)] = seen
    assert name == "Counter" and report.values == [2.0, -1.0, None] and columns["solution"] == ["a", "b", "c"]
    assert report.statuses == [Status.OK, Status.TIMEOUT, Status.OK]
    assert report.errors == [None, "get_reward() exceeded timeout_s=5", None]
    assert report.sample_seconds == [0.01, 5.0, None]
    # an async get_reward stays async (TRL gathers it), and an outcome that is not what TRL got counts for nothing
    environments[0].reward_outcome = RewardOutcome(3.0, Status.OK, "", 0.02)

    async def get_reward_async(environments, **kwargs):
        return [7.0, -1.0, None]

    trainer.reward_funcs.append(get_reward_async)
    trainer.reward_func_names.append("Counter")
    trainer.reward_weights.append(1.0)
    callback.environment_rewards.clear()
    callback.record_environment_rewards(trainer, first=2)
    assert inspect.iscoroutinefunction(trainer.reward_funcs[2])
    assert run(trainer.reward_funcs[2](prompts=["p"] * 3, completions=["c"] * 3, environments=environments)) \
        == [7.0, -1.0, None]
    assert seen[-1][1].statuses == [Status.OK, Status.TIMEOUT, Status.OK] and seen[-1][1].errors[0] is None
    assert reward_report("Counter", [1.0], [Other()], 0.0).statuses == [Status.OK]


def test_an_environments_memory_fits_its_processes_or_is_refused():
    from rewardbox.api.environments import _episode_settings

    # Where the user sets none: one live and one prepared process of about 6 MiB per episode, and the sandbox's own
    assert _episode_settings({}, 64)["memory"] == "1280m" and _episode_settings({}, 8)["memory"] == "1024m"
    assert _episode_settings({"memory": "4g"}, 256)["memory"] == "4g"
    with pytest.raises(ConfigError, match=r"environment memory: 1g cannot hold the processes of max_episodes=256 "
                                          r".*set memory to at least 3584m, or lower max_episodes"):
        _episode_settings({"memory": "1g"}, 256)
    with pytest.raises(ConfigError, match="'lots' is not a size"):
        _episode_settings({"memory": "lots"}, 8)
