"""Errors that reach the user as one line: bad input (exit code 2), and failed writes named as OSErrors."""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

# ``log.warning(..., extra=RANK_OWN)``: a warning about this rank alone (its machine's cache folder), which ranks other
# than 0 print too; what every rank would say alike, rank 0 alone says (train/loop.py:quiet_other_rank).
RANK_OWN = {"rank_own": True}


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""

    exit_code = 2  # EXIT_USAGE


class TrainingStopped(RuntimeError):
    """The run cannot go on (non-finite loss, a failed save, ...); the message says where and what to try."""


class PeerLost(TrainingStopped):
    """A rank's process ended mid-run, so the others' collectives failed. ``quiet``: another survivor (the lowest
    rank still running) says it, so this one exits without a word."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class Terminated(BaseException):
    """SIGTERM before the first step: there is nothing to save yet, so the run stops at once. A BaseException, as
    KeyboardInterrupt is, so that no library's ``except Exception`` swallows it."""


# Exit codes of ``shardtune train`` and ``shardtune launch`` (the README's table). 0 means training finished.
EXIT_FAILED = 1  # the run stopped without finishing; nothing new to resume from unless the message names it
EXIT_USAGE = 2  # bad input, found before anything was written
# Stopped by SIGTERM (preemption, scancel, a pod's deletion) after a checkpoint that was saved and verified: run the
# same command with resume_from_checkpoint true to finish. 128 + SIGTERM, what a shell reports for it. ``export`` and
# ``merge`` stopped by SIGTERM exit with it too, their temporary files removed.
EXIT_PREEMPTED = 143


def first_line(text: str, default: str = "") -> str:
    """The first line of an error message (``default`` when it is empty): what a one-line report shows."""
    return (text.strip().splitlines() or [default])[0]


def closest(word: str, choices: Iterable[str], cutoff: float = 0.5) -> str | None:
    """The choice nearest to ``word`` (case-insensitive), or None when nothing is ``cutoff`` close (difflib's ratio).

    A word of three or more characters that begins some choices is a shortened name ('h100' for 'h100-80gb'):
    one of those wins over a choice that is merely spelled alike ('h200').
    """
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    word = word.lower()
    extended = [c for c in lowered if c.startswith(word)] if len(word) >= 3 else []
    match = difflib.get_close_matches(word, extended or list(lowered), n=1, cutoff=0 if extended else cutoff)
    return lowered[match[0]] if match else None


def check_choice(value: str, choices: Iterable[str], what: str) -> str:
    """Return ``value`` if it is one of ``choices`` (case-insensitive), else raise a UsageError naming them."""
    choices = list(choices)
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    hint = closest(value, choices)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    raise UsageError(f"unknown {what} '{value}': choose one of {', '.join(choices)}.{did_you_mean}")


# Rust's std::io::Error (safetensors) ends with "(os error 28)"; C and Python messages say "errno 28", "[Errno 28]".
_OS_ERROR_CODE = re.compile(r"(?:os error|errno)\s*(\d+)", re.IGNORECASE)
# torch.save's zip writer on a failed write. On a full disk (torch 2.13, a full tmpfs) it says only
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", with no word of the disk.
_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "file write failed", "unexpected pos")


def as_write_error(exc: BaseException, path: str | Path) -> OSError | None:
    """The OSError that ``exc``, raised while writing ``path``, stands for; None when it is no failed write.

    safetensors (``SafetensorError``) and ``torch.save`` (``RuntimeError``) report a full disk or a denied write
    in their own words and without the path. Only those two, and only with the marks of an I/O error in the
    message, are failed writes: anything else raised while writing is a bug, and keeps its traceback.
    """
    from_safetensors = type(exc).__module__.split(".")[0] == "safetensors"
    if isinstance(exc, OSError) or not (from_safetensors or isinstance(exc, RuntimeError)):
        return None
    text = str(exc)
    code = errno.ENOSPC if "No space left on device" in text else None
    if code is None and (found := _OS_ERROR_CODE.search(text)):
        code = int(found.group(1))
    if code is not None:
        return OSError(code, os.strerror(code), str(path))
    if any(mark in text for mark in _TORCH_WRITE_FAILED):
        return OSError(errno.EIO, f"write failed, the disk may be full ({first_line(text)})", str(path))
    return None


# What to do about a failed file operation, by its errno (a write that failed, a path that cannot be made).
_OS_ERROR_FIX = {
    errno.ENOSPC: "free disk space or give a path on another disk",
    errno.EDQUOT: "free disk space (the disk quota is used up) or give a path on another disk",
    errno.EACCES: "fix the permissions or give another path", errno.EPERM: "fix the permissions or give another path",
    errno.EROFS: "the file system is read-only: give a path on a writable one",
    errno.EEXIST: "something is already there: move it away or give another path",
    errno.ENOTDIR: "a file stands where a folder is needed: move it away or give another path",
    errno.EISDIR: "a folder stands where a file is needed: move it away or give another path",
    errno.ENAMETOOLONG: "give a shorter path",
}


def os_error_fix(exc: OSError) -> str:
    """What to do about ``exc``, in a few words chosen by its errno."""
    return _OS_ERROR_FIX.get(exc.errno, "free disk space, fix the permissions or give another path")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Inside: a failed write of ``path`` raises an OSError naming ``path`` (see ``as_write_error``), the
    library's own error chained to it, so it is reported as one line like any other failed write. An OSError
    that names no file (a full disk met by ``file.write``, as gguf's writer meets it) gets ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except Exception as exc:
        failed = as_write_error(exc, path)
        if failed is None:
            raise
        raise failed from exc
