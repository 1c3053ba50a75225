"""``shardtune export RUN_OR_CHECKPOINT OUT --format gguf --quantize f16|bf16|q8_0``: a run as one GGUF file.

Whatever the source (a run's output_dir, its ``final/``, a checkpoint, a merged model folder, a GGUF), it becomes
one float32 transformers model on CPU, any LoRA adapter merged into its base, and ``gguf_export.write_gguf``
writes it; an Ollama ``Modelfile`` goes beside it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from shardtune.errors import UsageError
from shardtune.gguf_export import MARK_KEY, check_quantize, family_of, write_gguf
from shardtune.gguf_source import GgufFile, check_complete, described, find_gguf, metadata, parsed_once
from shardtune.gguf_source import load_config as load_gguf_config
from shardtune.gguf_vocab import template_for_gguf
from shardtune.hub import (adapter_folder_problem, adapter_weights_problem, is_adapter_folder, loading_refused,
                           looks_like_local_path, model_folder_problem, pickled_weights_refused, tokenizer_problem)
from shardtune.files import WRITTEN_BY
from shardtune.ollama import modelfile_written_by_shardtune, write_modelfile
from shardtune.train.destination import folder_made_for
from shardtune.train.export import load_checkpoint_model, load_plain_model, merged_model
from shardtune.train.layout import MANIFEST, trained_prompt_style

log = logging.getLogger("shardtune")


def gguf_target(out: str | Path, quantize: str) -> Path:
    """OUT ending in .gguf is the file; any other OUT is a folder that gets ``model-QUANTIZE.gguf``."""
    out = Path(out)
    if out.suffix.lower() == ".gguf":
        if out.is_dir():
            raise UsageError(f"OUT {out}: a folder has that name; give a file path ending in .gguf or a folder")
        return out
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out}: a file is there; give a folder, or a file path ending in .gguf")
    return out / f"model-{quantize}.gguf"


def _adapter_base(adapter: Path, base: str | None) -> str:
    if base:
        return base
    recorded = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not recorded:
        raise UsageError(f"{adapter}/adapter_config.json names no base model; give it with --base")
    if looks_like_local_path(recorded) and not Path(recorded).expanduser().exists():
        # a moved base: said as the adapter's record, not as a --base nobody gave or a hub name it is not
        raise UsageError(f"{adapter}/adapter_config.json names its base {recorded}, which is not there (moved or "
                         f"deleted?); give the base model with --base")
    return recorded


def _model_in(path: Path) -> Path:
    """The folder that holds the model of ``path``: a run's output_dir (a folder with a final/ and no config.json
    of its own) means its final/; any other path is itself."""
    if path.is_dir() and (path / "final").is_dir() and not (path / "config.json").is_file():
        return path / "final"
    return path


def load_source(source: str | Path, base: str | None = None) -> tuple[object, object, str | None]:
    """(a float32 model with any adapter merged, its tokenizer, the base model path it came from or None) of a
    run's output_dir, a final/ folder, a checkpoint, a PEFT adapter, a model folder or a GGUF file."""
    path = _model_in(Path(source))
    if not path.exists():
        raise UsageError(f"RUN_OR_CHECKPOINT {source}: no such file or folder; give a run's output_dir, its final/, "
                         f"a checkpoint folder or a model folder")
    if path.is_dir() and (path / MANIFEST).is_file():
        # the adapters merged in float32 into the base as stored, as a run's final/ is (merged_model): a QLoRA
        # run's 4-bit base would keep bitsandbytes' packed weights, which no GGUF tensor type holds
        model, tokenizer, is_peft, model_path = load_checkpoint_model(path, base=base, float32=True)
        return (model.merge_and_unload() if is_peft else model), tokenizer, model_path
    if path.is_dir() and is_adapter_folder(path):
        if problem := adapter_folder_problem(path):  # before PEFT or safetensors stop on it with a traceback
            raise UsageError(problem)
        base_path = _adapter_base(path, base)
        if problem := tokenizer_problem(f"--base {base_path}", path, base_path) or adapter_weights_problem(path):
            raise UsageError(problem)
        with pickled_weights_refused(path, Path(base_path)):  # as merge and generate: one line, not a traceback
            model, tokenizer = merged_model(path, base_path)
        return model, tokenizer, base_path
    if find_gguf(path) or (path / "config.json").is_file():
        name = f"RUN_OR_CHECKPOINT {source}"
        if base:  # silently ignored, it left the user believing the export was of their --base
            raise UsageError(f"--base {base}: {name} is a whole model (a model folder or GGUF), not an adapter or a "
                             f"checkpoint, and has no base to replace; leave --base out")
        if problem := model_folder_problem(path, name, trust_remote_code=False, trust_fix="load it in Python with "
                                           "trust_remote_code=True and save_pretrained it without its code first") \
                or tokenizer_problem(name, path):
            raise UsageError(problem)
        with pickled_weights_refused(path), loading_refused(name, "the folder is damaged or was altered: save it "
                                                                   "again, or use a copy you trust"):
            model, tokenizer = load_plain_model(path, "RUN_OR_CHECKPOINT", "give a Transformers model folder")
        return model, tokenizer, _trained_from(path) or str(path)
    raise UsageError(f"RUN_OR_CHECKPOINT {source}: holds no final/, manifest.json, adapter_config.json or "
                     f"config.json; give a run's output_dir, its final/, a checkpoint or a model folder")


