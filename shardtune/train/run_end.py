"""What a run leaves when it ends: final/, the summary.json record, the hub upload and the last log line; and
whether a run in the output folder already ended (so a repeated command does nothing)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shardtune.config import TrainConfig
from shardtune.dist import RankFailed
from shardtune.errors import TrainingStopped, UsageError, first_line
from shardtune.train.checkpoint import (Checkpointer, checkpoint_damage, checkpoints_dir, write_failure,
                                       write_fix)
from shardtune.train.job import Job
from shardtune.train.layout import BASE_QUANTIZATION, PROMPT_STYLE, train_on_from
from shardtune.train.metrics import flops_per_token, max_over_ranks, peak_flops, peak_memory_bytes
from shardtune.train.output_dir import read_summary
from shardtune.train.plan import unwrap

log = logging.getLogger("shardtune")


def finished_summary(out: Path, max_steps: int) -> dict[str, Any] | None:
    """The summary of a run in ``out`` that ended, its final/ written: it reached ``max_steps``, or early stopping
    ended it. None otherwise (a run stopped by SIGTERM, or asked now for more steps), whatever checkpoint a resume
    would start from."""
    summary = read_summary(out)
    if summary is None or not (out / "final").is_dir():
        return None
    ended = summary.get("stopped_by") in ("early stopping", "callback stop") or (
        summary.get("stopped_by") == "completed" and summary["steps"] >= max_steps)
    return summary if ended else None


def starting_from_scratch(out: Path, max_steps: int) -> None:
    """resume_from_checkpoint true found no checkpoint in ``out``: a job stopped before its first one starts again,
    with a warning. A run that finished there without saving any, asked now for ``max_steps`` (more than it ran),
    is refused: training again from step 1 beside it is not carrying it on."""
    summary = read_summary(out)
    if summary is not None and summary.get("stopped_by") == "completed" and (out / "final").is_dir():
        raise UsageError(f"resume_from_checkpoint=true: {out} holds a run that finished at step {summary['steps']} "
                         f"and saved no checkpoint, so it cannot be carried on to step {max_steps}: this run "
                         f"would start again from step 1. To train on from its final/, {train_on_from(out / 'final')},"
                         f" in a new output_dir; to train again from scratch here, set resume_from_checkpoint false "
                         f"and overwrite_output_dir true")
    log.warning("resume_from_checkpoint=true: no complete checkpoint in %s; starting from scratch",
                checkpoints_dir(out))


def verify_stop_checkpoint(job: Job, checkpointer: Checkpointer) -> None:
    """After SIGTERM: the checkpoint just saved must read back as its manifest says, or the run says none was."""
    damaged = checkpoint_damage(Path(checkpointer.last), job.info)
    if damaged:
        raise TrainingStopped(f"stopped by SIGTERM at step {job.state.step}, but its checkpoint is damaged "
                              f"({damaged}): no checkpoint was saved for this stop")


def export_final(job: Job, checkpointer: Checkpointer) -> str:
    """``final/``: the runner gathers what each rank holds and rank 0 writes it."""
    out = Path(job.cfg.run.output_dir)
    try:
        final = job.runner.export_final(out, job.tokenizer, is_peft=job.cfg.lora.use_peft_lora)
    except (OSError, RankFailed) as exc:
        raise TrainingStopped(
            f"training finished but {out / 'final'} was not written ({write_failure(exc)}). Last checkpoint: "
            f"{checkpointer.last or 'none'} ('shardtune export CHECKPOINT OUT' writes one as final/ would be); "
            f"{write_fix(exc, out)}") from exc
    return str(final) if final else str(out / "final")


def best_summary(job: Job) -> dict[str, Any]:
    """The best checkpoint and metric, when load_best_model_at_end or early stopping asked for them."""
    cfg, best = job.cfg, job.state.best
    if not (cfg.checkpoint.load_best_model_at_end or cfg.run.early_stopping_patience):
        return {}
    return {"metric_for_best_model": best.metric, "best_metric": best.checkpoint_value,
            "best_step": best.checkpoint_step, "best_eval_metric": best.eval_value,
            "best_model_checkpoint": job.state.best_model_checkpoint}


def run_summary(job: Job, checkpointer: Checkpointer, *, stopped_by: str, start_step: int, tokens: int,
                loss_sum: float, wall: float) -> dict[str, Any]:
    """What summary.json says of the run: steps, throughput, MFU on known GPUs, peak memory, how it ended, and the
    metrics Transformers' ``Trainer.train`` returns, by their names (train_loss: the mean of this run's steps'
    losses; epoch: fractional)."""
    info, state = job.info, job.state
    flops = peak_flops(info.device)
    mfu = None
    if flops and tokens:
        per_token = flops_per_token(unwrap(job.model), job.parameters, job.trainable_parameters,
                                    job.cfg.data.max_seq_len, frozen_base=job.cfg.lora.use_peft_lora)
        mfu = per_token * tokens / wall / (flops * job.plan.num_devices(info))
    resumed = checkpointer.resumed_from is not None
    steps = state.step - start_step
    return {"steps": state.step, "max_steps": state.max_steps, "steps_this_run": steps,
            "resumed_from_step": start_step if resumed else None, "epochs": state.epochs_completed, "wall_s": wall,
            "tokens": tokens, "tokens_per_s": tokens / max(wall, 1e-9),
            "trainable_parameters": job.trainable_parameters, "parameters": job.parameters,
            "world_size": info.world_size, **job.plan.summary(), "device_type": info.device.type,
            "mfu": mfu, "peak_memory_bytes": max_over_ranks(peak_memory_bytes(info.device), info.device),
            "stopped_by": stopped_by, "last_checkpoint": checkpointer.last, **best_summary(job),
            "compile": compile_summary(job), **job.runner.applied.summary(),
            PROMPT_STYLE: job.data.report.prompt_style or None,
            BASE_QUANTIZATION: job.cfg.lora.bnb_4bit_quant_type if job.cfg.lora.use_4bit_quantization else None,
            "train_loss": loss_sum / steps if steps else None, **last_evaluation(state.log_history),
            "train_runtime": wall, "train_steps_per_second": steps / max(wall, 1e-9), "epoch": state.epochs_done}


def last_evaluation(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's last evaluation, by the names ``Trainer.evaluate`` returns (eval_loss, eval_perplexity) and the
    step it was made at (eval_step); nothing where the run never evaluated."""
    last = next((record for record in reversed(history) if "eval_loss" in record), None)
    if last is None:
        return {}
    return {"eval_loss": last["eval_loss"], "eval_perplexity": last.get("eval_perplexity"), "eval_step": last["step"]}


