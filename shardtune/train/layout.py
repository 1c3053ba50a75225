"""The checkpoint folder layout: ``output_dir/checkpoints/step-N/``, complete once ``manifest.json`` is written.

A leaf (it imports nothing of shardtune but its errors), so the command can check a resume folder before any model
loads, and the checkpointer writes and reads the same names.
"""

from __future__ import annotations

import re
from pathlib import Path

# resume_from_checkpoint values that name no folder: the newest complete checkpoint in output_dir, or none.
RESUME_NEWEST = ("true", "yes", "1", "latest")
RESUME_OFF = ("false", "no", "0", "")
MANIFEST = "manifest.json"  # written last into a checkpoint folder: its presence means the save completed
STEP_FOLDER = re.compile(r"step-(\d+)$")


def checkpoint_folder_problem(folder: str | Path, label: str, *, or_else: str = "") -> str | None:
    """Why ``folder`` is not a complete checkpoint, as one line starting with ``label``; None when it is one.

    A folder that does not exist gets the step-N folders beside it listed, so a mistyped step is fixed at a glance.
    """
    path = Path(folder)
    if (path / MANIFEST).is_file():
        return None
    if path.exists():
        return (f"{label}: not a complete shardtune checkpoint (no {MANIFEST}); give an "
                f"output_dir/checkpoints/step-N folder{or_else}")
    parent = path.parent
    steps = sorted((int(m.group(1)), p) for p in parent.iterdir() if (m := STEP_FOLDER.match(p.name))
                   and p.is_dir()) if parent.is_dir() else []
    complete = [p.name for _, p in steps if (p / MANIFEST).is_file()]
    if complete:
        return f"{label}: no such folder; {parent} holds {', '.join(complete)}: give one of those{or_else}"
    if steps:
        beside = f"{parent} holds only incomplete checkpoints: {', '.join(p.name for _, p in steps)}"
    else:
        beside = f"{parent} holds no step-N folder" if parent.is_dir() else f"{parent} does not exist either"
    return f"{label}: no such folder ({beside}); give an output_dir/checkpoints/step-N folder{or_else}"


def resume_problem(spec: str | None, label: str) -> str | None:
    """Why ``resume_from_checkpoint`` = ``spec`` names no complete checkpoint (a line led by ``label``); None when
    it names one, or asks for the newest one, or for none."""
    if spec is None or spec.lower() in RESUME_NEWEST + RESUME_OFF:
        return None
    return checkpoint_folder_problem(spec, label, or_else=", or true for the newest one")
