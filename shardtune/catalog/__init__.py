"""Known architectures, shipped as the owners' ``config.json`` data so nothing is downloaded.

Each ``<name>.json`` holds the Hugging Face config of one model plus a ``_shardtune`` key with the Hub id and the
published parameter count (which the tests compare with the count of the model built from the config).
"""

from __future__ import annotations

import json
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
    prints and ``--emit-config`` writes, each in any case (Llama-3.1-8B as the model card spells it); anything else
    unchanged."""
    if name in names():
        return name
    by_lower = {str(metadata(n).get("hf_id", "")).lower(): n for n in names()} | {n.lower(): n for n in names()}
    return by_lower.get(name.lower(), name)


def load(name: str) -> dict:
    """The config dict of a catalog model (without shardtune's own metadata); ``name`` may be its hub id."""
    name = canonical(name)
    if name not in names():
        hint = closest(name, names())
        did_you_mean = f"did you mean '{hint}'? " if hint else ""
        raise UsageError(
            f"unknown model '{name}': not a catalog name, a local folder or a config.json; "
            f"{did_you_mean}run 'shardtune estimate --list' to see the catalog."
        )
    return {k: v for k, v in _read(name).items() if k != META_KEY}


def metadata(name: str) -> dict:
    """The Hub id, published parameter count and its source for a catalog model."""
    return dict(_read(name).get(META_KEY, {}))
