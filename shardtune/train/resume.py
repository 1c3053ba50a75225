"""What a resumed run may change: the checkpoint's config against the new one, before anything is written.

The trained weights, the optimizer's moments and the data position only mean something for the model, adapters and
data they were made with: changing those on resume is refused in one line naming the key and both values. The
rest (learning rate, max_steps, the logging, eval and save cadence, ...) takes effect and is logged. A change of
a key that shapes the training rows (the template, the labels, the split, where the data is read from, ...) is
allowed where the rows stay the checkpoint's (their SHA-256 is compared when the data is read); where they do not,
the refusal names the keys.

The global batch (per_device_train_batch_size x gradient_accumulation_steps x processes) is tied to the data
position too. On as many processes as the checkpoint was saved on, changing it is refused (the command of the run
that saved it, which derived its accumulation as below, keeps that run's accumulation). On another number of
processes (an elastic job that lost or regained a machine, or a resume elsewhere), gradient_accumulation_steps is
derived from the checkpoint's global batch, with a logged line, and where no whole number of accumulation steps
keeps it the resume is refused naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from dataclasses import fields, replace
from typing import Any, NamedTuple

from shardtune.config import TrainConfig
from shardtune.config.optimizers import OPTIMIZERS
from shardtune.config.schema import DataConfig
from shardtune.errors import UsageError
from shardtune.train.model import target_modules
from shardtune.train.optim import moves_on_evaluations

log = logging.getLogger("shardtune")

# What the checkpoint's tensors and data position are tied to. The LoRA keys decide which tensors the adapters
# hold (rank, targets, DoRA's magnitudes, modules_to_save's copies, biases) or what the same tensors compute
# (alpha and rsLoRA scale the update; PiSSA and OLoRA's init rewrites the base weights the adapters were trained
# on): changed, the resumed run would train another model from the checkpoint's step, or fail to load it. Any
# other init changed could never take effect: the adapters were initialised when the run began.
LORA_ONLY = ("lora_r", "lora_target_modules", "lora_alpha", "use_rslora", "use_dora", "lora_modules_to_save",
             "lora_bias", "init_lora_weights")
FIXED = ("model_name_or_path", "use_peft_lora", "use_4bit_quantization", "bnb_4bit_quant_type", *LORA_ONLY,
         "dataset_name", "max_seq_len", "packing", "group_by_length", "seed", "optim")
# The data keys whose change the training rows' SHA-256 judges: eval-only and speed keys aside, the data section
# but for the FIXED keys that shape the rows' length, order or grouping. dataset_name is FIXED where the checkpoint
# recorded no rows' SHA-256 (saved before it was); where it did, the same rows read from another place resume (a
# copy on a node's own disk, a folder moved).
ROW_KEYS = ("dataset_name", *(f.name for f in fields(DataConfig)
                              if f.name not in FIXED and f.name not in ("eval_packing", "dataset_num_proc")))


def _same_place(old: Any, new: Any, *, by_ending: bool = False) -> bool:
    """Two model or data set names: equal as written, or the same local file or folder reached by two paths.
    ``by_ending``: the checkpoint's config keeps a relative path as it was given, from the working directory of
    then; where it names nothing from here, it names the same place when this one's path ends in it (``data``
    then, ``/work/data`` or ``./data`` now). Only for data, whose rows' SHA-256 is checked as they are read."""
    if old == new:
        return True
    old_path, new_path = Path(str(old)).expanduser(), Path(str(new)).expanduser()
    if not new_path.exists():
        return False
    if old_path.exists():
        return old_path.resolve() == new_path.resolve()
    tail = tuple(part for part in old_path.parts if part != ".")
    return (by_ending and not old_path.is_absolute() and bool(tail) and ".." not in tail
            and new_path.resolve().parts[-len(tail):] == tail)


def _same(key: str, old: Any, new: Any) -> bool:
    """A FIXED key unchanged: the same model folder or data by another path, or another name of the same optimizer
    (adamw_torch and adamw_torch_fused keep the same state) count as unchanged. (A data set's rows are checked
    too, by their SHA-256, when the data is read.)"""
    if key in ("model_name_or_path", "dataset_name"):
        return _same_place(old, new, by_ending=key == "dataset_name")
    if key == "optim":
        return old == new or (old in OPTIMIZERS and OPTIMIZERS.get(old) == OPTIMIZERS.get(new))
    if key == "lora_target_modules":  # the same modules in another order or spacing
        names = (target_modules(str(value)) for value in (old, new))
        return len({name if isinstance(name, str) else frozenset(name) for name in names}) == 1
    if key == "lora_modules_to_save":
        return set(old or []) == set(new or [])
    return old == new


def global_batch(values: dict[str, Any], data_world: int) -> int:
    return int(values["per_device_train_batch_size"]) * int(values["gradient_accumulation_steps"]) * data_world


