"""Everything a run needs, made in order: the data, the plan, the model and its runner, the optimizer.

Data first: tokenisation may take long, and it happens before any collective with a timeout.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardtune.config import TrainConfig
from shardtune.config.schema import EVALUATES
from shardtune.config.validation import SWITCHES
from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.gguf_source import parsed_once
from shardtune.strategies import no_as_ddp, resolve
from shardtune.train.build import build_model, plan_for
from shardtune.train.model import Precision, attn_implementation
from shardtune.train.model_parallel import check_processes, place_stages
from shardtune.train.optim import build_optimizer, build_scheduler, schedule_past_the_end
from shardtune.train.parallelize import Runner
from shardtune.train.plan import Plan
from shardtune.train.state import TrainState
from shardtune.train.step import StepContext

log = logging.getLogger("shardtune")


@dataclass
class Job:
    """What ``train`` works with, built once by ``make_job``."""

    cfg: TrainConfig
    info: DistInfo  # under MP: on the first stage's device, where batches and the loss live
    plan: Plan
    tokenizer: Any
    data: Any  # data.PreparedData: train, eval, report
    collator: Any
    model: nn.Module
    runner: Runner
    optimizer: torch.optim.Optimizer
    state: TrainState
    step: StepContext
    trainable_parameters: int
    parameters: int


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    if cfg.run.max_steps > 0:
        return cfg.run.max_steps
    return max(1, math.ceil(cfg.run.num_train_epochs * steps_per_epoch))


def run_length(cfg: TrainConfig, steps_per_epoch: int) -> str:
    """How the run's length was given, for messages: max_steps, or the epochs and their steps."""
    if cfg.run.max_steps > 0:
        return f"max_steps {cfg.run.max_steps}"
    return f"num_train_epochs {cfg.run.num_train_epochs:g} of {steps_per_epoch} steps each"


def batch_note(cfg: TrainConfig, sampler, steps: int, processes: int) -> str:
    """The global batch and the steps it makes, as Transformers' Trainer states its total train batch size: the
    losses, the steps per epoch and the schedule follow from it, so a run on more processes with the same
    per-device batch and accumulation trains other steps, and a user comparing the two needs to see why.
    ``processes``: the job's; pipeline stages read the same rows, so they count as one."""
    world = sampler.world_size
    ranks = f"{world} process{'' if world == 1 else 'es'}" if world == processes else \
        f"{world} (the {processes} processes are pipeline stages of the same rows)"
    note = (f"batch: global batch of {sampler.global_batch_size} rows per optimizer step (per_device_train_batch_size "
            f"{sampler.micro_batch_size} x gradient_accumulation_steps {sampler.gradient_accumulation_steps} x "
            f"{ranks}), {sampler.steps_per_epoch} steps "
            f"per epoch, {steps} in all ({run_length(cfg, sampler.steps_per_epoch)})")
    if left := sampler.num_rows % sampler.global_batch_size:
        # Every step is one whole global batch (the loss is normalised over it); Transformers' Trainer instead
        # trains a smaller last batch.
        note += (f"; {left} of the {sampler.num_rows} training rows are left out of each epoch: the last global "
                 f"batch would be incomplete (which rows, the epoch's order decides)")
    return note


def no_eval_split(cfg: TrainConfig, left_out: list[str] | None = None, dropped: int = 0) -> str:
    """eval_strategy or eval_on_start asks for evaluations and the data has no eval rows: refused (as Transformers'
    Trainer refuses an eval_strategy without an eval_dataset) rather than a run that never evaluates what the user
    asked for."""
    d, r = cfg.data, cfg.run
    named = ", ".join(d.eval_split_names())
    where = (f"split(s) {named} held {dropped} row(s), none with a target token: no assistant reply or completion, "
             f"or truncated away by max_seq_len {d.max_seq_len}" if dropped else
             f"no rows in split(s) {named}" if named else f"splits {d.splits} names none besides train")
    asked = f"eval_strategy {r.eval_strategy}" if r.eval_strategy != "no" else "eval_on_start true"
    off = " and ".join(setting for setting, on in (("eval_strategy no", r.eval_strategy != "no"),
                                                    ("eval_on_start false", r.eval_on_start)) if on)
    files = f" ({'; '.join(left_out)})" if left_out else ""
    return (f"{asked} evaluates on the eval split, and dataset_name '{d.dataset_name}' has no eval rows ({where})"
            f"{files}; add an eval split (e.g. test.jsonl beside train.jsonl), hold rows out of train with "
            f"eval_split_ratio 0.05, or set {off}")


