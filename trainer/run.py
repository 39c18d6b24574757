"""``train()``: GRPO with LoRA on reward sandboxes, from one config file.

Order matters: the config, then the dataset's columns, then every reward's image and sandboxes (a broken reward
fails in seconds), and only then the model. Every sandbox is removed at the end, on Ctrl-C and on errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..api.session import RewardSandboxes
from ..backends import Backend
from ..errors import ConfigError
from ..images.image import default_cache_dir
from ..spec import Where

from .callbacks import RewardLog, RewardPlotCallback, RewardReloadCallback, RunRecordCallback
from .config import BUILTIN_TINY, BUILTIN_TINY_TOOLS, DatasetSection, ModelSection, TrainConfig, load_train_config

log = logging.getLogger("rewardbox")

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Defaults that differ from GRPOConfig's: log every step, and report to nothing unless asked.
GRPO_DEFAULTS = {"logging_steps": 1, "report_to": "none"}


@dataclass
class TrainResult:
    output_dir: Path
    log_history: list = field(default_factory=list)
    trainer: Any = None
    is_main_process: bool = True


def load_datasets(section: DatasetSection, base_dir: Path, where: Where = Where()):
    """The train (and optional eval) dataset with a ``prompt`` column; other columns are kept for rewards.

    Raises:
        ConfigError: missing file, or a named column the dataset lacks (with the columns it has).
    """
    from datasets import load_dataset

    local = Path(section.path) if Path(section.path).is_absolute() else base_dir / section.path
    eval_ds = None
    if local.suffix in _LOCAL_FORMATS:
        if not local.is_file():
            raise ConfigError(f"{where.at('dataset', 'path')}: dataset {section.path}: file {local} does not exist "
                              "(dataset.path is relative to the config file)")
        ds = load_dataset(_LOCAL_FORMATS[local.suffix], data_files=str(local), split="train")
    else:
        ds = load_dataset(section.path, section.name, split=section.split)
        if section.test_split:
            eval_ds = load_dataset(section.path, section.name, split=section.test_split)
    if section.limit:
        ds = ds.select(range(min(section.limit, len(ds))))

    def prepare(d):
        columns = d.column_names
        if section.question_column:
            if section.question_column not in columns:
                raise ConfigError(f"{where.at('dataset', 'question_column')}: dataset {section.path} has no column "
                                  f"{section.question_column!r} for dataset.question_column "
                                  f"(columns: {', '.join(columns)})")
            system = [{"role": "system", "content": section.system_prompt}] if section.system_prompt else []
            q = section.question_column
            return d.map(lambda row: {"prompt": [*system, {"role": "user", "content": str(row[q])}]})
        if section.prompt_column not in columns:
            raise ConfigError(f"{where.at('dataset', 'prompt_column')}: dataset {section.path} has no column "
                              f"{section.prompt_column!r} for dataset.prompt_column (columns: {', '.join(columns)}); "
                              "name the prompt column, or set dataset.question_column")
        if section.prompt_column != "prompt":
            d = d.remove_columns([c for c in ["prompt"] if c in columns]).rename_column(section.prompt_column, "prompt")
        return d

    ds = prepare(ds)
    if eval_ds is not None:
        eval_ds = prepare(eval_ds)
    elif section.test_size:
        split = ds.train_test_split(test_size=section.test_size, seed=0)
        ds, eval_ds = split["train"], split["test"]
    return ds, eval_ds


def load_model(section: ModelSection):
    """Model and tokenizer; ``builtin:tiny`` is built locally (offline) on first use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = section.name_or_path
    if path == BUILTIN_TINY:
        from .tiny import VERSION, build_tiny_model

        path = str(build_tiny_model(default_cache_dir() / f"builtin-tiny-v{VERSION}"))
    elif path == BUILTIN_TINY_TOOLS:
        from .tiny import TOOL_VERSION, build_tiny_tool_model

        path = str(build_tiny_tool_model(default_cache_dir() / f"builtin-tiny-tools-v{TOOL_VERSION}"))
    dtype = "auto" if section.dtype == "auto" else getattr(torch, section.dtype)
    kwargs = {"trust_remote_code": section.trust_remote_code, "revision": section.revision}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def grpo_args(cfg: TrainConfig):
    """GRPOConfig from the ``grpo`` section, with reward weights from the rewards.

    Raises:
        ConfigError: GRPOConfig rejects a value (its message, naming the section).
    """
    import torch
    from trl import GRPOConfig

    defaults = dict(GRPO_DEFAULTS)
    if not torch.cuda.is_available():
        defaults.update(use_cpu=True, bf16=False)  # GRPOConfig defaults to bf16, which needs a GPU
    try:
        return GRPOConfig(output_dir=str(cfg.output_dir), reward_weights=[r.weight for r in cfg.rewards],
                          **{**defaults, **cfg.grpo})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{cfg.where.at('grpo')}: grpo: {e}") from None