def accumulation_for(label: str, old: dict[str, Any], new: dict[str, Any], *, saved_world: int, world: int,
                     given_accumulation: int | None = None, main: bool = True) -> int:
    """The gradient_accumulation_steps that keeps the checkpoint's global batch on ``world`` processes (see the
    module's docstring); ``old`` / ``new``: the checkpoint's and this run's flat configs; ``given_accumulation``:
    the one the checkpoint's run was given where it ran another (derived on its own resume), else None."""
    before, now = global_batch(old, saved_world), global_batch(new, world)
    warn = log.warning if main else log.debug  # every rank checks; rank 0 says it
    configured = int(new["gradient_accumulation_steps"])
    if before == now:
        # Another split of the same global batch on as many processes (on another number, load_checkpoint says so)
        if world == saved_world and int(old["gradient_accumulation_steps"]) != configured:
            (log.info if main else log.debug)(
                "resume: per_device_train_batch_size %s -> %s and gradient_accumulation_steps %s -> %d keep the "
                "checkpoint's global batch of %d rows per step, and so its data order",
                old["per_device_train_batch_size"], new["per_device_train_batch_size"],
                old["gradient_accumulation_steps"], configured, before)
        return configured
    if world == saved_world and configured == given_accumulation and \
            int(new["per_device_train_batch_size"]) == int(old["per_device_train_batch_size"]):
        # the command of the run that saved it (an elastic job restarted again on the machines it went on with)
        warn("resume on %d process(es), as the checkpoint was saved, by a run that was given "
             "gradient_accumulation_steps %d and ran %d to keep its checkpoint's global batch: %d -> %d keeps it (%d "
             "rows per step)", world, configured, int(old["gradient_accumulation_steps"]), configured,
             int(old["gradient_accumulation_steps"]), before)
        return int(old["gradient_accumulation_steps"])
    per_micro_step = int(new["per_device_train_batch_size"]) * world  # rows one micro-step reads on all ranks
    if world == saved_world:
        fix = (f"Set gradient_accumulation_steps {before // per_micro_step} to keep it" if before % per_micro_step == 0
               else f"Set per_device_train_batch_size {old['per_device_train_batch_size']} and "
                    f"gradient_accumulation_steps {old['gradient_accumulation_steps']} back")
        raise UsageError(f"{label}: the global batch was {before} rows per step (per_device_train_batch_size "
                         f"{old['per_device_train_batch_size']} x gradient_accumulation_steps "
                         f"{old['gradient_accumulation_steps']} x {saved_world} process(es)) and is {now} now "
                         f"({new['per_device_train_batch_size']} x {configured} x {world}); the data position "
                         f"counts steps of the first. {fix}, or start a new run in another output_dir")
    if before % per_micro_step:
        raise UsageError(f"{label}: the checkpoint's global batch of {before} rows per step ({saved_world} "
                         f"process(es)) cannot be kept on {world}: {before} is not a multiple of "
                         f"per_device_train_batch_size {new['per_device_train_batch_size']} x {world} process(es). "
                         f"Resume on a number of processes that divides it, or set per_device_train_batch_size so "
                         f"that it does")
    steps = before // per_micro_step
    warn("resume on %d process(es), the checkpoint was saved on %d: gradient_accumulation_steps %d -> %d keeps its "
         "global batch of %d rows per step (per_device_train_batch_size %s x %d x %d)", world, saved_world,
         configured, steps, before, new["per_device_train_batch_size"], steps, world)
    return steps


class ResumeCheck(NamedTuple):
    changed: dict[str, tuple[Any, Any]]  # settings that differ from the checkpoint's: key -> (then, now)
    gradient_accumulation_steps: int  # what keeps the checkpoint's global batch on this run's processes


# trainer_state.json's record of the model's files (``hub.model_fingerprint``), absent in checkpoints before it
MODEL_FINGERPRINT = "model_fingerprint"


def _same_model(label: str, old: Any, new: Any, recorded: str | None, main: bool) -> bool | None:
    """Whether ``new`` holds the model files the checkpoint was trained on, judged by the fingerprint it recorded:
    True (a copy at another path is said in one line), or a refusal where they differ, at the same path too (other
    weights put there since would carry the adapters over another base). None where nothing can be compared (no
    fingerprint recorded; a hub name not in the local cache): the paths decide."""
    from shardtune.hub import model_fingerprint

    now = model_fingerprint(str(new)) if recorded else None
    if now is None:
        return None
    if now != recorded:
        at = "the same path" if _same_place(old, new) else f"{new!r}"
        raise UsageError(f"{label}: the model at {at} is not the one the checkpoint was trained on ({old!r} then): "
                         f"its config.json or weight files differ. Give that model, or start a new run in another "
                         f"output_dir")
    if not _same_place(old, new) and main:
        log.info("resume: model_name_or_path %r -> %r: the same model files (config.json and weights), read from "
                 "the new place", old, new)
    return True


