"""The Hugging Face hub, asked once whether it can be reached before anything is loaded from it.

Without a network, huggingface_hub retries every request with back-off (about 50 s and 20 lines of retry
warnings per name) before it falls back to its local cache. One short request decides instead: when the hub
cannot be reached, this process (and the ranks a launcher starts, which inherit its environment) read the local
cache only (``HF_HUB_OFFLINE=1``), so a cached model loads at once and a missing one fails at once.

Also which names are hub names at all: a local path is never looked up there; and what a local model folder
lacks to load (config.json, weights, permission to run its own code), told before anything is loaded from it. A
leaf module: the config checks, the data readers and the commands ask it, and it asks none of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtune.errors import UsageError, first_line

log = logging.getLogger("shardtune")

PROBE_TIMEOUT_S = 3.0
# Data files by suffix: a name ending like one is a local path, never a hub data set.
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv",
              ".tsv": "tsv"}
# A data file compressed whole, as `datasets` (and so a TRL script) reads it: data.jsonl.gz is JSON lines.
COMPRESSIONS = (".gz", ".bz2", ".xz")


def data_file_kind(name: str | Path) -> str | None:
    """The kind of rows a file of this name holds (``EXTENSIONS``' values), compressed or not; None for no data
    file."""
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return EXTENSIONS.get(suffixes[-1]) if suffixes else None


def looks_like_local_path(name: str) -> bool:
    """A name read as a local path, never a hub name: ./x, /x, ~/x, a/b/c, or one ending like a data file or a
    GGUF file."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or data_file_kind(name) is not None or \
        Path(name).suffix.lower() == ".gguf"


def offline_already() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def hub_names(*names: str | None) -> list[str]:
    """The names that would be read from the hub: neither local paths nor existing folders."""
    return [n for n in names if n and not looks_like_local_path(n) and not Path(n).expanduser().exists()]


def reachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``endpoint`` answers at all (any HTTP status counts), through the environment's proxies."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return True


def offline_unless_reachable(*names: str | None) -> None:
    """Switch to the local cache (``HF_HUB_OFFLINE=1``) when ``names`` include hub names and the hub cannot be
    reached; nothing when every name is local, or the environment already decided."""
    wanted = hub_names(*names)
    if not wanted or offline_already():
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if reachable(endpoint):
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    # huggingface_hub and datasets read the variable when imported; either may already be
    for module, attribute in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], attribute, True)
    log.warning("cannot reach %s: %s will be read from the local Hugging Face cache only (HF_HUB_OFFLINE=1)",
                endpoint, ", ".join(wanted))


# What transformers loads weights from (single or sharded files, and the index of sharded ones).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")


def holds_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a model's weight files (``WEIGHT_PATTERNS``)."""
    return any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def is_whole_model_folder(folder: Path) -> bool:
    """Whether ``folder`` is what save_pretrained writes for a whole model: config.json and its weights."""
    return (folder / "config.json").is_file() and holds_weights(folder)


