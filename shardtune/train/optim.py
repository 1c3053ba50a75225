"""AdamW and the learning-rate schedule, with Transformers' conventions so recipes keep their meaning."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtune.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) are not decayed, as in Transformers' Trainer."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device, *,
                    sharded_scaler: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; the fused kernel on CUDA, the multi-tensor one elsewhere.

    ``sharded_scaler`` (FSDP with fp16): FSDP's ``ShardedGradScaler`` hands the optimizer a ``found_inf`` of shape
    [1], which fused AdamW cannot subtract from its 0-d step counts; the multi-tensor kernel takes it."""
    fused = device.type == "cuda" and not sharded_scaler
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             fused=fused or None, foreach=None if fused else True)


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """``warmup_steps`` when set, else ``ceil(warmup_ratio * total_steps)`` (TrainingArguments' rule)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warmup, then linear / cosine decay to zero, or constant (Transformers' ``get_scheduler``)."""
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                         num_training_steps=total_steps)
