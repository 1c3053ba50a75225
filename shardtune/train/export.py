"""The trained model in Hugging Face formats: ``final/`` at the end of a run, ``shardtune export`` of a checkpoint,
and ``shardtune export --merge`` of a LoRA adapter into its base.

Every folder is written under a temporary name and renamed when complete, so a failed or interrupted export leaves
nothing half-written; a failed write names its file (``errors.writing``).
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from shardtune.data.templates import reply_end_token
from shardtune.dist import DistInfo, run_and_share
from shardtune.errors import UsageError, writing
from shardtune.files import give_plain_mode
from shardtune.hub import (ADAPTER_ON_ANOTHER_BASE, adapter_folder_problem, adapter_left_out, adapter_weights_problem,
                           has_tokenizer, is_adapter_folder, is_whole_model_folder, loading_refused)
from shardtune.peft_names import embedding_layers_saved
from shardtune.train.checkpoint import FULL, SHARDED, checkpoint_damage, model_state_dict, state_dict_options
from shardtune.train.destination import folder_made_for, publish, refuse_destination, temporary_sibling
from shardtune.train.layout import (BASE_QUANTIZATION, MANIFEST, PROMPT_STYLE, checkpoint_folder_problem,
                                    trained_base_quantization, trained_prompt_style)
from shardtune.train.plan import unwrap
from shardtune.train.safe_load import load_dcp, load_safetensors, read_json


def write_export(target: Path, model: nn.Module, state: dict[str, torch.Tensor], tokenizer, is_peft: bool, *,
                 save_adapter: Callable[[nn.Module, dict[str, torch.Tensor], Path], None] | None = None,
                 label: str = "OUT", about: dict | None = None) -> Path:
    """``save_pretrained`` of ``state`` into a temporary sibling folder, moved to ``target`` when complete
    (``destination.publish``: only an earlier export's files are ever replaced there).

    ``save_adapter`` replaces PEFT's own adapter writing (the pipeline's stages each hold part of the adapters).
    ``about``: what the folder's export list records of the run (``publish``).
    """
    if target.exists() and not target.is_dir():  # found before the (long) write, not after it
        raise NotADirectoryError(errno.ENOTDIR, "a file is where the exported folder goes; move it away", str(target))
    with folder_made_for(target):  # the parents it makes go again if the write fails: no empty folders stay
        return _write_and_publish(target, model, state, tokenizer, is_peft, save_adapter, label, about)


def _write_and_publish(target: Path, model: nn.Module, state: dict[str, torch.Tensor], tokenizer, is_peft: bool,
                       save_adapter: Callable[[nn.Module, dict[str, torch.Tensor], Path], None] | None,
                       label: str, about: dict | None) -> Path:
    with writing(target):
        tmp = temporary_sibling(target)
    try:
        with writing(tmp):  # save_pretrained does not say which of its files failed
            if is_peft and save_adapter is not None:
                save_adapter(model, state, tmp)
            elif is_peft:
                peft_model = getattr(model, "module", model)
                peft_model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True,
                                           save_embedding_layers=embedding_layers_saved(peft_model))
            else:
                stop_at_tokenizer_eos(unwrap(model), tokenizer)
                unwrap(model).save_pretrained(str(tmp), state_dict=drop_tied_copies(model, state),
                                              safe_serialization=True)
            if is_peft:
                finish_adapter(tmp, getattr(getattr(model, "module", model), "initial_adapter", None))
            tokenizer.save_pretrained(str(tmp))
            give_plain_mode(*(path for path in tmp.rglob("*") if path.is_file() and not path.is_symlink()))
        return publish(tmp, target, label, about)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind (gone already when published)


def stop_at_tokenizer_eos(model: nn.Module, tokenizer) -> None:
    """List the tokenizer's EOS, and the token its chat template ends a reply with, among the EOS ids of the
    model's config and generation config, first, where they are not there. Every trained turn ends with that
    token, while transformers' generate (and vLLM) stop only at the generation config's ids: a named template
    with add_special_tokens makes its end of turn the tokenizer's EOS (TRL's setup_chat_format sets the ids as
    well), and a base model's own template ends turns with a token its generation config does not list (Gemma's
    <end_of_turn>, Qwen2.5 base's <|im_end|>, Llama 3 base's <|eot_id|> under llama-3). The model's own ids stay,
    so it still stops where it stopped before."""
    end = reply_end_token(tokenizer)
    stops = [token_id for token_id in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end) if end else None)
             if token_id is not None]
    for config in (model.config, getattr(model, "generation_config", None)):
        if not stops or config is None:
            continue
        ids = config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        missing = [token_id for token_id in dict.fromkeys(stops) if token_id not in ids]
        if missing:
            config.eos_token_id = [*missing, *ids] if ids or len(missing) > 1 else missing[0]


def drop_tied_copies(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second name of a tied weight (lm_head tied to the embeddings): a gathered state dict
    holds separate copies, which save_pretrained would write twice; loading ties them again from the config."""
    names_of: dict[int, list[str]] = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    aliases = {name for names in names_of.values() for name in names[1:]}
    return {key: value for key, value in state.items() if key not in aliases}