def is_adapter_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter (its adapter_config.json); ``adapter_folder_problem`` says what
    keeps one from being read."""
    return (folder / "adapter_config.json").is_file()


def _holds(folder: Path, most: int = 6) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "nothing"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def model_folder_problem(folder: str | Path, name: str, *, trust_remote_code: bool, trust_fix: str) -> str | None:
    """What keeps the local model folder ``folder`` from loading without running its code, as one line that
    starts with ``name`` (how the user gave it); None when nothing does. Checked from its files, before any
    model or tokenizer is read: no config.json, config.json without weights, a damaged file
    (``damaged_file_problem``), or config.json naming its own Python code (``auto_map``) for a model type
    transformers does not have, unless ``trust_remote_code``; ``trust_fix`` says how to allow that code."""
    import json

    from shardtune.gguf_source import find_gguf

    folder = Path(folder).expanduser()
    config_file = folder / "config.json"
    try:
        if find_gguf(folder):  # a GGUF holds config, weights and tokenizer, and no code
            return None
    except UsageError as exc:
        return str(exc)
    if folder.is_file():
        return (f"{name} is a file, not a model folder: give the folder that holds config.json and the weights (the "
                f"one save_pretrained wrote), or a .gguf file")
    if not config_file.is_file():
        return (f"{name} holds no config.json (it holds {_holds(folder)}): give a Transformers model folder, "
                f"the one save_pretrained wrote")
    if not holds_weights(folder):
        kinds = ", ".join(WEIGHT_PATTERNS[:-1]) + f" or {WEIGHT_PATTERNS[-1]}"
        ggufs = sorted(p.name for p in folder.glob("*.gguf") if p.is_file())  # a GGUF repository's config.json
        gguf = (f", or give one of its GGUF files ({folder / ggufs[0]}{' ...' if ggufs[1:] else ''}), which holds "
                f"the weights") if ggufs else ""
        return (f"{name} holds config.json but no weights (no {kinds} file; it holds {_holds(folder)}): copy the "
                f"weight files into it, or give the folder that has them{gguf}")
    if damaged := damaged_file_problem(folder):
        return damaged
    config = json.loads(config_file.read_text())
    auto_map = config.get("auto_map")
    if not auto_map and (problem := _model_type_problem(config.get("model_type"), f"{name}: {config_file.name}")):
        return problem
    if trust_remote_code or not auto_map or not _needs_own_code(config.get("model_type"), auto_map):
        return None
    classes = ", ".join(f"{cls} -> {ref}" for cls, ref in auto_map.items()) if isinstance(auto_map, dict) else auto_map
    return (f"{name} needs its own Python code to load (config.json: model_type {config.get('model_type')!r}, "
            f"auto_map {classes}), and shardtune does not run code from a model folder unless asked: if you "
            f"trust that code, {trust_fix}")


# Where configs state the longest sequence a model's positions cover (GPT-2 and its kin say n_positions or n_ctx).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(model: str) -> tuple[int, str] | None:
    """(the longest sequence ``model``'s positions cover, where that was read) from its config.json (a local
    folder, or a hub model already in the local cache) or its GGUF metadata; None where no config can be read
    without loading the model. A ``rope_scaling`` factor counts: the config then covers that much more."""
    return _config_number(model, "context_length", config_context_length)


def num_layers(model: str) -> tuple[int, str] | None:
    """(the decoder layers ``model`` has, where that was read) from its config.json's num_hidden_layers or its
    GGUF's block_count, read as ``context_length`` reads; None where neither can be read without loading it."""
    return _config_number(model, "block_count", config_num_layers)


def config_num_layers(config: object, where: str) -> tuple[int, str] | None:
    """(the decoder layers a model ``config`` (a dict, as config.json holds it) has, the key it was read from, led
    by ``where``); None where it says none."""
    config, where = _text_part(config, where, "num_hidden_layers")
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    return (layers, f"{where}num_hidden_layers") if type(layers) is int and layers > 0 else None


def _text_part(config: object, where: str, *keys: str) -> tuple[object, str]:
    """The part of ``config`` that holds ``keys``: itself, or a multimodal model's text_config (Gemma 3, Llama 4),
    and ``where`` led to it ("config.json: text_config.")."""
    if isinstance(config, dict) and not any(k in config for k in keys) and isinstance(config.get("text_config"), dict):
        return config["text_config"], f"{where}: text_config."
    return config, f"{where}: "


def _config_number(model: str, gguf_field: str, from_config) -> tuple[int, str] | None:
    """A number of ``model``'s architecture and where it was read: ``gguf_field`` of its GGUF metadata, else what
    ``from_config(config.json's dict, its path)`` reads; None where it cannot be read without loading the model."""
    import json

    from shardtune.gguf_source import find_gguf, metadata

    try:
        if gguf := find_gguf(model):
            meta = metadata(gguf)[0]
            value = meta.get(f"{meta.get('general.architecture')}.{gguf_field}")
            return (int(value), f"{gguf.path.name}: {gguf_field}") if isinstance(value, int) else None
    except UsageError:  # a damaged GGUF is reported by the folder checks
        return None
    config_file = _config_file(model)
    try:
        config = json.loads(config_file.read_text()) if config_file else None
    except (OSError, ValueError):
        return None
    return from_config(config, str(config_file))


