"""GPUs: one row per card, holding what the estimator and the trainer's MFU read from it.

``memory_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` prints for the card (MiB), the ceiling a process's
CUDA context plus PyTorch's reserved memory must stay under; None for a card the estimator does not offer
(``--gpu``). ``bf16`` says whether the card computes in bfloat16. ``peak_bf16_flops`` is the dense bf16
tensor-core peak (no sparsity) from the vendor's data sheet, None where we do not state one (no MFU rather than a
wrong one). ``device_key`` is looked for in the CUDA device name.

The links a training step's traffic crosses (``shardtune estimate --time``): ``interconnect`` is how the card's GPUs
in one node reach each other by default (NVLink on SXM boards; PCIe on PCIe cards, through host memory on GeForce
cards, whose driver has no peer-to-peer), ``nvlink`` the NVLink it can have at all (a bridge joins only pairs of
A6000 / RTX 3090), ``host_link`` the PCIe generation to the CPU (what CPU offload crosses), ``host`` the machine
such cards usually sit in (a desktop board for consumer cards: less memory bandwidth for an offloaded optimizer
step). ``memory_bandwidth`` (bytes/s, data sheet) times the memory-bound parts of a step (shardtune/memory/compute.py).
A card outside the table is described by its numbers: ``--gpu-spec tflops=121,memory=24,bandwidth=300,link=pcie4``
(``gpu_from_spec``).

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
    latency_s: float = 15e-6  # each collective's fixed cost on this link (NCCL's launch and handshakes)


# PCIe's line rate per direction for x16 (8, 16 and 32 GT/s with 128b/130b encoding, PCI-SIG), and the share of it
# that collectives reach between peer-to-peer PCIe cards: fitted to the published runs by bench/calibration.py
# (shardtune/memory/compute.py ``TimingParams.pcie_share``; bench/results/calibration.md). Published multi-GPU PCIe
# machines move FSDP's traffic at a few GB/s, far below the line rate (dual-socket boards, switches, no P2P).
PCIE_X16_BYTES_PER_S = {"pcie3": 15.75e9, "pcie4": 31.5e9, "pcie5": 63e9}
PCIE_P2P_SHARE = 0.1488
# The other achieved rates, each from a measurement where one was read (shardtune/memory/calibration/links.yaml
# quotes them): NVLink 3, 195 GB/s per direction (nccl-tests sendrecv, 8 x A100); NVLink 4, 339 GB/s (nccl-tests
# all_reduce bus bandwidth over 2 x 8 H100, so a lower bound for one node); PCIe 3.0 x16 between GeForce cards,
# whose driver turns peer-to-peer off so every copy goes through host memory, 5.7 GB/s (p2pBandwidthLatencyTest,
# 2 x RTX 2080 Ti). Derived, and saying how: NVLink 2 and 5, the NVLink bridge and Infinity Fabric at NVLink 3's
# 65% of nominal; through host memory on PCIe 4 and 5 at 2x and 4x the PCIe 3 measurement (the line rate doubles);
# InfiniBand and Ethernet at 90% of their line rate.


def _pcie(name: str, generation: str) -> Link:
    rate = PCIE_X16_BYTES_PER_S[name] * PCIE_P2P_SHARE
    return Link(name, f"PCIe {generation} x16, peer to peer (~{rate / 1e9:.1f} GB/s achieved)", rate)


INTRA_NODE_LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink5", "NVLink 5 (900 GB/s per direction)", 585e9),
    Link("nvlink4", "NVLink 4 (450 GB/s per direction)", 339e9),
    Link("nvlink3", "NVLink 3 (300 GB/s per direction)", 195e9),
    Link("nvlink2", "NVLink 2 (150 GB/s per direction)", 97.5e9),
    Link("infinity-fabric", "AMD Infinity Fabric (448 GB/s per direction)", 291e9),
    Link("nvlink-bridge", "NVLink bridge (GPU pairs, 56 GB/s per direction)", 36e9),
    _pcie("pcie5", "5.0"), _pcie("pcie4", "4.0"), _pcie("pcie3", "3.0"),
    Link("pcie5-host", "PCIe 5.0 x16 through host memory, no peer to peer (~23 GB/s)", 22.8e9),
    Link("pcie4-host", "PCIe 4.0 x16 through host memory, no peer to peer (~11 GB/s)", 11.4e9),
    Link("pcie3-host", "PCIe 3.0 x16 through host memory, no peer to peer (~5.7 GB/s)", 5.7e9),
)}
# Copies between a GPU and pinned host memory (CPU offload): DMA at about 78% of the x16 line rate (TLP and DMA
# overheads; an assumption, no measurement read).
HOST_LINKS: dict[str, Link] = {name: Link(name, f"PCIe {gen} x16 (~{rate / 1e9:.0f} GB/s)", rate)
                               for name, gen, rate in (("pcie5", "5.0", 50e9), ("pcie4", "4.0", 25e9),
                                                       ("pcie3", "3.0", 12e9))}
INTER_NODE_LINKS: dict[str, Link] = {link.name: link for link in (
    Link("infiniband", "InfiniBand NDR (400 Gb/s per GPU)", 45e9, latency_s=30e-6),
    Link("infiniband-hdr", "InfiniBand HDR (200 Gb/s per GPU)", 22.5e9, latency_s=30e-6),
    Link("infiniband-edr", "InfiniBand EDR (100 Gb/s, one per node)", 11.25e9, shared_by_node=True, latency_s=30e-6),
    Link("ethernet-400g", "400 GbE (one per node)", 45e9, shared_by_node=True, latency_s=60e-6),
    Link("ethernet-100g", "100 GbE (one per node)", 11e9, shared_by_node=True, latency_s=60e-6),
    Link("ethernet-25g", "25 GbE (one per node)", 2.75e9, shared_by_node=True, latency_s=60e-6),
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
    host: str = "server"
    peak_fp16_flops: float | None = None  # fp16 tensor peak where it differs from bf16's (cards without bf16)
    # hopper or blackwell: data-centre cards whose tensor peak needs warp-group MMA (sm_90 wgmma, sm_100 tcgen05),
    # which FlashAttention-2-class kernels do not issue; any other value (or none) for cards without it.
    arch: str = ""

    @property
    def warpgroup_mma(self) -> bool:
        return self.arch in WARPGROUP_ARCHS

    def peak_flops(self, mixed_precision: str) -> float | None:
        """The dense tensor-core peak a step in ``mixed_precision`` (bf16, fp16, no) computes at."""
        if mixed_precision == "no":
            return self.peak_fp32_flops
        if mixed_precision == "fp16":
            return self.peak_fp16_flops or self.peak_bf16_flops
        return self.peak_bf16_flops


# Each card's figures are its data sheet's: dense tensor-core peak (half the "with sparsity" figure), memory,
# memory bandwidth. shardtune/memory/calibration/cards.yaml records for every card where each figure was read.
# memory_bytes is nvidia-smi's memory.total (MiB) where one is recorded, else the data sheet's GB as 10^9 bytes.
# GeForce cards compute bf16 with fp32 accumulation at half their fp16-accumulate rate, the rate used here.
_HOPPER = {"interconnect": "nvlink4", "nvlink": "nvlink4", "host_link": "pcie5", "inter_node": "infiniband",
           "arch": "hopper"}
_A100 = {"interconnect": "nvlink3", "nvlink": "nvlink3", "host_link": "pcie4", "inter_node": "infiniband-hdr"}
_GEFORCE = {"host": "desktop"}
CARDS = (
    Gpu("h100-80gb", 81559 * MIB, label="NVIDIA H100 SXM 80GB", device_key="H100", peak_bf16_flops=989e12,
        peak_fp32_flops=67e12, memory_bandwidth=3.35e12, **_HOPPER),
    Gpu("h100-80gb-pcie", 81559 * MIB, label="NVIDIA H100 PCIe 80GB", device_key="H100 PCIe", peak_bf16_flops=756e12,
        peak_fp32_flops=51e12, memory_bandwidth=2.0e12, interconnect="pcie5", host_link="pcie5",
        inter_node="infiniband", arch="hopper"),
    Gpu("h200", 143771 * MIB, label="NVIDIA H200 141GB", device_key="H200", peak_bf16_flops=989e12,
        peak_fp32_flops=67e12, memory_bandwidth=4.8e12, **_HOPPER),
    Gpu("b200", 192_000_000_000, label="NVIDIA B200 192GB", device_key="B200", peak_bf16_flops=2250e12,
        peak_fp32_flops=80e12, memory_bandwidth=8.0e12, interconnect="nvlink5", nvlink="nvlink5",
        host_link="pcie5", inter_node="infiniband", arch="blackwell"),
    Gpu("mi300x", 192_000_000_000, label="AMD Instinct MI300X 192GB", device_key="MI300X", peak_bf16_flops=1300e12,
        peak_fp32_flops=None, memory_bandwidth=5.3e12, interconnect="infinity-fabric", nvlink=None,
        host_link="pcie5", inter_node="infiniband"),
    Gpu("a100-80gb", 81920 * MIB, label="NVIDIA A100 80GB", device_key="A100", peak_bf16_flops=312e12,
        peak_fp32_flops=19.5e12, memory_bandwidth=2.039e12, **_A100),
    Gpu("a100-40gb", 40960 * MIB, label="NVIDIA A100 40GB", device_key="A100", peak_bf16_flops=312e12,
        peak_fp32_flops=19.5e12, memory_bandwidth=1.555e12, **_A100),
    Gpu("v100-32gb", 32768 * MIB, bf16=False, label="NVIDIA V100 SXM2 32GB", device_key="V100",
        peak_fp16_flops=125e12, peak_fp32_flops=15.7e12, memory_bandwidth=897e9, interconnect="nvlink2",
        nvlink="nvlink2", host_link="pcie3", inter_node="infiniband-edr"),
    Gpu("v100-16gb", 16384 * MIB, bf16=False, label="NVIDIA V100 SXM2 16GB", device_key="V100",
        peak_fp16_flops=125e12, peak_fp32_flops=15.7e12, memory_bandwidth=897e9, interconnect="nvlink2",
        nvlink="nvlink2", host_link="pcie3", inter_node="infiniband-edr"),
    Gpu("l40s", 46068 * MIB, label="NVIDIA L40S 48GB", device_key="L40S", peak_bf16_flops=362.05e12,
        peak_fp32_flops=91.6e12, memory_bandwidth=864e9),
    Gpu("l4", 24_000_000_000, label="NVIDIA L4 24GB", device_key="L4", peak_bf16_flops=121e12,
        peak_fp32_flops=30.3e12, memory_bandwidth=300e9),
    Gpu("a10g", 24_000_000_000, label="NVIDIA A10G 24GB (AWS)", device_key="A10G", peak_bf16_flops=None,
        memory_bandwidth=600e9),
    Gpu("t4", 16_000_000_000, bf16=False, label="NVIDIA T4 16GB", device_key="T4", peak_fp16_flops=65.13e12,
        peak_fp32_flops=8.14e12, memory_bandwidth=320e9, interconnect="pcie3", host_link="pcie3"),
    Gpu("a6000", 49140 * MIB, label="NVIDIA RTX A6000 48GB", device_key="A6000", peak_bf16_flops=155e12,
        peak_fp32_flops=38.7e12, memory_bandwidth=768e9, nvlink="nvlink-bridge"),
    Gpu("a5000", 24_000_000_000, label="NVIDIA RTX A5000 24GB", device_key="A5000", peak_bf16_flops=111.1e12,
        peak_fp32_flops=27.8e12, memory_bandwidth=768e9, nvlink="nvlink-bridge"),
    Gpu("a6000-ada", 49140 * MIB, label="NVIDIA RTX 6000 Ada 48GB", device_key="RTX 6000 Ada",
        peak_bf16_flops=364e12, peak_fp32_flops=91.1e12, memory_bandwidth=960e9),
    Gpu("rtx5090", 32_000_000_000, label="NVIDIA GeForce RTX 5090 32GB", device_key="5090", peak_bf16_flops=209.6e12,
        peak_fp32_flops=104.8e12, memory_bandwidth=1792e9, interconnect="pcie5-host", host_link="pcie5", **_GEFORCE),
    Gpu("rtx4090", 24564 * MIB, label="NVIDIA GeForce RTX 4090 24GB", device_key="4090", peak_bf16_flops=165.2e12,
        peak_fp32_flops=82.6e12, memory_bandwidth=1008e9, interconnect="pcie4-host", **_GEFORCE),
    Gpu("rtx3090", 24576 * MIB, label="NVIDIA GeForce RTX 3090 24GB", device_key="3090", peak_bf16_flops=71e12,
        peak_fp32_flops=35.6e12, memory_bandwidth=936e9, interconnect="pcie4-host", nvlink="nvlink-bridge",
        **_GEFORCE),
    # Known to the MFU only.
    Gpu("h100-nvl", None, label="NVIDIA H100 NVL", device_key="H100 NVL", peak_bf16_flops=835e12, arch="hopper"),
    Gpu("l40", None, label="NVIDIA L40", device_key="L40", peak_bf16_flops=181.05e12),
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
    """The GPU called ``name``, spelled with any case, spaces, dashes or underscores and NVIDIA's or GeForce's word
    in front (RTX 4090, A100-80GB, NVIDIA GeForce RTX 3090); exit 2 with the list when unknown."""
    spelled = {_squeezed(key): key for key in GPUS}
    return GPUS[spelled.get(_squeezed(name)) or check_choice(name, GPUS, "GPU")]


def _squeezed(name: str) -> str:
    squeezed = "".join(c for c in name.lower() if c not in " -_")
    return squeezed.removeprefix("nvidia").removeprefix("geforce")


WARPGROUP_ARCHS = ("hopper", "blackwell")
SPEC_KEYS = {"tflops": "dense bf16 tensor-core TFLOP/s (half the data sheet's 'with sparsity' figure)",
             "memory": "memory in GiB", "bandwidth": "memory bandwidth in GB/s",
             "link": f"the link between a node's GPUs ({', '.join(INTRA_NODE_LINKS)}; default pcie4, pcie5 "
                     f"with arch=hopper or blackwell)",
             "host": "the PCIe link to the host: pcie5, pcie4 or pcie3 (default pcie4, pcie5 with arch=hopper or "
                     "blackwell)",
             "arch": "hopper or blackwell for a data-centre card of those generations (H100, H200, B200: "
                     "attention kernels reach less of their peak), else other (default)"}
SPEC_REQUIRED = ("tflops", "memory", "bandwidth")
SPEC_EXAMPLE = "--gpu-spec tflops=121,memory=24,bandwidth=300,link=pcie4"


def gpu_from_spec(text: str) -> Gpu:
    """A card outside the table, from its data sheet's numbers (``--gpu-spec``): exit 2 naming a missing, unknown
    or bad field."""
    fields: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SPEC_KEYS:
            raise UsageError(f"--gpu-spec: '{item}' is not one of {', '.join(k + '=' for k in SPEC_KEYS)} "
                             f"(e.g. {SPEC_EXAMPLE})")
        if key in fields and fields[key] != value.strip():
            raise UsageError(f"--gpu-spec: {key}= is given twice ({fields[key]} and {value.strip()}); give it once")
        fields[key] = value.strip()
    missing = [k for k in SPEC_REQUIRED if k not in fields]
    if missing:
        raise UsageError(f"--gpu-spec: missing {', '.join(f'{k}= ({SPEC_KEYS[k]})' for k in missing)}; "
                         f"e.g. {SPEC_EXAMPLE}")
    tflops, memory_gib, bandwidth_gbs = (_spec_number(fields, k) for k in SPEC_REQUIRED)
    arch = check_choice(fields.get("arch", "other"), (*WARPGROUP_ARCHS, "other"), "--gpu-spec arch")
    pcie = "pcie5" if arch in WARPGROUP_ARCHS else "pcie4"  # every Hopper and Blackwell data-centre card is PCIe 5.0
    link = check_choice(fields.get("link", pcie), INTRA_NODE_LINKS, "--gpu-spec link")
    host = check_choice(fields.get("host", pcie), ("pcie5", "pcie4", "pcie3"), "--gpu-spec host link")
    return Gpu(f"spec:{text}", int(memory_gib * GIB),
               label=f"GPU of {tflops:g} TFLOP/s, {memory_gib:g} GiB, {bandwidth_gbs:g} GB/s (--gpu-spec)",
               peak_bf16_flops=tflops * 1e12, memory_bandwidth=bandwidth_gbs * 1e9, interconnect=link,
               nvlink=link if link.startswith("nvlink") else None, host_link=host,
               arch="" if arch == "other" else arch)


def _spec_number(fields: dict[str, str], key: str) -> float:
    try:
        value = float(fields[key])
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--gpu-spec: {key}={fields[key]} is not a positive number ({SPEC_KEYS[key]})")
    return value


def custom_gpu(memory_gib: float) -> Gpu:
    """A GPU known only by its memory size in GiB (``--gpu-memory``)."""
    return Gpu(f"{memory_gib:g}GiB", int(memory_gib * GIB), label=f"{memory_gib:g} GiB GPU")


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the card ``device_name`` (``torch.cuda.get_device_name``), None where unknown.

    The longest key found in the name wins, so a variant is never taken for the card whose name it contains
    ("H100 PCIe" is not an H100 SXM, an "L40S" not an "L40" nor an "L4", an "A100" not an "A10")."""
    found = [g for g in CARDS if g.device_key and g.device_key in device_name]
    return max(found, key=lambda g: len(g.device_key)).peak_bf16_flops if found else None


