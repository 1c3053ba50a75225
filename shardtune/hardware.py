"""GPUs: one row per card, holding what the estimator and the trainer's MFU read from it.

``memory_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` prints for the card (MiB), the ceiling a process's
CUDA context plus PyTorch's reserved memory must stay under; None for a card the estimator does not offer
(``--gpu``). ``bf16`` says whether the card computes in bfloat16. ``peak_bf16_flops`` is the dense bf16
tensor-core peak (no sparsity) from the vendor's data sheet, None where we do not state one (no MFU rather than a
wrong one). ``device_key`` is looked for in the CUDA device name.

A leaf: the estimator (memory/) and the trainer (train/metrics.py) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import check_choice

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int | None
    bf16: bool = True
    label: str = ""
    device_key: str = ""
    peak_bf16_flops: float | None = None


CARDS = (
    Gpu("h100-80gb", 81559 * MIB, label="NVIDIA H100 80GB", device_key="H100", peak_bf16_flops=989e12),
    Gpu("h200", 143771 * MIB, label="NVIDIA H200 141GB", device_key="H200", peak_bf16_flops=989e12),
    Gpu("a100-80gb", 81920 * MIB, label="NVIDIA A100 80GB", device_key="A100", peak_bf16_flops=312e12),
    Gpu("a100-40gb", 40960 * MIB, label="NVIDIA A100 40GB", device_key="A100", peak_bf16_flops=312e12),
    Gpu("l40s", 46068 * MIB, label="NVIDIA L40S 48GB", device_key="L40S", peak_bf16_flops=362e12),
    Gpu("a6000", 49140 * MIB, label="NVIDIA RTX A6000 48GB", device_key="A6000", peak_bf16_flops=155e12),
    Gpu("rtx4090", 24564 * MIB, label="NVIDIA GeForce RTX 4090 24GB", device_key="4090", peak_bf16_flops=165e12),
    Gpu("rtx3090", 24576 * MIB, label="NVIDIA GeForce RTX 3090 24GB", device_key="3090", peak_bf16_flops=71e12),
    # Known to the MFU only.
    Gpu("h100-pcie", None, label="NVIDIA H100 PCIe", device_key="H100 PCIe", peak_bf16_flops=756e12),
    Gpu("h100-nvl", None, label="NVIDIA H100 NVL", device_key="H100 NVL", peak_bf16_flops=835e12),
    Gpu("l40", None, label="NVIDIA L40", device_key="L40", peak_bf16_flops=181e12),
    Gpu("l4", None, label="NVIDIA L4", device_key="L4", peak_bf16_flops=121e12),
    Gpu("a10g", None, label="NVIDIA A10G", device_key="A10G", peak_bf16_flops=None),
    Gpu("a10", None, label="NVIDIA A10", device_key="A10", peak_bf16_flops=125e12),
)
# The cards ``shardtune estimate --gpu`` offers.
GPUS: dict[str, Gpu] = {g.name: g for g in CARDS if g.memory_bytes is not None}
DEFAULT_GPU = "h100-80gb"


def gpu_by_name(name: str) -> Gpu:
    """The GPU called ``name`` (exit 2 with the list when unknown)."""
    return GPUS[check_choice(name, GPUS, "GPU")]


def custom_gpu(memory_gib: float) -> Gpu:
    """A GPU known only by its memory size in GiB (``--gpu-memory``)."""
    return Gpu(f"{memory_gib:g}GiB", int(memory_gib * GIB), label=f"{memory_gib:g} GiB GPU")


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the card ``device_name`` (``torch.cuda.get_device_name``), None where unknown.

    The longest key found in the name wins, so a variant is never taken for the card whose name it contains
    ("H100 PCIe" is not an H100 SXM, an "L40S" not an "L40" nor an "L4", an "A100" not an "A10")."""
    found = [g for g in CARDS if g.device_key and g.device_key in device_name]
    return max(found, key=lambda g: len(g.device_key)).peak_bf16_flops if found else None
