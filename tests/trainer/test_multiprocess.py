"""`accelerate launch` with two CPU processes: each rank scores its own completions in its own sandboxes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT


def train_two_ranks(tmp_path, config, out, *overrides: str) -> None:
    """Trains the quickstart for 2 steps with two accelerate ranks, and checks that each rank logged every reward
    for both steps with every sample scored ok."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "rewardbox.trainer", str(config), "--grpo.max_steps", "2", "--grpo.save_strategy", "no",
           "--output_dir", str(out), *overrides]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stderr and "rank 1 of 2" in proc.stderr
    for log_name in ("reward_logs.jsonl", "reward_logs.rank1.jsonl"):
        records = [json.loads(line) for line in (out / log_name).read_text().splitlines()]
        assert {r["reward"] for r in records} == {"format", "partial_format", "correct"}
        assert sorted({r["step"] for r in records}) == [0, 1]
        assert all(r["statuses"].get("ok") == r["samples"] for r in records)


def test_two_ranks_train_with_their_own_sandboxes(tmp_path, base_image):
    shutil.copytree(ROOT / "examples" / "quickstart", tmp_path / "quickstart")
    out = tmp_path / "out"
    train_two_ranks(tmp_path, tmp_path / "quickstart" / "config.yaml", out,
                    "--sandbox.docker.base_image", base_image)
    assert (out / "adapter_model.safetensors").exists()


def test_two_ranks_train_against_one_shared_service(tmp_path, base_image):
    """`accelerate launch` with two ranks and `backend: remote`: both score on one `rewardbox serve` (the quickstart's
    rewards in its Docker sandboxes), and neither rank starts a sandbox of its own."""
    import docker
    import yaml

    from tests.remote.conftest import launch_service

    shutil.copytree(ROOT / "examples" / "quickstart", tmp_path / "quickstart")
    config = tmp_path / "quickstart" / "config.yaml"
    data = yaml.safe_load(config.read_text())
    data["sandbox"] = {"backend": "docker", "docker": {"base_image": base_image}}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    service = launch_service([sys.executable, "-m", "rewardbox", "serve", str(config), "--listen", "127.0.0.1:0"],
                             dict(os.environ), timeout_s=300)
    try:
        engine = docker.from_env()
        served = {c.id for c in engine.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)}
        began = int(time.time()) - 1
        train_two_ranks(tmp_path, config, tmp_path / "out", "--sandbox.backend", "remote",
                        "--sandbox.remote.endpoints", f"[{service.target}]")
        created = list(engine.events(since=began, until=int(time.time()) + 1, decode=True,
                                     filters={"type": "container", "event": "create"}))
        created = [e for e in created if e["id"] not in served]
        assert created == []  # the ranks started no sandbox of their own
        running = engine.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)
        assert len(served) == 3 and served <= {c.id for c in running}
    finally:
        service.kill(signal.SIGTERM)
    assert "stopped; all sandboxes were removed" in "".join(service.output)
