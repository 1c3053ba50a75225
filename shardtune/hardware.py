"""GPUs: one row per card, holding what the estimator and the trainer's MFU read from it.

``memory_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` prints for the card (MiB), the ceiling a process's
CUDA context plus PyTorch's reserved memory must stay under; None for a card the estimator does not offer
(``--gpu``). ``bf16`` says whether the card computes in bfloat16. ``peak_bf16_flops`` is the dense bf16
tensor-core peak (no sparsity) from the vendor's data sheet, None where we do not state one (no MFU rather than a
wrong one). ``device_key`` is looked for in the CUDA device name.

The links a training step's traffic crosses (``shardtune estimate --time``): ``interconnect`` is how the card's GPUs
in one node reach each other by default (NVLink on SXM boards; PCIe on PCIe cards, consumer cards included),
``nvlink`` the NVLink it can have at all (a bridge joins only pairs of A6000 / RTX 3090), ``host_link`` the PCIe
generation to the CPU (what CPU offload crosses), ``host`` the machine such cards usually sit in (a desktop board
for consumer cards: less memory bandwidth for an offloaded optimizer step). ``memory_bandwidth`` (bytes/s, data
sheet) times the memory-bound parts of a step (optimizer update, NF4 dequantisation). ``efficiency_class`` picks
the share of the peak a training step reaches (shardtune/memory/timing.py, calibrated in docs/estimator.md).

A leaf: the estimator (memory/) and the trainer (train/metrics.py) both read it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardtune.errors import UsageError, check_choice

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Link:
    """A link between GPUs, between nodes, or between a GPU and its host."""

    name: str
    label: str
    bytes_per_s: float  # what a collective or a copy achieves per GPU and direction: effective, not nominal
    shared_by_node: bool = False  # one link per node that all its GPUs share (an Ethernet NIC), not one per GPU


# Effective rates: NVLink and InfiniBand at about 80% and 90% of their nominal per-direction rate (what NCCL's
# bus bandwidth reaches on large messages), PCIe x16 at about 78% (TLP and DMA overheads).
INTRA_NODE_LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink4", "NVLink 4 (450 GB/s per direction)", 360e9),
    Link("nvlink3", "NVLink 3 (300 GB/s per direction)", 240e9),
    Link("nvlink-bridge", "NVLink bridge (GPU pairs, 56 GB/s per direction)", 45e9),
    Link("pcie5", "PCIe 5.0 x16 (~50 GB/s)", 50e9),
    Link("pcie4", "PCIe 4.0 x16 (~25 GB/s)", 25e9),
    Link("pcie3", "PCIe 3.0 x16 (~12 GB/s)", 12e9),
)}
INTER_NODE_LINKS: dict[str, Link] = {link.name: link for link in (
    Link("infiniband", "InfiniBand NDR (400 Gb/s per GPU)", 45e9),
    Link("infiniband-hdr", "InfiniBand HDR (200 Gb/s per GPU)", 22.5e9),
    Link("ethernet-400g", "400 GbE (one per node)", 45e9, shared_by_node=True),
    Link("ethernet-100g", "100 GbE (one per node)", 11e9, shared_by_node=True),
    Link("ethernet-25g", "25 GbE (one per node)", 2.75e9, shared_by_node=True),
)}
LINK_ALIASES = {"nvlink": "the GPU's own NVLink", "pcie": "the GPU's own PCIe generation",
                "infiniband-ndr": "infiniband"}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int | None
    bf16: bool = True
    label: str = ""
    device_key: str = ""
    peak_bf16_flops: float | None = None
    peak_fp32_flops: float | None = None  # without tensor cores: what fp32 matmuls get by PyTorch's default
    memory_bandwidth: float | None = None
    interconnect: str = "pcie4"
    nvlink: str | None = None
    host_link: str = "pcie4"
    inter_node: str = "ethernet-100g"
    efficiency_class: str = "pcie-card"
    host: str = "server"


_HOPPER = {"interconnect": "nvlink4", "nvlink": "nvlink4", "host_link": "pcie5", "inter_node": "infiniband",
           "efficiency_class": "hopper"}
_A100 = {"interconnect": "nvlink3", "nvlink": "nvlink3", "host_link": "pcie4", "inter_node": "infiniband-hdr",
         "efficiency_class": "ampere-sxm"}
CARDS = (
    Gpu("h100-80gb", 81559 * MIB, label="NVIDIA H100 80GB", device_key="H100", peak_bf16_flops=989e12,
        peak_fp32_flops=67e12, memory_bandwidth=3.35e12, **_HOPPER),
    Gpu("h200", 143771 * MIB, label="NVIDIA H200 141GB", device_key="H200", peak_bf16_flops=989e12,
        peak_fp32_flops=67e12, memory_bandwidth=4.8e12, **_HOPPER),
    Gpu("a100-80gb", 81920 * MIB, label="NVIDIA A100 80GB", device_key="A100", peak_bf16_flops=312e12,
        peak_fp32_flops=19.5e12, memory_bandwidth=2.039e12, **_A100),
    Gpu("a100-40gb", 40960 * MIB, label="NVIDIA A100 40GB", device_key="A100", peak_bf16_flops=312e12,
        peak_fp32_flops=19.5e12, memory_bandwidth=1.555e12, **_A100),
    Gpu("l40s", 46068 * MIB, label="NVIDIA L40S 48GB", device_key="L40S", peak_bf16_flops=362e12,
        peak_fp32_flops=91.6e12, memory_bandwidth=864e9),
    Gpu("a6000", 49140 * MIB, label="NVIDIA RTX A6000 48GB", device_key="A6000", peak_bf16_flops=155e12,
        peak_fp32_flops=38.7e12, memory_bandwidth=768e9, nvlink="nvlink-bridge"),
    Gpu("a6000-ada", 49140 * MIB, label="NVIDIA RTX 6000 Ada 48GB", device_key="RTX 6000 Ada",
        peak_bf16_flops=364e12, peak_fp32_flops=91.1e12, memory_bandwidth=960e9),
    Gpu("rtx4090", 24564 * MIB, label="NVIDIA GeForce RTX 4090 24GB", device_key="4090", peak_bf16_flops=165e12,
        peak_fp32_flops=82.6e12, memory_bandwidth=1008e9, host="desktop"),
    Gpu("rtx3090", 24576 * MIB, label="NVIDIA GeForce RTX 3090 24GB", device_key="3090", peak_bf16_flops=71e12,
        peak_fp32_flops=35.6e12, memory_bandwidth=936e9, nvlink="nvlink-bridge", host="desktop"),
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

# Typical on-demand list prices in US dollars per GPU-hour, 2026-11: the middle of what hyperscalers and GPU clouds
# ask for one GPU of the card without a commitment. Spot, reserved and marketplace prices are often far lower: give
# yours with --price-per-gpu-hour.
PRICES_AS_OF = "2026-11"
TYPICAL_PRICE_PER_GPU_HOUR: dict[str, float] = {
    "h100-80gb": 3.00, "h200": 3.80, "a100-80gb": 1.80, "a100-40gb": 1.30, "l40s": 1.00, "a6000": 0.50,
    "a6000-ada": 0.80, "rtx4090": 0.40, "rtx3090": 0.25,
}


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


def intra_node_link(gpu: Gpu, name: str | None = None) -> Link:
    """The link between ``gpu``'s GPUs in one node: ``name`` (``--interconnect``), else the card's default."""
    if name is None:
        return INTRA_NODE_LINKS[gpu.interconnect]
    choice = check_choice(name, [*INTRA_NODE_LINKS, "nvlink", "pcie"], "interconnect")
    if choice == "pcie":
        return INTRA_NODE_LINKS[gpu.host_link]
    if choice == "nvlink":
        if gpu.nvlink is None:
            raise UsageError(f"--interconnect nvlink: the {gpu.label or gpu.name} has no NVLink; its GPUs talk over "
                             f"PCIe (--interconnect pcie, or name a link: {', '.join(INTRA_NODE_LINKS)}).")
        return INTRA_NODE_LINKS[gpu.nvlink]
    return INTRA_NODE_LINKS[choice]


def inter_node_link(gpu: Gpu, name: str | None = None) -> Link:
    """The network between nodes: ``name`` (``--inter-node``), else what clusters of the card usually have."""
    if name is None:
        return INTER_NODE_LINKS[gpu.inter_node]
    choice = check_choice(name, [*INTER_NODE_LINKS, "infiniband-ndr"], "inter-node network")
    return INTER_NODE_LINKS[LINK_ALIASES.get(choice, choice)]


def host_link(gpu: Gpu) -> Link:
    """The PCIe link between ``gpu`` and its host's memory (what CPU offload crosses)."""
    return INTRA_NODE_LINKS[gpu.host_link]


