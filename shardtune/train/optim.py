"""The optimizer and the learning-rate schedule, with Transformers' names and conventions so recipes keep their
meaning. Which optimizer each ``optim`` name is, and the state it keeps, is config/optimizers.py's table."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from shardtune.config import OptimConfig
from shardtune.config.optimizers import OPTIMIZERS, OptimizerSpec, non_cuda_alternative
from shardtune.errors import UsageError
from shardtune.train.optim_shards import LocalShardAdamW, LocalShardSteps


# Transformers' Trainer leaves undecayed the parameters whose name says bias or norm (layernorm, rmsnorm, a module
# called norm or ending in _norm) and those of nn.LayerNorm modules; every other trainable parameter decays, DoRA's
# 1-D magnitude vectors among them.
_NOT_DECAYED_NAMES = re.compile(r"bias|layernorm|rmsnorm|(^|\.)norm($|\.)|_norm($|\.)")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Transformers' Trainer's two groups: ``weight_decay`` for the trainable parameters it decays, 0 for biases
    and norm weights, told apart as it tells them (by name and by nn.LayerNorm module)."""
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            if not param.requires_grad or id(param) in seen:  # a tied weight: its first name decides
                continue
            seen.add(id(param))
            skipped = isinstance(module, nn.LayerNorm) or _NOT_DECAYED_NAMES.search(name.lower())
            (no_decay if skipped else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device, *,
                    sharded_scaler: bool = False, pure_bf16: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optim`` names (Transformers' names, config/optimizers.py) over the trainable parameters,
    with Transformers' arguments: learning_rate and weight_decay (matrices only) for all, the Adam betas and
    epsilon where the optimizer has them.

    ``sharded_scaler`` (FSDP with fp16): FSDP's ``ShardedGradScaler`` hands the optimizer a ``found_inf`` of shape
    [1], which fused AdamW cannot subtract from its 0-d step counts; the multi-tensor kernel takes it.

    ``pure_bf16`` (torch_dtype bfloat16; validation allows AdamW only): AdamW with stochastically rounded bf16
    updates (bf16_adamw.py), so that small steps are not rounded away."""
    spec = OPTIMIZERS[cfg.optim]
    groups = param_groups(model, cfg.weight_decay)
    if pure_bf16:
        from shardtune.train.bf16_adamw import BF16AdamW

        return BF16AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if spec.library == "bitsandbytes":
        if spec.paged and device.type != "cuda":  # bitsandbytes would page nothing and say so only in a warning
            raise UsageError(f"optim={cfg.optim} pages its state through CUDA unified memory and this run is on "
                             f"{device.type}; use optim {non_cuda_alternative(cfg.optim)} (the same, not paged)")
        return _bitsandbytes(spec, groups, cfg, model)
    if spec.kind == "adafactor":
        from transformers.optimization import Adafactor

        # Transformers' adafactor: the given learning rate, no relative step, no parameter scaling.
        return Adafactor(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False)
    if spec.kind == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate)
    fused = device.type == "cuda" and not sharded_scaler
    return LocalShardAdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                           eps=cfg.adam_epsilon, fused=fused or None, foreach=None if fused else True)


def _bitsandbytes(spec: OptimizerSpec, groups: list[dict], cfg: OptimConfig,
                  model: nn.Module) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW or Lion, 8 or 32-bit, paged or not; FSDP2's DTensor shards are stepped shard by shard
    (optim_shards.py), plain tensors as bitsandbytes always does. The 8-bit ones keep the embeddings' state in
    fp32, as Transformers' Trainer has them do (8-bit state of embedding rows is what bitsandbytes warns is
    unstable)."""
    import bitsandbytes as bnb

    base = {"adamw": bnb.optim.AdamW, "lion": bnb.optim.Lion}[spec.kind]
    if base not in _SHARD_CLASSES:
        _SHARD_CLASSES[base] = type(f"Sharded{base.__name__}", (LocalShardSteps, base), {})
    cls = _SHARD_CLASSES[base]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), optim_bits=spec.state_bits,
                  is_paged=spec.paged)
    if spec.kind == "adamw":
        kwargs["eps"] = cfg.adam_epsilon
    # bitsandbytes' AdamW defaults weight_decay to 1e-2: every group carries its own, so none is defaulted.
    optimizer = cls(groups, **kwargs)
    if spec.state_bits == 8:
        optimizer.fp32_state = frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))
    return optimizer


