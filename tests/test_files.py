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


def test_a_json_shardtune_wrote_is_its_users_once_edited(tmp_path: Path) -> None:
    """bench strategies' results JSON was judged by its written_by key alone, so a user's edited copy was replaced
    by the next run. Its digest of its values holds only while nobody changed them (spacing and key order aside);
    one written before the digest is judged by its key, as before."""
    import json

    from shardtune.files import with_json_digest, written_by_shardtune

    path = tmp_path / "bench.json"
    record = {"written_by": "shardtune bench strategies", "results": [{"strategy": "DDP", "tokens_per_s": 900.0}]}
    path.write_text(json.dumps(with_json_digest(record), indent=1))
    assert written_by_shardtune(path)
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))  # spacing and order only
    assert written_by_shardtune(path)
    edited = json.loads(path.read_text())
    edited["results"][0]["tokens_per_s"] = 1200.0
    path.write_text(json.dumps(edited))
    assert not written_by_shardtune(path)
    path.write_text(json.dumps(record))  # before the digest
    assert written_by_shardtune(path)
    path.write_text(json.dumps({**record, "written_by": "me"}))
    assert not written_by_shardtune(path)


def test_a_text_file_with_lines_added_after_its_digest_is_its_users(tmp_path: Path, capsys) -> None:
    """A recipe from --emit-config with 'max_steps: 100' added at its end (or a cluster job with a command added
    after its last line) was replaced by the next run of the same command, the user's line lost: its last line was
    no longer the digest, so the file was judged as one written before shardtune marked its files, by the mark in
    its first line. A file whose digest line has lines after it was edited; one without any digest line is still
    judged by its mark."""
    from shardtune.cli import main
    from shardtune.files import with_digest, written_by_shardtune

    path = tmp_path / "job.sbatch"
    text = "#!/bin/bash\n# Written by 'shardtune launch'.\nsrun true\n"
    path.write_text(with_digest(text))
    assert written_by_shardtune(path)
    path.write_text(with_digest(text) + "\n\n")  # blank lines after it change nothing
    assert written_by_shardtune(path)
    path.write_text(with_digest(text) + "echo done\n")
    assert not written_by_shardtune(path)
    path.write_text(text)  # written before the digest: its mark decides
    assert written_by_shardtune(path)

    recipe = tmp_path / "r.yaml"
    argv = ["estimate", "llama-3.1-8b", "--method", "lora", "--emit-config", str(recipe)]
    assert main(argv) == 0 and main(argv) == 0  # its own recipe, replaced
    capsys.readouterr()
    recipe.write_text(recipe.read_text() + "max_steps: 100\n")
    mine = recipe.read_text()
    assert main(argv) == 2
    assert f"--emit-config {recipe}: a file that shardtune did not write is there" in capsys.readouterr().err
    assert recipe.read_text() == mine
