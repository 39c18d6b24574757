"""rewardbox.sandboxed: what it ships, how it names and sets up each reward, and the errors a user meets before
anything starts. Sandboxes run on the local backend here (real processes, real gRPC); the conformance suite runs
sandboxed() on every backend, and tests/trainer/test_dropin_fidelity.py trains a real TRL script with it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import packaging.version
import pytest

from rewardbox import ConfigError, RewardLoadError, configure, sandboxed
from rewardbox.api import shipping
from tests.conftest import run

LOCAL = {"backend": "local"}


def count_vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def newer_than_one(prompt, completion, example):
    return float(packaging.version.Version(completion) > packaging.version.Version("1.0"))


def breaks(completions, **kwargs):
    boom = {}["missing"]  # the line a sandbox's traceback shows
    return boom


def _call(fn, completions, **columns):
    return run(fn(prompts=["p"] * len(completions), completions=completions, **columns))


def test_names_styles_and_order_follow_reward_funcs():
    def closure_maker(k):
        def bonus(prompt, completion, example):
            return k
        return bonus

    funcs = [count_vowels, "some/reward-model", closure_maker(1.5), closure_maker(2.5), lambda completions, **kw: [0.0]]
    with sandboxed(funcs, sandbox=LOCAL) as out:
        assert out[1] == "some/reward-model"  # a reward model passes through unchanged, in its place
        assert [getattr(f, "__name__", f) for f in out] == [
            "count_vowels", "some/reward-model", "bonus", "bonus_2", "_lambda_"]
        styles = {r.name: r.style for r in out.sandboxes.config.rewards}
        assert styles == {"count_vowels": "batch", "bonus": "sample", "bonus_2": "sample", "_lambda_": "batch"}
        assert _call(out[0], ["banana", "xyz"]) == [3.0, 0.0]
        assert _call(out[3], ["a", "b"]) == [2.5, 2.5]


def test_shared_settings_apply_to_all_and_configure_overrides_one():
    with sandboxed([count_vowels, configure(newer_than_one, timeout_s=9, packages=["packaging"], env={"B": "2"})],
                   sandbox=LOCAL, timeout_s=3, default_score=-1.0, packages=["regex"], env={"A": "1"}) as out:
        a, b = out.sandboxes.config.rewards
        assert (a.timeout_s, a.default_score, a.packages, a.env) == (3, -1.0, ["regex"], {"A": "1"})
        assert (b.timeout_s, b.default_score, b.packages, b.env) == (9, -1.0, ["regex", "packaging"],
                                                                     {"A": "1", "B": "2"})
        assert _call(out[1], ["2.0", "0.5"]) == [1.0, 0.0]


def test_unknown_and_derived_settings_are_refused_naming_them():
    with pytest.raises(ConfigError, match=r"unknown setting 'timeout' \(reward settings are .*timeout_s"):
        with sandboxed([count_vowels], sandbox=LOCAL, timeout=3):
            pass
    with pytest.raises(ConfigError, match=r"configure\(count_vowels, \.\.\.\): unknown setting 'name' \(name "
                                          r"come from the function itself\)"):
        configure(count_vowels, name="x")
    with pytest.raises(ConfigError, match=r"^rewardbox\.sandboxed: reward_funcs\[1\] newer_than_one \(.*\): "
                                          r"isolation: Input should be 'sample', 'process' or 'worker'"):
        with sandboxed([count_vowels, configure(newer_than_one, isolation="none")], sandbox=LOCAL):
            pass


def test_a_function_that_cannot_be_shipped_fails_before_anything_starts_naming_it():
    held = socket.socket()
    try:
        def over_a_socket(completions, **kwargs):
            return [float(held.fileno())] * len(completions)

        with pytest.raises(ConfigError, match=r"reward_funcs\[1\] over_a_socket \(.*test_sandboxed\.py:\d+\) cannot "
                                              r"be shipped to a sandbox: TypeError: cannot pickle 'socket' object"):
            with sandboxed([count_vowels, over_a_socket], sandbox=LOCAL):
                pytest.fail("nothing may start")
    finally:
        held.close()


def test_a_function_that_needs_the_trainers_stack_is_refused_unless_named():
    import torch

    weights = torch.ones(3)

    def uses_torch(completions, **kwargs):
        return [float(weights.sum())] * len(completions)

    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] uses_torch .* refers to torch\..*, of torch, the "
                                          r"trainer's own stack.*name it in packages"):
        with sandboxed([uses_torch], sandbox=LOCAL):
            pass
    shipment = shipping.Shipper().ship(uses_torch, "reward", "uses_torch", ["torch==2.13.0"])
    assert shipment.packages[0] == "torch==2.13.0" and not any("torch" in p for p in shipment.inferred)


def test_what_the_code_imports_is_added_at_the_hosts_version_and_local_modules_go_by_value(tmp_path):
    shipment = shipping.Shipper().ship(newer_than_one, "reward", "newer_than_one", [])
    assert shipment.packages == [f"cloudpickle=={shipping.cloudpickle.__version__}",
                                 f"packaging=={packaging.__version__}"]
    assert list(shipment.inferred.values()) == ["packaging"]  # the module the function reads
    # this test module is no installed distribution: its code went by value, so the sandbox never imports `tests`
    # (the generated module runs where `tests` cannot be imported, as in a sandbox)
    check = "import sys; sys.modules['tests'] = None\n" + shipment.source + "\nprint(reward('p', '2.1', {}))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.stdout.strip() == "1.0", done.stderr
    named = shipping.Shipper().ship(newer_than_one, "reward", "newer_than_one", ["packaging>=20", "cloudpickle"])
    assert named.packages == ["packaging>=20", "cloudpickle"] and not named.inferred


def test_trl_rewards_go_by_value_without_trl_or_torch():
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    for fn in (think_format_reward, get_soft_overlong_punishment(20, 5)):
        shipment = shipping.Shipper().ship(fn, "reward", "trl", [])
        assert shipment.packages == [f"cloudpickle=={shipping.cloudpickle.__version__}"], shipment.inferred


def test_a_sandbox_on_another_python_fails_at_start_saying_which_and_the_fix(monkeypatch):
    monkeypatch.setattr(shipping, "PYTHON", (3, 1))
    with pytest.raises(RewardLoadError, match=r"ships reward as Python 3\.1 code .* but this sandbox runs Python "
                                              r"3\.\d+: set sandbox\.docker\.base_image to auto \(python:3\.1-slim"):
        with sandboxed([count_vowels], sandbox=LOCAL):
            pass


def test_a_shipped_functions_traceback_shows_the_scripts_own_line():
    with sandboxed([breaks], sandbox=LOCAL, default_score=None) as out:
        assert _call(out[0], ["x"]) == [None]
        error = out[0].last_report.errors[0]
    assert "KeyError: 'missing'" in error
    assert "test_sandboxed.py" in error and 'boom = {}["missing"]  # the line' in error


def test_the_users_own_project_installed_from_a_folder_goes_by_value(tmp_path, monkeypatch):
    # an editable install of the user's project: a distribution whose direct_url.json points at a folder
    (tmp_path / "myproject").mkdir()
    (tmp_path / "myproject" / "__init__.py").write_text(
        "def project_reward(completions, **kwargs):\n    return [2.0 for _ in completions]\n")
    info = tmp_path / "myproject-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myproject\nVersion: 0.1\n")
    (info / "top_level.txt").write_text("myproject\n")
    (info / "direct_url.json").write_text(json.dumps({"url": (tmp_path / "src").as_uri(), "dir_info": {"editable": True}}))
    monkeypatch.syspath_prepend(str(tmp_path))
    from myproject import project_reward

    shipper = shipping.Shipper()
    assert shipper._distribution("myproject") == "myproject"  # an installed distribution, yet:
    shipment = shipper.ship(project_reward, "reward", "project_reward", [])
    assert shipment.packages == [f"cloudpickle=={shipping.cloudpickle.__version__}"]  # no `myproject==0.1`
    check = "import sys; sys.modules['myproject'] = None\n" + shipment.source + "\nprint(reward(completions=[1]))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path / "myproject",
                          timeout=60)
    assert done.stdout.strip() == "[2.0]", done.stderr


def test_async_rewards_are_shipped_and_awaited():
    async def slow_len(completions, **kwargs):
        import asyncio

        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    with sandboxed([slow_len], sandbox=LOCAL) as out:
        assert _call(out[0], ["ab", "abcd"]) == [2.0, 4.0]
