"""bitsandbytes left out of a process whose work does not use it.

PEFT imports bitsandbytes whenever it is installed (``peft/helpers.py``), and bitsandbytes wraps its CPU kernels
in ``torch.compile`` as it is imported, which loads TorchInductor: about 1.5 s of every process's start, and three
lines of output, for work that never touches it. A ``shardtune train`` process whose job uses nothing of
bitsandbytes (no 4-bit base, no bitsandbytes optimizer, no model saved quantised), and a ``generate``, ``chat`` or
``merge`` process whose base model was not saved quantised, marks it as not installed before PEFT is imported, and
PEFT goes on as it does on a machine without it. Only a process the ``shardtune`` command owns does this: the same
work called inside another program (a notebook, the tests) leaves its modules alone.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from shardtune.config.optimizers import OPTIMIZERS


def needs_bitsandbytes(cfg) -> bool:
    """Whether the job loads bitsandbytes: QLoRA's 4-bit base, an 8-bit or paged optimizer, or a model whose
    config says it was saved quantised (or whose config cannot be read before loading, a hub model not in the
    cache: then it may be)."""
    if cfg.lora.use_4bit_quantization or OPTIMIZERS[cfg.optim.optim].library == "bitsandbytes":
        return True
    return _declares_quantization(cfg.model.model_name_or_path)


def model_needs_bitsandbytes(model: str | Path | None) -> bool:
    """Whether loading ``model`` (a folder, a GGUF file or a hub name; None where it is not known before loading)
    may load bitsandbytes: it was saved quantised, or its config cannot be read first."""
    return model is None or _declares_quantization(str(model))


def _declares_quantization(name: str) -> bool:
    from shardtune.gguf_source import find_gguf

    if find_gguf(name) is not None:  # dequantised as it is read
        return False
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json")
        except ValueError:  # not a hub name either; loading the model says what is wrong with it
            cached = None
        if not isinstance(cached, str):
            return True  # not readable before the model loads: keep bitsandbytes within reach
        config = Path(cached)
    try:
        return "quantization_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return True


def leave_out_unless(needed: Callable[[], bool]) -> None:
    """Mark bitsandbytes as not installed in this process when ``needed()`` (does the work use it?) is false and
    nothing has imported it or PEFT yet."""
    if "bitsandbytes" not in sys.modules and "peft" not in sys.modules and not needed():
        sys.modules["bitsandbytes"] = None  # importlib's mark for "not importable": import raises, find_spec is None
