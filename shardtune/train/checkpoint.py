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
- ``config.yaml``: the resolved config; ``manifest.json``: written last, lists what a complete checkpoint holds.
Everything is written into ``.tmp-step-N`` and renamed once every rank has finished, so a ``step-N`` folder is
always complete; a leftover ``.tmp-*`` (a save that was killed) is ignored with a warning. A write that fails
(disk full, no permission) or is interrupted (Ctrl-C on rank 0) removes the temporary folder and stops every rank at
once, not at the next collective's timeout: rank 0 raises its own error, the others a ``RankFailed`` naming rank 0,
the checkpoint and the cause. A failed write is an OSError naming the file, also where safetensors or torch.save
said it in their own words (``errors.writing``), so the trainer reports it in one line.
A resumed run appends to ``metrics.jsonl`` after dropping the records past the checkpoint's step (a killed run
logged steps that the resumed run redoes), so every step appears once, with the loss of the run that kept it.
Nothing is unpickled: DCP and safetensors read tensors, ``.pt`` files load with ``weights_only=True``, the rest is
JSON and YAML.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from shardtune.config import (MANIFEST, RESUME_NEWEST, RESUME_OFF, STEP_FOLDER,
                              checkpoint_folder_problem)
from shardtune.errors import UsageError, writing
from shardtune.train.dist import DistInfo, run_and_share

log = logging.getLogger("shardtune")
FORMAT_VERSION = 1
SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"
# Test-only fault injection: "POINT:STEP[:RANK[:HOW]]", POINT during_save or after_save, SIGKILLs the rank(s)
# there (HOW: TERM sends SIGTERM instead, TERM-LAUNCHER sends it to the parent launcher), on the first attempt
# of an elastic job only, so a restarted job runs through. POINT write_full with HOW ENOSPC makes the writing of
# the FULL_STATE_DICT files fail as a full disk does; with HOW INT the rank gets SIGINT there (Ctrl-C).
FAULT_ENV = "SHARDTUNE_TEST_KILL"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _options(trainable_only: bool, full: bool = False, flat_optimizer: bool = False) -> StateDictOptions:
    # A LoRA checkpoint holds only the adapters, so loading it must not ask for the frozen base (strict=False).
    # flat_optimizer keys the optimizer's param-group settings by parameter name ("param_groups.<name>.lr")
    # instead of by group index: pipeline stages each hold different parameters, and DCP keeps a single copy
    # of a key that every rank writes, so "param_groups.0.params" would keep one stage's list and the other
    # stages would load their groups without lr, betas, ...
    return StateDictOptions(ignore_frozen_params=trainable_only, full_state_dict=full, cpu_offload=full,
                            strict=not trainable_only, flatten_optimizer_state_dict=flat_optimizer)