@parsed_once()  # a GGUF's metadata, read by the tokenizer and the model alike
def make_job(cfg: TrainConfig, info: DistInfo, stage_bounds: tuple[tuple[int, int], ...] | None = None) -> Job:
    """Tokenise the data, resolve the plan, build and parallelize the model, make the optimizer and schedule."""
    from shardtune.data import Collator, GlobalBatchSampler, load_tokenizer, prepare_datasets
    from shardtune.data.templates import added_token_ids, special_tokens_written
    from shardtune.train.best import best_for

    check_processes(resolve(cfg.distributed.distributed_type, info.world_size > 1), info)
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data, trust_remote_code=cfg.model.trust_remote_code)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.run.seed)
    if SWITCHES[EVALUATES](cfg) and not (data.eval is not None and len(data.eval)):
        ev = data.report.eval
        raise UsageError(no_eval_split(cfg, [note for note in data.report.notes if " left out: " in note],
                                       ev.empty_rows_dropped + ev.bad_rows_skipped if ev is not None else 0))
    if info.is_main:
        log.info("data: %s", data.report.format())
        log.info(data.cache_note())
    precision = Precision(cfg.mixed_precision, pure_bf16=cfg.model.pure_bf16)
    plan, info = place_stages(plan_for(cfg, info, precision), cfg, info, stage_bounds)
    # Pipeline stages exchange fixed-shape activations: every batch is padded to max_seq_len there. The collator
    # writes the attention mask in the form the model's attention reads (eager adds it to the scores).
    collator = Collator(tokenizer.pad_token_id, pad_to_multiple_of=None if plan.shards_batch else cfg.data.max_seq_len,
                        attn_implementation=attn_implementation(cfg.model, info.device, precision.compute_dtype))
    if (note := no_as_ddp(cfg.distributed.distributed_type, info.world_size, "trained")) and info.is_main:
        log.info(note)
    log.info("strategy: %s, %s", plan.describe(info), precision.describe())
    world, rank = plan.data_split(info)
    lengths = [sum(lens) for lens in data.train["seq_lens"]] if cfg.data.group_by_length else None
    sampler = GlobalBatchSampler(len(data.train), micro_batch_size=cfg.run.per_device_train_batch_size,
                                 gradient_accumulation_steps=cfg.run.gradient_accumulation_steps,
                                 world_size=world, rank=rank, seed=cfg.run.seed, lengths=lengths,
                                 rows_sha256=data.report.rows_sha256)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    for note in schedule_past_the_end(cfg.optim, steps, run_length(cfg, sampler.steps_per_epoch)):
        if info.is_main:
            log.warning(note)
    model, runner, trainable, total = build_model(cfg, plan, precision, info, len(tokenizer),
                                                  added_token_ids=added_token_ids(tokenizer),
                                                  data_specials=special_tokens_written(data.train, tokenizer))
    if info.is_main:
        log.info(batch_note(cfg, sampler, steps, info.world_size))
    optimizer = build_optimizer(model, cfg.optim, info.device, sharded_scaler=plan.sharded_grad_scaler,
                                pure_bf16=precision.pure_bf16)
    best = best_for(cfg)
    scheduler = build_scheduler(optimizer, cfg.optim, steps, greater_is_better=best.greater_is_better)
    state = TrainState(sampler, scheduler, runner.scaler, max_steps=steps, best=best,
                       output_dir=cfg.run.output_dir)
    step = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, runner=runner, info=info,
                       max_grad_norm=cfg.optim.max_grad_norm, pad_token_id=tokenizer.pad_token_id)
    return Job(cfg=cfg, info=info, plan=plan, tokenizer=tokenizer, data=data, collator=collator, model=model,
               runner=runner, optimizer=optimizer, state=state, step=step, trainable_parameters=trainable,
               parameters=total)