def compile_summary(job: Job) -> dict[str, Any] | None:
    """torch_compile's record (layers, graphs, recompilations), logged here once; None when it is off."""
    report = job.runner.applied.compiled
    if report is None:
        return None
    (log.warning if report.compiled_nothing() else log.info)("%s", report.describe())
    return report.summary()


def push_to_hub(cfg: TrainConfig, folder: str | None) -> dict[str, str]:
    """``push_to_hub``: upload ``final/`` to ``hub_model_id``; where the hub cannot be reached, a warning saying how
    to upload it later. What summary.json records of it: the repository, or why the upload failed."""
    if not cfg.run.push_to_hub or not folder:
        return {}
    repo_id = cfg.run.hub_model_id or Path(cfg.run.output_dir).resolve().name
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=cfg.run.hub_token)
        api.create_repo(repo_id, private=bool(cfg.run.hub_private_repo), exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="shardtune: final model")
        log.info("pushed %s to the hub as %s", folder, repo_id)
        return {"hub_model_id": repo_id}
    except Exception as exc:  # noqa: BLE001 - the run succeeded; the upload is best effort, said loudly
        first = first_line(str(exc), type(exc).__name__)
        log.warning("push_to_hub: could not upload %s to %s (%s); the model is saved locally: upload it once the hub "
                    "is reachable with 'hf upload %s %s'", folder, repo_id, first, repo_id, folder)
        return {"push_to_hub_failed": f"{repo_id}: {first}"}


def log_summary(summary: dict[str, Any], cfg: TrainConfig) -> None:
    """The run's last line: what this run did (a resumed run counts only its own steps), or that it did nothing."""
    step, ran, resumed_from = summary["steps"], summary["steps_this_run"], summary["resumed_from_step"]
    if ran == 0:
        by_steps = cfg.run.max_steps > 0
        limit = f"max_steps ({cfg.run.max_steps})" if by_steps else \
            f"the last step of num_train_epochs {cfg.run.num_train_epochs:g}"
        final = f" (final/ written from {summary['last_checkpoint']})" if summary.get("final") else ""
        past = by_steps and step > cfg.run.max_steps  # a checkpoint after the step max_steps asks to end at
        earlier = f", or resume from a checkpoint at or before step {cfg.run.max_steps} to end there" if past else ""
        log.info("nothing to train: resumed at step %d, %s %s, so no step was taken%s; raise %s to train further%s",
                 step, "past" if past else "already", limit, final, "max_steps" if by_steps else "num_train_epochs",
                 earlier)
        return
    what = f"{ran} step{'' if ran == 1 else 's'}"
    if resumed_from is not None:
        span = f"step {step}" if ran == 1 else f"steps {resumed_from + 1}-{step}"
        what += f" ({span}, resumed from step {resumed_from})"
    mfu = summary["mfu"]
    on_gpu = summary.get("device_type") == "cuda"
    # A stopped run is not done: its last line says so (the command's own line then says how to carry it on).
    ended = {"SIGTERM": "stopped by SIGTERM", "early stopping": "done (early stopping)",
             "callback stop": "done (a callback stopped it)"}.get(summary["stopped_by"], "done")
    log.info("%s: %s in %.1f s, %.0f tokens/s%s, peak memory %.2f GiB per %s", ended, what, summary["wall_s"],
             summary["tokens_per_s"], f", MFU {mfu:.1%}" if mfu is not None else "",
             summary["peak_memory_bytes"] / 2**30,
             "GPU (reserved by PyTorch)" if on_gpu else "process (resident memory, the whole process)")
