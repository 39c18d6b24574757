"""The code-execution example (examples/code): its rewards score programs by running them on the problems' tests,
in this process, in real Docker sandboxes, and during a real `rewardbox train` run."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from rewardbox import build_samples
from rewardbox.backends.docker import DockerBackend
from tests.conftest import ROOT, run, started_sandboxes

EXAMPLE = ROOT / "examples" / "code"
ROWS = [json.loads(line) for line in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
SUM = next(r for r in ROWS if r["question"].startswith("Read two integers a and b on one line, separated"))
EXAMPLE_COLUMNS = {"tests": SUM["tests"], "language": SUM["language"]}  # as a reward receives them: strings

RIGHT = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
PARTLY = "```python\nprint(3)\n```"  # right for the first of the three tests only
WRONG = "```\na, b = map(int, input().split())\nprint(a - b)\n```"  # a bare fence counts as code too
CRASHES = "```python\nraise SystemExit(input() + ' is not a number')\n```"
BROKEN = "```python\nprint(int(input()\n```"
NO_CODE = "The answer is a + b."
TWO_BLOCKS = "```python\nx = 1\n```\nand\n```python\nprint(input())\n```"


@pytest.fixture
def docker_sandboxes(write_config, docker_client, base_image):
    """docker_sandboxes(rewards) -> started RewardSandboxes on the docker backend, stopped after the test."""
    yield from started_sandboxes(write_config, {"backend": "docker", "docker": {"base_image": base_image}},
                                 lambda config: DockerBackend(config.sandbox.backend_settings("docker"),
                                                              client=docker_client))


@pytest.fixture(scope="module")
def rewards():
    spec = importlib.util.spec_from_file_location("code_example_rewards", EXAMPLE / "rewards" / "code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_problems_each_have_three_tests_as_a_json_string():
    assert len(ROWS) >= 20
    for row in ROWS:
        assert set(row) == {"question", "tests", "language"} and row["language"] == "python"
        assert "```python" in row["question"]
        tests = json.loads(row["tests"])
        assert len(tests) == 3 and all(set(t) == {"stdin", "stdout"} for t in tests)


@pytest.mark.parametrize("completion, expected", [
    (RIGHT, 1.0), (PARTLY, pytest.approx(1 / 3)), (WRONG, 0.0), (CRASHES, 0.0), (BROKEN, 0.0), (NO_CODE, 0.0),
    (TWO_BLOCKS, 0.0),  # the last block runs: it echoes its input
])
def test_pass_rate_is_the_fraction_of_tests_the_last_code_block_passes(rewards, completion, expected):
    assert rewards.pass_rate(SUM["question"], completion, EXAMPLE_COLUMNS) == expected


@pytest.mark.parametrize("completion, expected", [
    (RIGHT, 1.0), (WRONG, 1.0), (BROKEN, 0.5), (TWO_BLOCKS, 0.5), (NO_CODE, 0.0),
])
def test_code_format_wants_exactly_one_block_of_valid_python(rewards, completion, expected):
    assert rewards.code_format(SUM["question"], completion, EXAMPLE_COLUMNS) == expected


def test_the_example_rewards_run_programs_inside_docker_sandboxes(docker_sandboxes):
    """The same verdicts from the reward's own hardened container, where the programs run under uids of their
    own: what the training run below cannot show, since the tiny model writes no working program."""
    completions = [RIGHT, PARTLY, WRONG, CRASHES, NO_CODE]
    sandboxes = docker_sandboxes([
        {"name": "pass_rate", "file": "code.py", "code": (EXAMPLE / "rewards" / "code.py").read_text(),
         "timeout_s": 10},
        {"name": "code_format", "file": "code.py", "timeout_s": 2},
    ])
    n = len(completions)
    columns = {"tests": [SUM["tests"]] * n, "language": ["python"] * n}
    samples = build_samples([SUM["question"]] * n, completions, columns)
    passed = run(sandboxes["pass_rate"].client.score(samples))
    formatted = run(sandboxes["code_format"].client.score(samples))
    assert passed.statuses == ["ok"] * n and formatted.statuses == ["ok"] * n
    assert passed.values == pytest.approx([1.0, 1 / 3, 0.0, 0.0, 0.0])
    assert formatted.values == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_training_the_code_example_scores_every_completion_in_sandboxes(tmp_path, docker_client, base_image):
    shutil.copytree(EXAMPLE, tmp_path / "code")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rewardbox", "train", str(tmp_path / "code" / "config.yaml"),
                             "--grpo.max_steps", "2", "--output_dir", str(out),
                             "--sandbox.docker.base_image", base_image],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()  # a no-op when it has ended
    assert proc.returncode == 0, stderr[-3000:]
    assert "2 steps; mean total reward" in stdout and "saved to" in stdout, stdout

    records = [json.loads(line) for line in (out / "reward_logs.jsonl").read_text().splitlines()]
    assert {r["reward"] for r in records} == {"pass_rate", "code_format"}
    for name in ("pass_rate", "code_format"):
        steps = [r for r in records if r["reward"] == name]
        assert [r["step"] for r in steps] == [0, 1]
        assert all(r["samples"] == 8 and r["statuses"] == {"ok": 8} for r in steps), steps
    assert (out / "adapter_model.safetensors").exists()
    assert docker_client.containers.list(all=True, filters={"label": f"rewardbox.pid={proc.pid}"},
                                         ignore_removed=True) == []
