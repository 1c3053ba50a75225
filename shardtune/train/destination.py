"""Where ``export`` and ``merge`` write: only their own files, never over what a user made.

A destination folder must be new or empty. ``--overwrite`` accepts one that holds an earlier export: the files that
export listed in ``.shardtune-export.json`` are replaced or removed, every other file stays untouched, and a new
file that would land on one of those is refused. The current folder, a folder that holds it, and a folder that
holds the source (or the run it belongs to) are refused whatever the flags: an export never lands on what it reads;
so is a folder inside the source, or inside a run's final/ or checkpoints/ (which the run moves and deletes), and
an OUT that is a symlink (``_symlink_problem``).

The export is written into a fresh temporary sibling (``.tmp-NAME-XXXX``) and moved in when complete, so a failed
or interrupted export leaves the destination as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from fnmatch import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from shardtune.errors import UsageError
from shardtune.files import umask
from shardtune.train.layout import EXPORT_LIST, listed_files, stamp

# What save_pretrained writes for a model, an adapter and a tokenizer: such a file in OUT that an earlier export did
# not write is refused before the export's work starts, not only when it would be replaced at the end.
EXPORT_NAMES = ("README.md", "config.json", "generation_config.json", "adapter_config.json", "adapter_model.*",
                "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "added_tokens.json",
                "vocab.json", "merges.txt", "tokenizer.model")


def _holds(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def _listing(folder: Path, limit: int = 3) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def protected_paths(sources: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """(path, what it is) that no destination may hold: the current folder and each source (a folder holding a
    source's run holds the source too)."""
    return [(Path.cwd().resolve(), "the current folder"),
            *((_real(source), f"the source {source}") for source in sources)]


def _real(path: str | Path) -> Path:
    """``path`` with its symlinks followed; a loop of symlinks (which Path.resolve raises on) is left as it is,
    for the command's own check of that path to name."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _is_run(folder: Path) -> bool:
    """Whether ``folder`` is a shardtune run's output_dir: its config.yaml beside what only a run writes (its
    metrics, summary or lock, or a checkpoint's manifest), not beside any folder called checkpoints/ or final/ (a
    Hydra project's root has a config.yaml too)."""
    from shardtune.train.layout import MANIFEST
    from shardtune.train.output_dir import LOCK

    return (folder / "config.yaml").is_file() and (
        any((folder / name).is_file() for name in ("metrics.jsonl", "summary.json", LOCK))
        or any((folder / "checkpoints").glob(f"step-*/{MANIFEST}")))


def inside_problem(where: Path, sources: Sequence[str | Path]) -> str | None:
    """Why a destination folder ``where`` (resolved) inside a source, or inside a folder a run manages (its
    final/, checkpoints/, trackers' folders), may not receive an export: a run's resume moves aside, and its
    save_total_limit and overwrite_output_dir delete, what they hold; an export in an adapter folder changes what
    the folder loads as. None otherwise (a folder of its own inside a run's output_dir is fine)."""
    from shardtune.train.output_dir import RUN_FILES

    for parent in (where, *where.parents):
        if parent.name in RUN_FILES and _is_run(parent.parent):
            return (f"is inside {parent}, which the run in {parent.parent} manages (a resume, save_total_limit or "
                    f"overwrite_output_dir moves or deletes what it holds)")
    for source in sources:
        real = _real(source)
        if real.is_dir() and _holds(real, where) and not _is_run(real):
            return f"is inside the source {source}"
    return None


def destination_problem(out: str | Path, label: str, *, sources: Sequence[str | Path],
                        overwrite: bool) -> str | None:
    """Why the folder ``out`` may not receive an export (one line led by ``label``); None when it may."""
    out = Path(out)
    if out.is_symlink():
        return _symlink_problem(label, out)
    if out.exists() and not out.is_dir():
        return f"{label} {out}: a file is there; give a new or empty folder"
    where = _real(out)
    for protected, what in protected_paths(sources):
        if _holds(where, protected):
            place = f"is {what}" if where == protected else f"holds {what}"
            return f"{label} {out}: {place}, which an export never writes over; give a new folder, such as ./exported"
    if inside := inside_problem(where, sources):
        return f"{label} {out}: {inside}; give a folder outside it, such as ./exported"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if overwrite:
        ours = listed_files(out)
        theirs = sorted(p.name for p in out.iterdir() if p.name not in ours and any(fnmatch(p.name, pattern)
                                                                                  for pattern in EXPORT_NAMES))
        return _not_ours(label, out, theirs) if theirs else None
    return (f"{label} {out}: not empty (it holds {_listing(out)}); give a new or empty folder, or add --overwrite to "
            f"replace the files of an earlier shardtune export there (nothing else is touched)")


def _symlink_problem(label: str, out: Path) -> str:
    """OUT that is a symlink is refused, whatever it leads to, rather than followed: ``publish`` renames the
    finished folder onto OUT, which would replace the link itself (a link to an empty folder failed only then,
    after all the work, as 'Not a directory'), and replacing files one by one in the folder it leads to can cross
    to another filesystem, where a rename fails halfway through. Naming the folder it leads to is the fix: then
    the export is a plain one there, with every check of a plain folder."""
    real = _real(out)
    if not real.exists():
        return f"{label} {out}: a symlink that leads nowhere (or a loop of symlinks); remove it or give another path"
    return f"{label} {out}: a symlink to {real}, which an export does not follow; give the folder itself, {real}, " \
           f"or a new folder"


def _not_ours(label: str, out: Path, theirs: list[str]) -> str:
    one = len(theirs) == 1
    return (f"{label} {out}: {', '.join(theirs[:3])} there {'was' if one else 'were'} not written by a shardtune "
            f"export (or changed since), and --overwrite replaces only those; move {'it' if one else 'them'} away or "
            f"give a new folder")


def refuse_destination(out: str | Path, label: str, *, sources: Sequence[str | Path], overwrite: bool) -> None:
    if problem := destination_problem(out, label, sources=sources, overwrite=overwrite):
        raise UsageError(problem)


def temporary_sibling(target: Path) -> Path:
    """A new, empty folder beside ``target`` (unique, so nothing of anyone else's is ever reused or removed), with
    the mode a plain mkdir gives under the umask: mkdtemp's 0700 would keep a team's readers and a serving
    account out of the export it becomes."""
    if not target.parent.exists():
        target.parent.mkdir(parents=True)
    folder = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    folder.chmod(0o777 & ~umask())
    return folder


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def publish(tmp: Path, target: Path, label: str, about: dict | None = None) -> Path:
    """Move the complete export in ``tmp`` to ``target``: a rename where ``target`` is new or empty; else (an
    earlier export, ``--overwrite`` having been checked) file by file, replacing and removing only the files
    the earlier export listed. ``tmp`` is gone afterwards. ``about``: what the export's list also records of the
    run it came from (its ``prompt_style``)."""
    written = _files(tmp)
    stamps = {name: stamp(tmp / name) for name in written}  # a rename keeps them
    (tmp / EXPORT_LIST).write_text(json.dumps({"written_by": "shardtune export", **(about or {}), "files": stamps},
                                              indent=1))
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        tmp.rename(target)
        return target
    ours = listed_files(target)
    theirs = [name for name in written if (target / name).exists() and name not in ours]
    if theirs:
        raise UsageError(_not_ours(label, target, theirs))
    for name in sorted(ours - set(written)):  # an earlier export's files this one does not write (old shards)
        (target / name).unlink(missing_ok=True)
    for name in [*written, EXPORT_LIST]:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / name, target / name)
    shutil.rmtree(tmp)
    return target


@contextlib.contextmanager
def folder_made_for(target: Path) -> Iterator[None]:
    """``target``'s folder, made (with any missing parents) for the block; the folders made here are removed
    again when the block fails or is interrupted (SIGTERM, Ctrl-C) and they are still empty: a refused or stopped
    export leaves no empty folder behind, and never removes one it did not make."""
    made = []
    for folder in (target.parent, *target.parent.parents):
        if folder.exists() or folder.is_symlink():
            break
        made.append(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in made:  # the innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
