"""shardtune.files: a file written by shardtune is either what it was before or complete, never half of one."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from shardtune.files import replacing, write_text


def full_disk_after_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on ``Path.write_text`` writes half its text, then fails as a full disk does."""
    def half(self: Path, text: str, *args, **kwargs) -> int:
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", half)


def test_a_complete_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("before")
    write_text(tmp_path / "summary.json", "after")
    assert (tmp_path / "summary.json").read_text() == "after"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_a_write_that_fails_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "summary.json").write_text("before")
    full_disk_after_half(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        write_text(tmp_path / "summary.json", "after, at length")
    assert open(tmp_path / "summary.json").read() == "before"
    assert os.listdir(tmp_path) == ["summary.json"]  # the temporary file is gone


def test_an_interrupted_write_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), replacing(tmp_path / "plot.png") as tmp:
        tmp.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_a_modelfile_that_cannot_be_written_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GGUF export's Modelfile, written after the .gguf: a failure leaves no half Modelfile nor its temporary.
    from shardtune.ollama import write_modelfile

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    full_disk_after_half(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        write_modelfile(tmp_path / "model.gguf", None, "</s>")
    assert os.listdir(tmp_path) == ["model.gguf"]
