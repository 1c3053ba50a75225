"""Known architectures, shipped as the owners' ``config.json`` data so nothing is downloaded.

Each ``<name>.json`` holds the Hugging Face config of one model plus a ``_shardtune`` key with the Hub id and the
published parameter count (which the tests compare with the count of the model built from the config).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

from shardtune.errors import UsageError, closest

CATALOG_DIR = Path(__file__).parent
META_KEY = "_shardtune"


def names() -> list[str]:
    """Catalog names, sorted."""
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


@cache
def _read(name: str) -> dict:
    return json.loads((CATALOG_DIR / f"{name}.json").read_text())


def canonical(name: str) -> str:
    """The catalog name of ``name``: a catalog name, or the model's Hugging Face id, which is what ``--list``
    prints and ``--emit-config`` writes, each in any case (Llama-3.1-8B as the model card spells it), or an
    instruction-tuned variant's id (``variant_of``); anything else unchanged."""
    if name in names():
        return name
    return _by_id(name) or _by_id(variant_of(name) or "") or name


def _by_id(name: str) -> str | None:
    """The catalog name whose own name or Hugging Face id is ``name`` in any case; None where none is."""
    return _lower_names().get(name.lower())


@cache
def _lower_names() -> dict[str, str]:
    """Each catalog model's Hugging Face id and name, lower case, to its name (read once: ``canonical`` asks up
    to four times a call, and an estimate calls it from several places)."""
    return {str(metadata(n).get("hf_id", "")).lower(): n for n in names()} | {n.lower(): n for n in names()}


# The words the owners' ids add for an instruction-tuned variant of a base model (meta-llama/Llama-3.1-8B-Instruct,
# google/gemma-2-9b-it, meta-llama/Llama-2-7b-chat-hf, mistralai/Mistral-7B-Instruct-v0.1): fine-tuned from it,
# the same architecture and vocabulary.
VARIANT_WORDS = ("instruct", "it", "chat")


def is_catalog_model(name: str) -> bool:
    """Whether ``name`` is a catalog model's own name or Hugging Face id (in any case), not a variant's id."""
    return name in names() or _by_id(name) is not None


def variant_of(name: str) -> str | None:
    """The Hugging Face id of the base model in the catalog whose instruction-tuned variant the id ``name`` is, by
    its owner's naming (``name`` without its -Instruct, -it or -chat part); None where ``name`` is no hub id, is in
    the catalog itself, or that id is not."""
    owner, slash, model = name.rpartition("/")
    parts = model.split("-")
    kept = [part for part in parts if part.lower() not in VARIANT_WORDS]
    if not slash or _by_id(name) or len(kept) == len(parts) or not kept:
        return None
    base = owner + slash + "-".join(kept)
    return base if _by_id(base) else None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([bm])", re.IGNORECASE)


def of_about(size: str) -> list[str] | None:
    """The catalog models whose published parameter count is within a third of ``size`` ("8b", "70B", "135M"),
    nearest first; None where ``size`` is no such size."""
    match = _SIZE.fullmatch(size.strip())
    if not match:
        return None
    wanted = float(match[1]) * (1e9 if match[2].lower() == "b" else 1e6)
    counts = {n: metadata(n).get("published_parameters") or 0 for n in names()}
    near = [n for n, count in counts.items() if wanted > 0 and abs(count - wanted) <= wanted / 3]
    return sorted(near, key=lambda n: (abs(counts[n] - wanted), n))


def load(name: str) -> dict:
    """The config dict of a catalog model (without shardtune's own metadata); ``name`` may be its hub id."""
    name = canonical(name)
    if (sized := of_about(name)) is not None:
        which = (f"the catalog's models of about that size: {', '.join(sized)}; give one of them" if sized else
                 "no catalog model is of about that size ('shardtune estimate --list' prints them); give one")
        raise UsageError(f"unknown model '{name}': a size alone does not say the architecture; {which} (or a model "
                         f"folder or its config.json)")
    if name not in names():
        hint = closest(name, names())
        did_you_mean = f"did you mean '{hint}'? " if hint else ""
        hub = (f"'hf download {name} config.json' puts its config in the local Hugging Face cache (no weights), "
               f"which the estimate reads; " if name.count("/") == 1 else "")
        raise UsageError(
            f"unknown model '{name}': not a catalog name, a local folder, a config.json or a hub model in the local "
            f"Hugging Face cache; {did_you_mean}{hub}run 'shardtune estimate --list' to see the catalog."
        )
    return {k: v for k, v in _read(name).items() if k != META_KEY}


def metadata(name: str) -> dict:
    """The Hub id, published parameter count and its source for a catalog model."""
    return dict(_read(name).get(META_KEY, {}))
