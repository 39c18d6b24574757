"""Dataset loading and prompt formatting for `rewardbox train`: local files in every supported format."""

from __future__ import annotations

import pandas as pd
import pytest

from rewardbox import ConfigError
from rewardbox.trainer.config import DatasetSection
from rewardbox.trainer.run import load_datasets

ROWS = [{"question": f"What is {i} + 1?", "answer": i + 1, "text": f"plain prompt {i}"} for i in range(8)]


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json", ".jsonl"])
def test_local_files_with_a_question_column_become_conversational_prompts(tmp_path, suffix):
    frame = pd.DataFrame(ROWS)
    path = tmp_path / f"data{suffix}"
    {".csv": lambda: frame.to_csv(path, index=False), ".parquet": lambda: frame.to_parquet(path),
     ".json": lambda: frame.to_json(path, orient="records", lines=True),
     ".jsonl": lambda: frame.to_json(path, orient="records", lines=True)}[suffix]()
    train, evaluation = load_datasets(
        DatasetSection(path=path.name, question_column="question", system_prompt="Be brief."), tmp_path)
    assert evaluation is None and len(train) == 8
    assert train[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is 0 + 1?"}]
    assert train[0]["answer"] == 1  # other columns stay for the rewards (as strings there)


def test_a_named_prompt_column_is_used_as_the_prompt_and_test_size_holds_out_rows(tmp_path):
    pd.DataFrame(ROWS).to_json(tmp_path / "d.jsonl", orient="records", lines=True)
    train, evaluation = load_datasets(DatasetSection(path="d.jsonl", prompt_column="text", test_size=0.25), tmp_path)
    assert len(train) == 6 and len(evaluation) == 2
    assert set(train.column_names) == {"prompt", "question", "answer"}
    assert train[0]["prompt"].startswith("plain prompt")


def test_a_missing_prompt_column_is_named_with_the_columns_there_are(tmp_path):
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.csv", index=False)
    with pytest.raises(ConfigError, match=r"has no column 'prompt' for dataset\.prompt_column \(columns: question, "
                                          r"answer, text\); name the prompt column"):
        load_datasets(DatasetSection(path="d.csv"), tmp_path)
