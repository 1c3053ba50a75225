"""``train(cfg)``: the whole fine-tune, top to bottom, for every strategy.

Read it in order: join the process group, make the job (data, plan, model and runner, optimizer: ``job.py``),
resume if asked, then loop over global batches (step, log, evaluate, save: ``Loop``), and export the result. The
strategy never appears here: ``parallelize`` chose the runner that the step calls.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune.config import TrainConfig, save_resolved
from shardtune.data.loaders import train_loader
from shardtune.dist import (DistInfo, RankFailed, all_reduce_sum, ended_ranks, environment, init_distributed, lost_peer,
                            process_table, refuse_other_settings, refuse_other_versions, run_and_share,
                            shutdown)
from shardtune.errors import RANK_OWN, PeerLost, Terminated, TrainingStopped, UsageError, first_line
from shardtune.files import write_text
from shardtune.train.callbacks import CallbackList, load_callbacks
from shardtune.train.checkpoint import Checkpointer, checkpoints_dir, complete_checkpoints, resume_point
from shardtune.train.evaluate import Evaluator
from shardtune.train.job import Job, make_job
from shardtune.train.model import decide_precision
from shardtune.train.metrics import MetricsLog, progress_bar, start_peak_memory
from shardtune.train.layout import RESUME_NEWEST, RESUME_OFF
from shardtune.train.optim import plateau_step
from shardtune.train.output_dir import OutputDirLock, claim_output_dir, clear_earlier_run, set_aside_newer
from shardtune.train.plan import needs_process_group, unwrap_ddp
from shardtune.train.resume import with_accumulation
from shardtune.train.run_end import (export_final, finished_summary, log_summary, push_to_hub, run_summary,
                                     starting_from_scratch, verify_stop_checkpoint)
from shardtune.train.step import NonFiniteLoss, train_step
from shardtune.train.trackers import start_trackers

__all__ = ["TrainingStopped", "train"]

log = logging.getLogger("shardtune")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# full_determinism's environment, as Transformers' enable_full_determinism sets it (less CUDA_LAUNCH_BLOCKING, which
# serialises every kernel launch and adds nothing to determinism): cuBLAS's fixed workspace, which
# torch.use_deterministic_algorithms needs for CUDA matmuls, and flash-attn's deterministic backward.
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "FLASH_ATTENTION_DETERMINISTIC": "1"}
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"  # PyTorch's refusal of such an operation


@contextmanager
def numerics(cfg: TrainConfig) -> Iterator[None]:
    """The run under ``full_determinism`` and ``tf32``, as Transformers' TrainingArguments set them; PyTorch's
    settings and the environment are put back afterwards (a run started from Python leaves its process as it found
    it). tf32 goes through set_float32_matmul_precision, the setting torch.compile's inductor reads."""
    algorithms = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    precision = torch.get_float32_matmul_precision() if cfg.run.tf32 is not None else None
    try:
        with environment(DETERMINISM_ENV if cfg.run.full_determinism else {}):
            if cfg.run.full_determinism:
                torch.use_deterministic_algorithms(True)
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            if cfg.run.tf32 is not None:
                torch.set_float32_matmul_precision("high" if cfg.run.tf32 else "highest")
            yield
    finally:
        torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if precision is not None:
            torch.set_float32_matmul_precision(precision)


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
        quiet_other_rank(handler)


def quiet_other_rank(handler: logging.Handler) -> None:
    """A rank other than 0 runs the same code as rank 0, so its warnings (a resume that found no checkpoint, an
    fp16 step skipped) and the libraries' bars and notices would print once per process: it prints errors, and the
    warnings about itself alone (``dist.RANK_OWN``)."""
    handler.addFilter(lambda record: record.levelno >= logging.ERROR or all(getattr(record, key, False) == value
                                                                            for key, value in RANK_OWN.items()))
    warnings.filterwarnings("ignore", category=UserWarning)
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Loading weights" on every rank
    datasets.disable_progress_bars()


