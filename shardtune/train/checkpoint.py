"""Checkpoints that resume exactly, and the final export in Hugging Face formats.

A checkpoint ``output_dir/checkpoints/step-N/`` holds:
- ``dcp/``: model (the trainable part only for LoRA/QLoRA) and optimizer, written by every rank with
  ``torch.distributed.checkpoint`` (sharded, resharded on load, so a run may resume on another world size);
- ``rng/rank-R.pt``: each rank's RNG states (dropout must draw the same masks after resume), tensors only;
- ``trainer_state.json``: step, epoch, the data sampler's position, scheduler and gradient-scaler state;
- ``config.yaml``: the resolved config; ``manifest.json``: written last, lists what a complete checkpoint holds.
Everything is written into ``.tmp-step-N`` and renamed once every rank has finished, so a ``step-N`` folder is
always complete; a leftover ``.tmp-*`` (a save that was killed) is ignored with a warning.
Nothing is unpickled: DCP reads tensors, RNG files load with ``weights_only=True``, the rest is JSON and YAML.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from shardtune.errors import UsageError
from shardtune.train.dist import DistInfo, barrier

log = logging.getLogger("shardtune")
STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _options(trainable_only: bool, full: bool = False) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, full_state_dict=full, cpu_offload=full)


def rng_state() -> dict[str, Any]:
    """Every RNG that training draws from, as tensors and plain values (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool, trainer_state: dict[str, Any], config_yaml: str, info: DistInfo,
                    save_total_limit: int | None = None) -> Path:
    """Write ``checkpoints/step-{step}`` from every rank; returns its path once it is complete."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if info.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    options = _options(trainable_only)
    state = {"model": get_model_state_dict(model, options=options),
             "optim": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp.save(state, checkpoint_id=str(tmp / "dcp"))
    torch.save(rng_state(), tmp / "rng" / f"rank-{info.rank}.pt")
    barrier()
    if info.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": info.world_size,
                    "trainable_only": trainable_only, "complete": True}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if save_total_limit:
            for old in complete_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first; warns about any save that was killed half-way."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
        elif entry.name.startswith(".tmp-step-") or match:
            warnings.warn(f"ignoring incomplete checkpoint {entry} (its save was interrupted)", stacklevel=2)
    return [path for _, path in sorted(found)]


def resolve_resume(spec: str | None, output_dir: str | Path) -> Path | None:
    """``resume_from_checkpoint``: a folder, or true for the newest complete checkpoint in ``output_dir``."""
    if spec is None or str(spec).lower() in ("false", "no", "0", ""):
        return None
    if str(spec).lower() in ("true", "yes", "1", "latest"):
        found = complete_checkpoints(output_dir)
        if not found:
            log.warning("resume_from_checkpoint=true: no complete checkpoint in %s; starting from scratch",
                        checkpoints_dir(output_dir))
            return None
        return found[-1]
    path = Path(spec)
    if not (path / MANIFEST).is_file():
        raise UsageError(f"resume_from_checkpoint={spec!r}: not a complete shardtune checkpoint (no {MANIFEST}); "
                         f"give a checkpoints/step-N folder or true for the newest one")
    return path


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool,
                    info: DistInfo) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer state."""
    manifest = json.loads((path / MANIFEST).read_text())
    options = _options(trainable_only)
    state = {"model": get_model_state_dict(model, options=options),
             "optim": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    rng_file = path / "rng" / f"rank-{info.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    if manifest["world_size"] != info.world_size:
        log.warning("resuming a %d-process checkpoint on %d processes: weights and optimizer are resharded; "
                    "the data order is kept (same global batch), random draws such as dropout masks differ",
                    manifest["world_size"], info.world_size)
    return json.loads((path / "trainer_state.json").read_text())


def export_final(output_dir: str | Path, model: nn.Module, tokenizer, *, is_peft: bool, info: DistInfo) -> Path | None:
    """Write ``output_dir/final``: a Transformers model folder, or a PEFT adapter folder for LoRA/QLoRA.

    The full (gathered) state dict is assembled on CPU from every rank's shards, then rank 0 writes it through
    ``save_pretrained`` into a temporary folder that is renamed when complete.
    """
    from shardtune.train.parallelize import unwrap

    state = get_model_state_dict(model, options=_options(trainable_only=is_peft, full=True))
    target = Path(output_dir) / "final"
    if not info.is_main:
        barrier()
        return None
    tmp = Path(output_dir) / ".tmp-final"
    if tmp.exists():
        shutil.rmtree(tmp)
    inner = getattr(model, "module", model)  # DDP
    if is_peft:
        inner.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    else:
        unwrap(model).save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    barrier()
    return target
