"""``train(cfg)``: the whole fine-tune, top to bottom, for one process, DDP and FSDP2 alike.

Read it in order: join the process group, make the data, build the model and parallelize it, build the optimizer,
resume if asked, then loop over global batches (step, log, evaluate, save), and export the result.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from shardtune.config import TrainConfig, save_resolved
from shardtune.errors import first_line
from shardtune.train import checkpoint as ckpt
from shardtune.train.dist import DistInfo, RankFailed, all_reduce_sum, init_distributed, shutdown
from shardtune.train.build import build_model, fsdp_param_dtype
from shardtune.train.memory_check import PREDICTABLE_STRATEGIES, memory_check, tracked_step
from shardtune.train.metrics import (MetricsLog, flops_per_token, max_over_ranks, peak_flops, peak_memory_bytes,
                                     progress_bar, start_peak_memory)
from shardtune.train.model import Precision, attn_implementation
from shardtune.train.optim import build_optimizer, build_scheduler
from shardtune.train.parallelize import make_plan, unwrap
from shardtune.train.step import NonFiniteLoss, StepContext, evaluate, train_step

log = logging.getLogger("shardtune")


class TrainingStopped(RuntimeError):
    """The run cannot go on (non-finite loss, ...); the message says where and what to try."""


def write_failure(exc: BaseException) -> str:
    """One line for a failed write: another rank's ``RankFailed`` names that rank; this rank's own error its type.

    A failed DCP save names the first rank that failed and its error (DCP's own message is a traceback per rank).
    """
    if isinstance(exc, RankFailed):
        return str(exc)
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (cause, _) = min(exc.failures.items())
        return f"rank {rank}: {write_failure(cause)}"
    message = first_line(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def write_fix(exc: BaseException, out: Path) -> str:
    """What to do about a failed write: the disk or the permissions under ``out``; nothing where the rank that
    wrote was interrupted (Ctrl-C there), which is no fault of the disk."""
    if isinstance(exc, RankFailed) and exc.interrupted:
        return f"rank {exc.rank} was interrupted, so this rank stopped too"
    return f"free disk space or fix the permissions under {out}, or point output_dir elsewhere"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_logging(level: str, info: DistInfo) -> None:
    """INFO on rank 0 ("passive" means info, as in Transformers); the other ranks stay quiet unless it is serious."""
    chosen = logging.INFO if level == "passive" else getattr(logging, level.upper())
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[%(asctime)s shardtune rank {info.rank}] %(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(chosen if info.is_main else logging.WARNING)
    # bitsandbytes announces at import that an optional CPU kernel package is missing; the fallback is fine.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # Library deprecation notices are for us, not for the user, and every rank would print them again.
    warnings.filterwarnings("ignore", category=FutureWarning)
    if not info.is_main:
        warnings.filterwarnings("ignore", category=UserWarning)


def inject_fault(step: int, info: DistInfo) -> None:
    """Fault injection for the test suite: make one rank hang or die at a given step (never set by users).

    SHARDTUNE_FAULT=hang:STEP:RANK sleeps forever; die:STEP:RANK exits at once with code 17 (only on the
    first attempt of an elastic restart, so the restarted worker goes on).
    """
    spec = os.environ.get("SHARDTUNE_FAULT")
    if not spec:
        return
    kind, at_step, at_rank = spec.split(":")
    if int(at_step) != step or int(at_rank) != info.rank:
        return
    if kind == "hang":
        # A rank stuck in its work, which the launcher's SIGTERM ends (the trainer's own handler would only set a
        # flag for a step that never ends, and torchrun would wait 30 s before SIGKILL).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(10**6)
    elif kind == "die" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os._exit(17)


class SigtermFlag:
    """Remembers a SIGTERM (what schedulers send before preemption) so the loop can save and exit cleanly."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = True

    def any_rank(self, device: torch.device) -> bool:
        return bool(all_reduce_sum([float(self.received)], device)[0].item() > 0)

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def push_to_hub(cfg: TrainConfig, folder: str | None) -> None:
    """``push_to_hub``: upload ``final/`` to ``hub_model_id``; where the hub cannot be reached, a warning."""
    if not cfg.run.push_to_hub or not folder:
        return
    repo_id = cfg.run.hub_model_id or Path(cfg.run.output_dir).resolve().name
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=cfg.run.hub_token)
        api.create_repo(repo_id, private=bool(cfg.run.hub_private_repo), exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="shardtune: final model")
        log.info("pushed %s to the hub as %s", folder, repo_id)
    except Exception as exc:  # noqa: BLE001 - the run succeeded; the upload is best effort, said loudly
        first = first_line(str(exc), type(exc).__name__)
        log.warning("push_to_hub: could not upload %s to %s (%s); the model is saved locally", folder, repo_id,
                    first)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    if cfg.run.max_steps > 0:
        return cfg.run.max_steps
    return max(1, math.ceil(cfg.run.num_train_epochs * steps_per_epoch))


