"""The run's claim on ``output_dir``: one run at a time (a lock), and never on top of another run's files.

Two runs writing one folder mix silently: checkpoints of one, config.yaml of the other, every step twice in
metrics.jsonl, and a later ``resume_from_checkpoint true`` picks up whichever checkpoint is newest. So rank 0
holds ``output_dir/.shardtune.lock`` for the whole run (an ``flock`` the kernel releases when the process dies,
plus host, pid and start time for the message a second run prints), and a folder that holds an earlier run is
used only when the config says how: ``resume_from_checkpoint`` (carry on from it) or ``overwrite_output_dir``
(delete its files first, as Transformers users know the key).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from shardtune.files import written_by_shardtune
from shardtune.errors import UsageError
from shardtune.train.layout import RESUME_OFF, STEP_FOLDER

log = logging.getLogger("shardtune")

LOCK = ".shardtune.lock"
# What a run writes into output_dir; overwrite_output_dir removes these and nothing else.
# (wandb/ and mlruns/: report_to wandb and mlflow's local runs; MLFLOW_TRACKING_URI elsewhere is not touched;
# plots/: 'shardtune plot RUN' pictures of the run's metrics, which would show the earlier run's curves.)
RUN_FILES = ("checkpoints", "final", "tensorboard", "wandb", "mlruns", "plots", "config.yaml", "metrics.jsonl",
             "summary.json")
TRACKER_FOLDERS = ("tensorboard", "wandb", "mlruns")


class OutputDirLock:
    """``output_dir/.shardtune.lock``, held (``flock``) from ``acquire`` until ``release`` or the process's death."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self._fd: int | None = None
        self.restarted = False  # the lock was taken over from an earlier attempt of this torchrun job
        self.earlier: list[str] = []  # an earlier run's files this run replaces (``clear_earlier_run``)

    def acquire(self) -> None:
        """Take the lock, or refuse in one line naming the run that holds it; a dead holder's lock is taken over."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(_unwritable(self.path.parent, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.read(fd, 4096))
            os.close(fd)
            raise UsageError(f"output_dir {self.path.parent} is in use by another run ({holder}): wait for it to "
                             f"finish, stop it, or give another output_dir") from None
        previous = os.read(fd, 4096)
        if previous.strip():
            # The kernel dropped the holder's flock, so it is no longer running (killed, or its machine died).
            self.restarted = _restarted_from(previous)
            (log.info if self.restarted else log.warning)(
                "output_dir %s: taking over the lock of a run that is no longer running (%s)", self.path.parent,
                _describe(previous))
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run_id": _run_id()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode() + b"\n", 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def claim_output_dir(cfg) -> OutputDirLock:
    """Rank 0, before anything is written: create ``output_dir``, lock it, and check it holds no other run.

    A folder with an earlier run's files is refused unless ``resume_from_checkpoint`` is set (the run carries on
    from it) or ``overwrite_output_dir`` is true: its files are deleted by ``clear_earlier_run``, once nothing can
    refuse the new run (a typo in its data or targets does not cost the earlier run).
    """
    folder = Path(cfg.run.output_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"output_dir {folder} is a file, not a folder: give a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(_unwritable(folder, exc)) from None
    lock = OutputDirLock(folder)
    lock.acquire()
    try:
        earlier = earlier_run(folder)
        resuming = str(cfg.checkpoint.resume_from_checkpoint or "").lower() not in RESUME_OFF
        if resuming and cfg.run.overwrite_output_dir:  # Transformers' Trainer lets the resume win too
            log.warning("overwrite_output_dir true: nothing is deleted, since resume_from_checkpoint %s carries the "
                        "run in %s on; set resume_from_checkpoint false to start afresh there",
                        cfg.checkpoint.resume_from_checkpoint, folder)
        if earlier and not resuming:
            if not (cfg.run.overwrite_output_dir or lock.restarted):  # a restart without resume starts over
                raise UsageError(
                    f"output_dir {folder} holds an earlier run ({', '.join(earlier)}): set resume_from_checkpoint "
                    f"true to carry on from its newest checkpoint, overwrite_output_dir true to delete it and start "
                    f"afresh, or give another output_dir")
            lock.earlier = earlier
    except BaseException:
        lock.release()
        raise
    return lock


def clear_earlier_run(lock: OutputDirLock) -> None:
    """Delete the earlier run ``claim_output_dir`` let this one start over (``overwrite_output_dir``, or a restart
    without resume), and say so; nothing where it found none."""
    folder, earlier = lock.path.parent, lock.earlier
    if not earlier:
        return
    lock.earlier = []
    superseded = sorted(p.name for p in (folder / "checkpoints").glob(f"{SUPERSEDED}*"))
    kept = delete_earlier_run(folder)
    (log.info if lock.restarted else log.warning)(
        "%s: deleted the earlier run in %s (%s)", "restart" if lock.restarted else "overwrite_output_dir",
        folder, ", ".join(earlier + [f"checkpoints/{name}" for name in superseded]))
    if kept:
        log.warning("kept what the earlier run's manifests and lists do not name: %s", _first_names(kept))
    # What is left where this run writes (final/, a step folder holding a user's file, or one whose manifest lists
    # no files, from an older format) goes aside: never taken for this run's, never replaced by it.
    left = [*sorted(p for p in (folder / "checkpoints").glob("step-*") if p.is_dir()), folder / "final"]
    if (aside := set_aside(folder, left)) is not None:
        log.warning("moved what remains of the earlier run's final/ and checkpoints to %s: this run writes its own",
                    aside)


def delete_earlier_run(folder: Path) -> list[str]:
    """Delete the files an earlier run wrote in ``folder`` (its ``RUN_FILES``) and no other: a checkpoint's are
    those its manifest lists, final/'s those its export list names (unchanged since), a superseded folder's as a
    run's own; what trackers wrote is theirs. The folders left empty go. Returns what is kept (a user's notes in
    checkpoints/, an edited model card in final/), relative to ``folder``."""
    for name in RUN_FILES:
        path = folder / name
        if path.is_dir() and not path.is_symlink() and name in TRACKER_FOLDERS:
            shutil.rmtree(path)  # a tracker's logs, all of them its own (a symlink in them is removed, not followed)
            continue
        for file in _run_files(path, name):
            file.unlink(missing_ok=True)
        _remove_empty_folders(path)
    kept = []
    for name in RUN_FILES:
        path = folder / name
        if path.is_file():
            kept.append(name)
        elif path.is_dir():
            kept += [str(p.relative_to(folder)) for p in path.rglob("*") if p.is_file()]
    return sorted(kept)


def _run_files(path: Path, name: str) -> list[Path]:
    """The files of a run's entry ``path`` (called ``name`` in its output_dir) that shardtune wrote."""
    from shardtune.train.layout import EXPORT_LIST, listed_files

    if not path.is_dir():
        return [path] if path.exists() else []
    if name == "final":
        return [path / EXPORT_LIST, *(path / f for f in listed_files(path))]
    if name == "plots":  # the pictures shardtune plot wrote; one of the user's stays
        return [f for f in path.iterdir() if f.is_file() and not f.is_symlink() and written_by_shardtune(f)]
    if name != "checkpoints":
        return []
    files: list[Path] = []
    for entry in path.iterdir():
        if entry.name.startswith(".tmp-step-") and entry.is_dir() and not entry.is_symlink():  # a save killed
            shutil.rmtree(entry)
        elif STEP_FOLDER.match(entry.name) and entry.is_dir():
            files += checkpoint_files(entry)
        elif entry.name.startswith(SUPERSEDED) and entry.is_dir():  # an earlier run set aside: a run's own files
            files += [f for n in RUN_FILES for f in _run_files(entry / n, n)]
    return files