class SigtermFlag:
    """SIGTERM, what schedulers send before preemption: before the first step it stops the run at once (there is
    nothing to save, ``Terminated``); from ``in_loop`` on it is remembered, and the loop saves and stops cleanly."""

    def __init__(self) -> None:
        self.received = False
        self.in_loop = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = True
        if not self.in_loop:
            raise Terminated

    def any_rank(self, device: torch.device) -> bool:
        return bool(all_reduce_sum([float(self.received)], device)[0].item() > 0)

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def train(cfg: TrainConfig, callbacks: Sequence[Any] = (), *,
          stage_bounds: tuple[tuple[int, int], ...] | None = None) -> dict[str, Any]:
    """Run the fine-tune the config describes; returns the summary (also written to summary.json).

    ``callbacks``: objects with ``on_*`` events (``train.callbacks``), or classes made with no arguments, after
    those the config's ``callbacks`` names. ``stage_bounds``: MP/PP's decoder layers per stage (``shardtune train``
    asks the memory estimator).
    """
    sigterm = SigtermFlag()
    try:
        with numerics(cfg):  # before CUDA starts: cuBLAS reads its workspace setting once
            info = init_distributed(cfg.run.ddp_timeout, group_for_one=needs_process_group(cfg.distributed))
            setup_logging(cfg.run.log_level, info)
            processes: list[tuple[str, int]] = []
            try:
                processes = process_table(info)  # who runs where: to name a rank that dies
                refuse_other_versions(info)  # before the settings: another version may read them otherwise
                refuse_other_settings(cfg.to_flat(), info, may_differ=("machine_rank",))
                # a bad name stops the run before anything is written
                made = load_callbacks(cfg.run.callbacks, callbacks)
                with output_dir_claimed(cfg, info) as claim:  # so does a folder in use, or one holding another run
                    return _train(cfg, info, made, stage_bounds, sigterm, claim)
            except RuntimeError as exc:
                if cfg.run.full_determinism and NO_DETERMINISTIC_KERNEL in str(exc):
                    raise TrainingStopped(f"full_determinism true: {first_line(str(exc)).split(', but')[0]}; leave "
                                          f"full_determinism out, or avoid that operation") from exc
                if not (info.distributed and lost_peer(exc)):
                    raise
                raise peer_lost(cfg, info, processes) from None  # one line, not the backend's traceback
            finally:
                shutdown()
    finally:
        sigterm.restore()


def peer_lost(cfg: TrainConfig, info: DistInfo, processes: list[tuple[str, int]]) -> PeerLost:
    """What a survivor says when a collective failed because another rank's process ended: which rank (those on
    this host are looked up; one elsewhere is named by its host's absence) and the newest complete checkpoint.
    The lowest rank still running says it; the others stay quiet."""
    gone = ended_ranks(processes, info.rank) if processes else None
    if gone:
        who = f"rank {', '.join(map(str, gone))} {'is' if len(gone) == 1 else 'are'} gone (the process ended: " \
              f"killed, out of memory, or stopped by its own error, printed above)"
        quiet = any(r < info.rank and r not in gone for r in range(info.world_size))
    else:
        who = f"a rank on another machine is gone (the connection to it closed){elsewhere(processes)}: see that " \
              f"machine's messages"
        quiet = info.rank != 0
    found = complete_checkpoints(cfg.run.output_dir, warn=False)
    after = (f"newest complete checkpoint: {found[-1]}; run the same command with resume_from_checkpoint true to "
             f"carry on from it (its files are checked first)" if found else
             "no checkpoint was saved yet: run the same command to start again")
    return PeerLost(f"{who}, and training cannot go on without it; {after}", quiet=quiet)


