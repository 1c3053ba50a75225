"""Checkpoints load without running code: DCP's pickled metadata through an allow-list, its non-tensor values
through ``torch.load(weights_only=True)``.

PyTorch's DCP reader unpickles ``dcp/.metadata`` with plain ``pickle.load`` and its default planner reads
non-tensor values (an optimizer's ``lr``, ``betas``) with ``torch.load(weights_only=False)``: a checkpoint shared
between people or machines could run any code on ``resume_from_checkpoint`` or ``shardtune export``. Here the
metadata unpickler admits only the classes DCP itself writes (its metadata dataclasses, ``torch.Size``, dtypes,
paths), and every value goes through PyTorch's weights-only unpickler. Anything else is refused before it runs,
as ``UnsafeCheckpoint`` naming the file and what it asked for.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardtune.checksums import sha256_file
from shardtune.errors import UsageError, first_line

# (module, name) pairs DCP's metadata may name besides the classes of torch.distributed.checkpoint.metadata.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name ("torch.strided")
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("copyreg", "_reconstructor"), ("builtins", "object"),
}


class UnsafeCheckpoint(UsageError):
    """A checkpoint file asked to run code, or cannot be read as what shardtune writes; nothing of it was run."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.path}: refused to load: it asks for {module}.{name}, which a checkpoint never "
                               f"holds (a planted pickle runs code when loaded); nothing of it was run. Use a "
                               f"checkpoint you trust, or resume from an earlier one")


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream, path).load()
            except UnsafeCheckpoint:
                raise
            except Exception as exc:  # noqa: BLE001 - a cut or garbled file: say so in one line
                raise UnsafeCheckpoint(f"{path}: not a readable DCP metadata file ({type(exc).__name__}); the "
                                       f"checkpoint is damaged: resume from an earlier one") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpoint(f"{path}: not DCP metadata (it holds a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with PyTorch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"{read_item.dest_index.fqn}: refused to load a value of the checkpoint "
                                   f"({str(exc).splitlines()[0]}); nothing of it was run") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_dcp(state: dict[str, Any], folder: Path, *, no_dist: bool,
             fix: str = "resume from another checkpoint") -> None:
    """``dcp.load`` of ``folder`` into ``state`` through the safe reader and planner.

    DCP wraps a failure of any rank in a ``CheckpointException``; a refused file comes back out of it as the one
    ``UnsafeCheckpoint`` line, on every rank; one that cannot be read ends with ``fix``; an interruption (Ctrl-C,
    SIGTERM's ``Terminated``) comes back out as itself.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        # DCP wraps every BaseException: Ctrl-C or SIGTERM while reading is an interruption to pass on, not damage
        # (called damage, it was exit 2 and 'the checkpoint is damaged' for a stop a user or a scheduler asked for)
        if stop := next((cause for cause, _ in exc.failures.values() if not isinstance(cause, Exception)), None):
            raise stop from None
        refused = [cause for cause, _ in exc.failures.values() if isinstance(cause, UnsafeCheckpoint)]
        if refused:
            raise refused[0] from None
        rank, (cause, _) = min(exc.failures.items())
        raise UnsafeCheckpoint(f"{folder}: cannot be read (rank {rank}: {type(cause).__name__}: "
                               f"{first_line(str(cause))}); the checkpoint is damaged or was written for another "
                               f"model or setup: {fix}") from None
    except (ValueError, RuntimeError, OSError) as exc:  # a damaged file read on one process, outside DCP's wrap
        raise UnsafeCheckpoint(f"{folder}: cannot be read ({type(exc).__name__}: {first_line(str(exc))}); the "
                               f"checkpoint is damaged: {fix}") from None


def load_pt(path: Path) -> Any:
    """A ``.pt`` file of tensors and plain values (RNG states, a gathered optimizer), never running code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(f"{path}: refused to load ({first_line(str(exc))}); nothing of it was run. Use a "
                               f"checkpoint you trust, or resume from an earlier one") from None
    except (RuntimeError, EOFError) as exc:
        raise UnsafeCheckpoint(f"{path}: cannot be read ({type(exc).__name__}: {first_line(str(exc))}); the "
                               f"checkpoint is damaged: resume from an earlier one") from None


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (manifest, trainer state: each one object); a damaged one is one line naming it."""
    import json

    try:
        found = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        found, why = None, type(exc).__name__
    else:
        why = f"a JSON {type(found).__name__}, not an object"
    if not isinstance(found, dict):
        raise UnsafeCheckpoint(f"{path}: not the JSON shardtune writes ({why}); the checkpoint is damaged: resume "
                               f"from another checkpoint")
    return found


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file (tensors only by design); a damaged one is one line naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise UnsafeCheckpoint(f"{path}: cannot be read ({first_line(str(exc))}); the checkpoint is damaged: resume "
                               f"from another checkpoint") from None


def file_digests(folder: Path, *, skip: str, share: tuple[int, int] = (0, 1)) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under ``folder`` but ``skip`` (the manifest that will hold them).

    ``share`` (rank, world size): this rank's share of the files, every world-size-th of them in name order, so
    that the ranks of a run hash a checkpoint together, each reading 1/world of it.
    """
    rank, world = share
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != skip)
    return {p.relative_to(folder).as_posix(): file_digest(p) for p in files[rank::world]}


def file_digest(path: Path) -> dict[str, Any]:
    """A manifest's entry for one file: its size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def damage(folder: Path, digests: dict[str, dict[str, Any]], share: tuple[int, int] = (0, 1)) -> str | None:
    """What in ``folder`` differs from the manifest's ``digests`` (one line naming the file), or None if intact.
    ``share`` (rank, world size): check only this rank's share of the files, as ``file_digests`` hashes them."""
    rank, world = share
    for name, want in sorted(digests.items())[rank::world]:
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes, {want['bytes']} were saved (cut short or overwritten)"
        if sha256_file(path) != want["sha256"]:
            return f"{path} has changed since it was saved (its SHA-256 differs from the manifest's)"
    return None