def checkpoint_files(path: Path) -> list[Path]:
    """The files of checkpoint ``path`` that shardtune wrote: those its manifest lists, and the manifest; none where
    it lists none (a manifest from before they were listed, or none)."""
    from shardtune.train.layout import MANIFEST, stays_inside

    try:
        listed = list(json.loads((path / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    # A manifest's names stay inside its checkpoint (one naming '../..' reaches nothing outside).
    return [path / MANIFEST, *(path / f for f in listed if stays_inside(f))] if listed else []


def drop_checkpoint(path: Path) -> None:
    """``save_total_limit``'s deletion of checkpoint ``path`` (in output_dir/checkpoints): the files it wrote go; a
    file of the user's in it is kept, moved aside with what holds it (``set_aside``), and named."""
    files = checkpoint_files(path)
    if not files:  # a checkpoint whose manifest lists no files (an older format): the folder is all its own
        shutil.rmtree(path, ignore_errors=True)
        return
    for file in files:
        file.unlink(missing_ok=True)
    _remove_empty_folders(path)
    if path.exists():
        kept = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        aside = set_aside(path.parent.parent, [path])
        log.warning("save_total_limit: deleted checkpoint %s, but not what its manifest does not name (%s): moved "
                    "to %s", path, _first_names(kept), aside)


def _first_names(names: list[str]) -> str:
    """``names`` for a log line: the first five, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _remove_empty_folders(path: Path) -> None:
    """The folders under ``path`` (and ``path``) that hold nothing, deepest first; symlinks are not followed."""
    if not path.is_dir() or path.is_symlink():
        return
    for root, _, _ in os.walk(path, topdown=False):
        if not any(Path(root).iterdir()):
            Path(root).rmdir()


SUPERSEDED = "superseded-"  # checkpoints/superseded-<time>/: what a resume from an older checkpoint set aside


def set_aside(output_dir: Path, paths: list[Path]) -> Path | None:
    """Move ``paths`` (inside ``output_dir``) into ``checkpoints/superseded-<time>/`` with their relative paths,
    and a copy of ``metrics.jsonl`` beside them: nothing of the run is deleted. None when none exists."""
    paths = [path for path in paths if path.exists()]
    if not paths:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = output_dir / "checkpoints" / f"{SUPERSEDED}{stamp}"
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = output_dir / "checkpoints" / f"{SUPERSEDED}{stamp}-{suffix}"
    folder.mkdir(parents=True)
    for path in paths:
        moved = folder / path.relative_to(output_dir)
        moved.parent.mkdir(parents=True, exist_ok=True)
        path.rename(moved)
    if (output_dir / "metrics.jsonl").is_file():
        shutil.copy2(output_dir / "metrics.jsonl", folder / "metrics.jsonl")
    return folder


def newer_than(output_dir: Path, step: int) -> list[Path]:
    """What a later point of the run left when it resumes at ``step``: its checkpoints after ``step``
    (complete or not), final/, and summary.json unless it says SIGTERM stopped the run at ``step`` (a preempted
    run's: SIGTERM saves a checkpoint and writes the summary at the same step, and a requeue resumes right there).
    A run that finished at ``step`` wrote its final/ and the summary describing it: both go aside."""
    later = [path for path in (output_dir / "checkpoints").glob("step-*")
             if (m := STEP_FOLDER.match(path.name)) and int(m.group(1)) > step]
    summary = read_summary(output_dir)
    preempted = summary and summary["steps"] == step and summary.get("stopped_by") == "SIGTERM"
    ends = [output_dir / "final"] + ([] if preempted else [output_dir / "summary.json"])
    return sorted(later, key=lambda p: int(STEP_FOLDER.match(p.name).group(1))) + [p for p in ends if p.exists()]


def read_summary(output_dir: Path) -> dict | None:
    """The run's summary.json, with the step it stopped at (``steps``, a whole number); None where there is none,
    or it cannot be read as one."""
    try:
        summary = json.loads((output_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and isinstance(summary.get("steps"), int) else None


def set_aside_newer(output_dir: Path, step: int) -> Path | None:
    """Resuming at ``step``: what the run made after it is moved aside (``set_aside``), said before anything is
    replaced, so that this run's own checkpoints and final/ never land on them."""
    later = newer_than(output_dir, step)
    names = ", ".join(str(path.relative_to(output_dir)) for path in later)
    folder = set_aside(output_dir, later)
    if folder is not None:
        log.warning("resuming at step %d, but the run holds %s, written after that checkpoint: moved to %s (with a "
                    "copy of metrics.jsonl) rather than replaced; this run writes its own", step, names, folder)
    return folder


def earlier_run(folder: Path) -> list[str]:
    """What of an earlier run ``folder`` holds, in words ('checkpoints step-10..step-20', 'metrics.jsonl')."""
    found = []
    steps = sorted(int(m.group(1)) for p in (folder / "checkpoints").glob("step-*")
                   if (m := STEP_FOLDER.match(p.name)))
    if steps:
        found.append(f"checkpoints step-{steps[0]}" + (f"..step-{steps[-1]}" if len(steps) > 1 else ""))
    found += [name for name in RUN_FILES if name not in ("checkpoints", "config.yaml") and (folder / name).exists()]
    return found


def _run_id() -> str | None:
    """torchrun's id of this job, written into the lock."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def _restarted_from(previous: bytes) -> bool:
    """Whether this is torchrun restarting the job whose worker left ``previous``: the same job id, and this worker
    is a restart (ids such as static rendezvous's 'none' are shared by separate launches; restarts are not)."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return restarts != "0" and _run_id() is not None and _field(previous, "run_id") == _run_id()


def _field(raw: bytes, key: str):
    try:
        return json.loads(raw.decode()).get(key)
    except (ValueError, AttributeError):
        return None


def _describe(raw: bytes) -> str:
    """'pid 123 on host h, started 2026-11-24 01:00:00 UTC' from a lock file's contents."""
    pid, host, started = (_field(raw, k) for k in ("pid", "host", "started"))
    if pid is None:
        return "its lock file holds no details"
    return f"pid {pid} on host {host}, started {started}"


def _unwritable(folder: Path, exc: OSError) -> str:
    reason = "read-only" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else exc.strerror
    return (f"output_dir {folder} cannot be written ({reason}: {exc.strerror}): fix its permissions or give another "
            f"output_dir")
