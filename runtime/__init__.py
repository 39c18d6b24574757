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

Subpackages: ``rewardbox.api`` (what a training script calls), ``rewardbox.scoring`` (the client, replicas and
transport), ``rewardbox.backends`` (where sandboxes run; :func:`register_backend` adds one), ``rewardbox.images``
(sandbox images), ``rewardbox.serve`` (``rewardbox serve``), ``rewardbox.deploy`` (Kubernetes, AppArmor),
``rewardbox.report`` (the run record and its report), ``rewardbox.bench``, ``rewardbox.integrations`` (verl),
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
    "Endpoint": ".scoring.transport",
    "GrpcTransport": ".scoring.transport",
    "Transport": ".scoring.transport",
    "Replica": ".scoring.replica",
    "RewardClient": ".scoring.client",
    "ScoreReport": ".scoring.client",
    "SandboxedReward": ".api.reward",
    "in_process_rewards": ".api.in_process",
    "build_samples": ".scoring.samples",
    "samples_from_rows": ".scoring.samples",
    "RewardSandboxes": ".api.session",
    "sandboxed": ".api.dropin",
    "configure": ".api.dropin",
    "sandboxed_tools": ".api.tools",
    "ToolError": ".api.tools",
    "sandboxed_environment": ".api.environments",
    "end_episode": ".api.environments",
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
    from .scoring.client import RewardClient, ScoreReport  # noqa: F401
    from .api.in_process import in_process_rewards  # noqa: F401
    from .errors import (BackendError, ConfigError, ImageBuildError, RewardboxError, RewardLoadError,  # noqa: F401
                         TransportError)
    from .scoring.replica import Replica  # noqa: F401
    from .api.reward import SandboxedReward  # noqa: F401
    from .scoring.samples import build_samples, samples_from_rows  # noqa: F401
    from .api.dropin import configure, sandboxed  # noqa: F401
    from .api.tools import ToolError, sandboxed_tools  # noqa: F401
    from .api.environments import end_episode, sandboxed_environment  # noqa: F401
    from .api.session import RewardSandboxes  # noqa: F401
    from .spec import RewardboxConfig, RewardSpec, SandboxSettings, load_config, parse_config  # noqa: F401
    from .trainer import TrainConfig, load_train_config, train  # noqa: F401
    from .scoring.transport import Endpoint, GrpcTransport, Transport  # noqa: F401
    from .wire import Status, TrainerState  # noqa: F401
