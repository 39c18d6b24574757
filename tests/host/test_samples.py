"""How TRL's keyword arguments and JSONL rows become what a reward sees."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest

from rewardbox import build_samples, samples_from_rows
from rewardbox.scoring.samples import column_problem
from rewardbox.wire import decode_columns, example_of


def test_columns_become_strings_that_literal_eval_recovers():
    [s] = build_samples(["p"], ["c"], {
        "answer": [42], "ratio": [0.5], "tags": [["a", "b"]], "meta": [{"k": 1}], "none": [None],
        "array": [np.array([1, 2, 3])], "scalar": [np.float32(2.5)], "text": ["plain"],
    })
    example = example_of(s.columns_json)
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


def test_jsonl_rows_need_prompt_and_completion_and_a_missing_column_is_none_as_in_a_dataset():
    with pytest.raises(ValueError, match=r"sample 1 has no 'completion' key"):
        samples_from_rows([{"prompt": "p", "completion": "c"}, {"prompt": "p"}])
    a, b = samples_from_rows([{"prompt": "p", "completion": "c", "x": 1}, {"prompt": "p", "completion": "d"}])
    # The same string training gives for a missing value (datasets fills None): one stringification for both.
    assert example_of(a.columns_json) == {"x": "1"} and example_of(b.columns_json) == {"x": "None"}
    assert decode_columns(b.columns_json) == {"x": None}


NATIVE = {"z_int": 3, "a_float": 0.1, "m_list": [1, [2, "x"]], "b_dict": {"k": [True, None]}, "y_bool": False,
          "c_none": None, "big": 2**70, "nan": float("inf"), "text": "caf\u00e9 \ud800"}


def test_columns_travel_with_their_native_values_in_the_dataset_order():
    [s] = build_samples(["p"], ["c"], {k: [v] for k, v in NATIVE.items()})
    decoded = decode_columns(s.columns_json)
    assert list(decoded) == list(NATIVE)  # the dataset's order, not sorted
    assert decoded == NATIVE and [type(v) for v in decoded.values()] == [type(v) for v in NATIVE.values()]
    assert list(example_of(s.columns_json)) == list(NATIVE)


@pytest.mark.parametrize("value, named", [(b"raw", "bytes"), ((1, 2), "tuple"), ([1, {2: 3}], "dict key of type int"),
                                          (np.array([1]), "ndarray")])
def test_a_column_json_cannot_carry_is_named_for_batch_style(value, named):
    problem = column_problem({"ok": ["x"], "bad": [value]})
    assert problem is not None and "column 'bad'" in problem and named in problem and "sample 0" in problem
    assert column_problem({k: [v] for k, v in NATIVE.items()}) is None


def test_completion_ids_travel_per_sample():
    a, b = build_samples(["p", "p"], ["c", "d"], {}, completion_ids=[[1, 2, 3], np.array([4])])
    assert list(a.completion_ids) == [1, 2, 3] and list(b.completion_ids) == [4] and a.has_completion_ids
    [plain] = build_samples(["p"], ["c"], {})
    assert not plain.has_completion_ids
    with pytest.raises(ValueError, match=r"got 1 completion_ids for 2 completions"):
        build_samples(["p", "p"], ["a", "b"], {}, completion_ids=[[1]])
