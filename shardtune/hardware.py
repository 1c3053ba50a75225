"""GPUs people fine-tune on, with the memory the driver reports as total.

``memory_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` prints for the card (MiB), the ceiling a process's
CUDA context plus PyTorch's reserved memory must stay under. ``bf16`` says whether the card computes in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import check_choice

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bf16: bool = True
    label: str = ""


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h100-80gb", 81559 * MIB, label="NVIDIA H100 80GB"),
        Gpu("h200", 143771 * MIB, label="NVIDIA H200 141GB"),
        Gpu("a100-80gb", 81920 * MIB, label="NVIDIA A100 80GB"),
        Gpu("a100-40gb", 40960 * MIB, label="NVIDIA A100 40GB"),
        Gpu("l40s", 46068 * MIB, label="NVIDIA L40S 48GB"),
        Gpu("a6000", 49140 * MIB, label="NVIDIA RTX A6000 48GB"),
        Gpu("rtx4090", 24564 * MIB, label="NVIDIA GeForce RTX 4090 24GB"),
        Gpu("rtx3090", 24576 * MIB, label="NVIDIA GeForce RTX 3090 24GB"),
    )
}
DEFAULT_GPU = "h100-80gb"


def gpu_by_name(name: str) -> Gpu:
    """The GPU called ``name`` (exit 2 with the list when unknown)."""
    return GPUS[check_choice(name, GPUS, "GPU")]


def custom_gpu(memory_gib: float) -> Gpu:
    """A GPU known only by its memory size in GiB (``--gpu-memory``)."""
    return Gpu(f"{memory_gib:g}GiB", int(memory_gib * GIB), label=f"{memory_gib:g} GiB GPU")
