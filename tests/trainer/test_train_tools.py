"""`rewardbox train` with a `tools:` section: the example's config (examples/tools), sandboxed tools and rewards,
trains exactly as the same config run with everything in-process (`--in-process`), and a tool's settings are
checked before anything starts."""

from __future__ import annotations

import inspect
import json
import shutil
import sqlite3
from pathlib import Path

import contextlib

import pytest
import yaml

from rewardbox import ConfigError
from rewardbox.trainer import load_train_config, train
from tests.conftest import ROOT
from tests.trainer.test_tools_trainer import Adder

EXAMPLE = ROOT / "examples" / "tools"


def _config(tmp_path: Path, base_image: str, model: Path, **changes) -> Path:
    for name in ("tools.py", "rewards.py", "train.jsonl"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    config = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    config["sandbox"]["docker"] = {"base_image": base_image}
    config["model"]["name_or_path"] = str(model)
    config["grpo"]["max_steps"] = 3
    config["output_dir"] = str(tmp_path / "out")
    for key, value in changes.items():
        config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _tool_calls(output_dir: Path) -> list:
    with contextlib.closing(sqlite3.connect(output_dir / "record.sqlite")) as db:
        return db.execute("SELECT name, arguments, shown, status, error, latency_s FROM tool_calls "
                          "ORDER BY completion_id, position").fetchall()


def _check_recorded(calls: list, logged: list, completions_per_step: int, tool) -> None:
    """The record holds every call TRL counted, each with what its tool gives in-process for those arguments (or
    raises) and its sandboxed call's time; a call of a name the model made up, TRL's error and no time."""
    assert len(calls) == round(sum(step["tools/call_frequency"] for step in logged) * completions_per_step)
    assert any(name == tool.__name__ for name, *_ in calls)
    for name, arguments, shown, status, error, latency in calls:
        if name != tool.__name__:
            assert (status, shown, latency) == ("error", str({"error": f"Tool {name} not found."}), None)
            continue
        try:
            expected = ("ok", str(tool(**json.loads(arguments))))
        except Exception as e:  # noqa: BLE001 - the tool's own exception, as TRL shows it
            expected = ("error", str({"error": str(e)}))
        assert (status, shown) == expected, (name, arguments, shown, status, error)
        assert latency is not None and 0 < latency < 30, (name, arguments, latency)  # paired with its sandboxed call


def _logged(result) -> list:
    return [{k: v for k, v in entry.items() if k.startswith(("reward", "tools/"))}
            for entry in result.log_history if "reward" in entry]


def test_the_tools_example_trains_identically_sandboxed_and_in_process(tmp_path, tiny_tool_model, docker_client,
                                                                       base_image):
    path = _config(tmp_path, base_image, tiny_tool_model)
    boxed = _logged(train(path))
    calls = _tool_calls(tmp_path / "out")
    plain = _logged(train(path, in_process=True))
    assert boxed == plain
    assert sum(step["tools/call_frequency"] for step in boxed) > 0  # not vacuous: the model called the tool
    namespace: dict = {}
    exec((EXAMPLE / "tools.py").read_text(), namespace)
    _check_recorded(calls, boxed, 8, namespace["add"])


def test_a_tools_settings_and_signature_are_checked_before_anything_starts(tmp_path, tiny_tool_model, base_image):
    tool = {"name": "add", "source": "tools.py", "timeout_s": 2}
    path = _config(tmp_path, base_image, tiny_tool_model, tools=[{**tool, "default_score": 0.0}])
    with pytest.raises(ConfigError, match=r"config\.yaml:\d+: tool 'add': default_score mean nothing for a tool"):
        load_train_config(path)
    path = _config(tmp_path, base_image, tiny_tool_model, tools=[{**tool, "source": "missing.py"}])
    with pytest.raises(ConfigError, match=r"tool 'add': source .*missing\.py is not a \.py file"):
        load_train_config(path)
    path = _config(tmp_path, base_image, tiny_tool_model, tools=[tool])
    (tmp_path / "tools.py").write_text("import numpy\n\ndef add(a: numpy.ndarray) -> int:\n    return 0\n")
    with pytest.raises(ConfigError, match=r"tools\.py:3: the type hint 'numpy\.ndarray' names something other"):
        load_train_config(path)


ADDER = inspect.getsource(Adder)  # the environment of the script-level test, as a file


def test_an_environment_in_a_config_trains_identically_sandboxed_and_in_process(tmp_path, tiny_tool_model,
                                                                                docker_client, base_image):
    environment = {"name": "adder", "source": "adder.py", "function": "Adder", "timeout_s": 5, "max_episodes": 16}
    path = _config(tmp_path, base_image, tiny_tool_model, tools=[], environment=environment)
    (tmp_path / "adder.py").write_text(ADDER)
    boxed = _logged(train(path))
    calls = _tool_calls(tmp_path / "out")
    plain = _logged(train(path, in_process=True))
    assert boxed == plain
    assert sum(step["tools/call_frequency"] for step in boxed) > 0
    assert sum(step["tools/failure_frequency"] for step in boxed) > 0
    _check_recorded(calls, boxed, 8, Adder().add)  # add's result depends on its arguments alone
    assert {status for name, _, _, status, *_ in calls if name == "add"} == {"ok", "error"}
    assert any(step["rewards/Adder/mean"] > 0 for step in boxed)  # the episodes' state reached get_reward
    # The environment's reward is in the record beside the others: each batch's values as TRL got them, each
    # episode's status and its sandboxed get_reward's time, and the completions' totals count it
    with contextlib.closing(sqlite3.connect(tmp_path / "out" / "record.sqlite")) as db:
        scores = db.execute("SELECT step, value, status, latency_s FROM scores WHERE reward = 'Adder' "
                            "ORDER BY completion_id").fetchall()
        weights = dict(db.execute("SELECT name, weight FROM rewards").fetchall())
        totals = db.execute("SELECT c.total, SUM(r.weight * s.value) FROM completions c JOIN scores s "
                            "ON s.completion_id = c.id JOIN rewards r ON r.name = s.reward GROUP BY c.id").fetchall()
    steps = sorted({step for step, *_ in scores})
    assert len(scores) == 8 * len(boxed) and len(steps) == len(boxed)
    means = [sum(v for s, v, *_ in scores if s == step) / 8 for step in steps]
    assert means == pytest.approx([step["rewards/Adder/mean"] for step in boxed])
    assert all(status == "ok" and latency is not None and 0 < latency < 30 for _, _, status, latency in scores)
    assert weights["Adder"] == 1.0 and len(weights) >= 2
    assert totals and all(total == pytest.approx(weighted) for total, weighted in totals)


def test_an_environments_class_and_settings_are_checked_before_anything_starts(tmp_path, tiny_tool_model,
                                                                               base_image):
    environment = {"name": "adder", "source": "adder.py", "function": "Adder"}
    path = _config(tmp_path, base_image, tiny_tool_model, environment={**environment, "workers": 4})
    (tmp_path / "adder.py").write_text(ADDER)
    with pytest.raises(ConfigError, match=r"config\.yaml:\d+: workers are fixed for an environment"):
        load_train_config(path)
    path = _config(tmp_path, base_image, tiny_tool_model, environment={**environment, "function": "Missing"})
    with pytest.raises(ConfigError, match=r"adder\.py: no top-level `class Missing`"):
        load_train_config(path)


def test_the_agent_example_trains_with_its_environment_sandboxed(tmp_path, tiny_tool_model, docker_client,
                                                                 base_image):
    config = ROOT / "examples" / "agent" / "config.yaml"
    cfg = load_train_config(config, [f"--model.name_or_path={tiny_tool_model}", "--grpo.max_steps=1",
                                     f"--output_dir={tmp_path / 'out'}",
                                     f"--sandbox.docker.base_image={base_image}"])
    result = train(cfg)
    logged = _logged(result)
    assert len(logged) == 1 and "rewards/CodeEnv/mean" in logged[0] and "rewards/brevity/mean" in logged[0]