def elsewhere(processes: list[tuple[str, int]]) -> str:
    """The other machines of the job and their ranks, for a survivor to say where the lost rank ran: a user with
    two machines then knows which one to look at (and which to start again)."""
    import socket

    ranks: dict[str, list[int]] = {}
    for rank, (host, _) in enumerate(processes):
        if host != socket.gethostname():
            ranks.setdefault(host, []).append(rank)
    shown = [f"{host} (rank {rs[0]}{f' to {rs[-1]}' if len(rs) > 1 else ''})" for host, rs in ranks.items()][:4]
    return f"; the job's other machine{'s' if len(ranks) > 1 else ''}: {', '.join(shown)}" if shown else ""


def _train(cfg: TrainConfig, info: DistInfo, callbacks: Sequence[Any], stage_bounds,
           sigterm: SigtermFlag, claim: OutputDirLock | None) -> dict[str, Any]:
    cfg = decide_precision(cfg, info.device)  # bf16 where the hardware has it, unless the config says; recorded
    resume = resume_point(cfg, info)  # a damaged checkpoint, or a setting it cannot change, stops the run here
    configured = cfg.run.gradient_accumulation_steps
    if resume is not None:  # on another number of processes, accumulation keeps the checkpoint's global batch
        cfg = with_accumulation(cfg, resume.gradient_accumulation_steps)
    out = Path(cfg.run.output_dir)
    seed_everything(cfg.run.seed)
    job = make_job(cfg, info, stage_bounds)  # a refusal here has written nothing into output_dir
    if configured != cfg.run.gradient_accumulation_steps:  # its checkpoints say so: the same command resumes them
        job.state.configured_accumulation = configured
    resuming = str(cfg.checkpoint.resume_from_checkpoint or "").lower() not in RESUME_OFF
    # The newest checkpoint asked for (a requeue's true, or latest, yes, 1; not a chosen one)
    newest = str(cfg.checkpoint.resume_from_checkpoint).lower() in RESUME_NEWEST
    # a run that ended is left as it is
    done = run_and_share(lambda: finished_summary(out, job.state.max_steps), runs=info.is_main,
                         what=f"reading {out / 'summary.json'}")[0] if newest else None
    if done is not None:  # a requeued job of a run that ended: its final/ and summary.json stay as they are
        log.info("nothing to train: %s finished at step %d already (%s, max_steps %d); its final/ and summary.json "
                 "are kept as they are; raise max_steps to train further", out, done["steps"], done["stopped_by"],
                 job.state.max_steps)
        return done
    if resume is None and newest:  # a job stopped before its first checkpoint; not a run that ended here
        starting_from_scratch(out, job.state.max_steps)
    checkpointer = Checkpointer(cfg, job.info, job.plan, job.model, job.optimizer, job.state,
                                flat_optimizer=job.runner.flat_optimizer)
    checkpointer.resume(resume)  # a checkpoint this run cannot continue (its data order, say) stops it here
    start_step = job.state.step  # what this run adds is counted from here
    model = unwrap_ddp(job.model)  # callbacks get the model as Transformers hands it them: not DDP's wrapper
    evaluator = Evaluator(cfg, job)
    hooks = CallbackList(callbacks, cfg, job.state, model=model, processing_class=job.tokenizer,
                         optimizer=job.optimizer, lr_scheduler=job.state.scheduler,
                         train_dataloader=train_loader(job.data.train, job.state.sampler, job.collator),
                         eval_dataloader=evaluator.loader,  # refused before a tracker writes
                         ranks_device=job.info.device if job.info.distributed else None)
    # An earlier run this one replaces goes now, when nothing above refused this run, and before a tracker writes.
    run_and_share(lambda: clear_earlier_run(claim) if claim else None, runs=info.is_main,
                  what=f"deleting the earlier run in {out}")
    trackers = start_trackers(cfg.run.report_to, out, cfg.run.run_name, cfg.to_flat(), enabled=job.info.is_main,
                              resumed_at=start_step if resuming else 0, project=cfg.run.project)
    metrics = MetricsLog(out, job.info, trackers, strategy=cfg.run.logging_strategy, every=cfg.run.logging_steps,
                         first_step=cfg.run.logging_first_step, history=job.state.log_history)
    hooks.on_train_begin(model=model, optimizer=job.optimizer, plan=job.plan, info=job.info)
    if resuming:
        # Later checkpoints, final/ and summary.json of the run are moved aside before this run replaces any, once
        # nothing can refuse the run any more (the resumed checkpoint, the trackers, the callbacks' start).
        run_and_share(lambda: set_aside_newer(out, resume.step if resume else 0), runs=info.is_main,
                      what=f"setting aside what {out} holds from after the resumed step")
        checkpointer.drop_redone_metrics()
    if info.is_main:
        save_resolved(cfg, out / "config.yaml")
    start_peak_memory(job.info.device)
    loop = Loop(job, checkpointer, evaluator, metrics, hooks, sigterm)
    started = time.perf_counter()
    try:
        stopped_by = loop.run()
        summary = run_summary(job, checkpointer, stopped_by=stopped_by, start_step=start_step, tokens=loop.tokens,
                              loss_sum=loop.loss_sum, wall=time.perf_counter() - started)
        if stopped_by != "SIGTERM" and cfg.checkpoint.load_best_model_at_end:
            # Before on_train_end, as Transformers' Trainer loads it: a callback there sees what final/ will hold.
            # None where the last step's weights are the best (evaluated there): they are in the model.
            loaded = checkpointer.load_best(loop.last_eval)
            summary["final_step"] = job.state.best.checkpoint_step if loaded else job.state.step
        # trackers get these records too, at the run's last step where they name none (plots and trackers need one)
        hooks.on_train_end(model=model, summary=summary, log=lambda record: log_record(metrics, hooks, record))
    except BaseException:
        metrics.close(failed=True)
        raise
    metrics.close()
    if stopped_by == "SIGTERM":
        verify_stop_checkpoint(job, checkpointer)
    else:
        summary["final"] = export_final(job, checkpointer)
    if job.info.is_main:
        summary.update(push_to_hub(cfg, summary.get("final")))
        write_text(out / "summary.json", json.dumps(summary, indent=1))
        log_summary(summary, cfg)
    return summary


