"""Regenerate ``catalog_counts.json`` (see catalog_data.py): every catalog model built on meta and counted.

Run after changing the catalog or the counting code:  python -m shardtune.memory.catalog_build
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from shardtune.files import write_text
from shardtune.memory.catalog_data import DATA_PATH, config_sha256
from shardtune.memory.inventory import ModelAnalysis


def compute_entry(name: str) -> dict:
    """Build catalog model ``name`` on meta and return what the package ships for it."""
    analysis = ModelAnalysis(name, use_cache=False, use_packaged=False)  # count from the model itself
    digest = config_sha256(analysis.config_dict)
    inventory = asdict(analysis.inventory)
    inventory.pop("name")
    return {"config_sha256": digest, "inventory": inventory, "table": analysis.table}


def write_catalog_counts(path: Path = DATA_PATH) -> None:
    """Recompute every catalog model and write ``path`` (via a temporary file and a rename)."""
    import importlib.metadata

    from shardtune import catalog

    data = {"transformers": importlib.metadata.version("transformers"),
            "models": {name: compute_entry(name) for name in catalog.names()}}
    write_text(path, json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m shardtune.memory.catalog_build",
                            description=f"Recount every catalog model on meta and rewrite {DATA_PATH.name} (run "
                                        f"after changing the catalog or the counting code).").parse_args()
    write_catalog_counts()
    print(f"wrote {DATA_PATH}")