_SHARD_CLASSES: dict[type, type] = {}


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """``warmup_steps`` when set, else ``ceil(warmup_ratio * total_steps)`` (TrainingArguments' rule)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def schedule_past_the_end(cfg: OptimConfig, total_steps: int, run_length: str) -> list[str]:
    """What of the schedule lies past the run's end (a recipe's steps kept in a shorter run, such as a trial of a
    few steps), which Transformers' Trainer runs without a word: warmup_steps past the end never reach
    learning_rate; warmup_stable_decay's warm-up and decay (and stable steps, where given) past the end start the
    decay midway, at a fraction of the rate, or never. Warnings, not refusals: the run goes as Transformers runs
    it, and a trial of a recipe meant for a longer run is a thing people do."""
    notes = []
    if cfg.warmup_steps > total_steps:
        notes.append(f"warmup_steps={cfg.warmup_steps} is longer than the run's {total_steps} optimizer steps "
                     f"({run_length}): it ends before its rate reaches learning_rate {cfg.learning_rate:g}, as it "
                     f"would in Transformers; for more than a trial, set warmup_steps to at most {total_steps} or "
                     f"give warmup_ratio (a share of the run)")
    if cfg.lr_scheduler_type != "warmup_stable_decay":
        return notes
    warmup = "warmup_steps" if cfg.warmup_steps else f"warmup_ratio {cfg.warmup_ratio:g}'s"
    phases = {warmup: warmup_steps(cfg, total_steps), "num_stable_steps": cfg.num_stable_steps,
              "num_decay_steps": cfg.num_decay_steps}
    given = {name: steps for name, steps in phases.items() if steps}
    if sum(given.values()) > total_steps:
        said = " + ".join(f"{name} {steps}" for name, steps in given.items())
        said += f" = {sum(given.values())} steps" if len(given) > 1 else " steps"
        notes.append(f"lr_scheduler_type warmup_stable_decay: {said}, more than the run's {total_steps} optimizer "
                     f"steps ({run_length}): its decay starts midway, at a fraction of learning_rate, or never, as "
                     f"it would in Transformers; for more than a trial, make them fit in {total_steps} steps "
                     "(lr_scheduler_kwargs num_decay_steps, num_stable_steps; warmup_steps)")
    return notes


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, *,
                    greater_is_better: bool = False):
    """Linear warm-up, then ``lr_scheduler_type``'s schedule with the settings it reads, as Transformers'
    ``get_scheduler`` builds it from ``lr_scheduler_kwargs``; reduce_lr_on_plateau's cuts wait for a metric
    that ``greater_is_better`` says the direction of (``plateau_step``)."""
    from transformers import get_scheduler

    settings = schedule_settings(cfg)
    if is_plateau(cfg):
        settings["mode"] = "max" if greater_is_better else "min"
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                              num_training_steps=total_steps, scheduler_specific_kwargs=settings)
    if is_plateau(cfg):  # the rate its cuts start from, saved with it (a resume may change learning_rate)
        scheduler.base_lrs = [group["lr"] for group in optimizer.param_groups]
    return scheduler


# ReduceLROnPlateau's progress, which a resume takes from the checkpoint; its other fields are this run's settings.
PLATEAU_PROGRESS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch", "_last_lr", "base_lrs")


def load_schedule_state(scheduler, saved: dict, *, steps_done: int, same_metric: bool) -> None:
    """A checkpoint's schedule state into this run's ``scheduler``. Step schedules (every one but the plateau)
    take it as saved, or continue at ``steps_done`` after a plateau's. reduce_lr_on_plateau keeps this run's
    settings (plateau_* keys, min_lr, the metric's direction) and takes the checkpoint's progress (its best, its
    count, its cuts) where the checkpoint's was one watching the same metric (``same_metric``); else it starts
    afresh from learning_rate."""
    saved_plateau = "num_bad_epochs" in saved
    if not moves_on_evaluations(scheduler):
        if saved_plateau:
            scheduler.last_epoch = steps_done
        else:
            scheduler.load_state_dict(saved)
    elif saved_plateau and same_metric:
        for name in PLATEAU_PROGRESS:
            if name in saved:
                setattr(scheduler, name, saved[name])


def is_plateau(cfg: OptimConfig) -> bool:
    """Whether the rate moves on evaluations (``plateau_step``) rather than after every optimizer step."""
    return cfg.lr_scheduler_type == "reduce_lr_on_plateau"


def moves_on_evaluations(scheduler) -> bool:
    """Whether ``scheduler`` is reduce_lr_on_plateau's, which evaluations step (``plateau_step``), not the
    optimizer's steps."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def plateau_step(scheduler, metric: float) -> None:
    """reduce_lr_on_plateau: one evaluation's ``metric`` seen, the rate cut where it has stopped improving (as
    Transformers' Trainer steps it after each evaluation); no other schedule moves here."""
    if moves_on_evaluations(scheduler):
        scheduler.step(metric)


def schedule_settings(cfg: OptimConfig) -> dict[str, float | str]:
    """The settings ``cfg``'s schedule reads (validation refuses them under any other); one left unset takes
    the schedule's default in Transformers (num_cycles 0.5 or 1, timescale: the warm-up steps or 10000,
    num_stable_steps: the steps the warm-up and decay leave; torch's min_lr 0)."""
    read = {"cosine": {"num_cycles": cfg.num_cycles},
            "cosine_with_min_lr": {"min_lr_rate": cfg.min_lr_rate, "min_lr": cfg.min_lr, "num_cycles": cfg.num_cycles},
            "cosine_warmup_with_min_lr": {"min_lr_rate": cfg.min_lr_rate, "min_lr": cfg.min_lr,
                                          "num_cycles": cfg.num_cycles, "warmup_lr_rate": cfg.warmup_lr_rate},
            "reduce_lr_on_plateau": {"factor": cfg.plateau_factor, "patience": cfg.plateau_patience,
                                     "threshold": cfg.plateau_threshold, "threshold_mode": cfg.plateau_threshold_mode,
                                     "cooldown": cfg.plateau_cooldown, "min_lr": cfg.min_lr or 0.0,
                                     "eps": cfg.plateau_eps},
            "cosine_with_restarts": {"num_cycles": cfg.num_cycles},
            "polynomial": {"lr_end": cfg.lr_end, "power": cfg.power},
            "inverse_sqrt": {"timescale": cfg.timescale},
            "warmup_stable_decay": {"num_decay_steps": cfg.num_decay_steps, "num_stable_steps": cfg.num_stable_steps,
                                    "warmup_type": cfg.warmup_type, "decay_type": cfg.decay_type,
                                    "min_lr_ratio": cfg.min_lr_ratio, "num_cycles": cfg.num_cycles}
            }.get(cfg.lr_scheduler_type, {})
    return {name: value for name, value in read.items() if value is not None}