def config_context_length(config: object, where: str) -> tuple[int, str] | None:
    """(the longest sequence a model ``config`` (a dict, as config.json holds it) covers, the key it was read from,
    led by ``where``); None where it says none."""
    config, where = _text_part(config, where, *CONTEXT_KEYS)
    if not isinstance(config, dict):
        return None
    key = next((k for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    if key is None:
        return None
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else {}
    factor = scaling.get("factor") if isinstance(scaling.get("factor"), (int, float)) else 1
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, int) and config[key] > original:  # Llama 3.1's: the positions already scaled
        factor = 1
    return int(config[key] * max(1, factor)), f"{where}{key}" + (" x rope_scaling factor" if factor > 1 else "")


def _config_file(model: str) -> Path | None:
    """config.json of a local model folder (or the file itself), or of a hub model in the local cache (no network);
    None otherwise."""
    local = Path(model).expanduser() / "config.json"
    if local.is_file():
        return local
    if Path(model).expanduser().is_file() and Path(model).name == "config.json":
        return Path(model).expanduser()
    if looks_like_local_path(model) or Path(model).expanduser().exists():
        return None
    return cached_config_file(model)


# What a model fingerprint reads of each weight file besides its name and size: this many pieces of this many
# bytes, spread evenly over the file (a few MB read of a model of any size: a second, where hashing it whole takes
# minutes). Another model of the same shapes (a base and its instruct variant) differs in every piece.
FINGERPRINT_PIECES, FINGERPRINT_PIECE_BYTES = 16, 1 << 16
# config.json keys that a save rewrites without the model changing
FINGERPRINT_IGNORED_KEYS = ("transformers_version", "_name_or_path")


def model_fingerprint(name_or_path: str) -> str | None:
    """A SHA-256 that tells a model's files apart wherever they are: its config.json (but the keys a save rewrites)
    and, for each weight file, its name, size and evenly spread pieces of its bytes. ``name_or_path``: a model
    folder, a GGUF file, or a hub name whose snapshot the local cache holds; None where there are no files to read
    (a hub name not downloaded)."""
    import hashlib

    from shardtune.gguf_source import find_gguf

    gguf = find_gguf(name_or_path)
    if gguf is not None:
        config, weights = None, [gguf.path]
    else:
        config = _config_file(name_or_path)
        if config is None:
            return None
        weights = sorted(p for pattern in WEIGHT_PATTERNS[:-1] for p in config.parent.glob(pattern))
    digest = hashlib.sha256()
    if config is not None:
        values = json.loads(config.read_text())
        for key in FINGERPRINT_IGNORED_KEYS:
            values.pop(key, None)
        digest.update(json.dumps(values, sort_keys=True).encode())
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for piece in range(FINGERPRINT_PIECES):
                f.seek(max(0, size - FINGERPRINT_PIECE_BYTES) * piece // max(1, FINGERPRINT_PIECES - 1))
                digest.update(f.read(FINGERPRINT_PIECE_BYTES))
    return digest.hexdigest()


def cached_config_file(name: str, filename: str = "config.json") -> Path | None:
    """``filename`` (config.json) of the hub model ``name`` where the local Hugging Face cache holds it (no
    network: what an earlier download or 'hf download NAME config.json' left there); None otherwise."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, filename)
    except ValueError:  # not a hub name
        return None
    return Path(cached) if isinstance(cached, str) else None


def _model_type_problem(model_type: object, where: str) -> str | None:
    """A config.json (without code of its own) whose model_type this transformers does not know, or none at all."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not model_type:
        return f"{where} has no model_type, so its architecture is unknown: give the config.json the model came with"
    if model_type in CONFIG_MAPPING_NAMES:
        return None
    import transformers

    return (f"{where}: model_type {model_type!r} is not one transformers {transformers.__version__} knows: upgrade "
            f"it (pip install -U transformers), or give a model of an architecture it has")


def _needs_own_code(model_type: object, auto_map: object) -> bool:
    """Whether transformers has no built-in class for ``model_type`` that stands in for the folder's code (it
    uses its own one where it has, as for models that shipped code before transformers adopted them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return True
    return isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map \
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def damaged_file_problem(folder: str | Path, *, weights: bool = True) -> str | None:
    """The first file of a model or adapter folder that cannot be what its name says, as one line naming it: a
    JSON file that is no UTF-8 JSON object, a chat template that is no UTF-8 text, a safetensors file without a readable
    header (unless ``weights`` is false: the estimate reads the settings and the tokenizer only). Read before the
    libraries read them (they would stop with a traceback that names no file). Weights in pickle files (``*.bin``)
    are left to transformers and PEFT, which read them with torch's weights-only unpickler."""
    import json

    from safetensors import SafetensorError, safe_open

    kinds = {".json": "a JSON object", ".jinja": "UTF-8 text", **({".safetensors": "a safetensors file"} if weights
                                                                   else {})}
    for path in sorted(Path(folder).expanduser().iterdir()):
        if path.suffix not in kinds or not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="np") as f:
                    f.keys()
            else:
                text = path.read_bytes().decode("utf-8")
                if path.suffix == ".json" and not isinstance(found := json.loads(text), dict):
                    # every JSON file of a model or adapter folder holds one object (settings, a vocabulary)
                    raise TypeError(f"it holds a {type(found).__name__}")
        except (ValueError, TypeError, OSError, SafetensorError) as exc:  # UnicodeDecodeError, JSONDecodeError too
            return (f"{path}: not {kinds[path.suffix]} ({_why(exc)}); the folder is damaged or was altered, and "
                    f"nothing of it was loaded: save the model again, or use a copy you trust")
    return None


def _why(exc: Exception) -> str:
    if isinstance(exc, TypeError):
        return str(exc)
    if isinstance(exc, UnicodeDecodeError):
        return f"byte {exc.start} is not UTF-8"
    if isinstance(exc, ValueError) and hasattr(exc, "lineno"):  # json.JSONDecodeError
        return f"line {exc.lineno}: {exc.msg}"
    return f"{type(exc).__name__}: {first_line(str(exc))[:120]}"


# Files a folder's tokenizer is read from (fast, slow sentencepiece, or the config naming the class; a GPT-2
# style vocab.json with its merges.txt, Mistral's tekken.json, a tiktoken file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json",
                   "tokenizer.tiktoken")
