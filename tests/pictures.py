"""The figures a command draws, kept as it saves them, and the pixel size its PNG files say they have."""

from __future__ import annotations

from pathlib import Path

import pytest


def keep_saved_figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[object, float]]:
    """From now on, every ``Figure.savefig`` also records the figure and its dpi under the file's final name (the
    name the temporary file is renamed to)."""
    from matplotlib.figure import Figure

    saved: dict[str, tuple[object, float]] = {}
    savefig = Figure.savefig

    def keep(fig, fname, *args, **kwargs):
        name = Path(fname).name  # .tmp-NAME.PID while it is written (shardtune.files.replacing)
        saved[name.removeprefix(".tmp-").rsplit(".", 1)[0] if name.startswith(".tmp-") else name] = fig, kwargs["dpi"]
        return savefig(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG's header, after checking its signature."""
    header = path.read_bytes()[:24]  # the 8-byte signature, then the IHDR chunk: length, type, width, height
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def drawn_size(fig, dpi: float) -> tuple[int, int]:
    """The pixel size ``fig`` has when saved at ``dpi``."""
    return tuple(round(inches * dpi) for inches in fig.get_size_inches())
