"""The validated config: one YAML file holds the sandbox settings and the rewards (and, for training, the model,
dataset, GRPO and LoRA sections, typed in :mod:`rewardbox.trainer.config`)."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .registry import AUTO, backend_names, backend_type
from .wire import DEFAULT_CONCURRENCY, DEFAULT_MAX_LOG_BYTES, DEFAULT_WORKERS

_NAME = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
_BYTE_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}  # Docker's: powers of 1024


MEMORY_PATTERN = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")  # what Docker's --memory takes


def memory_bytes(memory: str) -> int:
    """A ``memory`` setting (as the field's pattern allows) in bytes, as Docker reads it (no unit: bytes)."""
    unit = memory[-1].lower()
    if unit in _BYTE_UNITS:
        return int(float(memory[:-1]) * _BYTE_UNITS[unit])
    return int(float(memory))
# A Debian package name (policy 5.6.1), optionally pinned to a version (5.6.12) as `apt-get install` takes it.
_DEB = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?$")


def is_local_package(package: str) -> bool:
    """A `packages` entry that is a folder (or wheel file) on the host rather than a requirement string."""
    return package.startswith((".", "/", "~"))


def is_debian_package(entry: str) -> bool:
    """A `system_packages` entry: a Debian package name, optionally ``=VERSION``."""
    return bool(_DEB.match(entry))


class _Yaml12BoolLoader(yaml.SafeLoader):
    """SafeLoader where only true/false are booleans (YAML 1.2): `save_strategy: no` stays the string 'no'."""


_Yaml12BoolLoader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12BoolLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# YAML 1.1 needs a dot in a float; `learning_rate: 5e-6` must not become a string.
_Yaml12BoolLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def yaml_load(text: str):
    """Parses YAML text as YAML 1.2 reads it: yes/no/on/off are strings (TRL users write `save_strategy: no`),
    and 5e-6 is a float."""
    return yaml.load(text, Loader=_Yaml12BoolLoader)


@dataclass(frozen=True)
class Where:
    """A place in the config file for error messages: ``file:line`` when the line of a key path is known."""

    file: str = "config"
    lines: Mapping[tuple, int] = field(default_factory=dict)
    prefix: tuple = ()

    def at(self, *path: Any) -> str:
        """``file:line`` of the key path (or of its closest enclosing key), else ``file``."""
        full = self.prefix + tuple(path)
        while full and full not in self.lines:
            full = full[:-1]
        line = self.lines.get(full)
        return f"{self.file}:{line}" if line else self.file

    def section(self, *path: Any) -> "Where":
        return replace(self, prefix=self.prefix + tuple(path))


def _key_lines(node: Any, path: tuple = (), out: Optional[dict] = None) -> dict:
    """Line numbers (1-based) of every key and list item in a composed YAML node tree, by key path."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            out[path + (key.value,)] = key.start_mark.line + 1
            _key_lines(value, path + (key.value,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            out[path + (i,)] = value.start_mark.line + 1
            _key_lines(value, path + (i,), out)
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RewardSpec(_Strict):
    """One reward function and how to run it."""

    name: str = Field(pattern=_NAME, description="unique; becomes the TRL reward name and metric prefix")
    source: Path = Field(description="Python file, relative to the config file")
    function: Optional[str] = Field(default=None, description="attribute to call; default: name")
    args: Optional[dict[str, Any]] = Field(
        default=None, description="a factory's keyword arguments: function(**args) is called once when the sandbox "
        "loads the file, and what it returns is the reward (as TRL's get_soft_overlong_punishment(...) or "
        "open-r1's get_cosine_scaled_reward(...)); JSON values only")
    style: Literal["sample", "batch", "tool", "environment"] = Field(
        default="sample", description="sample: fn(prompt, completion, example); batch: TRL's fn(prompts, "
        "completions, **columns); tool: a TRL tool, fn(**arguments); environment: a TRL environment's factory "
        "(rewardbox.sandboxed_tools and sandboxed_environment make these two)")
    isolation: Literal["sample", "process", "worker"] = Field(
        default="sample", description="sample: every sample (batch style: every call) runs in a process of its "
        "own, forked from the module's state after import, so nothing one sample does reaches another; process: "
        "the same, in a freshly prepared process per sample (slower); worker: processes reused across samples, "
        "which keep whatever state the reward leaves (only for rewards you vouch keep none that matters)")
    packages: list[str] = Field(default_factory=list, description="pip requirement strings, or local folders/wheels")
    system_packages: list[str] = Field(default_factory=list, description="Debian packages installed in this "
                                       "reward's image, e.g. [g++, nodejs]")
    timeout_s: PositiveFloat = Field(default=5.0, description="per sample (sample style) or per call (batch)")
    retries: int = Field(default=3, ge=0, description="retries of transient sandbox failures")
    default_score: Optional[float] = Field(default=0.0, description="fallback score; null gives None")
    weight: float = 1.0
    network: bool = False
    secrets: list[str] = Field(default_factory=list, description="host environment variables passed to this reward")
    env: dict[str, str] = Field(default_factory=dict, description="plain environment variables for this reward")
    replicas: PositiveInt = 1
    workers: PositiveInt = DEFAULT_WORKERS
    concurrency: PositiveInt = Field(default=DEFAULT_CONCURRENCY,
                                     description="async functions: samples in flight per worker")
    warm: Optional[PositiveInt] = Field(
        default=None, le=512, description="isolation: sample: processes kept forked and ready for the next samples "
        "(default 32; 8 under gVisor, where each costs about 12 MiB)")
    memory: str = Field(default="1g", pattern=MEMORY_PATTERN.pattern)
    cpus: PositiveFloat = 1.0
    pids: PositiveInt = 256
    max_log_bytes: PositiveInt = DEFAULT_MAX_LOG_BYTES
    max_in_flight: Optional[PositiveInt] = Field(
        default=None, description="samples of this reward that may run at once on a shared service (`rewardbox "
        "serve`), for all its clients together (e.g. an LLM judge's rate limit); more wait, with backoff")

    @property
    def memory_bytes(self) -> int:
        """``memory`` in bytes, as Docker reads it (no unit: bytes). What ``docker.utils.parse_bytes`` does for the
        pattern the field allows, without it: the client reads this for every backend, and importing docker costs
        about 80 ms where no Docker backend is used."""
        return memory_bytes(self.memory)

    @field_validator("args")
    @classmethod
    def _args_json(cls, args: Optional[dict]) -> Optional[dict]:
        if args is not None:
            try:
                json.dumps(args, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"args must hold JSON values only (strings, numbers, lists, mappings): {e}") from None
        return args

    @field_validator("packages")
    @classmethod
    def _requirements_parse(cls, packages: list[str]) -> list[str]:
        for p in packages:
            if is_local_package(p):  # resolved against the config file's folder in parse_config
                continue
            try:
                Requirement(p)
            except InvalidRequirement as e:
                raise ValueError(f"package {p!r} is not a valid pip requirement: {e}") from None
        return packages

    @field_validator("system_packages")
    @classmethod
    def _debian_names(cls, packages: list[str], info: ValidationInfo) -> list[str]:
        for j, p in enumerate(packages):
            if not is_debian_package(p):
                who = f"reward {info.data['name']!r}: " if "name" in info.data else ""
                raise ValueError(f"{who}system_packages[{j}] {p!r} is not a Debian package name: lower-case letters, "
                                 "digits and + - . (at least two), optionally =VERSION, e.g. g++, nodejs or "
                                 "jq=1.6-2.1+deb12u2")
        return packages

    @property
    def function_name(self) -> str:
        return self.function or self.name


class SandboxSettings(_Strict):
    """Where sandboxes run and how the host talks to them.

    ``backend`` names a registered backend (or ``auto``: docker when an engine answers, else an error); each
    registered backend has a settings section of its own under its name (``sandbox.docker:``, ...), typed by the
    backend. Validated through :func:`sandbox_settings_model`, which adds those sections.
    """

    backend: str = Field(default=AUTO, description="auto | a registered backend: docker, local, ...")
    start_timeout_s: PositiveFloat = 60.0
    rpc_grace_s: PositiveFloat = Field(default=10.0, description="added to each Score deadline")
    backoff_initial_s: PositiveFloat = 0.2
    backoff_max_s: PositiveFloat = 5.0

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        names = backend_names()
        if name != AUTO and name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"no backend named {name!r}{hint} (registered: {AUTO}, {', '.join(names)})")
        return name

    def backend_settings(self, name: str) -> BaseModel:
        """The typed settings section of backend ``name``: as configured, else its defaults."""
        section = getattr(self, name, None)
        return section if section is not None else backend_type(name).settings_type()


@lru_cache(maxsize=None)
def _sandbox_model(names: tuple[str, ...]) -> type[SandboxSettings]:
    sections: dict[str, Any] = {name: (Optional[backend_type(name).settings_type], None) for name in names}
    return create_model("SandboxSettings", __base__=SandboxSettings, __module__=__name__, **sections)


def sandbox_settings_model() -> type[SandboxSettings]:
    """SandboxSettings with one optional section per registered backend (rebuilt when the registry grows)."""
    return _sandbox_model(tuple(backend_names()))


class RewardboxConfig(_Strict):
    """The whole config file. The training sections are typed by rewardbox.trainer (its TrainConfig subclasses
    this); here they are accepted as they are, so that ``rewardbox score`` and ``build`` read a training config."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)

    sandbox: SandboxSettings = Field(default_factory=lambda: sandbox_settings_model()())
    rewards: list[RewardSpec] = Field(min_length=1)
    model: Optional[Any] = Field(default=None, description="training: the model to train")
    dataset: Optional[Any] = Field(default=None, description="training: the dataset")
    grpo: Optional[Any] = Field(default=None, description="training: trl.GRPOConfig fields")
    lora: Optional[Any] = Field(default=None, description="training: peft.LoraConfig fields")
    output_dir: Optional[Any] = Field(default=None, description="training: where to save")
    save_merged: bool = Field(default=False, description="training: also save the LoRA-merged model")
    tools: Optional[Any] = Field(default=None, description="training: TRL tools, each call run in a sandbox")
    environment: Optional[Any] = Field(default=None, description="training: a TRL environment, each episode in a "
                                       "sandbox")
    base_dir: Path = Field(default=Path("."), exclude=True, description="directory sources are relative to")
    where: Where = Field(default_factory=Where, exclude=True, description="the file and key lines, for errors")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _with_backend_sections(cls, value: Any) -> Any:
        # Nested errors keep their full location (sandbox.docker.base_image) because the sections are fields.
        return sandbox_settings_model().model_validate(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _unique_names(self) -> "RewardboxConfig":
        seen: set[str] = set()
        for r in self.rewards:
            if r.name in seen:
                raise ValueError(f"reward name {r.name!r} is used twice; names must be unique")
            seen.add(r.name)
        return self

    def source_path(self, reward: RewardSpec) -> Path:
        return reward.source if reward.source.is_absolute() else (self.base_dir / reward.source).resolve()


def _location(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_validation_error(err: ValidationError, where: Where) -> str:
    """One line per problem, each naming the file, line, key path and the fix."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = _location(where.prefix + loc)
        if e["type"] == "extra_forbidden":
            lines.append(f"{where.at(*loc)}: unknown key {key!r}; {_unknown_key_hint(where.prefix + loc)}")
        elif e["type"] == "missing":
            lines.append(f"{where.at(*loc)}: missing required key {key!r}")
        else:
            lines.append(f"{where.at(*loc)}: {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _unknown_key_hint(loc: tuple) -> str:
    """The fix for an unknown key: where a backend's setting belongs, or the closest valid spelling."""
    if len(loc) == 2 and loc[0] == "sandbox":
        owners = [name for name in backend_names() if loc[1] in backend_type(name).settings_type.model_fields]
        if owners:
            return (f"it is a setting of the {owners[0]} backend: write it as sandbox.{owners[0]}.{loc[1]} "
                    f"(sandbox: {{{owners[0]}: {{{loc[1]}: ...}}}})")
    return "check its spelling (see README 'Config')"


def parse_config(data: Any, base_dir: Path, where: Where = Where(),
                 config_type: type[RewardboxConfig] = RewardboxConfig) -> RewardboxConfig:
    """Validates a config mapping and checks every reward's source file exists.

    Raises:
        ConfigError: naming the file, line and key, or the reward and the file that is missing.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where.file}: expected a mapping with `sandbox:` and `rewards:`, got {type(data).__name__}")
    try:
        config = config_type.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None
    config.where = where
    _paths_from(config.sandbox, base_dir)
    for i, r in enumerate(config.rewards):
        path = config.source_path(r)
        if not path.is_file():
            raise ConfigError(f"{where.at('rewards', i, 'source')}: reward {r.name!r}: source file {path} does not "
                              f"exist (rewards[].source is relative to the config file's directory {base_dir})")
        if path.suffix != ".py":
            raise ConfigError(f"{where.at('rewards', i, 'source')}: reward {r.name!r}: source {path} is not a .py file")
        resolved = []
        for j, package in enumerate(r.packages):
            if is_local_package(package):
                local = Path(package).expanduser()
                local = local if local.is_absolute() else (base_dir / local).resolve()
                if not local.exists():
                    raise ConfigError(f"{where.at('rewards', i, 'packages', j)}: reward {r.name!r}: local package "
                                      f"{local} does not exist (a path in `packages` is relative to the config file)")
                package = str(local)
            resolved.append(package)
        r.packages = resolved
    return config


def _paths_from(sandbox: "SandboxSettings", base_dir: Path) -> None:
    """Every path of every backend's settings section (``sandbox.remote.tls_ca``, ``sandbox.docker.cache_dir``,
    a registered backend's own) relative to the config file's directory, as reward sources are, not to the
    directory the command runs in. ``~`` is the user's home."""
    for name in type(sandbox).model_fields:
        section = getattr(sandbox, name, None)
        if not isinstance(section, BaseModel):
            continue
        for key in type(section).model_fields:
            value = getattr(section, key)
            if isinstance(value, Path):
                value = value.expanduser()
                setattr(section, key, value if value.is_absolute() else (base_dir / value).resolve())


def read_yaml_file(path: Path) -> tuple[Any, Where]:
    """The parsed content of a config file and where each key is in it.

    Raises:
        ConfigError: the file is missing or not YAML.
    """
    try:
        text = path.read_text()
        return yaml_load(text), Where(str(path), _key_lines(yaml.compose(text, Loader=_Yaml12BoolLoader)))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load_config(path: str | Path) -> RewardboxConfig:
    """Reads and validates a YAML config file.

    Raises:
        ConfigError: the file is missing, not YAML, or fails validation.
    """
    path = Path(path)
    data, where = read_yaml_file(path)
    return parse_config(data, path.resolve().parent, where)