def model_flops_per_token(*, trained: int, frozen: int, layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs per trained token, PaLM's accounting (Chowdhery et al. 2022, appendix B), for MFU: the trainer's
    (train/metrics.py) and the estimator's (memory/timing.py). Recomputation is not counted.

    ``trained`` and ``frozen`` count the weights a token's matmuls multiply by: 2 FLOPs per weight forward and 4
    backward, where a frozen weight skips its own gradient (2 of the 4: what LoRA saves). Neither counts an input
    embedding the LM head does not share (a table lookup, as torchtitan counts it) nor the experts a router does not
    pick (``inactive_expert_weights``). Attention adds 12 x layers x hidden x seq_len."""
    return 6.0 * trained + 4.0 * frozen + 12.0 * layers * hidden * seq_len


def expert_shape(config) -> tuple[int, int, int]:
    """(experts, experts a token runs, MLP width) of a transformers text ``config``, read where each family writes
    them (Mixtral's num_local_experts, Qwen-MoE's num_experts and moe_intermediate_size); a dense model has 1 and 1.
    The trainer's MFU reads all three here, the estimator's inventory the expert counts (its MLP width is required:
    it reads the config's own, where the MFU takes 0 for a config without one)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    width = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0)
    return experts, getattr(config, "num_experts_per_tok", None) or 1, width


def inactive_expert_weights(*, layers: int, experts: int, per_token: int, hidden: int, intermediate: int) -> int:
    """Weights of the experts a token does not run: gated MLP experts of 3 x hidden x intermediate each."""
    return 0 if experts <= 1 else layers * (experts - per_token) * 3 * hidden * intermediate


def intra_node_link(gpu: Gpu, name: str | None = None) -> Link:
    """The link between ``gpu``'s GPUs in one node: ``name`` (``--interconnect``), else the card's default."""
    if name is None:
        return INTRA_NODE_LINKS[gpu.interconnect]
    choice = check_choice(name, [*INTRA_NODE_LINKS, "nvlink", "pcie"], "interconnect")
    if choice == "pcie":
        return INTRA_NODE_LINKS[gpu.host_link]
    if choice.startswith("nvlink"):
        if gpu.nvlink is None:
            raise UsageError(f"--interconnect {choice}: the {gpu.label or gpu.name} has no NVLink; its GPUs talk "
                             f"over PCIe (--interconnect pcie, or name a link: "
                             f"{', '.join(n for n in INTRA_NODE_LINKS if not n.startswith('nvlink'))}).")
        if choice == "nvlink":
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
    return HOST_LINKS[gpu.host_link]


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
