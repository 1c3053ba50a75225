"""The training configuration: small typed sections (``schema``), read from recipes, Accelerate files and the command
line in one precedence order (``loading``), every problem reported at once (``validation``).

The bottom layer with ``shardtune.data``: it imports nothing of train/, memory/ or cli/.
"""

from __future__ import annotations

from shardtune.config.keys import parse_bool
from shardtune.config.loading import (build_config, load_run_config, load_train_config, raise_problems,
                                      read_accelerate_config, run_config_problems, save_resolved)
from shardtune.config.schema import (DATASET_PLACEHOLDER, DistributedConfig, LoraConfig, ModelConfig, OptimConfig,
                                     TrainConfig, known_keys)
from shardtune.config.validation import validate

__all__ = ["DATASET_PLACEHOLDER", "DistributedConfig", "LoraConfig", "ModelConfig", "OptimConfig", "TrainConfig",
           "build_config", "known_keys", "load_run_config", "load_train_config", "parse_bool", "raise_problems",
           "read_accelerate_config", "run_config_problems", "save_resolved", "validate"]