def _test_fault(point: str, step: int, info: DistInfo, path: Path | None = None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_point, want_step, want_rank, how = (spec.split(":") + ["", "", "", ""])[:4]
    if want_point == point and int(want_step) == step and (not want_rank or int(want_rank) == info.rank):
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if how == "INT":  # Ctrl-C where only this rank gets it: Python raises KeyboardInterrupt right here
            os.kill(os.getpid(), signal.SIGINT)
        if how == "TERM":  # what a scheduler sends this process before preemption
            os.kill(os.getpid(), signal.SIGTERM)
        elif how == "TERM-LAUNCHER":  # ... or the launcher, which forwards it to every worker
            os.kill(os.getppid(), signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict[str, Any]:
    """Every RNG that training draws from, as tensors and plain values (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}
    if torch.cuda.is_available():
        # Every visible GPU's generator (host-side state, no context is made): MP's stages draw dropout masks on
        # their own devices.
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_all"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        if len(state.get("cuda_all", ())) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_all"])
        torch.cuda.set_rng_state(state["cuda"])


def _write_full(folder: Path, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """FULL_STATE_DICT (rank 0): one model file and one optimizer file of the gathered state."""
    from safetensors.torch import save_file

    # Tied weights share storage, which safetensors refuses; each tensor gets its own copy.
    tensors = {k: v.detach().clone().contiguous() for k, v in model_state.items()}
    with writing(folder / "model.safetensors"):
        save_file(tensors, folder / "model.safetensors")
    with writing(folder / "optimizer.pt"):
        torch.save(optim_state, folder / "optimizer.pt")


def _fresh_folder(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "rng").mkdir(parents=True)


def _complete(tmp: Path, final: Path, trainer_state: dict[str, Any], config_yaml: str,
              manifest: dict[str, Any]) -> None:
    """Rank 0, once every rank has written its part: the small files, the manifest last, then the rename."""
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def save_checkpoint(output_dir: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool, trainer_state: dict[str, Any], config_yaml: str, info: DistInfo,
                    save_total_limit: int | None = None, state_dict_type: str = SHARDED,
                    flat_optimizer: bool = False) -> Path:
    """Write ``checkpoints/step-{step}`` from every rank; returns its path once it is complete.

    ``flat_optimizer`` (pipeline parallel, SHARDED only): optimizer state keyed by parameter name, see ``_options``.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    what = f"saving checkpoint {final}"
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": info.world_size,
                "trainable_only": trainable_only, "state_dict_type": state_dict_type,
                "flat_optimizer": flat_optimizer, "complete": True}

    def drop_tmp() -> None:  # a failed write leaves nothing half-written (a killed save does: it is ignored)
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    run_and_share(lambda: _fresh_folder(tmp), runs=info.is_main, what=what, on_failure=drop_tmp)
    full_state = None
    if state_dict_type == FULL:  # every rank helps gather, rank 0 writes
        options = _options(trainable_only, full=True)
        full_state = (get_model_state_dict(model, options=options),
                      get_optimizer_state_dict(model, optimizer, options=options))
    else:
        options = _options(trainable_only, flat_optimizer=flat_optimizer)
        state = {"model": get_model_state_dict(model, options=options),
                 "optim": get_optimizer_state_dict(model, optimizer, options=options)}
        try:  # DCP shares a failed write among the ranks itself (CheckpointException on every rank)
            dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not info.distributed)
        except CheckpointException:
            drop_tmp()
            raise

    def write_own_part() -> None:
        if full_state is not None and info.is_main:
            _test_fault("write_full", step, info, tmp / "model.safetensors")
            _write_full(tmp, *full_state)
        with writing(tmp / "rng" / f"rank-{info.rank}.pt"):
            torch.save(rng_state(), tmp / "rng" / f"rank-{info.rank}.pt")
        _test_fault("during_save", step, info)

    run_and_share(write_own_part, runs=True, what=what, on_failure=drop_tmp)
    run_and_share(lambda: _complete(tmp, final, trainer_state, config_yaml, manifest), runs=info.is_main,
                  what=what, on_failure=drop_tmp)
    if info.is_main and save_total_limit:
        for old in complete_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    _test_fault("after_save", step, info)
    return final


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first; warns about any save that was killed half-way."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
        elif entry.name.startswith(".tmp-step-") or match:
            log.warning("ignoring incomplete checkpoint %s (its save was interrupted)", entry)
    return [path for _, path in sorted(found)]


def resolve_resume(spec: str | None, output_dir: str | Path) -> Path | None:
    """``resume_from_checkpoint``: a folder, or true for the newest complete checkpoint in ``output_dir``."""
    if spec is None or str(spec).lower() in RESUME_OFF:
        return None
    if str(spec).lower() in RESUME_NEWEST:
        found = complete_checkpoints(output_dir)
        if not found:
            log.warning("resume_from_checkpoint=true: no complete checkpoint in %s; starting from scratch",
                        checkpoints_dir(output_dir))
            return None
        return found[-1]
    path = Path(spec)
    problem = checkpoint_folder_problem(path, f"resume_from_checkpoint={spec}", or_else=", or true for the newest one")
    if problem:
        raise UsageError(problem)
    return path


