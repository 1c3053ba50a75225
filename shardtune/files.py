"""Writing a file so that nobody ever reads half of it: into a temporary name beside it, renamed onto it when
complete (a rename within one folder is atomic), removed when the write fails. A leaf: anything may import it.
"""

from __future__ import annotations

import contextlib
import os
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
