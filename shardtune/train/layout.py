"""The checkpoint folder layout: ``output_dir/checkpoints/step-N/``, complete once ``manifest.json`` is written.

A leaf (it imports nothing of shardtune but its errors), so the command can check a resume folder before any model
loads, and the checkpointer writes and reads the same names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# resume_from_checkpoint values that name no folder: the newest complete checkpoint in output_dir, or none.
RESUME_NEWEST = ("true", "yes", "1", "latest")
RESUME_OFF = ("false", "no", "0", "")
MANIFEST = "manifest.json"  # written last into a checkpoint folder: its presence means the save completed
STEP_FOLDER = re.compile(r"step-(\d+)$")
EXPORT_LIST = ".shardtune-export.json"  # the files an export wrote, so that --overwrite touches those only
PROMPT_STYLE = "prompt_style"  # summary.json's (and an export list's): "chat template", "plain text" or "mixed"
# summary.json's (and an adapter export list's): the 4-bit type (nf4, fp4) of a QLoRA run's base, null otherwise
BASE_QUANTIZATION = "base_quantization"


# The manifest's fields a load reads, each with what a save writes there: every format wrote the first two; the
# others came later and are read with a default where absent.
MANIFEST_NEEDS = {"world_size": "a whole number >= 1", "trainable_only": "true or false"}
# trainable_token_ids: the token rows a LoRA run trains (PEFT's trainable_token_indices), which a load must wrap
# alike; the rows the run added are found again from its tokenizer, those its base never trained are not.
MANIFEST_MAY_HOLD = {"flat_optimizer": "true or false", "files": "an object of file names",
                     "trainable_token_ids": "a list of token ids"}
_HOLDS = {"a whole number >= 1": lambda v: type(v) is int and v >= 1, "true or false": lambda v: type(v) is bool,
          "an object of file names": lambda v: isinstance(v, dict),
          "a list of token ids": lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)}


def manifest_problem(manifest: dict, where: Path) -> str | None:
    """What in the manifest ``where`` (read as ``manifest``) no save wrote, as one line naming it; None when a
    load can read it. The manifest lists the other files' hashes, not its own: its fields are checked here."""
    for field, what in {**MANIFEST_NEEDS, **MANIFEST_MAY_HOLD}.items():
        if field not in manifest:
            if field in MANIFEST_NEEDS:
                return f"{where} has no {field} (a save writes {what} there)"
        elif not _HOLDS[what](manifest[field]):
            return f"{where}: {field} is {manifest[field]!r}, where a save writes {what}"
    return None


def stamp(path: Path) -> dict[str, int]:
    """What tells a file unchanged since it was listed: its size and modification time."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def trained_prompt_style(model: str | Path) -> str | None:
    """How the run that made the model folder ``model`` (or the checkpoint folder) wrote its prompts
    (``PROMPT_STYLE``): said by the run's summary.json beside its final/ (once the run ended), or by the export list
    of a folder merged or exported from it; None where neither says."""
    return _run_record(model, PROMPT_STYLE)


def trained_base_quantization(adapter: str | Path) -> str | None:
    """The 4-bit type (nf4, fp4) of the base a QLoRA run trained ``adapter`` on (``BASE_QUANTIZATION``): a
    checkpoint's config.yaml says it, else as ``trained_prompt_style`` finds it (a run's output_dir read as its
    final/); None for LoRA, or where nothing says."""
    folder = Path(adapter).expanduser()
    if (folder / MANIFEST).is_file():  # a run still going, or stopped, has no summary.json yet
        import yaml

        try:
            config = yaml.safe_load((folder / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        quantized = isinstance(config, dict) and config.get("use_4bit_quantization") is True
        return str(config.get("bnb_4bit_quant_type")) if quantized else None
    if (folder / "final").is_dir() and (folder / "summary.json").is_file():  # a run's output_dir
        folder = folder / "final"
    return _run_record(folder, BASE_QUANTIZATION)


def _run_record(model: str | Path, field: str) -> str | None:
    """``field`` of the record of the run that made ``model``: its summary.json, or the folder's export list."""
    folder = Path(model).expanduser()
    if (folder / MANIFEST).is_file():  # output_dir/checkpoints/step-N
        folder = folder.parent.parent / "final"
    record = folder.parent / "summary.json" if folder.name == "final" else folder / EXPORT_LIST
    try:
        said = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    value = said.get(field) if isinstance(said, dict) else None
    return value if isinstance(value, str) else None


