"""``rewardbox.trainer``: GRPO training on reward sandboxes, ``train("config.yaml")`` or ``rewardbox train
config.yaml``. Needs the ``train`` extra (torch, transformers, trl, peft, datasets, accelerate)."""

from .config import TrainConfig, load_train_config, parse_train_config
from .run import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "load_train_config", "parse_train_config", "train"]
