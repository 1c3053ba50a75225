"""The trained model in Hugging Face formats: ``final/`` at the end of a run, ``shardtune export`` of a checkpoint,
and ``shardtune export --merge`` of a LoRA adapter into its base.

Every folder is written under a temporary name and renamed when complete, so a failed or interrupted export leaves
nothing half-written; a failed write names its file (``errors.writing``).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from shardtune.dist import DistInfo, run_and_share
from shardtune.errors import UsageError, writing
from shardtune.train.checkpoint import FULL, SHARDED, checkpoint_damage, state_dict_options
from shardtune.train.layout import MANIFEST, checkpoint_folder_problem
from shardtune.train.plan import unwrap
from shardtune.train.safe_load import load_dcp, load_safetensors, read_json


def write_export(target: Path, model: nn.Module, state: dict[str, torch.Tensor], tokenizer, is_peft: bool, *,
                 save_adapter: Callable[[nn.Module, dict[str, torch.Tensor], Path], None] | None = None) -> Path:
    """``save_pretrained`` of ``state`` into a temporary folder, renamed to ``target`` when complete.

    ``save_adapter`` replaces PEFT's own adapter writing (the pipeline's stages each hold part of the adapters).
    """
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


def export_final(output_dir: str | Path, model: nn.Module, tokenizer, *, is_peft: bool, info: DistInfo) -> Path | None:
    """Write ``output_dir/final``: a Transformers model folder, or a PEFT adapter folder for LoRA/QLoRA.

    The full (gathered) state dict is assembled on CPU from every rank's shards, then rank 0 writes it through
    ``save_pretrained`` into a temporary folder that is renamed when complete; every rank learns if that failed.
    """
    state = get_model_state_dict(model, options=state_dict_options(trainable_only=is_peft, full=True))
    target = Path(output_dir) / "final"
    run_and_share(lambda: write_export(target, model, state, tokenizer, is_peft), runs=info.is_main,
                  what=f"writing {target}")
    return target if info.is_main else None


def check_out(out: Path) -> None:
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
    check_out(Path(out))
    if problem := checkpoint_folder_problem(path, str(checkpoint)):
        raise UsageError(problem)
    overrides = ["--model_name_or_path", base] if base else []
    cfg = load_train_config([str(path / "config.yaml"), *overrides])
    if damaged := checkpoint_damage(path):
        raise UsageError(f"{checkpoint}: {damaged}; export an earlier checkpoint")
    manifest = read_json(path / MANIFEST)
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
    options = state_dict_options(is_peft)
    if manifest.get("state_dict_type", SHARDED) == FULL:
        state = load_safetensors(path / "model.safetensors")
    else:
        state = {"model": get_model_state_dict(model, options=options)}
        load_dcp(state, path / "dcp", no_dist=True)
        state = state["model"]
    set_model_state_dict(model, state, options=options)
    return write_export(Path(out), model, get_model_state_dict(model, options=options), tokenizer, is_peft)


def adapter_problem(adapter: Path) -> str | None:
    """Why ``adapter`` is not a PEFT adapter folder, in one line; None when it is one."""
    if (adapter / "adapter_config.json").is_file():
        return None
    return (f"{adapter}: not a PEFT adapter folder (no adapter_config.json); give output_dir/final of a LoRA run or "
            f"the folder 'shardtune export' wrote")


def merge_adapter(adapter: str | Path, base: str | Path, out: str | Path) -> Path:
    """Fold a PEFT LoRA adapter into its base model and write a Transformers model folder (one process, CPU)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.train.model import resize_for_tokenizer

    adapter, base, out = Path(adapter), Path(base), Path(out)
    check_out(out)
    if problem := adapter_problem(adapter):
        raise UsageError(problem)
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