def train(
    config: TrainConfig | str | Path,
    overrides: Sequence[str] = (),
    callbacks: Sequence[Any] = (),
    backend: Optional[Backend] = None,
    in_process: bool = False,
) -> TrainResult:
    """Runs GRPO training as the config says and returns where it saved and what it logged.

    Args:
        config: a TrainConfig, or the path of the YAML file.
        overrides: ``["--grpo.max_steps", "5", ...]`` applied to the file (ignored for a TrainConfig).
        callbacks: extra transformers TrainerCallbacks.
        backend: a sandbox backend to use instead of ``sandbox.backend``.
        in_process: call the reward files in this process as plain TRL reward functions (no sandbox, no isolation;
            see :mod:`rewardbox.api.in_process`): for debugging, and to check that sandboxed training matches plain TRL.
    Raises:
        ConfigError, RewardLoadError, ImageBuildError, BackendError: before any model is loaded.
    """
    from accelerate import PartialState
    from peft import LoraConfig
    from trl import GRPOTrainer

    cfg = config if isinstance(config, TrainConfig) else load_train_config(config, overrides)
    output_dir = cfg.output_dir
    args = grpo_args(cfg)
    train_ds, eval_ds = load_datasets(cfg.dataset, cfg.base_dir, cfg.where)
    state = PartialState()
    output_dir.mkdir(parents=True, exist_ok=True)
    if in_process:
        return _train_in_process(cfg, args, train_ds, eval_ds, state, callbacks)
    sandboxes = RewardSandboxes(cfg, backend=backend)
    record = RunRecordCallback(sandboxes)
    tool_sandboxes: Optional[RewardSandboxes] = None
    environment = None
    try:
        # On each node the local rank 0 builds the images first; that node's other ranks then find them cached.
        # (Images live in each node's engine, so every node builds its own, once.) Ranks do not share containers.
        with state.local_main_process_first():
            sandboxes.start()
        # A parameter TRL will not pass, or a column that cannot reach a sandbox, fails here, before the model loads.
        columns = [c for c in train_ds.column_names if c not in ("prompt", "completion", "completion_ids")]
        sandboxes.check_columns(columns, {c: train_ds[0][c] for c in columns} if len(train_ds) else None,
                                source=f"dataset {cfg.dataset.path}")
        assert sandboxes.backend is not None  # started above
        log.info("rank %d of %d: %d reward sandbox(es) running on the %s backend", state.process_index,
                 state.num_processes, sum(len(r) for r in sandboxes.replicas.values()), sandboxes.backend.name)
        log_name = "reward_logs.jsonl" if state.is_main_process else f"reward_logs.rank{state.process_index}.jsonl"
        reward_log = RewardLog(output_dir / log_name)
        for reward in sandboxes.rewards:
            reward.listeners.append(reward_log.listener)

        tools: Optional[list] = None
        if cfg.tools:
            from ..api.tools import tools_from_config

            with state.local_main_process_first():
                tool_sandboxes, tools = tools_from_config(cfg, cfg.tools, backend=backend)
        environment_factory = None
        if cfg.environment is not None:
            from ..api.environments import environment_from_config

            with state.local_main_process_first():
                environment = environment_from_config(cfg, cfg.environment, backend=backend)
            environment_factory = environment.factory
        model, tokenizer = load_model(cfg.model)
        peft_config = LoraConfig(**{"task_type": "CAUSAL_LM", **cfg.lora}) if cfg.lora is not None else None
        names = [r.name for r in sandboxes.rewards]
        trainer = GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=list(sandboxes.rewards), args=args,
            train_dataset=train_ds, eval_dataset=eval_ds, peft_config=peft_config, tools=tools,
            environment_factory=environment_factory,
            callbacks=[record, RewardReloadCallback(sandboxes, reward_log, on_reload=record.new_version),
                       RewardPlotCallback(output_dir / "rewards.png", names), *callbacks],
        )
        record.record_environment_rewards(trainer, first=len(sandboxes.rewards))
        trainer.train()
        trainer.save_model(str(output_dir))
        if state.is_main_process:
            tokenizer.save_pretrained(str(output_dir))  # rewards.png was written by RewardPlotCallback.on_train_end
            if cfg.save_merged and peft_config is not None:
                merged = trainer.model.merge_and_unload()
                merged.save_pretrained(str(output_dir / "merged"))
                tokenizer.save_pretrained(str(output_dir / "merged"))
        return TrainResult(output_dir=output_dir, log_history=trainer.state.log_history, trainer=trainer,
                           is_main_process=state.is_main_process)
    finally:
        record.close()  # what was scored before an error stays in the record
        sandboxes.stop()
        if tool_sandboxes is not None:
            tool_sandboxes.stop()
        if environment is not None:
            environment.stop()


def _train_in_process(cfg: TrainConfig, args, train_ds, eval_ds, state, callbacks) -> TrainResult:
    from peft import LoraConfig
    from trl import GRPOTrainer

    from ..api.in_process import in_process_rewards, load_function

    log.warning("rewards run IN PROCESS: no sandbox, no isolation, no timeouts or fallbacks (--in-process)")
    reward_funcs = in_process_rewards(cfg)
    tools = [load_function(tool, cfg.source_path(tool)) for tool in cfg.tools] or None
    environment_factory = None if cfg.environment is None else \
        load_function(cfg.environment, cfg.source_path(cfg.environment))
    model, tokenizer = load_model(cfg.model)
    peft_config = LoraConfig(**{"task_type": "CAUSAL_LM", **cfg.lora}) if cfg.lora is not None else None
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward_funcs, args=args, train_dataset=train_ds,
        eval_dataset=eval_ds, peft_config=peft_config, tools=tools, environment_factory=environment_factory,
        callbacks=[RewardPlotCallback(cfg.output_dir / "rewards.png", [f.__name__ for f in reward_funcs]),
                   *callbacks],
    )
    trainer.train()
    trainer.save_model(str(cfg.output_dir))
    if state.is_main_process:
        tokenizer.save_pretrained(str(cfg.output_dir))
    return TrainResult(output_dir=cfg.output_dir, log_history=trainer.state.log_history, trainer=trainer,
                       is_main_process=state.is_main_process)