def log_record(metrics: MetricsLog, hooks: CallbackList, record: dict[str, Any]) -> None:
    """on_train_end's ``log``: ``record`` into metrics.jsonl and the trackers, at the run's last step where it names
    none, and to every callback's on_log, as each record is."""
    record = {"step": hooks.state.step, **record}
    metrics.write(record)
    hooks.on_log(logs=record)


class Loop:
    """Steps through the global batches; after each step, logs, evaluates and saves when the config says so.

    Each of ``MetricsLog``, ``Evaluator`` and ``Checkpointer`` decides for itself (``should_*``), after every step
    and at every epoch's end; callbacks may ask for more through ``hooks.control``.
    """

    def __init__(self, job: Job, checkpointer: Checkpointer, evaluator: Evaluator, metrics: MetricsLog,
                 hooks: CallbackList, sigterm: SigtermFlag) -> None:
        self.job, self.checkpointer, self.evaluator, self.metrics, self.hooks = (job, checkpointer, evaluator,
                                                                                metrics, hooks)
        self.sigterm = sigterm
        self.tokens = 0  # trained by this run
        self.loss_sum = 0.0  # of this run's steps' losses: summary.json's train_loss is their mean
        self.bar = None
        self.last_eval: dict[str, Any] | None = None  # the latest eval record, for the best checkpoint
        self.early_stopped = False

    def run(self) -> str:
        """Train to ``max_steps`` (or a callback's stop); returns ``"completed"``, ``"early stopping"``,
        ``"callback stop"`` or ``"SIGTERM"``."""
        job, state, sigterm = self.job, self.job.state, self.sigterm
        self.bar = progress_bar(state.max_steps, state.step, job.info.is_main and not job.cfg.run.disable_tqdm)
        sigterm.in_loop = True  # from here a SIGTERM is answered with a checkpoint
        control = self.hooks.control
        if job.cfg.run.eval_on_start and state.step == 0:
            self.evaluate(counted=False)  # a baseline: it takes no part in early stopping or the best checkpoint
        try:
            while not self.finished():
                control.should_epoch_stop = False  # as Transformers clears it when an epoch begins
                batches = state.epoch_batches()
                self.hooks.on_epoch_begin()
                last = False
                for rows in batches:
                    last = self.step([job.collator([job.data.train[i] for i in indices]) for indices in rows])
                    self.after_step(at_epoch_end=False, last=last)
                    if sigterm.any_rank(job.info.device):
                        if not self.checkpointer.just_saved():
                            self.hooks.on_save(checkpoint=self.checkpointer.save("SIGTERM"))
                        return "SIGTERM"
                    self.hooks.agreed()  # a flag on_log, on_evaluate or on_save set on one rank acts on all
                    if last or control.should_training_stop or control.should_epoch_stop:
                        break
                # The epoch ran to its end, or a callback's should_epoch_stop skips the rest of it (as Transformers
                # goes on with the next epoch), or the run stops inside it (max_steps, should_training_stop).
                if control.should_epoch_stop and not (last or control.should_training_stop):
                    state.cut_epoch()  # where after_step has not already (a flag on_save set)
                state.end_epoch()
                # Transformers logs, evaluates and saves for epoch strategies at each of these ends.
                self.hooks.on_epoch_end()  # before the epoch's log, eval and save, which it may ask for
                self.after_step(at_epoch_end=True, last=self.finished())
            if self.early_stopped:
                return "early stopping"
            # a callback's should_training_stop before max_steps (or its should_epoch_stop, cutting epochs short)
            # ends the run as early stopping does
            return "completed" if state.step >= state.max_steps else "callback stop"
        finally:
            self.bar.close()

    def finished(self) -> bool:
        """Whether the run is done: ``max_steps`` trained, a stop asked for, or its epochs all begun (fewer steps
        than max_steps when should_epoch_stop cut some short, as Transformers' Trainer runs its epochs)."""
        state = self.job.state
        return state.step >= state.max_steps or self.hooks.agreed().should_training_stop or \
            state.epochs_completed >= state.num_train_epochs

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> bool:
        """One optimizer step; returns whether it was the run's last."""
        job, state = self.job, self.job.state
        # As Transformers' callback handler does at each step's begin: a flag set outside a step (on_train_begin,
        # on_save) asks for nothing; one set from here on acts after this step.
        control = self.hooks.control
        control.should_log = control.should_evaluate = control.should_save = False
        self.hooks.on_step_begin(micro_batches=micro_batches, model=self.hooks.common["model"],
                                 optimizer=job.optimizer)
        try:
            stats = train_step(job.step, micro_batches)
        except NonFiniteLoss as exc:
            raise TrainingStopped(non_finite_message(exc, job, self.checkpointer)) from None
        state.step += 1
        if stats.skipped:
            log.warning("step %d: fp16 gradients overflowed (inf or NaN): no update, the loss scale lowered to %g "
                        "and the learning-rate schedule held back; frequent skips: lower learning_rate, or use bf16 "
                        "where the GPU has it", state.step, stats.loss_scale)
        every = job.cfg.run.torch_empty_cache_steps
        if every and state.step % every == 0:
            empty_device_cache(job.info.device)
        state.last_stats = stats
        if state.tokens_seen is not None:
            state.tokens_seen += stats.tokens
        self.tokens += stats.tokens
        self.loss_sum += stats.loss
        self.metrics.count(stats.tokens)
        self.bar.update(1)
        self.hooks.on_step_end(stats=stats)
        return state.step >= state.max_steps or self.hooks.agreed().should_training_stop

    def after_step(self, *, at_epoch_end: bool, last: bool) -> None:
        # Each read of the flags after events ran agrees them over the ranks first (hooks.agreed).
        state, control = self.job.state, self.hooks.agreed()
        asked, control.should_log = control.should_log, False
        self.log(at_epoch_end=at_epoch_end, last=last, asked=asked)
        at_end = state.step >= state.max_steps  # not a callback's or early stopping's stop, as in Transformers
        if self.evaluator.should_evaluate(state.step, at_epoch_end=at_epoch_end, at_end=at_end) or \
                self.hooks.agreed().should_evaluate:
            control.should_evaluate = False
            self.evaluate(counted=True)
            if self.early_stopped:  # this evaluation made the step the run's last: logged as the last is (under
                self.log(at_epoch_end=False, last=True)  # logging_strategy steps; epoch logs at the epoch's end)
        if self.hooks.agreed().should_epoch_stop and not (at_epoch_end or last or control.should_training_stop):
            state.cut_epoch()  # before this step's checkpoint, which then resumes at the next epoch's first step
        if self.checkpointer.should_save(state.step, at_epoch_end=at_epoch_end, at_end=at_end) or control.should_save:
            control.should_save = False
            reason = ("end of training" if last else "end of epoch") if at_epoch_end else \
                "end of training" if at_end else "save_steps"
            # before the save: the checkpoint carries it
            state.best.on_save(state.step, self.last_eval, str(checkpoints_dir(self.job.cfg.run.output_dir)))
            with self.metrics.paused():
                self.hooks.on_save(checkpoint=self.checkpointer.save(reason))

    def log(self, *, at_epoch_end: bool, last: bool, asked: bool = False) -> None:
        """The step's metrics.jsonl record, when ``MetricsLog.should_log`` says so; to the bar and on_log too."""
        state = self.job.state
        if self.metrics.should_log(state.step, at_epoch_end=at_epoch_end, last=last, asked=asked) and \
                state.last_stats:
            record = self.metrics.log_step(state, state.last_stats)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if self.job.info.is_main and self.job.cfg.run.disable_tqdm:  # no bar to show it: a line, as eval's
                log.info("step %d: loss %.4f, lr %.4g, grad_norm %.4g, %.0f tokens/s", state.step, record["loss"],
                         record["lr"], record["grad_norm"], record["tokens_per_s"])
            self.hooks.on_log(logs=record)

    def evaluate(self, *, counted: bool) -> None:
        """One eval pass, logged; ``counted``: it takes part in early stopping and the choice of the best."""
        state, patience = self.job.state, self.job.cfg.run.early_stopping_patience
        with self.metrics.paused():
            result = self.evaluator.run()
            if result is None:
                return
            self.metrics.write(result)
            self.hooks.on_log(logs=result)  # as Transformers logs eval metrics through on_log
            self.hooks.on_evaluate(metrics=result)
        if not counted:
            return
        self.last_eval = result
        state.best.on_evaluate(result)
        before = state.scheduler.get_last_lr()[0]
        plateau_step(state.scheduler, result[state.best.metric])
        if (after := state.scheduler.get_last_lr()[0]) < before:
            log.info("step %d: learning rate cut from %.4g to %.4g: %s has not improved for %d evaluations "
                     "(reduce_lr_on_plateau)", state.step, before, after, state.best.metric,
                     state.scheduler.patience + 1)
        if patience is not None and state.best.evals_without_improvement >= patience:
            log.info("early stopping at step %d: %s has not improved on %.6g for %d evaluation%s "
                     "(early_stopping_patience)", state.step, state.best.metric, state.best.eval_value, patience,
                     "" if patience == 1 else "s")
            self.hooks.control.should_training_stop = self.early_stopped = True


