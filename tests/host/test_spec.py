"""Config errors are found before anything starts, with messages that name the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rewardbox import ConfigError, RewardLoadError, RewardSandboxes, load_config

OK = "def ok(prompt, completion, example):\n    return 1.0\n"


# write_config writes: sandbox (line 1), backend (2), rewards (3), then per reward: source (4), name (5), others


def test_unknown_key_is_named_with_file_and_line(write_config):
    path = write_config([{"name": "ok", "code": OK, "timout_s": 3}])
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:6: unknown key 'rewards\[0\]\.timout_s'"):
        load_config(path)


def test_bad_value_is_named_with_file_and_line(write_config):
    path = write_config([{"name": "ok", "code": OK, "timeout_s": -1}])
    with pytest.raises(ConfigError,
                       match=r"rewardbox\.yaml:6: rewards\[0\]\.timeout_s: Input should be greater than 0"):
        load_config(path)


def test_missing_source_file_is_named_with_its_line(write_config):
    path = write_config([{"name": "ok", "code": OK}, {"name": "ghost", "file": "ghost.py"}])
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:6: reward 'ghost': source file .*ghost\.py does not exist"):
        load_config(path)


def test_duplicate_names_are_rejected(write_config):
    path = write_config([{"name": "ok", "code": OK}, {"name": "ok", "file": "ok.py"}])
    with pytest.raises(ConfigError, match="used twice"):
        load_config(path)


@pytest.mark.parametrize(
    "code, style, message",
    [
        ("def ok(prompt, completion, example):\n    return 1.0 +\n", "sample", r"ok\.py:2: SyntaxError"),
        ("import not_a_real_package_xyz\n", "sample",
         r"ok\.py:1: ModuleNotFoundError: No module named 'not_a_real_package_xyz'\. The local backend installs no "
         r"packages"),
        ("def other(prompt, completion, example):\n    return 1.0\n", "sample",
         r"no function 'ok'.*Callables defined there: other"),
        ("def ok(completions, **kwargs):\n    return [1.0]\n", "sample", r"ok\.py:1: .*does not fit style 'sample'"),
        ("def ok(prompt, completion, example):\n    return 1.0\n", "batch", r"does not fit style 'batch'"),
        ("raise RuntimeError('boom at import')\n", "sample", r"ok\.py:1: RuntimeError while importing: boom"),
        ("import os\nos._exit(3)\n", "sample", r"ok\.py: the process importing it died"),
    ],
)
def test_unusable_reward_code_fails_at_start_naming_file_and_line(write_config, code, style, message):
    config = load_config(write_config([{"name": "ok", "code": code, "style": style}]))
    sandboxes = RewardSandboxes(config)
    with pytest.raises(RewardLoadError, match=message):
        sandboxes.start()
    assert sandboxes.replicas == {}  # nothing left running


def test_cli_score_exits_nonzero_on_a_broken_reward_before_scoring(write_config, tmp_path):
    path = write_config([{"name": "ok", "code": "def ok(prompt, completion, example):\n    return (\n"}])
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"prompt": "p", "completion": "c"}\n')
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "score", str(path), "--samples", str(samples),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "SyntaxError" in proc.stderr and "ok.py:2" in proc.stderr
    assert not out.exists()


def test_yaml_reads_no_as_a_string_and_5e_minus_6_as_a_float():
    from rewardbox.spec import yaml_load

    assert yaml_load("save_strategy: no\nlearning_rate: 5e-6\nflag: true\nn: 3\nname: on") == {
        "save_strategy": "no", "learning_rate": 5e-6, "flag": True, "n": 3, "name": "on"}


def test_importing_a_sibling_file_says_the_sandbox_gets_only_the_reward_file(write_config, tmp_path):
    path = write_config([{"name": "uses_helper",
                          "code": "from helpers import parse\ndef uses_helper(prompt, completion, example):\n"
                                  "    return parse(completion)\n"}])
    (tmp_path / "rewards" / "helpers.py").write_text("def parse(text):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match=r"(?s)uses_helper\.py:1: ModuleNotFoundError: No module named "
                                              r"'helpers'\. The local backend installs no packages.*'helpers' is a "
                                              r"module beside .* receives only the reward's own file"):
        RewardSandboxes(load_config(path)).start()


def test_an_import_that_never_finishes_fails_the_start_within_start_timeout(write_config):
    path = write_config([{"name": "stuck", "code": "while True:\n    pass\n"}], sandbox={"start_timeout_s": 5})
    sandboxes = RewardSandboxes(load_config(path))
    with pytest.raises(RewardLoadError, match=r"stuck\.py: importing took longer than \d+s; a slow import needs a "
                                              r"larger sandbox\.start_timeout_s"):
        sandboxes.start()
    assert sandboxes.replicas == {}


def test_every_path_of_a_backend_section_is_relative_to_the_config_file(tmp_path, monkeypatch):
    config_dir = tmp_path / "project"
    config_dir.mkdir()
    (config_dir / "r.py").write_text("def r(prompt, completion, example):\n    return 1.0\n")
    (config_dir / "rewards.yaml").write_text(
        "sandbox:\n  backend: remote\n  remote:\n    endpoints: ['localhost:1']\n    tls_ca: certs/ca.pem\n"
        "  docker:\n    cache_dir: ~/rbx-cache\nrewards:\n  - {name: r, source: r.py}\n")
    monkeypatch.chdir(tmp_path)  # somewhere else than the config's directory
    config = load_config(config_dir / "rewards.yaml")
    assert config.sandbox.backend_settings("remote").tls_ca == config_dir / "certs" / "ca.pem"
    assert config.sandbox.backend_settings("docker").cache_dir == (Path.home() / "rbx-cache")
