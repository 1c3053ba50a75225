"""The supervised fine-tuning data pipeline: read, template, mask, truncate, pack, cache, sample and collate.

Names are imported on first use so that ``shardtune --help`` does not pay for torch and ``datasets``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Collator": ".collate", "DataConfig": "..config.schema", "DataReport": ".report", "EvalSampler": ".sampler",
            "GlobalBatchSampler": ".sampler", "PreparedData": ".pipeline", "prepare_datasets": ".pipeline",
            "load_tokenizer": ".templates"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardtune.data' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
