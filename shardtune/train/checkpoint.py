"""Checkpoints that resume exactly, and the export in Hugging Face formats.

A checkpoint ``output_dir/checkpoints/step-N/`` holds:
- the model (the trainable part only for LoRA/QLoRA) and optimizer, either ``dcp/`` written by every rank with
  ``torch.distributed.checkpoint`` (SHARDED_STATE_DICT: resharded on load, so a run may resume on another world
  size) or ``model.safetensors`` + ``optimizer.pt`` gathered and written by rank 0 (FULL_STATE_DICT); pipeline
  stages key their optimizer state by parameter name (``flat_optimizer`` in the manifest), as each holds other
  parameters;
- ``rng/rank-R.pt``: each rank's RNG states (dropout must draw the same masks after resume), tensors only;
- ``trainer_state.json``: step, epochs done (a float, as in Transformers), the data sampler's position, scheduler
  and gradient-scaler state;
- ``config.yaml``: the resolved config; ``manifest.json``: written last, lists what a complete checkpoint holds,
  with the size and SHA-256 of every other file: a checkpoint is checked against it before it loads, a damaged
  one is refused in one line naming the file, and ``resume_from_checkpoint true`` takes the newest intact one.
Everything is written into ``.tmp-step-N`` and renamed once every rank has finished, so a ``step-N`` folder is
always complete; a leftover ``.tmp-*`` (a save that was killed) is ignored with a warning. A write that fails
(disk full, no permission) or is interrupted (Ctrl-C on rank 0) removes the temporary folder and stops every rank at
once, not at the next collective's timeout: rank 0 raises its own error, the others a ``RankFailed`` naming rank 0,
the checkpoint and the cause. A failed write is an OSError naming the file, also where safetensors or torch.save
said it in their own words (``errors.writing``), so the trainer reports it in one line.
A resumed run appends to ``metrics.jsonl`` after dropping the records past the checkpoint's step (a killed run
logged steps that the resumed run redoes), so every step appears once, with the loss of the run that kept it.
Loading runs no code from the files (``safe_load.py``): DCP's metadata is unpickled through an allow-list of the
classes DCP writes, its non-tensor values and every ``.pt`` file load with ``weights_only=True``, safetensors holds
tensors only, and the rest is JSON and YAML (``yaml.safe_load``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from shardtune.config import TrainConfig
from shardtune.config.loading import load_saved_config
from shardtune.dist import DistInfo, RankFailed, run_and_share
from shardtune.errors import TrainingStopped, UsageError, as_write_error, first_line, writing
from shardtune.files import write_text
from shardtune.hub import model_fingerprint
from shardtune.strategies import resolve
from shardtune.train.layout import (MANIFEST, RESUME_NEWEST, RESUME_OFF, STEP_FOLDER, manifest_problem,
                                    newest_trainer_checkpoint, resume_problem, trainer_checkpoint_problem)
from shardtune.train.model import trainable_token_ids
from shardtune.train.output_dir import drop_checkpoint
from shardtune.train.plan import Plan
from shardtune.train.resume import (MODEL_FINGERPRINT, apply_learning_rate, check_resume, rows_changed_by,
                                    this_runs_optimizer_settings)
from shardtune.train.safe_load import damage, file_digest, file_digests, load_dcp, load_pt, load_safetensors, read_json
from shardtune.train.state import TrainState, rng_state, set_rng_state, trainer_state_problem

log = logging.getLogger("shardtune")
FORMAT_VERSION = 2  # 2: the manifest lists every file with its size and SHA-256
SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def state_dict_options(trainable_only: bool, full: bool = False, flat_optimizer: bool = False) -> StateDictOptions:
    # A LoRA checkpoint holds only the adapters, so loading it must not ask for the frozen base (strict=False).
    # flat_optimizer keys the optimizer's param-group settings by parameter name ("param_groups.<name>.lr")
    # instead of by group index: pipeline stages each hold different parameters, and DCP keeps a single copy
    # of a key that every rank writes, so "param_groups.0.params" would keep one stage's list and the other
    # stages would load their groups without lr, betas, ...
    return StateDictOptions(ignore_frozen_params=trainable_only, full_state_dict=full, cpu_offload=full,
                            strict=not trainable_only, flatten_optimizer_state_dict=flat_optimizer)


# What bitsandbytes' Linear4bit adds to a state dict beside its frozen weight (weight.absmax, weight.quant_map, the
# nested ones, weight.quant_state.bitsandbytes__nf4): one process holds it, an FSDP2-sharded 4-bit weight does not.
_QUANT_STATE_KEY = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.\w+)$")


def model_state_dict(model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
    """``get_model_state_dict``, and with ``ignore_frozen_params`` (a LoRA/QLoRA checkpoint) without the 4-bit
    base's quantisation state: it belongs to the frozen base, which every load quantises afresh, and an FSDP2
    QLoRA checkpoint lacks it, so a 1-process resume or export that asked for it stopped at "Missing key"."""
    state = get_model_state_dict(model, options=options)
    if not options.ignore_frozen_params:
        return state
    return {key: value for key, value in state.items() if not _QUANT_STATE_KEY.search(key)}


def _optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                          options: StateDictOptions) -> dict[str, Any]:
    """``get_optimizer_state_dict``, and {} for an optimizer that holds no parameter (a pipeline stage none of whose
    modules LoRA adapts), which it refuses ("optim state_dict is empty")."""
    if not _has_parameters(optimizer):
        return {}
    return get_optimizer_state_dict(model, optimizer, options=options)


def _has_parameters(optimizer: torch.optim.Optimizer) -> bool:
    return any(group["params"] for group in optimizer.param_groups)


def _write_full(folder: Path, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """FULL_STATE_DICT (rank 0): one model file and one optimizer file of the gathered state."""
    from safetensors.torch import save_file

    from shardtune.files import give_plain_mode

    # Tied weights share storage, which safetensors refuses; each tensor gets its own copy.
    tensors = {k: v.detach().clone().contiguous() for k, v in model_state.items()}
    with writing(folder / "model.safetensors"):
        save_file(tensors, folder / "model.safetensors")
    with writing(folder / "optimizer.pt"):
        torch.save(optim_state, folder / "optimizer.pt")
    give_plain_mode(folder / "model.safetensors")  # save_file's 0600 is no other file's mode in a checkpoint


def _fresh_folder(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "rng").mkdir(parents=True)


def _complete(tmp: Path, final: Path, trainer_state: dict[str, Any], config_yaml: str,
              manifest: dict[str, Any], digests: dict[str, dict[str, Any]]) -> None:
    """Rank 0, once every rank has written and hashed its part (``digests``): the small files, the manifest last
    (with every file's size and SHA-256, so damage is found before a load), then the rename."""
    small = ("trainer_state.json", "config.yaml")
    (tmp / small[0]).write_text(json.dumps(trainer_state, indent=1))
    (tmp / small[1]).write_text(config_yaml)
    digests = {**digests, **{name: file_digest(tmp / name) for name in small}}
    history = _digest(logged_losses(final.parent.parent, manifest["step"]))  # checkpoints/step-N: in output_dir
    manifest = {**manifest, "history": history, "files": dict(sorted(digests.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _dcp_write_error(exc: CheckpointException, path: Path) -> OSError | None:
    """The failed write a DCP save's first failing rank stands for, naming ``path`` (DCP's own words name no file:
    "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" for a full disk); None for another
    failure, which keeps DCP's exception."""
    if not exc.failures:
        return None
    cause = min(exc.failures.items())[1][0]
    if isinstance(cause, OSError):
        return OSError(cause.errno, cause.strerror, str(path)) if cause.errno and not cause.filename else cause
    return as_write_error(cause, path)


def save_checkpoint(output_dir: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool, trainer_state: dict[str, Any], config_yaml: str, info: DistInfo,
                    save_total_limit: int | None = None, state_dict_type: str = SHARDED,
                    flat_optimizer: bool = False, keep: Path | None = None) -> Path:
    """Write ``checkpoints/step-{step}`` from every rank; returns its path once it is complete.

    ``save_total_limit`` then deletes the oldest complete checkpoints beyond it, but never ``keep`` (the best one).

    ``flat_optimizer`` (pipeline parallel, SHARDED only): optimizer state keyed by parameter name, see ``_options``.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    what = f"saving checkpoint {final}"
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": info.world_size,
                "trainable_only": trainable_only, "state_dict_type": state_dict_type,
                "flat_optimizer": flat_optimizer, "complete": True,
                **({"trainable_token_ids": tokens} if (tokens := trainable_token_ids(model)) else {})}

    def drop_tmp() -> None:  # a failed write leaves nothing half-written (a killed save does: it is ignored)
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    run_and_share(lambda: _fresh_folder(tmp), runs=info.is_main, what=what, on_failure=drop_tmp)
    full_state = None
    if state_dict_type == FULL:  # every rank helps gather, rank 0 writes
        options = state_dict_options(trainable_only, full=True)
        full_state = (model_state_dict(model, options),
                      _optimizer_state_dict(model, optimizer, options))
    else:
        options = state_dict_options(trainable_only, flat_optimizer=flat_optimizer)
        state = {"model": model_state_dict(model, options),
                 "optim": _optimizer_state_dict(model, optimizer, options)}
        try:  # DCP shares a failed write among the ranks itself (CheckpointException on every rank)
            dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not info.distributed)
        except CheckpointException as exc:
            drop_tmp()
            if (failed := _dcp_write_error(exc, final / "dcp")) is not None:
                raise failed from exc
            raise

    def write_own_part() -> None:
        if full_state is not None and info.is_main:
            _write_full(tmp, *full_state)
        with writing(tmp / "rng" / f"rank-{info.rank}.pt"):
            torch.save(rng_state(), tmp / "rng" / f"rank-{info.rank}.pt")

    run_and_share(write_own_part, runs=True, what=what, on_failure=drop_tmp)
    # Every rank hashes its share of the files (each reads 1/world of the checkpoint), rank 0 gathers them.
    mine: dict[str, dict[str, Any]] = {}
    run_and_share(lambda: mine.update(file_digests(tmp, skip=MANIFEST, share=_share(info))), runs=True, what=what,
                  on_failure=drop_tmp)
    digests = {name: digest for part in _gather(mine, info) for name, digest in part.items()}
    run_and_share(lambda: _complete(tmp, final, trainer_state, config_yaml, manifest, digests), runs=info.is_main,
                  what=what, on_failure=drop_tmp)
    if info.is_main and save_total_limit:
        for old in complete_checkpoints(output_dir)[:-save_total_limit]:
            if keep is None or old.resolve() != keep.resolve():
                drop_checkpoint(old)  # a file of the user's in it is kept, moved aside
    return final


def complete_checkpoints(output_dir: str | Path, *, warn: bool = True) -> list[Path]:
    """Complete checkpoints, oldest first; ``warn``s about any save that was killed half-way."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
        elif warn and (entry.name.startswith(".tmp-step-") or match):
            log.warning("ignoring incomplete checkpoint %s (its save was interrupted)", entry)
    return [path for _, path in sorted(found)]


def checkpoint_damage(path: Path, info: DistInfo | None = None) -> str | None:
    """What in checkpoint ``path`` differs from its manifest, or in the manifest from what a save writes (one line),
    or None. Every rank checks its share of the files and all hear the first problem (in name order), so every
    rank reads 1/world of the checkpoint. A checkpoint written before manifests listed their files (format 1)
    cannot be checked: None."""
    manifest = read_json(path / MANIFEST)
    if problem := manifest_problem(manifest, path / MANIFEST):  # the same file on every rank: all return here
        return problem
    digests = manifest.get("files")
    if digests is None:
        return None
    found = [problem for problem in _gather(damage(path, digests, share=_share(info)), info) if problem]
    return min(found) if found else None


def state_problem(path: Path) -> str | None:
    """What in checkpoint ``path``'s trainer_state.json no run could have saved (``trainer_state_problem``), or
    None; a file that is not JSON is damage, said so."""
    try:
        state, manifest = read_json(path / "trainer_state.json"), read_json(path / MANIFEST)
    except (OSError, UsageError) as exc:
        return str(exc)
    match = STEP_FOLDER.match(path.name)
    return trainer_state_problem(state, folder_step=int(match.group(1)) if match else None,
                                 manifest_step=manifest.get("step") if isinstance(manifest, dict) else None)


def checkpoint_problem(path: Path, info: DistInfo | None = None) -> str | None:
    """Why checkpoint ``path`` cannot be resumed: its files against the manifest, then its trainer state."""
    return checkpoint_damage(path, info) or state_problem(path)


def _share(info: DistInfo | None) -> tuple[int, int]:
    """(rank, world size): which share of a checkpoint's files this rank hashes or checks."""
    return (info.rank, info.world_size) if info is not None and info.distributed else (0, 1)


def _gather(part: Any, info: DistInfo | None) -> list[Any]:
    """Every rank's ``part``, in rank order, on every rank (just ``[part]`` without a process group)."""
    if info is None or not info.distributed:
        return [part]
    import torch.distributed as dist

    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, part)
    return parts


def resolve_resume(spec: str | None, output_dir: str | Path, info: DistInfo | None = None) -> Path | None:
    """``resume_from_checkpoint``: a folder, or true for the newest intact checkpoint in ``output_dir``.

    A damaged checkpoint (a file cut short, changed or missing against its manifest, or a trainer state no run
    could have saved) is refused when named; with true, the newest one before it is taken, with a warning naming
    what was wrong.
    """
    if spec is None or str(spec).lower() in RESUME_OFF:
        return None
    if str(spec).lower() in RESUME_NEWEST:
        found = complete_checkpoints(output_dir)
        trainer = None if found else newest_trainer_checkpoint(output_dir)
        if trainer:  # a run moved from Transformers' Trainer: starting from scratch is not what it asks for
            raise UsageError(trainer_checkpoint_problem(trainer, f"resume_from_checkpoint=true: no shardtune "
                                                                 f"checkpoint in {output_dir}, only {trainer}"))
        if not found:  # the run starts from scratch, unless it ended already (the loop says which)
            return None
        for path in reversed(found):
            problem = checkpoint_problem(path, info)
            if problem is None:
                return path
            log.warning("resume_from_checkpoint=true: skipping %s: %s", path.name, problem)
        raise UsageError(f"resume_from_checkpoint=true: every checkpoint in {checkpoints_dir(output_dir)} is damaged "
                         f"(the oldest: {problem}); start afresh with resume_from_checkpoint false")
    problem = resume_problem(str(spec), f"resume_from_checkpoint={spec}")
    if problem is None:
        damaged = checkpoint_problem(Path(spec), info)
        problem = damaged and f"resume_from_checkpoint={spec}: {damaged}; resume from an earlier checkpoint"
    if problem:
        raise UsageError(problem)
    return Path(spec)


def _read_full(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return load_safetensors(path / "model.safetensors"), load_pt(path / "optimizer.pt")


def _read_full_on_rank0(path: Path, info: DistInfo) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Rank 0 reads the consolidated files; the other ranks get empty dicts and receive every tensor from it."""
    if not info.distributed:
        return _read_full(path)
    full: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
    run_and_share(lambda: full.append(_read_full(path)), runs=info.is_main, what=f"reading checkpoint {path}")
    return full[0] if full else ({}, {})


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool,
                    info: DistInfo) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer state."""
    manifest = read_json(path / MANIFEST)
    if manifest.get("trainable_only", trainable_only) != trainable_only:
        saved = "LoRA adapters only" if manifest["trainable_only"] else "all weights"
        raise UsageError(f"resume_from_checkpoint={path}: the checkpoint holds {saved}, this run "
                         f"{'trains LoRA' if trainable_only else 'is full fine-tuning'}; keep use_peft_lora as saved")
    if manifest.get("state_dict_type", SHARDED) == FULL:
        # Rank 0 reads the consolidated files and broadcasts each tensor; every rank keeps its own shard of it.
        model_state, optim_state = _read_full_on_rank0(path, info)
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only,
                                   strict=not trainable_only, broadcast_from_rank0=info.distributed)
    else:
        # The layout the checkpoint was written in (older checkpoints: param groups by index).
        options = state_dict_options(trainable_only, flat_optimizer=manifest.get("flat_optimizer", False))
        state = {"model": model_state_dict(model, options),
                 "optim": _optimizer_state_dict(model, optimizer, options)}
        load_dcp(state, path / "dcp", no_dist=not info.distributed)
        model_state, optim_state = state["model"], state["optim"]
    set_model_state_dict(model, model_state, options=options)
    if _has_parameters(optimizer):
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    rng_file = path / "rng" / f"rank-{info.rank}.pt"
    if rng_file.is_file():
        set_rng_state(load_pt(rng_file))
    if manifest["world_size"] != info.world_size and info.is_main:
        log.warning("resuming a %d-process checkpoint on %d process%s: weights and optimizer are resharded; "
                    "the data order is kept (same global batch), random draws such as dropout masks differ",
                    manifest["world_size"], info.world_size, "" if info.world_size == 1 else "es")
    return read_json(path / "trainer_state.json")


def logged_losses(output_dir: Path, step: int) -> list[list]:
    """The (step, loss) records ``output_dir``'s metrics.jsonl logged up to ``step``: the history a checkpoint
    saved at ``step`` carries on."""
    return [[record.get("step"), record["loss"]] for _, record in _metric_records(output_dir / "metrics.jsonl")
            if "loss" in record and record.get("step", 0) <= step]


def _metric_records(path: Path) -> list[tuple[str, dict]]:
    """Each line of a metrics.jsonl with its record; a line cut short by a kill is left out."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append((line, record))
    return records


def _digest(logged: list[list]) -> str:
    return hashlib.sha256(json.dumps(logged).encode()).hexdigest()


def history_problem(output_dir: Path, checkpoint: Path, step: int) -> str | None:
    """Resuming ``checkpoint`` into ``output_dir``, whose metrics.jsonl must be the history the checkpoint carries
    on (its manifest's ``history``): the run keeps the records up to ``step`` and logs after them. Another run's
    folder, or this run's after a resume from an earlier step took another branch, would mix two runs' losses in
    one file (and its trackers, and what save_total_limit keeps). None where they agree, or nothing tells (no
    metrics.jsonl; an older manifest). Step ``step``'s own record may have come after the save (an epoch's end logs
    again), so the history without it agrees too."""
    saved = read_json(checkpoint / MANIFEST).get("history")
    if saved is None or not (output_dir / "metrics.jsonl").is_file():
        return None
    logged = logged_losses(output_dir, step)
    if saved in (_digest(logged), _digest([record for record in logged if record[0] != step])):
        return None
    return (f"resume_from_checkpoint {checkpoint}: output_dir {output_dir} holds another history (its metrics.jsonl "
            f"up to step {step} is not what the checkpoint was trained through: another run, or another branch of "
            f"this one); resume into the run folder that saved the checkpoint, or give an empty output_dir to "
            f"carry on from it there")


def trim_metrics(output_dir: str | Path, step: int) -> int:
    """Drop ``metrics.jsonl`` records after ``step``: a killed run logged steps that the resumed run redoes.

    Returns how many records were dropped. The file is rewritten to a temporary name and renamed.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line, record in _metric_records(path) if record.get("step", 0) <= step]
    if len(kept) != len(lines):
        write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


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


class ResumePoint(NamedTuple):
    path: Path
    step: int  # the checkpoint's optimizer step (checked against its folder and manifest)
    changed: dict[str, tuple[Any, Any]]  # the settings that differ from the checkpoint's: key -> (then, now)
    gradient_accumulation_steps: int  # keeps the checkpoint's global batch on this run's processes


def resume_point(cfg: TrainConfig, info) -> ResumePoint | None:
    """The checkpoint this run resumes from (None for a fresh run), checked against the new config before
    anything is written: damaged files and settings the checkpoint is tied to are refused in one line."""
    path = resolve_resume(cfg.checkpoint.resume_from_checkpoint, cfg.run.output_dir, info)
    if path is None:
        return None
    old = load_saved_config(path / "config.yaml")
    # A pipeline's stages all read the whole batch: its data is split over one rank, whatever the processes.
    saved_world = (int(read_json(path / MANIFEST)["world_size"])
                   if resolve(old.distributed.distributed_type, False).shards_batch else 1)
    world = info.world_size if resolve(cfg.distributed.distributed_type, False).shards_batch else 1
    state = read_json(path / "trainer_state.json")
    step, given = state["step"], state.get("configured_gradient_accumulation_steps")
    point = ResumePoint(path, step, *check_resume(path, old, cfg, saved_world=saved_world, world=world,
                                                  given_accumulation=given, main=info.is_main,
                                                  rows_recorded=bool(state["sampler"].get("rows_sha256")),
                                                  model_recorded=state.get(MODEL_FINGERPRINT)))
    if problem := history_problem(Path(cfg.run.output_dir), path, step):
        raise UsageError(problem)
    return point


class Checkpointer:
    """Saves when ``save_strategy`` says so, resumes a run, and remembers the last complete checkpoint."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, plan: Plan, model: nn.Module,
                 optimizer: torch.optim.Optimizer, state: TrainState, *, flat_optimizer: bool) -> None:
        self.out = Path(cfg.run.output_dir)
        self.settings = cfg.checkpoint
        self.config_yaml = yaml.safe_dump(cfg.to_flat(), sort_keys=False)
        self.info, self.plan, self.model, self.optimizer, self.state = info, plan, model, optimizer, state
        self.trainable_only = cfg.lora.use_peft_lora
        self.learning_rate = cfg.optim.learning_rate
        self.flat_optimizer = flat_optimizer
        self.resumed_from: Path | None = None
        self.resumed_step: int | None = None  # the step the run resumed at
        self.last: str | None = None
        self.model_name_or_path = cfg.model.model_name_or_path
        self._model_fingerprint: str | None = None  # read at the first save (``hub.model_fingerprint``)

    def should_save(self, step: int, *, at_epoch_end: bool, at_end: bool = False) -> bool:
        """epoch: each epoch's end; steps: every save_steps and the run's last step (``at_end``: max_steps reached),
        as Transformers' Trainer saves, so a run given more steps carries on from where it ended."""
        if self.settings.save_strategy == "epoch":
            return at_epoch_end
        return self.settings.save_strategy == "steps" and not at_epoch_end and (
            step % self.settings.save_steps == 0 or at_end)

    def resume(self, point: ResumePoint | None) -> Path | None:
        """Restore model, optimizer and ``state`` from ``resume_point``'s answer, if any. Nothing in output_dir
        changes here (a refusal leaves the run as it was): ``drop_redone_metrics`` trims metrics.jsonl after."""
        if point is None:
            return None
        path = point.path
        with this_runs_optimizer_settings(self.optimizer):
            trainer_state = load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                            trainable_only=self.trainable_only, info=self.info)
        try:
            self.state.load_state_dict(trainer_state)
        except UsageError as exc:  # the data order it cannot continue: named with the checkpoint the user gave
            raise UsageError(f"resume_from_checkpoint={path}: {str(exc).rstrip('.')}"
                             f"{rows_changed_by(point.changed)}") from None
        # The optimizer holds the rate the checkpoint's schedule set for the next step; this run's schedule (its
        # learning_rate, max_steps, warm-up or type may have changed) sets it instead. Unchanged, it is the same
        # value, computed the same way.
        then = self.optimizer.param_groups[0]["lr"]
        apply_learning_rate(self.optimizer, self.state.scheduler, self.learning_rate)
        now = self.optimizer.param_groups[0]["lr"]
        if self.info.is_main and not math.isclose(then, now, rel_tol=1e-9, abs_tol=1e-15):
            # e.g. a finished linear schedule stretched over more steps: its rate rises again, which no key says
            log.info("resume: step %d trains at lr %.6g, this run's schedule's rate, not %.6g, the checkpoint's "
                     "schedule's for that step: the rate follows the new settings from here", self.state.step + 1,
                     now, then)
        log.info("resumed from %s at step %d (epoch %g)", path, self.state.step, self.state.epochs_done)
        self.resumed_from, self.resumed_step, self.last = path, self.state.step, str(path)
        return path

    def drop_redone_metrics(self) -> None:
        """A killed run may have logged steps after the checkpoint this run resumed from (or, killed before its
        first checkpoint, any step): this run logs them again, so they leave metrics.jsonl."""
        if not self.info.is_main:
            return
        if self.resumed_from is not None:
            elsewhere = self.out.resolve() not in self.resumed_from.resolve().parents  # another run's checkpoint
            if elsewhere and self.state.step and not (self.out / "metrics.jsonl").exists():
                log.info("metrics.jsonl: %s holds only the steps after %d; the records up to step %d are in the "
                         "metrics.jsonl of the run that saved %s, and in trainer_state.json's log_history",
                         self.out / "metrics.jsonl", self.state.step, self.state.step, self.resumed_from)
            if dropped := trim_metrics(self.out, self.state.step):
                ends = self.state.step >= self.state.max_steps  # max_steps reached there: nothing is redone
                log.info("metrics.jsonl: dropped %d record(s) after step %d, %s", dropped, self.state.step,
                         "where this run resumes and, at max_steps, ends" if ends else "which this run redoes")
        elif str(self.settings.resume_from_checkpoint).lower() in RESUME_NEWEST:
            trim_metrics(self.out, 0)  # the run starts again at step 1

    def save(self, reason: str) -> Path:
        """Write ``checkpoints/step-N`` for the current step; a failed write stops the run in one line."""
        step = self.state.step
        best = self.state.best.checkpoint_step
        if self._model_fingerprint is None and self.info.is_main:  # only rank 0 writes trainer_state.json
            self._model_fingerprint = model_fingerprint(self.model_name_or_path) or ""
        trainer_state = {**self.state.state_dict(),
                         **({MODEL_FINGERPRINT: self._model_fingerprint} if self._model_fingerprint else {})}
        try:
            path = save_checkpoint(self.out, step, model=self.model, optimizer=self.optimizer,
                                   trainable_only=self.trainable_only, trainer_state=trainer_state,
                                   config_yaml=self.config_yaml, info=self.info,
                                   save_total_limit=self.settings.save_total_limit,
                                   state_dict_type=self.plan.state_dict_type, flat_optimizer=self.flat_optimizer,
                                   keep=checkpoints_dir(self.out) / f"step-{best}" if best is not None else None)
        except (OSError, RankFailed, CheckpointException) as exc:
            raise TrainingStopped(
                f"step {step}: the checkpoint was not saved ({write_failure(exc)}). Last good checkpoint: "
                f"{self.last or 'none'}; {write_fix(exc, self.out)}; then run again"
                f"{f' with resume_from_checkpoint={self.last}' if self.last else ''}") from exc
        self.last = str(path)
        log.info("saved checkpoint %s (%s)", path, reason)
        return path

    def load_best(self, last_eval: dict[str, Any] | None = None) -> Path | None:
        """``load_best_model_at_end``: put the best checkpoint's weights in the model (None when the last step's
        are the best). Its files are checked against its manifest first. ``last_eval``: the run's latest eval
        record; where it evaluated the last step (early stopping at a step that saved nothing) and beat the best
        checkpoint, the last step's weights are the better ones and stay."""
        best = self.state.best
        if best.checkpoint_step is None or best.checkpoint_step == self.state.step:
            return None
        if last_eval is not None and last_eval.get("step") == self.state.step and \
                best.better(last_eval[best.metric], best.checkpoint_value):
            log.info("load_best_model_at_end: final/ holds the last step's weights (step %d, %s %.6g): they beat "
                     "the best checkpoint, step-%d (%.6g)", self.state.step, best.metric, last_eval[best.metric],
                     best.checkpoint_step, best.checkpoint_value)
            return None
        path = Path(self.state.best_model_checkpoint)  # in the run resumed from, where it saved the best
        if not (path / MANIFEST).is_file():
            raise TrainingStopped(f"load_best_model_at_end: the best checkpoint, {path}, is gone (no {MANIFEST}); "
                                  f"final/ was not written. Export the checkpoint you want with 'shardtune export'")
        if problem := checkpoint_damage(path, self.info):
            raise TrainingStopped(f"load_best_model_at_end: the best checkpoint is damaged ({problem}); final/ "
                                  f"was not written. Export an intact checkpoint with 'shardtune export'")
        load_checkpoint(path, model=self.model, optimizer=self.optimizer, trainable_only=self.trainable_only,
                        info=self.info)
        log.info("load_best_model_at_end: final/ holds %s (%s %.6g), not the last step's weights", path,
                 best.metric, best.checkpoint_value)
        return path

    def just_saved(self) -> bool:
        return bool(self.last) and Path(self.last).name == f"step-{self.state.step}"
