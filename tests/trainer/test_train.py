"""`train()` end to end with the tiny model and Docker-sandboxed rewards."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from rewardbox import ConfigError
from rewardbox.backends.docker import DockerBackend, DockerSettings
from tests.conftest import ROOT, default_sigint
from rewardbox.trainer import load_train_config, train

REWARDS = """
import os, time

def shape(prompt, completion, example):
    print(f"scored-in-sandbox uid={os.getuid()}")
    return float(len(completion) % 3)

def slow(prompt, completion, example):
    if len(completion) % 2 == 0:  # about half of the samples: times out
        time.sleep(5)
    return 1.0
"""


def write_training_config(tmp_path: Path, base_image: str, rewards: list[dict], top: dict | None = None,
                          **grpo) -> Path:
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} + 1?", "answer": i + 1, "slow": i % 2 == 0}) + "\n" for i in range(8)
    ))
    config = {
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image}},
        "model": {"name_or_path": "builtin:tiny", "dtype": "float32"},
        "dataset": {"path": "data.jsonl", "question_column": "question", "system_prompt": "Answer briefly."},
        "grpo": {"max_steps": 3, "per_device_train_batch_size": 4, "num_generations": 4,
                 "max_completion_length": 8, "learning_rate": 0.01, "save_strategy": "no", "seed": 0, **grpo},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
        "output_dir": str(tmp_path / "out"),
        "rewards": rewards,
        **(top or {}),
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def docker_backend(docker_client, base_image: str) -> DockerBackend:
    return DockerBackend(DockerSettings(base_image=base_image), client=docker_client)


def write_reward(tmp_path: Path, name: str, code: str) -> str:
    (tmp_path / "rewards").mkdir(exist_ok=True)
    (tmp_path / "rewards" / name).write_text(textwrap.dedent(code))
    return f"rewards/{name}"


def reward_log(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "reward_logs.jsonl").read_text().splitlines()]


def test_training_with_docker_sandboxes_end_to_end(tmp_path, docker_client, base_image):
    source = write_reward(tmp_path, "rewards.py", REWARDS)
    path = write_training_config(tmp_path, base_image, [
        {"name": "shape", "source": source},
        {"name": "slow", "source": source, "timeout_s": 0.5, "default_score": 0.0, "workers": 4},
    ], top={"save_merged": True})
    result = train(path, backend=docker_backend(docker_client, base_image))
    out = result.output_dir
    history = [h for h in result.log_history if "rewards/shape/mean" in h]
    assert len(history) == 3

    # every logged reward came from the sandbox: the trainer's per-step means are the sandbox reports' means
    records = reward_log(out)
    shape_means = [r["mean"] for r in records if r["reward"] == "shape"]
    assert shape_means == pytest.approx([h["rewards/shape/mean"] for h in history])
    assert [r["step"] for r in records if r["reward"] == "shape"] == [0, 1, 2]
    # reward code ran under the sandbox's slot uids: neither root nor the server's (65534)
    uids = {int(u) for r in records if r["reward"] == "shape" for u in re.findall(r"scored-in-sandbox uid=(\d+)",
                                                                                     r["logs"])}
    assert uids and all(u >= 100000 for u in uids)

    # the reward that times out on about half the samples did not stop training; its fallbacks were logged
    slow = [r for r in records if r["reward"] == "slow"]
    assert sum(r["statuses"].get("timeout", 0) for r in slow) > 0
    assert sum(r["statuses"].get("ok", 0) for r in slow) > 0  # the other samples kept their real scores
    assert any(h["sandbox/slow/timeout_rate"] > 0 for h in history)
    assert sum(h["sandbox/slow/workers_replaced"] for h in history) == 0  # soft timeouts: no worker was killed
    for h in history:
        assert h["sandbox/slow/attempts"] == 1 and h["sandbox/slow/restarts_total"] == 0
        assert h["sandbox/slow/fallback_rate"] == h["sandbox/slow/timeout_rate"]
        assert h["rewards/slow/mean"] == pytest.approx(1.0 - h["sandbox/slow/timeout_rate"])

    # the run record holds every completion with both scores, statuses and each sample's own output
    db = sqlite3.connect(out / "record.sqlite")
    rows = db.execute("SELECT c.step, c.position, c.text, c.tokens, c.total, c.advantage, s.value, s.status, s.error, "
                      "s.logs, s.version, t.value, t.status, t.error FROM completions c "
                      "JOIN scores s ON s.completion_id = c.id AND s.reward = 'shape' "
                      "JOIN scores t ON t.completion_id = c.id AND t.reward = 'slow' ORDER BY c.id").fetchall()
    assert [r[0] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
    for step, h in enumerate(history):
        assert sum(r[6] for r in rows if r[0] == step) / 4 == pytest.approx(h["rewards/shape/mean"])
        assert sum(r[11] for r in rows if r[0] == step) / 4 == pytest.approx(h["rewards/slow/mean"])
        group = [r[5] for r in rows if r[0] == step]
        assert sum(group) == pytest.approx(0.0, abs=1e-6)  # advantages of one group center on zero
    for (_, _, text, tokens, total, _, shape, status, _, logs, version, slow, slow_status, slow_error) in rows:
        assert shape == float(len(text) % 3) and status == "ok" and version == "v1"
        assert total == pytest.approx(shape + slow)  # weights 1 and 1
        assert re.fullmatch(r"scored-in-sandbox uid=\d+\n", logs)  # its own print, not the batch's
        assert 0 < tokens <= 8
        assert (slow_status, slow) == ("ok", 1.0) or (slow_status == "timeout" and slow == 0.0 and slow_error)
    assert {r[12] for r in rows} == {"ok", "timeout"}
    prompts = db.execute("SELECT text, columns FROM prompts").fetchall()
    assert prompts and all("What is" in text and '"answer"' in columns for text, columns in prompts)
    db.close()

    # LoRA weights changed (lora_B starts at zero) and everything was saved
    weights = load_file(out / "adapter_model.safetensors")
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)
    assert (out / "adapter_config.json").exists() and (out / "tokenizer.json").exists()
    assert (out / "rewards.png").stat().st_size > 1000
    merged = out / "merged"
    assert (merged / "model.safetensors").exists() and (merged / "tokenizer.json").exists()
    assert not (merged / "adapter_config.json").exists()  # a plain model, the adapter folded in
    # and no container of this process is left
    mine = docker_client.containers.list(all=True, filters={"label": f"rewardbox.pid={os.getpid()}"},
                                         ignore_removed=True)
    assert mine == []


class EditRewardFile(TrainerCallback):
    """Rewrites the reward file at the end of given steps, as a user editing it during training would."""

    def __init__(self, path: Path, edits: dict[int, str]):
        self.path, self.edits = path, edits

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.edits:
            self.path.write_text(textwrap.dedent(self.edits[state.global_step]))


def test_editing_a_reward_file_mid_run_takes_effect_from_the_next_step(tmp_path, docker_client, base_image):
    source = write_reward(tmp_path, "live.py", "def live(prompt, completion, example):\n    return 1.0\n")
    path = write_training_config(tmp_path, base_image, [{"name": "live", "source": source}], max_steps=5)
    edits = {
        2: "def live(prompt, completion, example):\n    return 5.0\n",
        3: "def live(prompt, completion, example):\n    return (\n",  # broken: the previous version keeps running
    }
    result = train(path, backend=docker_backend(docker_client, base_image),
                   callbacks=[EditRewardFile(tmp_path / source, edits)])
    means = [h["rewards/live/mean"] for h in result.log_history if "rewards/live/mean" in h]
    assert means == [1.0, 1.0, 5.0, 5.0, 5.0]
    # the record labels each score with the version of the file that made it; the broken edit made none
    db = sqlite3.connect(result.output_dir / "record.sqlite")
    assert db.execute("SELECT version, first_step FROM versions ORDER BY version").fetchall() == [("v1", 0), ("v2", 2)]
    by_step = db.execute("SELECT c.step, s.version, AVG(s.value) FROM scores s JOIN completions c "
                         "ON c.id = s.completion_id GROUP BY c.step ORDER BY c.step").fetchall()
    assert by_step == [(0, "v1", 1.0), (1, "v1", 1.0), (2, "v2", 5.0), (3, "v2", 5.0), (4, "v2", 5.0)]
    events = [r for r in reward_log(result.output_dir) if "event" in r]
    assert [(e["event"], e["step"]) for e in events] == [("reloaded", 2), ("reload_failed", 3)]
    assert "SyntaxError" in events[1]["detail"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"grpo": {"max_stepz": 3}},
         r"train\.yaml:\d+: unknown key 'grpo\.max_stepz': not a GRPOConfig field; did you mean 'max_steps'"),
        ({"lora": {"rank": 4}}, r"unknown key 'lora\.rank': not a LoraConfig field"),
        ({"modell": {}}, r"unknown key 'modell'"),
        ({"rewards": [{"name": "gone", "source": "rewards/gone.py"}]}, r"reward 'gone': source file .* does not exist"),
        ({"dataset": {"path": "data.jsonl", "question_column": "questoin"}},
         r"train\.yaml:\d+: dataset data\.jsonl has no column 'questoin' for dataset\.question_column "
         r"\(columns: question, answer, slow\)"),
        ({"dataset": {"path": "missing.jsonl"}}, r"dataset missing\.jsonl: file .* does not exist"),
    ],
)
def test_config_errors_fail_before_training_naming_the_problem(tmp_path, monkeypatch, change, message):
    source = write_reward(tmp_path, "ok.py", "def ok(prompt, completion, example):\n    return 1.0\n")
    path = write_training_config(tmp_path, "unused", [{"name": "ok", "source": source}])
    data = yaml.safe_load(path.read_text())
    data["sandbox"]["backend"] = "local"
    data.update(change)
    path.write_text(yaml.safe_dump(data))

    def must_not_run(*args, **kwargs):
        raise AssertionError("the model was loaded although the config is broken")

    monkeypatch.setattr("rewardbox.trainer.run.load_model", must_not_run)
    monkeypatch.setattr("rewardbox.api.session.RewardSandboxes.start", must_not_run)
    with pytest.raises(ConfigError, match=message):
        train(path)


def test_command_line_overrides_in_trl_style(tmp_path):
    source = write_reward(tmp_path, "ok.py", "def ok(prompt, completion, example):\n    return 1.0\n")
    path = write_training_config(tmp_path, "unused", [{"name": "ok", "source": source}])
    cfg = load_train_config(path, ["--grpo.max_steps", "7", "--lora.r=2", "--model.dtype", "bfloat16",
                                   "--sandbox.backend", "local"])
    assert cfg.grpo["max_steps"] == 7 and cfg.lora["r"] == 2
    assert cfg.model.dtype == "bfloat16" and cfg.sandbox.backend == "local"
    proc = subprocess.run([sys.executable, "-m", "rewardbox.trainer", str(path), "--grpo.max_stepz", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "did you mean 'max_steps'" in proc.stderr


def _my_containers(docker_client, pid: int) -> list:
    return docker_client.containers.list(all=True, filters={"label": f"rewardbox.pid={pid}"}, ignore_removed=True)


def test_ctrl_c_during_training_removes_every_container(tmp_path, docker_client, base_image):
    import shutil
    import signal
    import time

    shutil.copytree(ROOT / "examples" / "quickstart", tmp_path / "quickstart")
    proc = subprocess.Popen([sys.executable, "-m", "rewardbox.trainer", str(tmp_path / "quickstart" / "config.yaml"),
                             "--grpo.max_steps", "5000", "--output_dir", str(tmp_path / "out"),
                             "--sandbox.docker.base_image", base_image],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    log_file = tmp_path / "out" / "reward_logs.jsonl"
    while not log_file.exists() or not log_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start scoring"
        time.sleep(0.2)
    assert len(_my_containers(docker_client, proc.pid)) == 3  # training is under way
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted; all sandboxes were removed" in stderr
    assert _my_containers(docker_client, proc.pid) == []


class FailAtStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise RuntimeError("boom in a callback")


def test_an_error_during_training_removes_every_container(tmp_path, docker_client, base_image):
    source = write_reward(tmp_path, "ok.py", "def ok(prompt, completion, example):\n    return 1.0\n")
    path = write_training_config(tmp_path, base_image, [{"name": "ok", "source": source, "replicas": 2}])
    with pytest.raises(RuntimeError, match="boom in a callback"):
        train(path, backend=docker_backend(docker_client, base_image), callbacks=[FailAtStep()])
    assert _my_containers(docker_client, os.getpid()) == []