def empty_device_cache(device: torch.device) -> None:
    """``torch_empty_cache_steps``: the CUDA allocator's cached blocks that no tensor uses go back to the driver (on
    every device of the process); a CPU has no such cache."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def output_dir_claimed(cfg: TrainConfig, info: DistInfo) -> Iterator[OutputDirLock | None]:
    """Rank 0 holds ``output_dir``'s lock for the run (``claim_output_dir``; yielded there, None on the other ranks);
    every rank hears of a refusal. A run that stops on bad input leaves no folder it made: an output_dir that did
    not exist and is empty goes again."""
    held: list[OutputDirLock] = []
    folder = Path(cfg.run.output_dir)
    made = info.is_main and not folder.exists()
    try:
        run_and_share(lambda: held.append(claim_output_dir(cfg)), runs=info.is_main,
                      what=f"claiming output_dir {cfg.run.output_dir}")
    except RankFailed as exc:
        if exc.kind != "UsageError":
            raise
        raise UsageError(exc.message) from None  # rank 0 prints it; the others exit 2 with it
    try:
        refuse_unshared_output_dir(cfg, info)
        yield held[0] if held else None
    except UsageError:
        for lock in held:
            lock.release()
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise
    finally:
        for lock in held:
            lock.release()


def refuse_unshared_output_dir(cfg: TrainConfig, info: DistInfo) -> None:
    """On several machines, every rank must see the output_dir rank 0 claimed: each rank writes its part of every
    checkpoint there, and reads them all on resume. A folder on each machine's own disk trained until the first
    save, then failed with 'Parent directory ... does not exist'. Rank 0's lock (its host, pid and start) is what
    every rank reads back; a rank that reads something else is on another file system. A collective."""
    from shardtune.train.output_dir import LOCK

    saves = cfg.checkpoint.save_strategy != "no"
    resumes = str(cfg.checkpoint.resume_from_checkpoint or "").lower() not in RESUME_OFF
    if not info.distributed or info.num_nodes < 2 or not (saves or resumes):
        return
    import socket

    lock = Path(cfg.run.output_dir) / LOCK
    seen = lock.read_bytes() if lock.is_file() else b""
    every: list[Any] = [None] * info.world_size
    torch.distributed.all_gather_object(every, (socket.gethostname(), seen))
    apart = sorted({host for host, other in every[1:] if other != every[0][1]})
    if apart:
        raise UsageError(f"output_dir {cfg.run.output_dir} is not shared between the machines: {', '.join(apart)} "
                         f"{'does' if len(apart) == 1 else 'do'} not see the folder rank 0 made on {every[0][0]}, and "
                         f"every rank writes its part of each checkpoint there and reads them all to resume; give an "
                         f"output_dir on a file system every machine mounts at that path (NFS, a cluster file system)")


def non_finite_message(exc: NonFiniteLoss, job: Job, checkpointer: Checkpointer) -> str:
    """A non-finite loss, in one line: right after a resume the checkpoint is the suspect (its hashes prove it
    unchanged since the save, not sane), with the first non-finite tensor it put in the model or optimizer."""
    step = job.state.step + 1
    resumed = checkpointer.resumed_from
    if resumed is None or job.state.step != checkpointer.resumed_step:
        return (f"step {step}: {exc}. Last good checkpoint: {checkpointer.last or 'none'}. Likely causes: "
                f"learning_rate {job.cfg.optim.learning_rate} too high, fp16 overflow (use bf16), or a bad batch; "
                f"resume from the checkpoint with a lower learning rate")
    bad = first_non_finite(job.model, job.optimizer)
    found = f"it put non-finite values in {bad}" if bad else "its weights and optimizer state are finite on this rank"
    return (f"step {step}: {exc}, on the first step after resuming from {resumed}: that checkpoint is suspect "
            f"({found}). Resume from an earlier checkpoint, or start afresh; lowering learning_rate will not help")


def first_non_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the first parameter, or optimizer state of one, holding NaN or inf (this rank's shards)."""
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if not torch.isfinite(local.detach()).all():
            return name
        for key, value in optimizer.state.get(param, {}).items():
            value = value.to_local() if hasattr(value, "to_local") else value
            if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
                return f"the optimizer's {key} of {name}"
    return None
