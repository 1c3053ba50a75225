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


def looks_like_local_path(name: str) -> bool:
    """A name read as a local path, never a hub name: ./x, /x, ~/x, a/b/c, or one ending like a data file."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).suffix.lower() in EXTENSIONS


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
    if not config_file.is_file():
        return (f"{name} holds no config.json (it holds {_holds(folder)}): give a Transformers model folder, "
                f"the one save_pretrained wrote")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        kinds = ", ".join(WEIGHT_PATTERNS[:-1]) + f" or {WEIGHT_PATTERNS[-1]}"
        return (f"{name} holds config.json but no weights (no {kinds} file; it holds {_holds(folder)}): copy the "
                f"weight files into it, or give the folder that has them")
    if damaged := damaged_file_problem(folder):
        return damaged
    config = json.loads(config_file.read_text())
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if trust_remote_code or not auto_map or not _needs_own_code(config.get("model_type"), auto_map):
        return None
    classes = ", ".join(f"{cls} -> {ref}" for cls, ref in auto_map.items()) if isinstance(auto_map, dict) else auto_map
    return (f"{name} needs its own Python code to load (config.json: model_type {config.get('model_type')!r}, "
            f"auto_map {classes}), and shardtune does not run code from a model folder unless asked: if you "
            f"trust that code, {trust_fix}")


def _needs_own_code(model_type: object, auto_map: object) -> bool:
    """Whether transformers has no built-in class for ``model_type`` that stands in for the folder's code (it
    uses its own one where it has, as for models that shipped code before transformers adopted them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return True
    return isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map \
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def damaged_file_problem(folder: str | Path) -> str | None:
    """The first file of a model or adapter folder that cannot be what its name says, as one line naming it: a
    JSON file that is no UTF-8 JSON, a chat template that is no UTF-8 text, a safetensors file without a readable
    header. Read before the libraries read them (they would stop with a traceback that names no file). Weights
    in pickle files (``*.bin``) are left to transformers and PEFT, which read them with torch's weights-only
    unpickler."""
    import json

    from safetensors import SafetensorError, safe_open

    kinds = {".json": "JSON", ".jinja": "UTF-8 text", ".safetensors": "a safetensors file"}
    for path in sorted(Path(folder).expanduser().iterdir()):
        if path.suffix not in kinds or not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="np") as f:
                    f.keys()
            else:
                text = path.read_bytes().decode("utf-8")
                if path.suffix == ".json":
                    json.loads(text)
        except (ValueError, OSError, SafetensorError) as exc:  # UnicodeDecodeError and JSONDecodeError included
            return (f"{path}: not {kinds[path.suffix]} ({_why(exc)}); the folder is damaged or was altered, and "
                    f"nothing of it was loaded: save the model again, or use a copy you trust")
    return None


def _why(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"byte {exc.start} is not UTF-8"
    if isinstance(exc, ValueError) and hasattr(exc, "lineno"):  # json.JSONDecodeError
        return f"line {exc.lineno}: {exc.msg}"
    return f"{type(exc).__name__}: {first_line(str(exc))[:120]}"


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
