"""Where a YAML (or JSON) file sets each key, read from its node tree before loading folds anything together: a key
set twice in one mapping, which a plain load keeps the last of without a word, is found with its lines. Recipes,
Accelerate files (config/loading.py) and DeepSpeed JSON (config/deepspeed.py) share it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml


def repeated_key_line(path: Path, key: Any, lines: list[int]) -> str:
    """One line refusing ``key`` set more than once in the file ``path``, at ``lines``."""
    times = "twice" if len(lines) == 2 else f"{len(lines)} times"
    where = ", ".join(map(str, lines[:-1])) + f" and {lines[-1]}"
    return f"{path}: key '{key}' is set {times} (lines {where}); keep one"


MERGE = "tag:yaml.org,2002:merge"  # '<<: *defaults' then a key: YAML's own override, not a key set twice


def _mappings(node: yaml.Node | None, seen: set[int] | None = None) -> Iterator[yaml.MappingNode]:
    """Every mapping in the tree under ``node``, once each (an alias is the node it points at)."""
    seen = set() if seen is None else seen
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            yield node
        for child in node.value:
            for part in child if isinstance(child, tuple) else (child,):
                yield from _mappings(part, seen)


def repeated_keys(node: yaml.Node | None) -> list[tuple[str, list[int]]]:
    """Each key a mapping anywhere under ``node`` sets more than once, with its lines (``safe_load`` would keep the
    last one silently)."""
    return [(key, at) for mapping in _mappings(node) for key, at in key_lines(mapping).items() if len(at) > 1]


def key_lines(node: yaml.Node | None, lift: str = "") -> dict[str, list[int]]:
    """The lines of each key a mapping writes (before '<<' merges fold in), and those of its ``lift`` block."""
    lines: dict[str, list[int]] = {}
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        if key.tag != MERGE and isinstance(key, yaml.ScalarNode):
            lines.setdefault(key.value, []).append(key.start_mark.line + 1)
        if lift and key.value == lift:
            for name, at in key_lines(value).items():
                lines.setdefault(name, []).extend(at)
    return lines