def listed_files(folder: Path) -> set[str]:
    """The files (relative paths) an earlier export listed in ``folder`` and nobody changed since (same size and
    modification time): a model card the user edited is the user's now. Empty when it wrote no list."""
    try:
        listed = json.loads((folder / EXPORT_LIST).read_text())["files"]
        return {name for name, recorded in listed.items()
                if stays_inside(name) and (folder / name).is_file() and stamp(folder / name) == recorded}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def stays_inside(name: str) -> bool:
    """A listed name that stays in its folder (no absolute path, no '..'): a list never reaches outside it."""
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts


def checkpoint_folder_problem(folder: str | Path, label: str, *, or_else: str = "") -> str | None:
    """Why ``folder`` is not a complete checkpoint, as one line starting with ``label``; None when it is one.

    A folder that does not exist gets the step-N folders beside it listed, so a mistyped step is fixed at a glance.
    """
    path = Path(folder)
    if (path / MANIFEST).is_file():
        return None
    parent = path.parent
    steps = _step_folders(parent)
    complete = [p.name for _, p in steps if (p / MANIFEST).is_file()]
    if path.exists():
        if newest := newest_checkpoint_in(path):
            return (f"{label}: not a checkpoint, but it holds checkpoints: give one of them, e.g. the "
                    f"newest, {newest}{or_else}")
        if complete:  # a save that never finished (its .tmp-step-N folder), or a copy cut short, beside good ones
            return (f"{label}: not a complete shardtune checkpoint (no {MANIFEST}: a save that did not finish, or a "
                    f"copy cut short); {parent} holds {', '.join(complete)}: give one of those{or_else}")
        return (f"{label}: not a complete shardtune checkpoint (no {MANIFEST}); give an "
                f"output_dir/checkpoints/step-N folder{or_else}")
    if complete:
        return f"{label}: no such folder; {parent} holds {', '.join(complete)}: give one of those{or_else}"
    if steps:
        beside = f"{parent} holds only incomplete checkpoints: {', '.join(p.name for _, p in steps)}"
    else:
        beside = f"{parent} holds no step-N folder" if parent.is_dir() else f"{parent} does not exist either"
    return f"{label}: no such folder ({beside}); give an output_dir/checkpoints/step-N folder{or_else}"


def newest_checkpoint_in(folder: str | Path) -> Path | None:
    """The newest complete checkpoint of a run's output_dir, or of its checkpoints/ folder, ``folder``; None where
    it holds none."""
    for holder in (Path(folder) / "checkpoints", Path(folder)):
        if found := [p for _, p in _step_folders(holder) if (p / MANIFEST).is_file()]:
            return found[-1]
    return None


def _step_folders(folder: Path) -> list[tuple[int, Path]]:
    """The step-N folders in ``folder``, by step."""
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FOLDER.match(p.name))
                  and p.is_dir()) if folder.is_dir() else []


def resume_problem(spec: str | None, label: str) -> str | None:
    """Why ``resume_from_checkpoint`` = ``spec`` names no complete checkpoint (a line led by ``label``); None when
    it names one, or asks for the newest one, or for none."""
    if spec is None or spec.lower() in RESUME_NEWEST + RESUME_OFF:
        return None
    return trainer_checkpoint_problem(Path(spec), label) or checkpoint_folder_problem(
        spec, label, or_else=", or true for the newest one")


def _trainer_step(path: Path) -> int | None:
    """The global_step of the Transformers Trainer checkpoint ``path`` (``checkpoint-N``: its trainer_state.json
    has global_step, a shardtune one step); None for any other folder."""
    try:
        step = json.loads((path / "trainer_state.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return None if (path / MANIFEST).is_file() else step


def newest_trainer_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest Transformers Trainer checkpoint (``checkpoint-N``) in ``output_dir``, or None."""
    folder = Path(output_dir)
    found = sorted((int(m.group(1)), p) for p in (folder.iterdir() if folder.is_dir() else ())
                   if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and _trainer_step(p) is not None)
    return found[-1][1] if found else None


def trainer_checkpoint_problem(path: Path, label: str) -> str | None:
    """A Transformers Trainer checkpoint given to resume, as one line (led by ``label``) saying so and how to train
    on from its weights; None for any other folder."""
    if (step := _trainer_step(path)) is None:
        return None
    return (f"{label}: a Transformers Trainer checkpoint (global_step {step}), which shardtune cannot resume: its "
            f"optimizer, scheduler and data position are Trainer's. To train on from its weights, "
            f"{train_on_from(path)}, with resume_from_checkpoint false and a new output_dir")


def train_on_from(weights: Path) -> str:
    """How a new run starts from the model or adapter folder ``weights`` (the end of a sentence's 'to ...')."""
    if (weights / "adapter_config.json").is_file():
        return (f"merge its adapter into the base (shardtune merge {weights} --base BASE MERGED) and give "
                f"model_name_or_path MERGED")
    return f"give model_name_or_path {weights}"