def check_resume(checkpoint: Path, saved: TrainConfig, cfg: TrainConfig, *, saved_world: int, world: int,
                 given_accumulation: int | None = None, main: bool = True, rows_recorded: bool = False,
                 model_recorded: str | None = None) -> ResumeCheck:
    """Refuse a resume from ``checkpoint`` (saved with the config ``saved``) that changes what it is tied to;
    return the changed keys, which take effect, and the accumulation that keeps the global batch.

    ``saved_world`` / ``world``: how many ranks split each global batch then and now (pipeline stages read it
    whole, so they count as one); ``given_accumulation``: see ``accumulation_for``; ``main``: this is the rank
    that says what changed (each rank checks); ``rows_recorded``: the checkpoint holds its training rows' SHA-256,
    which the data's are compared with when it is read; ``model_recorded``: its model files' fingerprint, which
    decides for model_name_or_path where the new one can be read (``_same_model``).
    """
    old, new = saved.to_flat(), cfg.to_flat()
    label = f"resume_from_checkpoint={checkpoint}"
    model_known = _same_model(label, old["model_name_or_path"], new["model_name_or_path"], model_recorded, main)
    for key in FIXED:
        if key in LORA_ONLY and not old["use_peft_lora"] or key == "bnb_4bit_quant_type" and not \
                old["use_4bit_quantization"] or rows_recorded and key in ROW_KEYS or \
                key == "model_name_or_path" and model_known:
            continue
        if not _same(key, old.get(key), new.get(key)):
            was = Path(str(old.get(key))).expanduser()
            relative = (" (a relative path, read from the directory the run was started in: resume from there)"
                        if key == "model_name_or_path" and not was.is_absolute() and not was.exists()
                        and Path(str(new.get(key))).expanduser().exists() else "")
            raise UsageError(f"{label}: {key} was {old.get(key)!r} when the checkpoint was saved and is "
                             f"{new.get(key)!r} now; its weights, optimizer state and data position belong to "
                             f"the first. Set {key} back{relative}, or start a new run in another output_dir")
    if saved.model.pure_bf16 and not cfg.model.pure_bf16:
        # The other way works: fp32 moments load into bf16 ones, and fp32 weights round to bf16.
        raise UsageError(f"{label}: torch_dtype was 'bfloat16' (pure bf16) when the checkpoint was saved and is "
                         f"{new.get('torch_dtype')!r} now; its optimizer state is pure bf16's AdamW, which fp32 "
                         f"master weights cannot continue. Set torch_dtype bfloat16 back, or start a new run in "
                         f"another output_dir")
    accumulation = accumulation_for(label, old, new, saved_world=saved_world, world=world,
                                    given_accumulation=given_accumulation, main=main)
    ignore = {"resume_from_checkpoint", "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps",
              "num_processes", "num_machines", "distributed_type", "overwrite_output_dir"}  # the last: see claim
    changed = {k: (old.get(k), new.get(k)) for k in new if k not in ignore and
               (k not in FIXED or rows_recorded and k in ROW_KEYS) and not _same(k, old.get(k), new.get(k))}
    for key, (then, now) in changed.items():
        log.info("resume: %s changed from %r to %r; %s", key, then, now,
                 "allowed where the training rows stay the checkpoint's (compared when the data is read)"
                 if key in ROW_KEYS else "the new value takes effect from here")
    return ResumeCheck(changed, accumulation)


def rows_changed_by(changed: dict[str, tuple[Any, Any]]) -> str:
    """The keys among ``changed`` (``ResumeCheck.changed``) that shape the training rows, in words for a refusal
    over the rows ('' where none did: the data file itself, the tokenizer or its template file changed)."""
    keys = [f"{key} was {then!r} when the checkpoint was saved and is {now!r} now"
            for key, (then, now) in changed.items() if key in ROW_KEYS]
    return f"; {', '.join(keys)}: set {'it' if len(keys) == 1 else 'them'} back" if keys else ""


def with_accumulation(cfg: TrainConfig, gradient_accumulation_steps: int) -> TrainConfig:
    """``cfg`` running ``gradient_accumulation_steps`` (the resolved config and checkpoints then say so)."""
    if gradient_accumulation_steps == cfg.run.gradient_accumulation_steps:
        return cfg
    return replace(cfg, run=replace(cfg.run, gradient_accumulation_steps=gradient_accumulation_steps))


@contextmanager
def this_runs_optimizer_settings(optimizer) -> Iterator[None]:
    """Keep the settings of ``optimizer``'s groups as this run's config made them (weight_decay, betas, eps, ...)
    through the load of a checkpoint's optimizer state, which brings the saved run's: a resume that changes one
    trains with the new value, as it says. The rate is ``apply_learning_rate``'s."""
    kept = [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
            for group in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)


def apply_learning_rate(optimizer, scheduler, learning_rate: float) -> None:
    """Make ``learning_rate`` the schedule's base, and this run's schedule the rate of the resumed step.

    The checkpoint's optimizer and scheduler state carry the old base rate (``initial_lr``, ``base_lrs``) and the
    old schedule's rate for the next step, which would otherwise win over the new config silently. Under
    reduce_lr_on_plateau the rate is ``learning_rate`` times the cuts the checkpoint made (none, where it started
    afresh: ``load_schedule_state``), not below min_lr.
    """
    if moves_on_evaluations(scheduler):  # reduce_lr_on_plateau: its cuts so far, from the new rate
        for group, base, now, floor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler._last_lr,
                                           scheduler.min_lrs):
            group["lr"] = max(learning_rate * now / base, floor) if base else learning_rate
        scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        return
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