# What makes a device compute bfloat16 natively (matmuls in bf16 at more than fp32's speed): NVIDIA GPUs from
# Ampere on (compute capability 8.0), x86 CPUs with AVX512-BF16 or AMX (Intel Cooper Lake, Sapphire Rapids and
# later; AMD Zen 4 and later). Elsewhere bf16 is emulated and slower than fp32, so fp32 is the default there.
CUDA_BF16_CAPABILITY = (8, 0)
CPU_BF16_FEATURES = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def native_bf16(device_type: str) -> tuple[bool, str]:
    """Whether this machine's ``device_type`` (cuda, cpu, ...) computes bf16 natively, and the words that say why.

    Asked of torch, never guessed: ``torch.cuda.get_device_capability`` for CUDA (the current device), the CPU
    features ``torch.cpu.get_capabilities`` reads (CPUID) for the CPU."""
    import torch

    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        native = (major, minor) >= CUDA_BF16_CAPABILITY
        relation = ">=" if native else "<"
        return native, f"{name}, compute capability {major}.{minor} {relation} 8.0"
    if device_type == "cpu":
        capabilities = getattr(torch.cpu, "get_capabilities", lambda: {})()
        found = [label for key, label in CPU_BF16_FEATURES.items() if capabilities.get(key)]
        if found:
            return True, f"this CPU has {' and '.join(found)}"
        return False, "this CPU has neither AVX512-BF16 nor AMX-BF16"
    return False, f"device {device_type}: bf16 is not known to run natively there"


@functools.lru_cache(maxsize=None)
def local_native_bf16() -> tuple[bool, str]:
    """``native_bf16`` of the device a job started here trains on: the GPU where torch sees one, else the CPU."""
    import torch

    return native_bf16("cuda" if torch.cuda.is_available() else "cpu")
