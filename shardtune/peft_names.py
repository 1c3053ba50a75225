"""How PEFT matches the module names a recipe lists against a model's modules, and what it saves of them.

One rule for the estimate's count (memory/lora_count.py), which works on a table of the model's modules, and for
the trainer's check of the names (train/model.py), which works on the live model: where they differed, estimate
refused a job that train ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardtune.errors import closest


def targets_module(full_name: str, target: str) -> bool:
    """A ``target_modules`` entry names the module: its whole dotted name, or its last dotted parts (PEFT's
    ``check_target_module_exists``: ``q_proj`` is ``...layers.0.self_attn.q_proj``, not ``...layers.0.xq_proj``)."""
    return full_name == target or full_name.endswith("." + target)


def saves_module(full_name: str, entry: str) -> bool:
    """A ``modules_to_save`` entry names the module: the end of its name, as PEFT's ``_set_trainable`` matches it
    (``head`` names ``lm_head``)."""
    return full_name.endswith(entry)


def unmatched(names: Iterable[str], modules: Iterable[str], *, saved: bool = False) -> list[str]:
    """The listed ``names`` that name none of ``modules`` (full dotted names), in the order given; ``saved``: as
    ``modules_to_save`` entries, else as ``target_modules`` ones."""
    matches = saves_module if saved else targets_module
    modules = list(modules)
    return [name for name in names if not any(matches(module, name) for module in modules)]


def did_you_mean(missing: Iterable[str], choices: Iterable[str]) -> str:
    """`` (did you mean q_proj, v_proj?)`` with the nearest of ``choices`` to each missing name; '' for none."""
    choices = list(choices)
    # dict keys: two missing names near one module (Phi-3's fused qkv_proj for q_proj, v_proj) name it once
    hints = list(dict.fromkeys(hint for name in missing if (hint := closest(name, choices))))
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def embedding_layers_saved(model: Any) -> bool | str:
    """PEFT's ``save_embedding_layers`` for the adapter of ``model`` (a PeftModel): "auto", where PEFT saves the
    base's embeddings when the vocabulary differs from the one its base's config.json gives, except on a local base
    with no config.json (a GGUF file): there PEFT warns that it found none and saves them not, which is False said
    without the warning. Rows a run added to the vocabulary are in the adapter either way (train/model.py
    added_token_targets)."""
    config = model.peft_config[model.active_adapter]
    base = Path(config.base_model_name_or_path).expanduser() if config.base_model_name_or_path else None
    return False if base is not None and base.exists() and not (base / "config.json").is_file() else "auto"