def _collate_steps(sampler, rows, collator):
    for micro_indices in sampler:
        yield [collator([rows[i] for i in indices]) for indices in micro_indices]


def _eval_batches(data, cfg: TrainConfig, info: DistInfo, collator, pipelined: bool):
    from shardtune.data import EvalSampler

    # Every pipeline stage reads the same batches, as in training.
    sampler = EvalSampler(len(data), batch_size=cfg.run.per_device_eval_batch_size,
                          world_size=1 if pipelined else info.world_size, rank=0 if pipelined else info.rank)
    for indices in sampler:
        yield collator([data[i] if i is not None else None for i in indices])


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the fine-tune the config describes; returns the summary (also written to summary.json)."""
    info = init_distributed(cfg.run.ddp_timeout, group_for_one=cfg.distributed.distributed_type == "FSDP")
    setup_logging(cfg.run.log_level, info)
    try:
        return _train(cfg, info)
    finally:
        shutdown()


def _train(cfg: TrainConfig, info: DistInfo) -> dict[str, Any]:
    from shardtune.data import Collator, GlobalBatchSampler, load_tokenizer, prepare_datasets

    out = Path(cfg.run.output_dir)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, out / "config.yaml")
    config_yaml = yaml.safe_dump(cfg.to_flat(), sort_keys=False)
    seed_everything(cfg.run.seed)

    # Data first: tokenisation may take long, and it happens before any collective with a timeout.
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data, trust_remote_code=cfg.model.trust_remote_code)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.run.seed)
    if info.is_main:
        log.info("data: %s", data.report.format())
    precision = Precision(cfg.mixed_precision)
    plan = make_plan(cfg.distributed, info, param_dtype=fsdp_param_dtype(cfg, precision),
                     gradient_checkpointing=cfg.run.gradient_checkpointing, use_reentrant=cfg.run.use_reentrant)
    pipelined = plan.strategy == "PP"
    if plan.strategy in ("MP", "PP"):
        from shardtune.train import model_parallel, pipeline

        plan = model_parallel.plan_stages(plan, cfg, info)
    if plan.strategy == "MP":
        info = model_parallel.step_info(info, plan)  # batches, the loss and its sums live on the first stage
    # Pipeline stages exchange fixed-shape activations: pad every batch to max_seq_len under PP.
    # The collator writes the attention mask in the form the model's attention reads (eager adds it to scores).
    attention = attn_implementation(cfg.model, info.device, precision.compute_dtype)
    collator = Collator(tokenizer.pad_token_id, pad_to_multiple_of=cfg.data.max_seq_len if pipelined else None,
                        attn_implementation=attention)
    if plan.strategy == "NO":
        log.info("strategy: a single process, mixed precision %s", precision.mixed_precision)
    else:
        log.info("strategy: %s%s on %d process(es), mixed precision %s", plan.strategy,
                 f" {plan.sharding}" if plan.strategy == "FSDP" else "", info.world_size, precision.mixed_precision)
    model, trainable, total = build_model(cfg, plan, precision, info, len(tokenizer))

    sampler = GlobalBatchSampler(len(data.train), micro_batch_size=cfg.run.per_device_train_batch_size,
                                 gradient_accumulation_steps=cfg.run.gradient_accumulation_steps,
                                 world_size=1 if pipelined else info.world_size, rank=0 if pipelined else info.rank,
                                 seed=cfg.run.seed)  # every pipeline stage reads the same global batch
    steps = total_steps(cfg, sampler.steps_per_epoch)
    fp16 = precision.mixed_precision == "fp16"
    optimizer = build_optimizer(model, cfg.optim, info.device, sharded_scaler=fp16 and plan.strategy == "FSDP")
    scheduler = build_scheduler(optimizer, cfg.optim, steps)
    scaler = None
    if fp16:
        if plan.strategy == "FSDP":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(info.device.type)
        else:
            scaler = torch.amp.GradScaler(info.device.type)
    ctx = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, plan=plan, info=info,
                      compute_dtype=precision.compute_dtype, max_grad_norm=cfg.optim.max_grad_norm,
                      pad_token_id=tokenizer.pad_token_id, scaler=scaler,
                      pipeline=pipeline.PipelineRunner(model, plan, info, cfg.distributed, precision.compute_dtype)
                      if pipelined else None)
    is_peft = cfg.lora.use_peft_lora

    def epochs_done() -> float:
        """Epochs trained so far, as Transformers counts them: 2.5 halfway through the third; 5.0 at the end of
        the fifth. The sampler's epoch is the one the last step belongs to, also after the loop counted it done."""
        return round(sampler.epoch + sampler.step_in_epoch / sampler.steps_per_epoch, 4)

    step, epoch = 0, 0
    resume = ckpt.resolve_resume(cfg.checkpoint.resume_from_checkpoint, out)
    if resume is not None:
        state = ckpt.load_checkpoint(resume, model=model, optimizer=optimizer, trainable_only=is_peft, info=info)
        step = state["step"]
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        # Epochs completed, from where the sampler stopped: a checkpoint taken at an epoch's last step (save_steps
        # or the run's last step) resumes with the next epoch, whichever strategy wrote it.
        epoch = sampler.epoch + int(sampler.step_in_epoch == sampler.steps_per_epoch)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if info.is_main:
            # A killed run may have logged steps after its last checkpoint: this run logs them again.
            dropped = ckpt.trim_metrics(out, step)
            if dropped:
                log.info("metrics.jsonl: dropped %d record(s) after step %d, which this run redoes", dropped, step)
        log.info("resumed from %s at step %d (epoch %g)", resume, step, epochs_done())
    start_step = step  # what this run adds is counted from here (the summary, the memory check)
    last_checkpoint = str(resume) if resume else None

    def save(reason: str) -> None:
        nonlocal last_checkpoint
        trainer_state = {"step": step, "epoch": epochs_done(), "sampler": sampler.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None}
        try:
            path = ckpt.save_checkpoint(out, step, model=model, optimizer=optimizer, trainable_only=is_peft,
                                        trainer_state=trainer_state, config_yaml=config_yaml, info=info,
                                        save_total_limit=cfg.checkpoint.save_total_limit,
                                        state_dict_type=cfg.distributed.fsdp_state_dict_type
                                        if plan.strategy == "FSDP" else ckpt.SHARDED, flat_optimizer=pipelined)
        except (OSError, RankFailed, CheckpointException) as exc:
            raise TrainingStopped(
                f"step {step}: the checkpoint was not saved ({write_failure(exc)}). Last good checkpoint: "
                f"{last_checkpoint or 'none'}; {write_fix(exc, out)}; then run again"
                f"{f' with resume_from_checkpoint={last_checkpoint}' if last_checkpoint else ''}") from exc
        last_checkpoint = str(path)
        log.info("saved checkpoint %s (%s)", path, reason)

    metrics = MetricsLog(out, info, tensorboard=cfg.run.report_to == "tensorboard")
    eval_every = cfg.run.eval_steps or cfg.run.logging_steps

    def run_eval() -> None:
        if data.eval is None or len(data.eval) == 0:
            return
        result = evaluate(model, _eval_batches(data.eval, cfg, info, collator, pipelined), plan, info,
                          precision.compute_dtype, pipeline=ctx.pipeline)
        metrics.write({"step": step, "epoch": epochs_done(), **result})
        log.info("step %d: eval_loss %.4f, perplexity %.3f", step, result["eval_loss"], result["eval_perplexity"])

    def log_step(stats) -> None:
        """One metrics.jsonl record for the step just taken; tokens/s over the steps since the last record."""
        nonlocal window_tokens, window_start
        elapsed = time.perf_counter() - window_start
        record = {"step": step, "epoch": epochs_done(), "loss": stats.loss, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": stats.grad_norm, "tokens": stats.tokens, "target_tokens": stats.target_tokens,
                  "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                  "peak_memory_bytes": max_over_ranks(peak_memory_bytes(info.device), info.device)}
        metrics.write(record)
        bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        window_tokens, window_start = 0, time.perf_counter()

    def epoch_boundary(reason: str) -> None:
        """What the epoch strategies do at the end of an epoch, or of training stopped inside one."""
        if cfg.run.logging_strategy == "epoch" and stats is not None:
            log_step(stats)
        if cfg.run.eval_strategy == "epoch":
            run_eval()
        if cfg.checkpoint.save_strategy == "epoch":
            save(reason)

    start_peak_memory(info.device)
    sigterm = SigtermFlag()
    bar = progress_bar(steps, step, info.is_main)
    started = time.perf_counter()
    window_tokens, window_start = 0, time.perf_counter()
    run_tokens = 0
    stopped_by_signal = False
    # The measured side of the memory check: CUDA's allocator counts; on CPU one step runs under the tracker,
    # one in which the optimizer states exist: step 2, or a resumed run's first (they came with the checkpoint).
    measure_on_cpu = (cfg.run.predict_memory and info.device.type == "cpu"
                      and plan.strategy in PREDICTABLE_STRATEGIES)
    tracked_step_number = start_step + 1 if start_step else min(2, steps)
    tracked_peak = 0
    # The padded length of the longest micro-batch measured (unpacked rows are padded to the batch's longest, not
    # to max_seq_len): the prediction traces that shape. On CPU the tracked step's; on CUDA the run's longest.
    measured_seq_len = 0
    stats = None  # the last step's; None until a step ran (a resume may start at an epoch's end)
    try:
        while step < steps and not stopped_by_signal:
            sampler.set_epoch(epoch)
            for micro_batches in _collate_steps(sampler, data.train, collator):
                inject_fault(step + 1, info)
                try:
                    longest = max(b["input_ids"].shape[1] for b in micro_batches)
                    if measure_on_cpu and step + 1 == tracked_step_number:
                        stats, tracked_peak = tracked_step(ctx, micro_batches)
                        measured_seq_len = longest
                    else:
                        stats = train_step(ctx, micro_batches)
                        if not measure_on_cpu:
                            measured_seq_len = max(measured_seq_len, longest)
                except NonFiniteLoss as exc:
                    raise TrainingStopped(
                        f"step {step + 1}: {exc}. Last good checkpoint: {last_checkpoint or 'none'}. Likely causes: "
                        f"learning_rate {cfg.optim.learning_rate} too high, fp16 overflow (use bf16), or a bad "
                        f"batch; resume from the checkpoint with a lower learning rate") from None
                step += 1
                window_tokens += stats.tokens
                run_tokens += stats.tokens
                bar.update(1)
                last = step >= steps
                if cfg.run.logging_strategy == "steps" and (step % cfg.run.logging_steps == 0 or last or step == 1):
                    log_step(stats)
                if cfg.run.eval_strategy == "steps" and step % eval_every == 0:
                    run_eval()
                if cfg.checkpoint.save_strategy == "steps" and step % cfg.checkpoint.save_steps == 0:
                    save("save_steps")
                if sigterm.any_rank(info.device):
                    if not last_checkpoint or Path(last_checkpoint).name != f"step-{step}":  # not just saved
                        save("SIGTERM")
                    stopped_by_signal = True
                    break
                if last:
                    if sampler.step_in_epoch == sampler.steps_per_epoch:
                        epoch += 1  # the last step also ended the epoch
                    break
            else:
                epoch += 1  # the epoch ran to its end
                epoch_boundary("end of epoch")
                continue
            # Stopped by max_steps: Transformers still logs, evaluates and saves for epoch strategies.
            if not stopped_by_signal:
                epoch_boundary("end of training")
    finally:
        bar.close()
        sigterm.restore()
        metrics.close()

    wall = time.perf_counter() - started
    flops = peak_flops(info.device)
    mfu = None
    if flops and run_tokens:
        per_token = flops_per_token(unwrap(model).config, total, trainable, cfg.data.max_seq_len)
        gpus = len(plan.devices) if plan.strategy == "MP" else info.world_size  # MP: one process, several GPUs
        mfu = per_token * run_tokens / wall / (flops * gpus)
    steps_this_run = step - start_step
    summary = {"steps": step, "steps_this_run": steps_this_run, "resumed_from_step": start_step if resume else None,
               "epochs": epoch, "wall_s": wall, "tokens": run_tokens,
               "tokens_per_s": run_tokens / max(wall, 1e-9), "trainable_parameters": trainable,
               "parameters": total, "world_size": info.world_size, "strategy": plan.strategy,
               "device_type": info.device.type,
               "mfu": mfu, "peak_memory_bytes": max_over_ranks(peak_memory_bytes(info.device), info.device),
               "stopped_by": "SIGTERM" if stopped_by_signal else "completed", "last_checkpoint": last_checkpoint}
    # A run that trained nothing (resumed at its last step) has no step to measure: no record rather than a wrong one.
    memory = memory_check(cfg, info, plan, tracked_peak, measured_seq_len) if steps_this_run else None
    if memory:
        summary.update(memory)
        metrics.write({"step": step, **memory})
        log.info("peak memory per %s: predicted %.3f GiB (traced at %d-token rows), measured %.3f GiB (%s), "
                 "error %+.1f%%", "GPU" if info.device.type == "cuda" else "process",
                 memory["predicted_peak_bytes"] / 2**30, memory["traced_seq_len"],
                 memory["measured_peak_bytes"] / 2**30, memory["measured_by"], 100 * memory["peak_error"])
    if not stopped_by_signal:
        export = pipeline.export_final if pipelined else ckpt.export_final
        try:
            final = export(out, model, tokenizer, is_peft=is_peft, info=info)
        except (OSError, RankFailed) as exc:
            raise TrainingStopped(
                f"training finished but {out / 'final'} was not written ({write_failure(exc)}). Last checkpoint: "
                f"{last_checkpoint or 'none'} ('shardtune export CHECKPOINT OUT' writes one as final/ would be); "
                f"{write_fix(exc, out)}") from exc
        summary["final"] = str(final) if final else str(out / "final")
    if info.is_main:
        tmp = out / ".tmp-summary.json"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(out / "summary.json")
        push_to_hub(cfg, summary.get("final"))
        log_summary(summary, cfg)
    return summary


def log_summary(summary: dict[str, Any], cfg: TrainConfig) -> None:
    """The run's last line: what this run did (a resumed run counts only its own steps), or that it did nothing."""
    step, ran, resumed_from = summary["steps"], summary["steps_this_run"], summary["resumed_from_step"]
    if ran == 0:
        by_steps = cfg.run.max_steps > 0
        limit = f"max_steps ({cfg.run.max_steps})" if by_steps else \
            f"the last step of num_train_epochs {cfg.run.num_train_epochs:g}"
        final = f" (final/ written from {summary['last_checkpoint']})" if summary.get("final") else ""
        log.info("nothing to train: resumed at step %d, already %s, so no step was taken%s; raise %s to train "
                 "further", step, limit, final, "max_steps" if by_steps else "num_train_epochs")
        return
    what = f"{ran} steps" if resumed_from is None else \
        f"{ran} steps (steps {resumed_from + 1}-{step}, resumed from step {resumed_from})"
    mfu = summary["mfu"]
    on_gpu = summary.get("device_type") == "cuda"
    log.info("done: %s in %.1f s, %.0f tokens/s%s, peak memory %.2f GiB per %s", what, summary["wall_s"],
             summary["tokens_per_s"], f", MFU {mfu:.1%}" if mfu is not None else "",
             summary["peak_memory_bytes"] / 2**30,
             "GPU (reserved by PyTorch)" if on_gpu else "process (resident memory, the whole process)")