def finish_adapter(folder: Path, initial: dict[str, torch.Tensor] | None) -> None:
    """Make the adapter folder travel: a local base recorded as an absolute path (a relative one only works from
    the folder training ran in; a hub name stays a name), and a PiSSA/OLoRA adapter converted into a plain LoRA
    adapter for the unmodified base (``initial``: the adapters' values right after injection)."""
    import json

    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if base and Path(base).expanduser().exists():
        config["base_model_name_or_path"] = str(Path(base).expanduser().resolve())
    if initial:
        _convert_mutated_init(folder / "adapter_model.safetensors", initial, config)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def _convert_mutated_init(weights: Path, initial: dict[str, torch.Tensor], config: dict) -> None:
    """PiSSA/OLoRA trained ``B A`` on a base from which ``B0 A0`` was taken: the same model is the original base
    plus ``B A - B0 A0`` = [B, -B0] [A; A0], a plain adapter of rank 2r with the scaling kept (alpha doubled, or
    times sqrt(2) under rsLoRA), which ``PeftModel.from_pretrained`` loads onto the unmodified base."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    start = {key.replace(".default.", "."): value for key, value in initial.items()}
    for key in [k for k in tensors if ".lora_A." in k]:
        key_b = key.replace(".lora_A.", ".lora_B.")
        a0, b0 = start[key].to(tensors[key].dtype), start[key_b].to(tensors[key_b].dtype)
        tensors[key] = torch.cat([tensors[key], a0], dim=0).contiguous()
        tensors[key_b] = torch.cat([tensors[key_b], -b0], dim=1).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    config["r"] *= 2
    config["lora_alpha"] *= 2 ** 0.5 if config.get("use_rslora") else 2
    config["init_lora_weights"] = True


def export_final(output_dir: str | Path, model: nn.Module, tokenizer, *, is_peft: bool, info: DistInfo) -> Path | None:
    """Write ``output_dir/final``: a Transformers model folder, or a PEFT adapter folder for LoRA/QLoRA.

    The full (gathered) state dict is assembled on CPU from every rank's shards, then rank 0 writes it through
    ``save_pretrained`` into a temporary folder that is renamed when complete; every rank learns if that failed.
    """
    state = model_state_dict(model, state_dict_options(trainable_only=is_peft, full=True))
    target = Path(output_dir) / "final"
    run_and_share(lambda: write_export(target, model, state, tokenizer, is_peft), runs=info.is_main,
                  what=f"writing {target}")
    return target if info.is_main else None


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, base: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write a checkpoint as ``final`` would be: a PEFT adapter folder, or a Transformers model folder.

    One process, any world size the checkpoint was written with (DCP reshards). ``base`` replaces the
    checkpoint's ``model_name_or_path`` when the base model has moved. ``out`` must be new or empty, or (with
    ``overwrite``) hold an earlier export, and never the checkpoint, its run or the current folder
    (``destination``).
    """
    if problem := exported_already(Path(checkpoint)):
        raise UsageError(problem)
    refuse_destination(out, "OUT", sources=[checkpoint], overwrite=overwrite)
    model, tokenizer, is_peft, _ = load_checkpoint_model(checkpoint, base=base)
    options = state_dict_options(is_peft)
    about = _prompt_style_record(checkpoint) or {}
    if is_peft and (quantization := trained_base_quantization(checkpoint)):  # merge and generate say it
        about[BASE_QUANTIZATION] = quantization
    return write_export(Path(out), model, model_state_dict(model, options), tokenizer, is_peft,
                        about=about or None)


