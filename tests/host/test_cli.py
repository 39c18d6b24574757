"""`rewardbox score` end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_score_writes_one_row_per_sample_in_order_with_status_and_weighted_total(write_config, tmp_path):
    path = write_config([
        {"name": "length", "code": "def length(prompt, completion, example):\n    return float(len(completion))\n",
         "weight": 0.5},
        {"name": "flaky", "code": "def flaky(prompt, completion, example):\n"
                                  "    if completion == 'bad':\n        raise ValueError('no')\n"
                                  "    return float(example['bonus'])\n", "default_score": None},
    ])
    samples = tmp_path / "s.jsonl"
    rows = [
        {"prompt": "p", "completion": "abcd", "bonus": 1},
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "bad"}],
         "bonus": 2},
    ]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "score", str(path), "--samples", str(samples),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got[0] == {"index": 0, "scores": {"length": 4.0, "flaky": 1.0}, "status": {"length": "ok", "flaky": "ok"},
                      "errors": {"length": None, "flaky": None}, "total": 3.0}
    assert got[1]["index"] == 1
    assert got[1]["scores"] == {"length": 3.0, "flaky": None}
    assert got[1]["status"] == {"length": "ok", "flaky": "error"}
    assert "ValueError: no" in got[1]["errors"]["flaky"]
    assert got[1]["total"] == 1.5
    assert "per-function status" in proc.stdout and "flaky" in proc.stdout


def test_per_request_http_logs_are_muted_unless_verbose():
    import logging

    from rewardbox import cli

    cli._setup_logging(False)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("rewardbox").isEnabledFor(logging.INFO)
    cli._setup_logging(True)
    assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    cli._setup_logging(False)