# An adapter's weights, as PEFT's save_pretrained writes them.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a tokenizer to load: one of its files, or a GGUF (its metadata holds one)."""
    from shardtune.gguf_source import find_gguf

    folder = Path(folder).expanduser()
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or find_gguf(folder) is not None


def tokenizer_problem(name: str, *folders: str | Path) -> str | None:
    """None when one of ``folders`` (read in that order) holds a tokenizer; else one line for ``name``."""
    if any(has_tokenizer(folder) for folder in folders):
        return None
    return (f"{name} holds no tokenizer (no {', '.join(TOKENIZER_FILES)}): copy the base model's tokenizer files "
            f"into it (tokenizer.save_pretrained(folder) writes them)")


# What to do about an adapter whose weights do not fit the base it is loaded on.
ADAPTER_ON_ANOTHER_BASE = "the adapter was trained on a base model of other shapes; give that base model"


def adapter_base(adapter_dir: Path) -> Path:
    """The base model folder (or GGUF) an adapter's adapter_config.json names, resolved as given or relative to the
    adapter folder, or a hub name's snapshot in the local Hugging Face cache (where training read it); a
    UsageError naming the file where it names none, or none on this machine."""
    from shardtune.gguf_source import find_gguf

    config_file = adapter_dir / "adapter_config.json"
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError as exc:
        raise UsageError(f"{config_file}: not valid JSON ({exc}); re-save the adapter with save_pretrained.") from exc
    if not base:
        raise UsageError(f"{config_file}: no 'base_model_name_or_path'; set it to the local base model folder.")
    for candidate in (Path(base).expanduser(), adapter_dir / base):
        if (candidate / "config.json").is_file() or find_gguf(candidate):  # a GGUF base: its .gguf file
            return candidate
    if cached := _config_file(base):  # a run trained on a hub name keeps the name in its adapter
        return cached.parent
    raise UsageError(f"{config_file}: base_model_name_or_path '{base}' is neither a local model folder nor in the "
                     f"local Hugging Face cache (nothing is downloaded); point it at the folder that holds the base "
                     f"model's config.json.")


def adapter_folder_problem(folder: str | Path) -> str | None:
    """What keeps the PEFT adapter folder ``folder`` from being read, as one line naming the file: no
    adapter_config.json, one that is not a JSON object, or a damaged file (``damaged_file_problem``); None when
    nothing does. Its weights are asked for apart (``adapter_weights_problem``), once its base has been checked."""
    import json

    folder = Path(folder).expanduser()
    config = folder / "adapter_config.json"
    if not config.is_file() and is_adapter_folder(folder / "final"):  # export takes it; merge not
        return f"{folder}: a LoRA run's output_dir, not its adapter; give {folder / 'final'}"
    if not config.is_file() and is_whole_model_folder(folder):  # a full fine-tune's final/, or any model
        return (f"{folder}: a whole model (config.json and its weights), not a PEFT adapter folder (no "
                f"adapter_config.json): nothing to merge; use the folder as it is, or give a LoRA run's "
                f"output_dir/final")
    if not config.is_file():
        return (f"{folder}: not a PEFT adapter folder (no adapter_config.json); give output_dir/final of a LoRA run "
                f"or the folder 'shardtune export' wrote")
    if damaged := damaged_file_problem(folder):
        return damaged
    if not isinstance(json.loads(config.read_text()), dict):
        return (f"{config}: not a JSON object (PEFT's adapter settings: peft_type, r, target_modules, ...); the "
                f"folder is damaged or was altered: save the adapter again, or use a copy you trust")
    return None


