"""rewardbox host runtime: reward sandboxes for GRPO training.

    from runtime import load_config, RewardSandboxes
    with RewardSandboxes(load_config("rewards.yaml")) as sandboxes:
        GRPOTrainer(..., reward_funcs=sandboxes.rewards).train()
"""

from .client import Replica, RewardClient, ScoreReport
from .errors import BackendError, ConfigError, ImageBuildError, RewardboxError, RewardLoadError
from .reward import SandboxedReward
from .samples import build_samples, samples_from_rows
from .session import RewardSandboxes
from .spec import RewardboxConfig, RewardSpec, SandboxSettings, load_config, parse_config

__all__ = [
    "BackendError",
    "ConfigError",
    "ImageBuildError",
    "Replica",
    "RewardClient",
    "RewardLoadError",
    "RewardSandboxes",
    "RewardSpec",
    "RewardboxConfig",
    "RewardboxError",
    "SandboxSettings",
    "SandboxedReward",
    "ScoreReport",
    "build_samples",
    "load_config",
    "parse_config",
    "samples_from_rows",
]
