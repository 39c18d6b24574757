"""The training config: the rewardbox YAML (``sandbox``, ``rewards``) plus ``model``, ``dataset``, ``grpo``,
``lora`` and ``output_dir``, with command-line overrides in the style TRL users know (``--grpo.max_steps 5``)."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ..api.environments import EnvironmentSpec
from ..errors import ConfigError
from ..spec import RewardboxConfig, RewardSpec, Where, parse_config, read_yaml_file, yaml_load

BUILTIN_TINY = "builtin:tiny"
BUILTIN_TINY_TOOLS = "builtin:tiny-tools"  # a tiny model that calls an `add` tool (trainer.tiny)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    name_or_path: str = Field(default=BUILTIN_TINY, description="hub id, local path, or builtin:tiny / "
                              "builtin:tiny-tools (offline)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    revision: Optional[str] = None


class DatasetSection(_Strict):
    path: str = Field(description="hub dataset id, or a local .json/.jsonl/.csv/.parquet file (relative to config)")
    name: Optional[str] = Field(default=None, description="hub dataset config name")
    split: str = "train"
    test_split: Optional[str] = Field(default=None, description="hub split for evaluation")
    test_size: Optional[float] = Field(default=None, gt=0, lt=1, description="fraction held out for evaluation")
    prompt_column: str = Field(default="prompt", description="a ready prompt column: text or messages")
    question_column: Optional[str] = Field(default=None, description="build conversational prompts from this column")
    system_prompt: Optional[str] = None
    limit: Optional[int] = Field(default=None, gt=0, description="use the first N rows")


class TrainConfig(RewardboxConfig):
    """Everything ``rewardbox train`` needs, validated before anything starts: the sandbox and rewards sections of
    :class:`~rewardbox.RewardboxConfig` (so it starts sandboxes as it is) with the training sections typed."""

    model: ModelSection = Field(default_factory=ModelSection)
    dataset: DatasetSection = Field(description="the dataset to train on (at least `dataset: {path: ...}`)")
    grpo: dict[str, Any] = Field(default_factory=dict, description="trl.GRPOConfig fields")
    lora: Optional[dict[str, Any]] = Field(default=None, description="peft.LoraConfig fields; none: full fine-tuning")
    output_dir: Path = Path("outputs/rewardbox-grpo")
    save_merged: bool = Field(default=False, description="also save the LoRA-merged model")
    tools: list[RewardSpec] = Field(default_factory=list, description="TRL tools (GRPOTrainer(tools=...)), each "
                                    "call run in a sandbox: name, source, function and the reward settings but "
                                    "style, default_score and weight")
    environment: Optional[EnvironmentSpec] = Field(default=None, description="a TRL environment "
                                                   "(environment_factory=), each episode a sandbox process: name, "
                                                   "source, function (the class), max_episodes and reward settings")


def _parse_value(text: str) -> Any:
    try:
        return yaml_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Applies ``--a.b value`` / ``--a.b=value`` pairs (values parsed as YAML) to a raw config mapping.

    Raises:
        ConfigError: an override is malformed or lacks a value.
    """
    args = list(overrides)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"override {arg!r} is not of the form --section.key VALUE (e.g. --grpo.max_steps 5)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            value = args[i + 1]
            i += 1
        i += 1
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(f"override --{key}: {part!r} is not a section")
            node = node[part]
        node[parts[-1]] = _parse_value(value)
    return data


def _check_fields(section: str, values: dict, cls: type, where: Where, reserved: Optional[dict] = None) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if reserved and key in reserved:
            raise ConfigError(f"{where.at(section, key)}: {section}.{key} is set by rewardbox ({reserved[key]}); "
                              "remove it from the config")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where.at(section, key)}: unknown key '{section}.{key}': not a {cls.__name__} "
                              f"field{hint}")


def parse_train_config(data: Any, base_dir: Path, where: Where = Where()) -> TrainConfig:
    """Validates every section. Raises ConfigError naming the file, line and key (or the reward file) at fault."""
    if isinstance(data, dict) and data.get("dataset") is None:
        raise ConfigError(f"{where.file}: missing required section 'dataset' (at least `dataset: {{path: ...}}`)")
    if isinstance(data, dict):  # `grpo:` or `model:` with nothing under it reads as null: an empty section
        data = {**data, **{k: {} for k in ("model", "grpo") if k in data and data[k] is None}}
    cfg = parse_config(data, base_dir, where, config_type=TrainConfig)
    assert isinstance(cfg, TrainConfig)  # validated as config_type
    _check_tools(cfg, where)
    from trl import GRPOConfig

    _check_fields("grpo", cfg.grpo, GRPOConfig, where, reserved={"reward_weights": "from each reward's weight",
                                                                 "output_dir": "top-level output_dir"})
    if cfg.lora is not None:
        from peft import LoraConfig

        _check_fields("lora", cfg.lora, LoraConfig, where)
    return cfg


def _check_tools(cfg: TrainConfig, where: Where) -> None:
    """Each ``tools:`` entry: a tool (style ``tool``), its source a .py file whose ``def`` the host can read its
    schema from, its name unique among the tools; the ``environment:``'s source and class likewise."""
    from ..api.tools import NOT_FOR_TOOLS, stub_from_source

    names: set[str] = set()
    for i, tool in enumerate(cfg.tools):
        meaningless = sorted(set(NOT_FOR_TOOLS) & tool.model_fields_set)
        if meaningless:
            raise ConfigError(f"{where.at('tools', i, meaningless[0])}: tool {tool.name!r}: "
                              f"{', '.join(meaningless)} mean nothing for a tool (it returns what it returns); "
                              "remove it")
        path = cfg.source_path(tool)
        if not path.is_file() or path.suffix != ".py":
            raise ConfigError(f"{where.at('tools', i, 'source')}: tool {tool.name!r}: source {path} is not a .py "
                              f"file (tools[].source is relative to the config file's directory {cfg.base_dir})")
        stub_from_source(path, tool.function_name)  # its schema can be read (the same check as at start)
        if tool.name in names:
            raise ConfigError(f"{where.at('tools', i, 'name')}: tool name {tool.name!r} is used twice")
        names.add(tool.name)
    cfg.tools = [tool.model_copy(update={"style": "tool"}) for tool in cfg.tools]
    environment = cfg.environment
    if environment is not None:
        from ..api.environments import NOT_FOR_ENVIRONMENTS
        from ..api.tools import class_stub_from_source

        fixed = sorted(set(NOT_FOR_ENVIRONMENTS) & environment.model_fields_set)
        if fixed:
            raise ConfigError(f"{where.at('environment', fixed[0])}: {', '.join(fixed)} are fixed for an "
                              "environment (each episode is a process of its own; max_episodes sets how many live "
                              "at once); remove it")
        path = cfg.source_path(environment)
        if not path.is_file() or path.suffix != ".py":
            raise ConfigError(f"{where.at('environment', 'source')}: environment {environment.name!r}: source "
                              f"{path} is not a .py file (relative to the config file's directory {cfg.base_dir})")
        class_stub_from_source(path, environment.function_name)  # its tools can be read (the same check as at start)


def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads the YAML file, applies overrides, validates. Raises ConfigError."""
    path = Path(path)
    data, where = read_yaml_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    return parse_train_config(apply_overrides(data, overrides), path.resolve().parent, where)
