"""rewardbox.sandboxed around a real TRL script's reward_funcs trains exactly as the script without it.

The script (tests/trainer/trl_script/train.py) mixes a function defined in the script (``__main__``), a function of
the user's own module, a closure a factory made, and ``trl.rewards.accuracy_reward`` (math-verify, which the
sandbox gets; TRL and torch it does not). It runs as a user runs it, as its own process, once plain and once with
``rewardbox.sandboxed(...)``: every step's rewards must be equal."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "trainer" / "trl_script"
STEPS = 8
NAMES = ("has_a_tag", "digit_share", "length_reward", "accuracy_reward")


def _train(tiny_model, tmp_path, *extra) -> list:
    done = subprocess.run([sys.executable, "train.py", str(tiny_model), str(tmp_path / "out"), str(STEPS), *extra],
                          cwd=SCRIPT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("HISTORY "))
    return [h for h in json.loads(line[len("HISTORY "):]) if "reward" in h]


def test_a_trl_script_trains_identically_with_its_reward_funcs_sandboxed(tiny_model, tmp_path, docker_client,
                                                                         base_image):
    plain = _train(tiny_model, tmp_path / "plain")
    boxed = _train(tiny_model, tmp_path / "boxed", "--sandboxed", base_image)
    assert len(plain) == len(boxed) == STEPS
    keys = ["reward", "reward_std"] + [f"rewards/{name}/{stat}" for name in NAMES for stat in ("mean", "std")]
    for a, b in zip(plain, boxed):
        assert [a[k] for k in keys] == [b[k] for k in keys], (a["step"], [(k, a[k], b[k]) for k in keys])
        assert all(b[f"sandbox/{name}/fallback_rate"] == 0.0 for name in NAMES)
    # not vacuous: each script reward moves from step to step (a random tiny model never answers right, so
    # accuracy_reward's right answers are checked below)
    for name in NAMES[:3]:
        assert len({round(h[f"rewards/{name}/mean"], 6) for h in plain}) > 1, name


def test_trl_accuracy_reward_sandboxed_scores_as_in_process(docker_client, base_image):
    from trl.rewards import accuracy_reward

    import rewardbox
    from tests.conftest import run

    texts = [r"So \boxed{\frac{1}{3}}", r"So \boxed{\frac{1}{2}}", "no idea", r"The answer is $4$", r"\boxed{4}"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {"solution": [r"\frac{1}{3}", r"\frac{1}{3}", r"\frac{1}{3}", "$4$", "not latex at all ]["]}
    expected = accuracy_reward(completions, **columns)
    assert expected[:2] == [1.0, 0.0] and None in expected
    with rewardbox.sandboxed([accuracy_reward], packages=["math-verify"],
                             sandbox={"docker": {"base_image": base_image}}) as (sandboxed,):
        assert run(sandboxed(prompts=["q"] * len(texts), completions=completions, **columns)) == expected
        assert sandboxed.last_report.statuses == ["ok"] * len(texts)
