"""The run record's own arithmetic and life cycle (rewardbox.report.record): totals and advantages as GRPO computes
them, a batch written only once every reward answered, and an earlier run's record kept beside a new one."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest

from rewardbox.scoring.client import ScoreReport
from rewardbox.report.record import RunRecorder, totals_and_advantages
from rewardbox.trainer.callbacks import set_aside
from rewardbox.wire import Status


def test_totals_and_advantages_are_grpos():
    import torch  # the train extra
    rows = [[1.0, 0.5], [0.0, None], [2.0, 1.0], [1.0, 1.0], [0.0, 0.0], [None, None], [3.0, 0.5], [1.0, 0.0]]
    weights = [1.0, 2.0]
    totals, advantages = totals_and_advantages(rows, weights, 4)
    # as TRL's GRPOTrainer: nansum of weighted rewards, then (x - group mean) / (group std + 1e-4)
    tensor = torch.tensor([[float("nan") if v is None else v for v in row] for row in rows])
    expected_totals = (tensor * torch.tensor(weights)).nansum(dim=1)
    grouped = expected_totals.view(-1, 4)
    mean = grouped.mean(dim=1).repeat_interleave(4)
    std = grouped.std(dim=1).repeat_interleave(4)
    expected = (expected_totals - mean) / (std + 1e-4)
    assert [0.0 if t is None else t for t in totals] == pytest.approx(expected_totals.tolist())
    assert totals[5] is None  # no reward answered at all
    assert advantages == pytest.approx(expected.tolist(), abs=1e-5)
    assert totals_and_advantages(rows[:6], weights, 4)[1] == [None] * 6  # not whole groups: no advantage


def report(name: str, values: list) -> ScoreReport:
    return ScoreReport(name=name, values=values, statuses=[Status.OK] * len(values), errors=[None] * len(values),
                       logs="the call", sample_logs=[f"{name} {i}\n" for i in range(len(values))])


def test_a_batch_is_written_once_every_reward_answered_and_an_earlier_run_is_kept_aside(tmp_path):
    path = tmp_path / "record.sqlite"
    recorder = RunRecorder(path, [("a", 1.0), ("b", 0.5)], num_generations=2)
    prompts, completions = ["p1", "p1", "p2", "p2"], ["x", "yy", "zzz", "w"]
    state = SimpleNamespace(global_step=3, epoch=0.5)
    recorder.observe("a", report("a", [1.0, 0.0, 1.0, 1.0]), state, prompts, completions, {"answer": [1, 1, 2, 2]})
    recorder.flush()
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 0  # b not yet
    recorder.observe("b", report("b", [0.0, 1.0, None, 1.0]), state, prompts, completions, {"answer": [1, 1, 2, 2]})
    recorder.close()
    db = sqlite3.connect(path)
    rows = db.execute("SELECT step, epoch, text, total FROM completions ORDER BY id").fetchall()
    assert rows == [(3, 0.5, "x", 1.0), (3, 0.5, "yy", 0.5), (3, 0.5, "zzz", 1.0), (3, 0.5, "w", 1.5)]
    assert db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM prompts").fetchone() == (2, 2)
    assert db.execute("SELECT logs FROM scores WHERE reward = 'b' ORDER BY completion_id").fetchall() == [
        ("b 0\n",), ("b 1\n",), ("b 2\n",), ("b 3\n",)]
    assert db.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 2
    db.close()
    kept = set_aside(path)
    assert kept is not None and kept.exists() and not path.exists()
    fresh = RunRecorder(path, [("a", 1.0)], num_generations=1)
    fresh.close()
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 0
    assert sqlite3.connect(kept).execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 4


def test_huge_scores_leave_every_view_answering(tmp_path):
    import json

    from rewardbox.report.app import Record, _clean

    recorder = RunRecorder(tmp_path / "record.sqlite", [("a", 2.0)], num_generations=2)
    for step in range(4):
        recorder.observe("a", report("a", [1e308, 1e200 if step % 2 else 0.5]), SimpleNamespace(global_step=step),
                         ["p", "p"], [f"x{step}", "y"], {})
    recorder.close()
    record = Record(tmp_path)
    for view in (record.meta(), record.graphs(), record.prompts(), record.completions({}), record.logs({}),
                 record.signals(), record.prompt(record.prompts()["rows"][0]["id"])):
        json.dumps(_clean(view), allow_nan=False)
    assert [r["total"] for r in record.completions({})["rows"]][:2] in ([2e200, None], [None, 2e200])