def load_checkpoint_model(checkpoint: str | Path, *, base: str | None = None,
                          float32: bool = False) -> tuple[nn.Module, object, bool, str]:
    """(model with the checkpoint's weights, its tokenizer, whether it is a PEFT model, the base model path) of
    ``checkpoint``, on CPU, one process. ``float32``: every weight in float32 and a QLoRA run's base unquantised,
    for a float merge of the adapters as ``merged_model`` makes one of the run's final/."""
    from shardtune.config.loading import load_saved_config
    from shardtune.data import load_tokenizer
    from shardtune.data.templates import added_token_ids as added_by_run
    from shardtune.train.model import Precision, apply_lora, load_base_model, resize_for_tokenizer

    path = Path(checkpoint)
    if problem := checkpoint_folder_problem(path, str(checkpoint)):
        raise UsageError(problem)
    overrides = ["--model_name_or_path", base] if base else []
    cfg = load_saved_config(path / "config.yaml", overrides).with_4bit_dtypes()  # config.yaml wrote them down
    if damaged := checkpoint_damage(path):
        raise UsageError(f"{checkpoint}: {damaged}; export an earlier checkpoint")
    manifest = read_json(path / MANIFEST)
    is_peft = bool(manifest["trainable_only"])
    try:
        tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data,
                                   trust_remote_code=cfg.model.trust_remote_code)
        precision = Precision("no") if float32 else Precision(cfg.mixed_precision, pure_bf16=cfg.model.pure_bf16)
        lora = dataclasses.replace(cfg.lora, use_4bit_quantization=False) if float32 else cfg.lora
        model = load_base_model(cfg.model, lora, precision, torch.device("cpu"))
    except UsageError as exc:
        raise UsageError(f"{checkpoint}: cannot load its base model ({exc}); run from the folder the training ran "
                         f"in (the path may be relative) or give the base model folder with --base") from None
    added_token_ids = sorted(set(resize_for_tokenizer(model, len(tokenizer), saved_rows_follow=True,
                                                      added=added_by_run(tokenizer)))
                             | set(manifest.get("trainable_token_ids", [])))
    if is_peft:
        # (a run saved before a mistyped lora_modules_to_save was refused still exports: PEFT had ignored it)
        model = apply_lora(model, lora, seed=cfg.run.seed, added_token_ids=added_token_ids, training=False)
    options = state_dict_options(is_peft)
    fix = ("give --base the base model the run trained, or leave --base out" if base else
           "export another checkpoint")
    if manifest.get("state_dict_type", SHARDED) == FULL:
        state = load_safetensors(path / "model.safetensors")
    else:
        state = {"model": model_state_dict(model, options)}
        load_dcp(state, path / "dcp", no_dist=True, fix=fix)
        state = state["model"]
    with loading_refused(str(checkpoint), fix, fix):  # weights of other shapes than the base's
        set_model_state_dict(model, state, options=options)
    return model, tokenizer, is_peft, cfg.model.model_name_or_path


def exported_already(folder: Path) -> str | None:
    """A folder in the form export writes (a run's final/, an earlier export or merge) given as the checkpoint: it
    needs no export to that form, which said only "no manifest.json; give a checkpoints/step-N folder". One line
    saying what it is and what to do with it; None for anything else."""
    if not folder.is_dir() or (folder / MANIFEST).is_file():
        return None
    if is_adapter_folder(folder):
        kind, use = "a PEFT adapter folder (a LoRA run's final/, or an export)", \
            "load it with PEFT as it is, fold it into its base with 'shardtune merge',"
    elif is_whole_model_folder(folder):
        kind, use = "a whole model folder (a full fine-tune's final/, an export or a merge)", \
            "load it with transformers as it is,"
    else:
        return None
    return (f"{folder}: {kind}, already in the form export writes, not a checkpoint: {use} or convert it with "
            f"--format gguf")