def _read_full(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors"), torch.load(path / "optimizer.pt", weights_only=True)


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
    manifest = json.loads((path / MANIFEST).read_text())
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
        options = _options(trainable_only, flat_optimizer=manifest.get("flat_optimizer", False))
        state = {"model": get_model_state_dict(model, options=options),
                 "optim": get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not info.distributed)
        model_state, optim_state = state["model"], state["optim"]
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    rng_file = path / "rng" / f"rank-{info.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    if manifest["world_size"] != info.world_size:
        log.warning("resuming a %d-process checkpoint on %d processes: weights and optimizer are resharded; "
                    "the data order is kept (same global batch), random draws such as dropout masks differ",
                    manifest["world_size"], info.world_size)
    return json.loads((path / "trainer_state.json").read_text())


def trim_metrics(output_dir: str | Path, step: int) -> int:
    """Drop ``metrics.jsonl`` records after ``step``: a killed run logged steps that the resumed run redoes.

    Returns how many records were dropped. The file is rewritten to a temporary name and renamed.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) != len(lines):
        tmp = path.with_name(".tmp-metrics.jsonl")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def write_export(target: Path, model: nn.Module, state: dict[str, torch.Tensor], tokenizer, is_peft: bool, *,
                 save_adapter: Callable[[nn.Module, dict[str, torch.Tensor], Path], None] | None = None) -> Path:
    """``save_pretrained`` of ``state`` into a temporary folder, renamed to ``target`` when complete.

    ``save_adapter`` replaces PEFT's own adapter writing (the pipeline's stages each hold part of the adapters).
    """
    from shardtune.train.parallelize import unwrap

    if target.exists() and not target.is_dir():  # found before the (long) write, not after it
        raise NotADirectoryError(errno.ENOTDIR, "a file is where the exported folder goes; move it away", str(target))
    tmp = target.with_name(f".tmp-{target.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        with writing(tmp):  # save_pretrained does not say which of its files failed
            if is_peft and save_adapter is not None:
                save_adapter(model, state, tmp)
            elif is_peft:
                getattr(model, "module", model).save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            else:
                unwrap(model).save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    return target


def _test_logits(model: nn.Module, path: str) -> None:
    """Test-only: the logits of the trained model in memory on a fixed input, to compare exports against."""
    ids = torch.arange(3, 35, dtype=torch.long).reshape(2, 16).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    model.train(was_training)
    torch.save({"input_ids": ids.cpu(), "logits": logits.cpu()}, path)


def export_final(output_dir: str | Path, model: nn.Module, tokenizer, *, is_peft: bool, info: DistInfo) -> Path | None:
    """Write ``output_dir/final``: a Transformers model folder, or a PEFT adapter folder for LoRA/QLoRA.

    The full (gathered) state dict is assembled on CPU from every rank's shards, then rank 0 writes it through
    ``save_pretrained`` into a temporary folder that is renamed when complete; every rank learns if that failed.
    """
    state = get_model_state_dict(model, options=_options(trainable_only=is_peft, full=True))
    logits_path = os.environ.get("SHARDTUNE_TEST_LOGITS")
    if logits_path:  # every rank runs the forward (FSDP gathers), rank 0 writes
        _test_logits(model, logits_path if info.is_main else os.devnull)
    target = Path(output_dir) / "final"
    run_and_share(lambda: write_export(target, model, state, tokenizer, is_peft), runs=info.is_main,
                  what=f"writing {target}")
    return target if info.is_main else None


def _check_out(out: Path) -> None:
    """``OUT`` of export and merge: refused before anything is loaded when a file is in the way."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out}: a file is there; give a folder path (it is created, or replaced if a folder)")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, base: str | None = None) -> Path:
    """Write a checkpoint as ``final`` would be: a PEFT adapter folder, or a Transformers model folder.

    One process, any world size the checkpoint was written with (DCP reshards). ``base`` replaces the
    checkpoint's ``model_name_or_path`` when the base model has moved.
    """
    from shardtune.config import load_train_config
    from shardtune.data import load_tokenizer
    from shardtune.train.model import Precision, apply_lora, load_base_model, resize_for_tokenizer

    path = Path(checkpoint)
    _check_out(Path(out))
    if problem := checkpoint_folder_problem(path, str(checkpoint)):
        raise UsageError(problem)
    overrides = ["--model_name_or_path", base] if base else []
    cfg = load_train_config([str(path / "config.yaml"), *overrides])
    manifest = json.loads((path / MANIFEST).read_text())
    is_peft = bool(manifest["trainable_only"])
    try:
        tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data,
                                   trust_remote_code=cfg.model.trust_remote_code)
        model = load_base_model(cfg.model, cfg.lora, Precision(cfg.mixed_precision), torch.device("cpu"))
    except UsageError as exc:
        raise UsageError(f"{checkpoint}: cannot load its base model ({exc}); run from the folder the training ran "
                         f"in (the path may be relative) or give the base model folder with --base") from None
    resize_for_tokenizer(model, len(tokenizer))
    if is_peft:
        model = apply_lora(model, cfg.lora, seed=cfg.run.seed)
    options = _options(is_peft)
    if manifest.get("state_dict_type", SHARDED) == FULL:
        from safetensors.torch import load_file

        state = load_file(path / "model.safetensors")
    else:
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=True)
        state = state["model"]
    set_model_state_dict(model, state, options=options)
    return write_export(Path(out), model, get_model_state_dict(model, options=options), tokenizer, is_peft)


def merge_adapter(adapter: str | Path, base: str | Path, out: str | Path) -> Path:
    """Fold a PEFT LoRA adapter into its base model and write a Transformers model folder (one process, CPU)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.train.model import resize_for_tokenizer

    adapter, base, out = Path(adapter), Path(base), Path(out)
    _check_out(out)
    if not (adapter / "adapter_config.json").is_file():
        raise UsageError(f"{adapter}: not a PEFT adapter folder (no adapter_config.json); give output_dir/final "
                         f"of a LoRA run or the folder 'shardtune export' wrote")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--base {base}: cannot load a model ({str(exc).splitlines()[0]}); give the base "
                         f"model folder the adapter was trained on") from None
    tokenizer_src = adapter if (adapter / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_src))
    resize_for_tokenizer(model, len(tokenizer))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return write_export(out, merged, merged.state_dict(), tokenizer, is_peft=False)