def _trained_from(folder: Path) -> str | None:
    """The GGUF a run's final/ (a full fine-tune's whole model) was trained from, as the run's config.yaml beside
    it names it: what the export keeps of its description (license, names, the tokenizer's pre-tokenizer and
    padding id) comes from there, as it does for an adapter or a checkpoint. None for any other folder."""
    import yaml

    config = folder.parent / "config.yaml"
    if folder.name != "final" or not config.is_file():
        return None
    try:
        named = (yaml.safe_load(config.read_text()) or {}).get("model_name_or_path")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return named if isinstance(named, str) and _source_gguf(named) else None


def _source_gguf(base_path: str | None):
    """The GGUF file the model was made from (a GGUF base), or None."""
    try:
        return find_gguf(base_path)
    except UsageError:
        return None


def gguf_destination_problem(target: Path, sources: list[str | Path], overwrite: bool) -> str | None:
    """Why the GGUF file ``target`` and the Modelfile beside it may not be written (one line); None when they may.

    Either already there is refused unless ``overwrite``; even then a GGUF or a Modelfile shardtune did not write
    (the user's own) and a GGUF that is a source of this export are kept, and refused.
    """
    modelfile = target.parent / "Modelfile"
    from shardtune.train.destination import inside_problem

    if inside := inside_problem(Path(os.path.realpath(target.parent)), sources):
        return f"OUT {target}: {inside}; give a folder outside it, such as ./exported"
    for source in sources:
        path = Path(source).expanduser()
        read = [path] if path.is_file() else sorted(path.glob("*.gguf")) if path.is_dir() else []
        if target.resolve() in [p.resolve() for p in read]:
            return f"OUT {target}: is what the export reads ({source}), which it never writes over; give another OUT"
    for path in (target, modelfile):
        if path == target and (not path.exists() or gguf_written_by_shardtune(path)):
            continue
        if path == modelfile and (not path.exists() or modelfile_written_by_shardtune(path)):
            continue
        edited = " (or it was edited since)" if path == modelfile else ""
        return (f"OUT {target}: {path} is there and shardtune did not write it{edited}; move it away or export into "
                f"another folder")
    if (other := _modelfile_names(modelfile)) not in (None, target.name) and (target.parent / other).exists():
        # One Modelfile per folder: replacing it would leave that GGUF without its own, even with --overwrite.
        return (f"OUT {target}: the Modelfile there belongs to {other}, exported into the same folder earlier; "
                f"export into another folder")
    if overwrite:
        return None
    there = [path for path in (target, modelfile) if path.exists()]
    if there:
        return (f"OUT {target}: {' and '.join(str(p) for p in there)} already exist{'s' if len(there) == 1 else ''}; "
                f"add --overwrite to replace {'it' if len(there) == 1 else 'them'}, or give another OUT")
    return None


def _modelfile_names(modelfile: Path) -> str | None:
    """The GGUF file a Modelfile's FROM line names beside it (``FROM ./NAME``), or None."""
    try:
        lines = modelfile.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip()[len("FROM ./"):] for line in lines if line.strip().startswith("FROM ./")), None)


def gguf_written_by_shardtune(path: Path) -> bool:
    """Whether the GGUF file ``path`` carries shardtune's mark in its own metadata (``MARK_KEY``, which
    ``write_gguf`` writes first): only such a file is shardtune's to replace. Nothing else makes a user's GGUF
    shardtune's: not a Modelfile beside it naming it (a copied Modelfile names whatever file the user puts there),
    nor the words anywhere else in its bytes (a description, a chat template)."""
    try:
        check_complete(path)
        meta, _ = metadata(GgufFile(Path(path).resolve()))
    except Exception:  # noqa: BLE001 - a file this reader cannot parse, whatever its parser raises, is not ours
        return False
    value = meta.get(MARK_KEY)
    return isinstance(value, str) and value.startswith(WRITTEN_BY)


