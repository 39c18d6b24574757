"""`accelerate launch` with two CPU processes: each rank scores its own completions in its own sandboxes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_two_ranks_train_with_their_own_sandboxes(tmp_path, base_image):
    shutil.copytree(ROOT / "examples" / "quickstart", tmp_path / "quickstart")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "rewardbox.trainer", str(tmp_path / "quickstart" / "config.yaml"),
           "--grpo.max_steps", "2", "--grpo.save_strategy", "no", "--output_dir", str(out),
           "--sandbox.docker.base_image", base_image]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stderr and "rank 1 of 2" in proc.stderr
    for log_name in ("reward_logs.jsonl", "reward_logs.rank1.jsonl"):
        records = [json.loads(line) for line in (out / log_name).read_text().splitlines()]
        assert {r["reward"] for r in records} == {"format", "partial_format", "correct"}
        assert sorted({r["step"] for r in records}) == [0, 1]
        assert all(r["statuses"].get("ok") == r["samples"] for r in records)
    assert (out / "adapter_model.safetensors").exists()