def merge_adapter(adapter: str | Path, base: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Fold a PEFT LoRA adapter into its base model and write a Transformers model folder (one process, CPU);
    ``out`` as for ``export_checkpoint``. The sum is taken in float32 (``merged_model``) and saved in the base's
    own dtype (``stored_dtype``), as PEFT's merge_and_unload of a base loaded as it is stored would: a bf16 base
    merged stays bf16 rather than twice its size."""
    out = Path(out)
    refuse_destination(out, "OUT", sources=[adapter, base], overwrite=overwrite)
    merged, tokenizer = merged_model(adapter, base)
    merged = merged.to(stored_dtype(base))
    # a plain-prompt run's merge is prompted as plain text too
    return write_export(out, merged, merged.state_dict(), tokenizer, is_peft=False, about=_prompt_style_record(adapter))


def _prompt_style_record(source: str | Path) -> dict | None:
    """What an export list keeps of how the run that made ``source`` wrote its prompts; None where nothing says."""
    style = trained_prompt_style(source)
    return {PROMPT_STYLE: style} if style else None


SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_dtype(base: str | Path) -> torch.dtype:
    """The floating dtype the model folder ``base`` is stored in, as transformers' ``dtype="auto"`` picks it: its
    config.json's ``dtype`` (``torch_dtype`` before transformers 5), else the first floating tensor of its
    safetensors weights; float32 where neither says (and for a GGUF base, whose quantized weights were read as
    float32: no dtype of its own fits them)."""
    import json

    from safetensors import safe_open

    from shardtune.gguf_source import find_gguf

    folder = Path(base).expanduser()
    if find_gguf(folder) or not folder.is_dir():
        return torch.float32
    try:
        config = json.loads((folder / "config.json").read_text())
        named = config.get("dtype") or config.get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        named = None
    dtype = getattr(torch, named, None) if isinstance(named, str) else None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as f:
                for name in f.keys():
                    if (dtype := SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())) is not None:
                        return dtype
        except Exception:  # noqa: BLE001 - weights this reader cannot open were refused before the merge; keep float32
            continue
    return torch.float32


def load_plain_model(path: str | Path, what: str, fix: str, tokenizer_folder: str | Path | None = None):
    """A model folder or GGUF file as a float32 causal LM on CPU, and its tokenizer (``tokenizer_folder``'s where
    given: an adapter's own, so that a base without one is not asked for it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.gguf_source import find_gguf, load_model, load_tokenizer, parsed_once

    own = AutoTokenizer.from_pretrained(str(tokenizer_folder)) if tokenizer_folder is not None else None
    if gguf := find_gguf(path):
        with parsed_once():
            return load_model(gguf, dtype=torch.float32), own or load_tokenizer(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what} {path}: cannot load a model ({str(exc).splitlines()[0]}); {fix}") from None
    return model, own or AutoTokenizer.from_pretrained(str(path))


def merged_model(adapter: str | Path, base: str | Path):
    """(the base model, a folder or GGUF file, with the LoRA adapter folded in; the adapter's tokenizer, or the
    base's where the adapter has none)."""
    from peft import PeftModel

    from shardtune.train.model import resize_for_tokenizer

    adapter = Path(adapter)
    if problem := adapter_folder_problem(adapter) or adapter_weights_problem(adapter):
        raise UsageError(problem)
    with loading_refused(f"adapter {adapter} on --base {base}", "the folders are damaged or do not belong together: "
                                                                 "save them again, or use copies you trust",
                         ADAPTER_ON_ANOTHER_BASE):
        model, tokenizer = load_plain_model(base, "--base", "give the base model folder the adapter was trained on",
                                            adapter if has_tokenizer(adapter) else None)
        resize_for_tokenizer(model, len(tokenizer), saved_rows_follow=True)
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    if problem := adapter_left_out(peft_model, adapter):
        raise UsageError(problem)
    return peft_model.merge_and_unload(), tokenizer
