"""The training configuration: small typed sections (``schema``), read from recipes, Accelerate files and the command
line in one precedence order (``loading``), every problem reported at once (``validation``).

The bottom layer with ``shardtune.data``: it imports nothing of train/, memory/ or cli/.
"""

from __future__ import annotations

from shardtune.config.loading import (Layers, Origin, build_config, load_run_config, load_train_config,
                                      parse_bool, parse_cli_pairs, raise_problems, read_accelerate_config,
                                      read_yaml_recipe, run_config_problems, save_resolved)
from shardtune.config.schema import (ACCEPTED_OPTIMS, DATASET_PLACEHOLDER, DISTRIBUTED_TYPES,
                                     FSDP_VERSIONS, HUB_STRATEGIES, LOG_LEVELS, MIXED_PRECISIONS,
                                     PIPELINE_SCHEDULES, SCHEDULERS, SECRET_KEYS, SHARDING_STRATEGIES,
                                     STATE_DICT_TYPES, STRATEGIES_STEPS, WRAP_POLICIES, CheckpointConfig,
                                     DistributedConfig, LoraConfig, ModelConfig, OptimConfig, RunConfig,
                                     TrainConfig, known_keys)
from shardtune.config.validation import input_problems, validate

__all__ = ["ACCEPTED_OPTIMS", "DATASET_PLACEHOLDER", "DISTRIBUTED_TYPES", "FSDP_VERSIONS",
           "HUB_STRATEGIES", "LOG_LEVELS", "MIXED_PRECISIONS", "PIPELINE_SCHEDULES", "SCHEDULERS",
           "SECRET_KEYS", "SHARDING_STRATEGIES", "STATE_DICT_TYPES", "STRATEGIES_STEPS", "WRAP_POLICIES",
           "CheckpointConfig", "DistributedConfig", "Layers", "LoraConfig", "ModelConfig", "OptimConfig", "Origin",
           "RunConfig", "TrainConfig", "build_config", "input_problems", "known_keys", "load_run_config",
           "load_train_config", "parse_bool", "parse_cli_pairs", "raise_problems", "read_accelerate_config",
           "read_yaml_recipe", "run_config_problems", "save_resolved", "validate"]