def export_gguf(source: str | Path, out: str | Path, *, quantize: str = "q8_0", base: str | None = None,
                overwrite: bool = False) -> Path:
    """Write ``source`` as a GGUF file (OUT, or OUT/model-QUANTIZE.gguf) and an Ollama Modelfile beside it; what
    is there already is refused unless ``overwrite`` (``gguf_destination_problem``)."""
    check_quantize(quantize)
    target = gguf_target(out, quantize)
    if problem := gguf_destination_problem(target, [source, *([base] if base else [])], overwrite):
        raise UsageError(problem)
    with parsed_once():  # the base GGUF, read for its weights, is not parsed again for its description
        if config := config_before_loading(source, base):
            family_of(config, how_to_convert(source))  # refused before any load: an architecture or RoPE scaling
        model, tokenizer, base_path = load_source(source, base)
        if base_path and (problem := gguf_destination_problem(target, [base_path], overwrite)):
            raise UsageError(problem)  # the base an adapter names, known only now
        gguf = _source_gguf(base_path)
        # llama.cpp's pre-tokenizer name as the base stated it: transformers' tokenizer built from it may not spell
        # the split in a way the name can be read back from
        pre = metadata(gguf)[0].get("tokenizer.ggml.pre") if gguf else None
        kept = described(gguf) if gguf else None
    family_of(model.config, how_to_convert(source))  # before the folder is made (a checkpoint's config is known now)
    if window := sliding_window(model.config):
        log.warning("--format gguf: the model attends to its last %d tokens only (sliding_window), which the GGUF "
                    "does not carry: llama.cpp and Ollama attend to every earlier token, so past %d tokens of "
                    "context its outputs differ from the trained model's", window, window)
    if plain_text := trained_prompt_style(_model_in(Path(source))) == "plain text":
        log.warning("--format gguf: the run trained on plain prompts, not the chat template the GGUF carries: the "
                    "Modelfile passes a prompt as it is; in llama.cpp use completion (llama-completion, or "
                    "llama-cli -no-cnv), not chat")
    name = Path(source).resolve().name
    name = Path(source).resolve().parent.name if name == "final" else name
    with folder_made_for(target):
        write_gguf(model.eval(), tokenizer, target, quantize, name=name, tokenizer_pre=pre, source=kept)
        write_modelfile(target, template_for_gguf(tokenizer.chat_template), tokenizer.eos_token,
                        plain_text=plain_text)
    return target


def how_to_convert(source: str | Path) -> str:
    """The steps from ``source`` to a GGUF of llama.cpp's own converter, which reads a whole Transformers model
    folder: an adapter is merged into its base first, a checkpoint exported first ('export --format hf' of a LoRA
    run, the one step once given for every source, gives an adapter, which the converter cannot read)."""
    path = _model_in(Path(source))
    convert = "with llama.cpp's convert_hf_to_gguf.py"
    if path.is_dir() and (path / MANIFEST).is_file():
        try:
            lora = bool(json.loads((path / MANIFEST).read_text()).get("trainable_only"))
        except (OSError, ValueError, AttributeError):
            lora = False
        if lora:
            return (f"run 'shardtune export {path} ADAPTER', then 'shardtune merge ADAPTER MERGED', and convert "
                    f"MERGED {convert}")
        return f"run 'shardtune export {path} MODEL' and convert MODEL {convert}"
    if path.is_dir() and is_adapter_folder(path):
        return f"run 'shardtune merge {path} MERGED' and convert MERGED {convert}"
    if _source_gguf(str(path)):
        return "it is a GGUF already: llama.cpp's llama-quantize changes its quantization"
    return f"convert {path}, a Transformers model folder, {convert}"


def sliding_window(config) -> int | None:
    """The attention window of a model that uses one shorter than its context (Mistral's ``sliding_window``, a
    Qwen2 with ``use_sliding_window``), or None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return window if window < getattr(config, "max_position_embeddings", window + 1) else None


def config_before_loading(source: str | Path, base: str | None = None):
    """The transformers config of the model ``load_source`` would load, read without its weights: a model
    folder's config.json, a GGUF's metadata, an adapter's base's. None where it is not had so cheaply (a
    checkpoint, whose base its config.yaml names) or cannot be read: ``load_source`` then says what is wrong."""
    from transformers import AutoConfig

    path = _model_in(Path(source))
    try:
        if path.is_dir() and (path / MANIFEST).is_file():
            return None
        if path.is_dir() and is_adapter_folder(path):
            path = Path(_adapter_base(path, base)).expanduser()  # a hub name is not looked up here
        if gguf := find_gguf(path):
            return load_gguf_config(gguf)
        if (path / "config.json").is_file():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - whatever reading it raises, load_source refuses it in its own words
        return None
    return None
