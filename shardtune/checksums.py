"""SHA-256 of files, for the manifests that checkpoints and the tokenised-data cache carry. A leaf module."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The file's SHA-256 (hex), read a MiB at a time."""
    sha = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
    return sha.hexdigest()
