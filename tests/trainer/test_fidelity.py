"""Sandboxed training matches plain TRL: the quickstart trained in-process and in Docker sandboxes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rewardbox import load_train_config, train
from tests.conftest import ROOT

STEPS = 30


def _run(tmp_path, name: str, in_process: bool):
    cfg = load_train_config(ROOT / "examples" / "quickstart" / "config.yaml", [
        "--grpo.max_steps", str(STEPS), "--grpo.save_strategy", "no", "--output_dir", str(tmp_path / name)])
    result = train(cfg, in_process=in_process)
    steps = [h for h in result.log_history if "reward" in h]
    adapter = load_file(str(result.output_dir / "adapter_model.safetensors"))
    return steps, adapter


def test_the_quickstart_trains_bit_identically_in_process_and_sandboxed(tmp_path, docker_client, base_image):
    plain, plain_adapter = _run(tmp_path, "in_process", in_process=True)
    boxed, boxed_adapter = _run(tmp_path, "sandboxed", in_process=False)
    assert len(plain) == len(boxed) == STEPS
    keys = ["reward"] + [f"rewards/{name}/mean" for name in ("format", "partial_format", "correct")]
    for a, b in zip(plain, boxed):
        assert [a[k] for k in keys] == [b[k] for k in keys], (a["step"], [a[k] for k in keys], [b[k] for k in keys])
        assert b["sandbox/correct/fallback_rate"] == 0.0
    assert len({round(h["reward"], 6) for h in plain}) > 1  # the rewards moved: the comparison is not vacuous
    assert plain_adapter.keys() == boxed_adapter.keys()
    assert all(torch.equal(plain_adapter[k], boxed_adapter[k]) for k in plain_adapter)