def adapter_weights_problem(folder: str | Path) -> str | None:
    """An adapter folder without its weights, as one line; None when they are there."""
    folder = Path(folder).expanduser()
    if any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        return None
    return (f"{folder}: holds adapter_config.json but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); copy "
            f"them into it, or export the checkpoint again ('shardtune export CHECKPOINT OUT')")


def adapter_left_out(model, folder: str | Path) -> str | None:
    """What of the adapter folder ``folder`` the loaded ``PeftModel`` ``model`` holds no place for, as one line; None
    when every tensor found a module. PEFT adapts the modules of the base that the adapter's config names and drops
    the adapter's other tensors without a word: on a base of other module names (a Llama adapter on Phi-3, whose
    q/k/v are one qkv_proj) a merge kept 4 of its 14 target modules."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    path = Path(folder).expanduser() / ADAPTER_WEIGHTS[0]
    if not path.is_file():  # the pickled file is read (or refused) by PEFT itself
        return None
    with safe_open(str(path), framework="pt") as f:
        saved = set(f.keys())
    # every tensor the adapter may hold, the base's embeddings included (PEFT saves them where the vocabulary grew);
    # "auto" would look for the base's config.json, which a GGUF base has not, and warn
    missing = sorted(saved - set(get_peft_model_state_dict(model, save_embedding_layers=True)))
    if not missing:
        return None
    return (f"adapter {folder}: {len(missing)} of its {len(saved)} tensors fit no module of the base (e.g. "
            f"{missing[0]}), so they would be left out; give the base model it was trained on (its "
            f"adapter_config.json's base_model_name_or_path)")


# The libraries that read model, tokenizer and adapter folders: what they raise about a folder's contents.
_LOADERS = ("transformers", "peft", "tokenizers", "huggingface_hub", "safetensors")


@contextmanager
def loading_refused(what: str, fix: str, mismatch_fix: str = "") -> Iterator[None]:
    """Inside: an error that transformers, PEFT or the tokenizers raise about what a folder holds (a value of the
    wrong type in a config, an unknown model or PEFT type, a file it cannot parse) is one UsageError naming
    ``what`` and the library's own first line, then ``fix``; weights of other shapes than the model's are said as
    such, then ``mismatch_fix`` where given (an adapter on another base). An error raised in shardtune's own code
    keeps its traceback: it is a bug, not bad input."""
    import traceback

    try:
        yield
    except RuntimeError as exc:  # torch's load_state_dict: weights of other shapes than the model's
        mismatch = re.search(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                             r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)", str(exc))
        if not mismatch:
            raise
        name, saved, model = mismatch.groups()
        raise UsageError(f"{what}: the weights do not fit the model ({name} is {saved} in the files, {model} in the "
                         f"model): {mismatch_fix or fix}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = Path(frames[-1].filename).parts if frames else ()
        if isinstance(exc, UsageError) or not any(name in where for name in _LOADERS):
            raise
        message = f"no {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else str(exc)
        raise UsageError(f"{what}: cannot be loaded ({type(exc).__name__}: {first_line(message)[:160]}); "
                         f"{fix}") from None


@contextmanager
def pickled_weights_refused(*folders: Path) -> Iterator[None]:
    """Inside: weights in a pickle file (``*.bin``) that torch's weights-only unpickler refuses (transformers and
    PEFT read them with it) are one UsageError naming the files and what they asked for, not a traceback whose
    advice is to load them unsafely. Nothing of them ran."""
    import pickle

    try:
        yield
    except pickle.UnpicklingError as exc:
        files = sorted({str(p) for folder in folders for p in folder.glob("*.bin")}) or [str(f) for f in folders]
        asked = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        why = f"it asks for {asked.group(1)}, which weights never hold" if asked else "not plain tensors"
        raise UsageError(f"{', '.join(files)}: refused to load ({why}); nothing of it was run. Use weights you "
                         f"trust, saved as safetensors") from None
