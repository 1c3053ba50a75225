"""Writing a file so that nobody ever reads half of it: into a temporary name beside it, renamed onto it when
complete (a rename within one folder is atomic), removed when the write fails. A leaf: anything may import it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write into: moved onto ``path`` when the block ends, removed when it
    raises (a full disk, Ctrl-C), so ``path`` holds either what it held before or the complete new file. The name
    (``.tmp-NAME.PID``) is this process's own, so ranks or runs writing the same file never share one, and it
    starts as every temporary of shardtune's does."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone already once replaced


def write_text(path: str | Path, text: str) -> Path:
    """``path`` holding ``text``, written through ``replacing``."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def cache_root() -> Path:
    """Where shardtune keeps what it can compute again (tokenised data in ``data/``, model counts in ``counts/``):
    $SHARDTUNE_CACHE, else $XDG_CACHE_HOME/shardtune, else ~/.cache/shardtune. Hugging Face's caches follow
    XDG_CACHE_HOME too, so a home with a small quota, its caches moved to scratch that way, is not filled by ours."""
    if os.environ.get("SHARDTUNE_CACHE"):
        return Path(os.environ["SHARDTUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardtune"


def umask() -> int:
    """This process's umask: set and set back, the one portable way to read it."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def give_plain_mode(*paths: str | Path) -> None:
    """Give each file the mode a plain ``open`` creates one with under the umask (0644 under umask 022).
    safetensors' ``save_file`` (0.8) creates its file 0600 whatever the umask, so the weights were the one file of
    an export that a team's readers and a serving account could not read, the rest of it being 0644."""
    mode = 0o666 & ~umask()
    for path in paths:
        os.chmod(path, mode)


# What marks a file as shardtune's own: a comment in its text files ("Written by 'shardtune launch'"), the
# "written_by" key of its JSON, the Software or Creator field of its pictures (FIGURE_METADATA).
WRITTEN_BY = "written by shardtune"
_OURS = re.compile(rb"(?i)written[ _]by[\"':\s]*shardtune")
_SCAN_BYTES = 4 << 20  # pictures keep their text fields near the start (PNG) or the end (PDF): all of a small file


# The picture formats whose files carry the mark (matplotlib writes these fields; JPEG and TIFF take none).
PICTURE_FIELDS = {"png": "Software", "pdf": "Creator", "svg": "Creator", "ps": "Creator", "eps": "Creator"}


def figure_metadata(fmt: str) -> dict[str, str]:
    """What ``savefig`` writes into a picture of format ``fmt`` so that shardtune later knows it as its own."""
    field = PICTURE_FIELDS.get(fmt)
    return {field: WRITTEN_BY} if field else {}


# The last line of a text file shardtune writes for its user (a recipe, a cluster job, a table): the SHA-256 of
# the lines above it, after a comment mark. A file whose last line still matches is shardtune's and nobody edited
# it; an edited one is its user's, and no command replaces it.
DIGEST_MARK = "unedited: sha256 "
_DIGEST_LINE = re.compile(rb"^(#|<!--) unedited: sha256 ([0-9a-f]{64})\b")


def with_digest(text: str, comment: str = "#") -> str:
    """``text`` (ending in a newline) with its digest line after it (``comment``: ``#``, or ``<!--`` in Markdown)."""
    import hashlib

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    end = " -->" if comment == "<!--" else ""
    return (f"{text}{comment} {DIGEST_MARK}{digest} (edit this file and it is yours: shardtune will not replace "
            f"it){end}\n")


JSON_DIGEST = "unedited_sha256"  # a JSON's own key: the SHA-256 of the rest of it (``with_json_digest``)


def _json_digest(record: dict) -> str:
    import hashlib
    import json

    rest = {key: value for key, value in record.items() if key != JSON_DIGEST}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


def with_json_digest(record: dict) -> dict:
    """``record`` (a JSON object shardtune writes for its user) with the digest of its values: edited, it is the
    user's (``written_by_shardtune``); spacing and key order do not count."""
    return {**record, JSON_DIGEST: _json_digest(record)}


def digest_holds(data: bytes) -> bool | None:
    """Whether the last line of a text file's ``data`` (``with_digest``) is the SHA-256 of the lines above it; None
    where the file has no digest line. A digest line with lines after it does not hold: they were added since."""
    import hashlib

    body, _, last = data.rstrip(b"\n").rpartition(b"\n")
    if not (found := _DIGEST_LINE.match(last)):
        return False if any(_DIGEST_LINE.match(line) for line in body.split(b"\n")) else None
    return hashlib.sha256(body + b"\n").hexdigest() == found.group(2).decode()


def written_by_shardtune(path: str | Path) -> bool:
    """Whether shardtune wrote ``path`` and nobody changed it since. A text file with a digest line
    (``with_digest``) is shardtune's while the digest matches the text above it; one without (an earlier version's
    recipe or job, a JSON) when its mark is in its first lines (a user's file that quotes the words further down
    is not), or in a JSON's top-level ``written_by``; a picture by its Software or Creator field."""
    import json

    try:
        with open(path, "rb") as f:
            data = f.read(_SCAN_BYTES + 1)
    except OSError:
        return False
    if (holds := digest_holds(data)) is not None and len(data) <= _SCAN_BYTES:
        return holds
    if data.lstrip().startswith(b"{"):
        try:
            record = json.loads(data)
            ours = str(record.get("written_by", "")).startswith("shardtune")
        except (ValueError, AttributeError):
            return False
        return ours and (JSON_DIGEST not in record or record[JSON_DIGEST] == _json_digest(record))
    if Path(path).suffix.lower().lstrip(".") in PICTURE_FIELDS:
        return bool(_OURS.search(data[:_SCAN_BYTES]))
    return bool(_OURS.search(b"\n".join(data.split(b"\n", 3)[:3])))


def foreign_file(path: str | Path, label: str) -> str | None:
    """Why ``path`` cannot take a file that a command writes where its user said (one line, naming ``label``, the
    option), or None: a folder is there, or a file shardtune did not write. A user's file is never replaced; an
    earlier output of shardtune's is."""
    path = Path(path).expanduser()
    if path.is_dir():
        return f"{label} {path}: that is a folder; give a file name"
    if path.exists() and not written_by_shardtune(path):
        return (f"{label} {path}: a file that shardtune did not write is there, and it is left alone; move it away "
                f"or give another path")
    return None
