"""Exact counts of every catalog model, shipped with the package so the first estimate needs no torch.

Building a model on the meta device needs torch and transformers, whose imports alone take ~3 s: too slow for "an
instant answer". So ``catalog_counts.json`` holds, per catalog model, the ``ModelInventory`` and the LoRA module
table that ``ModelAnalysis`` computes from the meta model: the same code, run ahead of time. An entry is used only
when the config is exactly the catalog's (its SHA-256 is stored beside it); tests/test_estimate_catalog_data.py
rebuilds every model on meta with the installed transformers and asserts the shipped data equals what it computes.

Regenerate after changing the catalog or the counting code:  python -m shardtune.memory.catalog_build
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

DATA_PATH = Path(__file__).with_name("catalog_counts.json")


def config_sha256(config_dict: dict) -> str:
    """A stable digest of a config dict (key order does not matter)."""
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()


@cache
def _load() -> dict:
    try:
        return json.loads(DATA_PATH.read_text())
    except (OSError, ValueError):  # a missing or damaged file only costs time: the model is built instead
        return {"models": {}}


def packaged_counts(name: str, config_dict: dict) -> dict | None:
    """The shipped {"inventory", "table"} of catalog model ``name``, if ``config_dict`` is exactly its config."""
    entry = _load()["models"].get(name)
    if entry and entry["config_sha256"] == config_sha256(config_dict):
        return entry
    return None
