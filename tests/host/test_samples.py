"""How TRL's keyword arguments and JSONL rows become what a reward sees."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest

from rewardbox import build_samples, samples_from_rows


def test_columns_become_strings_that_literal_eval_recovers():
    [s] = build_samples(["p"], ["c"], {
        "answer": [42], "ratio": [0.5], "tags": [["a", "b"]], "meta": [{"k": 1}], "none": [None],
        "array": [np.array([1, 2, 3])], "scalar": [np.float32(2.5)], "text": ["plain"],
    })
    example = dict(s.example)
    assert all(isinstance(v, str) for v in example.values())
    assert int(example["answer"]) == 42 and float(example["ratio"]) == 0.5
    assert ast.literal_eval(example["tags"]) == ["a", "b"]
    assert ast.literal_eval(example["meta"]) == {"k": 1}
    assert ast.literal_eval(example["array"]) == [1, 2, 3]  # numpy prints "[1 2 3]"; tolist() first
    assert float(example["scalar"]) == 2.5
    assert example["none"] == "None" and example["text"] == "plain"


def test_message_lists_give_text_and_keep_the_lists():
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question?"}]
    parts = [{"type": "text", "text": "multi"}, {"type": "text", "text": "part"}]
    completion = [{"role": "assistant", "content": parts}]
    [s] = build_samples([prompt], [completion], {})
    assert s.prompt == "question?" and s.completion == "multipart"
    assert json.loads(s.prompt_messages_json) == prompt
    assert json.loads(s.completion_messages_json) == completion
    [plain] = build_samples(["p"], ["c"], {})
    assert plain.prompt_messages_json == "" and plain.completion_messages_json == ""


def test_mismatched_lengths_name_the_column():
    with pytest.raises(ValueError, match=r"column 'answer' has 1 values for 2 completions"):
        build_samples(["p", "p"], ["a", "b"], {"answer": [1]})


def test_jsonl_rows_need_prompt_and_completion_and_missing_columns_are_empty():
    with pytest.raises(ValueError, match=r"sample 1 has no 'completion' key"):
        samples_from_rows([{"prompt": "p", "completion": "c"}, {"prompt": "p"}])
    a, b = samples_from_rows([{"prompt": "p", "completion": "c", "x": 1}, {"prompt": "p", "completion": "d"}])
    assert dict(a.example) == {"x": "1"} and dict(b.example) == {"x": ""}
