"""The data section of a training config, declared with the other sections (shardtune/config/schema.py)."""

from __future__ import annotations

from shardtune.config.schema import DATA_FORMATS, DataConfig

__all__ = ["DATA_FORMATS", "DataConfig"]
