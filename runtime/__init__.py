"""rewardbox: reward functions for GRPO training, run in sandboxes over gRPC.

    from rewardbox import RewardSandboxes, load_config
    with RewardSandboxes(load_config("rewards.yaml")) as sandboxes:
        GRPOTrainer(..., reward_funcs=sandboxes.rewards).train()

    from rewardbox import train
    train("config.yaml")            # the whole GRPO run from one file (needs the `train` extra)

    import rewardbox                # a script's own reward functions, each in a sandbox
    with rewardbox.sandboxed([accuracy_reward, my_reward], packages=["math-verify"]) as reward_funcs:
        GRPOTrainer(..., reward_funcs=reward_funcs).train()

    with rewardbox.sandboxed_tools([run_python]) as tools:   # a TRL script's tools, each call in a sandbox
        GRPOTrainer(..., tools=tools).train()

Subpackages: ``rewardbox.backends`` (where sandboxes run; :func:`register_backend` adds one),
``rewardbox.trainer`` (GRPO entry point), ``rewardbox.wire`` (what host and sandbox share) and
``rewardbox.sandbox`` (the sandbox server, which the host never imports).

The names below are imported on first use, so that importing a subpackage (the sandbox server does) loads none of
the host's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .wire import VERSION as __version__

_EXPORTS = {
    "BackendError": ".errors",
    "ConfigError": ".errors",
    "ImageBuildError": ".errors",
    "RewardLoadError": ".errors",
    "RewardboxError": ".errors",
    "TransportError": ".errors",
    "Backend": ".backends",
    "Sandbox": ".backends",
    "register_backend": ".backends",
    "Endpoint": ".transport",
    "GrpcTransport": ".transport",
    "Transport": ".transport",
    "Replica": ".replica",
    "RewardClient": ".client",
    "ScoreReport": ".client",
    "SandboxedReward": ".reward",
    "in_process_rewards": ".in_process",
    "build_samples": ".samples",
    "samples_from_rows": ".samples",
    "RewardSandboxes": ".session",
    "sandboxed": ".dropin",
    "configure": ".dropin",
    "sandboxed_tools": ".tools",
    "ToolError": ".tools",
    "sandboxed_environment": ".environments",
    "RewardSpec": ".spec",
    "RewardboxConfig": ".spec",
    "SandboxSettings": ".spec",
    "load_config": ".spec",
    "parse_config": ".spec",
    "Status": ".wire",
    "TrainerState": ".wire",
    "train": ".trainer",
    "TrainConfig": ".trainer",
    "load_train_config": ".trainer",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rewardbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers and IDEs see (re-exports, listed in __all__)
    from .backends import Backend, Sandbox, register_backend  # noqa: F401
    from .client import RewardClient, ScoreReport  # noqa: F401
    from .in_process import in_process_rewards  # noqa: F401
    from .errors import (BackendError, ConfigError, ImageBuildError, RewardboxError, RewardLoadError,  # noqa: F401
                         TransportError)
    from .replica import Replica  # noqa: F401
    from .reward import SandboxedReward  # noqa: F401
    from .samples import build_samples, samples_from_rows  # noqa: F401
    from .dropin import configure, sandboxed  # noqa: F401
    from .tools import ToolError, sandboxed_tools  # noqa: F401
    from .environments import sandboxed_environment  # noqa: F401
    from .session import RewardSandboxes  # noqa: F401
    from .spec import RewardboxConfig, RewardSpec, SandboxSettings, load_config, parse_config  # noqa: F401
    from .trainer import TrainConfig, load_train_config, train  # noqa: F401
    from .transport import Endpoint, GrpcTransport, Transport  # noqa: F401
    from .wire import Status, TrainerState  # noqa: F401
