"""rewardbox.integrations.verl through the installed verl's own reward loading and reward manager, scoring in
docker sandboxes. verl runs in .venv-verl (scripts/setup.sh: verl installed without its GPU stack, over this
environment), as its own process."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.conftest import ROOT

VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
REWARDS = textwrap.dedent("""
    import re

    def correct(prompt, completion, example):
        if completion == "crash":
            raise RuntimeError("a reward that breaks on one sample")
        found = re.search(r"<answer>(.*?)</answer>", completion) or re.fullmatch(r"\\s*(\\d+)\\s*", completion)
        return 1.0 if found and found.group(1).strip() == example["ground_truth"] else 0.0

    def tagged(prompts, completions, data_source, index, **kwargs):
        # batch style: the columns arrive as lists; index is extra_info's
        return [0.5 if c.startswith("<answer>") and s == "arith" else None if i == 5 else 0.0
                for c, s, i in zip(completions, data_source, index)]
""")


def test_verl_scores_its_batch_through_rewardbox_sandboxes(tmp_path, tiny_model, docker_client, base_image):
    if not VERL_PYTHON.exists():
        pytest.fail(f"{VERL_PYTHON} is missing: run `bash scripts/setup.sh` (it installs verl there)")
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = tmp_path / "rewardbox.yaml"
    before = {c.id for c in docker_client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)}
    config.write_text(json.dumps({
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image}},
        "rewards": [{"name": "correct", "source": "rewards.py", "default_score": -1.0, "retries": 0},
                    {"name": "tagged", "source": "rewards.py", "style": "batch", "weight": 2.0}]}))
    done = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "verl" / "verl_check.py"), str(config),
                           str(tiny_model)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    out = json.loads(line[len("RESULTS "):])
    assert out["decoded"][:4] == ["<answer>4</answer>", "<answer>5</answer>", "4", "crash"]
    correct = [r["correct"] for r in out["results"]]
    tagged = [r["tagged"] for r in out["results"]]
    assert correct == [1.0, 0.0, 1.0, -1.0, 1.0, 0.0]  # the crash fell back to default_score
    assert [r["correct_fallback"] for r in out["results"]] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert tagged == [0.5, 0.5, 0.0, 0.0, 0.5, None]  # None: the reward skipped that sample
    assert [r["score"] for r in out["results"]] == [2.0, 1.0, 1.0, -1.0, 2.0, 0.0]  # weighted sums
    # verl's process started the sandboxes; they stopped when it exited (an atexit hook's stop)
    assert {c.id for c in docker_client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)} <= before
