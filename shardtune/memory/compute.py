"""How long one micro-batch's forward and backward take on one GPU: the compute half of ``estimate --time``.

A step is matrix multiplications, attention, and memory-bound work, timed apart and added (they are separate
kernels; a GPU runs one at a time on the critical path):

- **Matmuls** (every linear layer and the LM head, forward, backward, and the forward again where checkpointing
  recomputes it): their count is exact from the shapes (2 FLOPs per weight per token forward; backward 4 for a
  trained weight, 2 for a frozen one, only its input's gradient). Each FLOP costs 1 / (``matmul`` x peak) and also
  1 / (``tile_intensity`` x memory bandwidth): a matmul kernel streams its operand tiles from memory, and the
  higher a card's peak is against its bandwidth, the further below peak its matmuls run (an A100 has 153 FLOPs
  per byte of bandwidth, an H100 SXM 295, an RTX 6000 Ada 379). Reading the weights once per pass is
  memory-bound too: per micro-batch, so small micro-batches pay more of it per token.
- **Attention** (QK^T and PV, 4 x seq_len x heads x head_dim FLOPs per token per layer forward; backward 2x
  that eager, 2.5x in fused kernels, which recompute QK^T) runs at ``attention`` x the peak, with the same
  bandwidth term; on Hopper and Blackwell data-centre cards at less (``WARPGROUP_ATTENTION``: their peak needs
  instructions FlashAttention-2-class kernels do not use). A causal kernel (flash attention, torch's causal SDPA,
  flex attention) skips the masked half; SDPA handed an explicit mask (what transformers does with packed rows)
  computes all of it and reads the mask; eager attention also writes and reads the L x L scores in memory.
- **Memory-bound work** moves bytes at ``MEMORY_EFFICIENCY`` x the data sheet's bandwidth: norms, activations,
  residual adds, RoPE and casts (``elementwise_bytes`` per token per layer per unit of 2 x hidden + intermediate,
  fewer when torch.compile or hand-written kernels fuse them: ``fused_elementwise_bytes``), the cross-entropy
  over the vocabulary, each LoRA adapter re-reading its input, QLoRA dequantising every NF4 weight before its
  matmul, eager attention's scores, the weights' reads and their gradients' writes.

The seven fitted numbers (``TimingParams``) come from shardtune/memory/calibration/, published measured runs,
by bench/calibration.py, which also reports each run predicted by a fit that left it out (docs/estimator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.hardware import PCIE_P2P_SHARE, Gpu, inactive_expert_weights
from shardtune.memory.formula import nf4_bytes
from shardtune.memory.inventory import LoraCount, ModelInventory
from shardtune.memory.setup import Setup, dtypes

# Copy-like kernels reach about this share of the data sheet's memory bandwidth (an assumption, not fitted: the
# elementwise byte counts are fitted instead, and the two would trade against each other).
MEMORY_EFFICIENCY = 0.8
# Bytes moved per logit by the cross-entropy, forward and backward (counted, not fitted): transformers' loss
# upcasts the bf16 logits (read 2, write 4), log-softmaxes them (4 + 4), and backward writes and reads the fp32
# gradient twice and casts it down (4 + 4 + 4 + 4 + 4 + 2); shardtune train's loss does the upcast and the
# log-softmax once more in backward (its chunks are checkpointed) and gathers the chunk gradients (+ 22);
# transformers <= 4.44's shifts the fp32 logits into a contiguous copy (read 4, write 4) and backward scatters the
# gradient back into a zeroed full-size one (write 4, then read 4 and write 4: + 20); a compiled chunked loss
# (torchtune) fuses it to a read of the logits and a write of their gradient, each twice.
LOSS_BYTES_PER_LOGIT = {"full": 36.0, "full-shifted": 56.0, "shardtune": 58.0, "chunked": 8.0}
# Eager attention's scores, bytes per score per layer, forward and backward: the bf16 scores written and read,
# the fp32 softmax written and read, its bf16 copy, and backward twice that; fused softmax kernels half of it.
EAGER_SCORE_BYTES = {"eager": 48.0, "fused": 24.0}
# A LoRA adapter's elementwise traffic in bytes per token per unit of (in + out) of the adapted weight, counted
# from PEFT's eager forward (dropout copies the input: read and write in; the two small matmuls read in and write
# out; scaling reads and writes out; the add reads two outs and writes one: 3 x in + 6 x out values) and backward
# (the same passes in reverse plus the input gradient's add: 7 x in + 3 x out), 2 bytes each: ~19 per dimension;
# fused (compiled) adapters read the input and the output gradient once more each: 8.
LORA_BYTES_PER_DIM = {"eager": 19.0, "fused": 8.0}
# Share of the forward that checkpointing recomputes, by policy: everything, every other layer (torchtitan's
# selective layer checkpointing), or the operators between the saved matmuls (torchtitan's selective op
# checkpointing saves every other matmul's output: about half the matmul work is recomputed).
RECOMPUTE = {"none": 0.0, "full": 1.0, "selective-layer": 0.5, "selective-op": 0.5}
ATTENTION_KERNELS = ("flash", "sdpa-mask", "eager")
# FlashAttention-2-class kernels (flash-attn 2, PyTorch's SDPA flash and memory-efficient backends, Triton ports)
# issue Ampere's warp-level MMA, not the warp-group MMA a Hopper or Blackwell data-centre card needs for its peak.
# The FlashAttention-2 paper (Dao 2023, section 4.1) measures its best forward at 73% of an A100's peak and, run
# unchanged on an H100, at "up to 335 TFLOPs/s", 34% of 989: on those cards attention's share of the peak is
# scaled by that ratio (not fitted).
WARPGROUP_ATTENTION = 335 / 989 / 0.73


@dataclass(frozen=True)
class TimingParams:
    """The fitted constants of the time model (bench/calibration.py fits them; the defaults are its fit on the
    whole calibration set, shardtune/memory/calibration/)."""

    # The values are bench/calibration.py's fit on every speed point (its output, to 4 digits). The matmul share
    # sits at its bound, 1: the fit explains all of the matmuls' shortfall by the bandwidth term.
    matmul: float = 1.0  # share of the dense tensor-core peak the linear layers' matmuls reach
    attention: float = 0.4164  # share of the peak the attention kernels reach
    tile_intensity: float = 1315  # FLOPs per byte of memory traffic a tensor-core kernel's tiles sustain
    elementwise_bytes: float = 57.75  # eager kernels: bytes per token per layer per (2 x hidden + intermediate)
    fused_elementwise_bytes: float = 33.14  # the same under torch.compile or hand-fused kernels
    overlap: float = 0.3626  # share of a micro-batch's compute that communication can hide behind
    pcie_share: float = PCIE_P2P_SHARE  # share of PCIe x16's line rate collectives reach between P2P PCIe cards


CALIBRATED = TimingParams()


@dataclass(frozen=True)
class Kernels:
    """How the step's kernels run. The defaults are shardtune train's: transformers' eager modules, SDPA (with
    the packed rows' block-causal mask), checkpointing as the setup says."""

    attention: str = "sdpa-mask"  # flash | sdpa-mask | eager
    fused: bool = False  # torch.compile or hand-written fused norm and activation kernels
    # Whether the rest of the graph is fused too (adapters, eager attention's scores, the loss): torch.compile's
    # inductor is; hand-written kernels for the norms and activations alone (Liger) are not. None: as ``fused``.
    whole_graph: bool | None = None
    recompute: str | None = None  # none | full | selective-layer | selective-op; None: full with checkpointing
    overlap_comm: bool = True  # gradients reduced during backward (DDP buckets, FSDP), not after it
    reduce_bytes: int | None = None  # bytes of a reduced gradient element; None: the master weights' size

    @property
    def graph_fused(self) -> bool:
        return self.fused if self.whole_graph is None else self.whole_graph


def kernels_of(setup: Setup) -> Kernels:
    """The kernels ``shardtune train`` runs for ``setup``: its attention implementation; the norms, activations and
    RoPE fused where torch_compile with inductor (the whole graph) or use_liger_kernel (Liger's Triton kernels for
    those alone) asks, eager modules otherwise. Other compile backends (eager, aot_eager) generate no kernels."""
    attention = {"flash_attention_2": "flash", "eager": "eager"}.get(setup.attn_implementation, "sdpa-mask")
    inductor = setup.torch_compile == "inductor"
    return Kernels(attention=attention, fused=inductor or setup.use_liger_kernel, whole_graph=inductor)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's forward and backward on one GPU, whole model, by kind of work (seconds)."""

    matmul_s: float
    attention_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s


def recompute_share(setup: Setup, kernels: Kernels) -> float:
    if kernels.recompute is not None:
        return RECOMPUTE[kernels.recompute]
    return 1.0 if setup.gradient_checkpointing else 0.0


def inactive_expert_params(inv: ModelInventory) -> int:
    """Weights of the experts a token does not run (gated MLP experts: 3 x hidden x intermediate each)."""
    return inactive_expert_weights(layers=inv.num_layers, experts=inv.num_experts, per_token=inv.experts_per_token,
                                   hidden=inv.hidden_size, intermediate=inv.intermediate_size)


def active_linear_params(inv: ModelInventory) -> int:
    """The decoder layers' matmul weights one token runs through: every linear layer of a dense model; of a
    mixture of experts, the attention, the router and the k experts the router picks. transformers 5 stores the
    experts as 3-D tensors, not nn.Linear (so not in ``layer_linear_params``): they are counted from
    ``layer_params``, whatever their layout (the few norm weights in it are noise beside the matmuls)."""
    if inv.num_experts <= 1:
        return sum(inv.layer_linear_params)
    return sum(inv.layer_params) - inactive_expert_params(inv)


def matmul_flops_per_token(inv: ModelInventory, setup: Setup, adapters: int, recompute: float) -> float:
    """Hardware FLOPs of the linear layers and the LM head per token: forward, backward, recomputation."""
    layers = active_linear_params(inv)
    head = inv.vocab_size * inv.hidden_size
    frozen_base = setup.uses_lora
    backward = (2.0 if frozen_base else 4.0) * (layers + head) + 4.0 * adapters
    return 2.0 * (layers + adapters + head) + backward + recompute * 2.0 * (layers + adapters)


def keys_per_query(seq_len: int, window: int | None, causal: bool) -> float:
    """The keys each query of a ``seq_len`` row is multiplied with, on average. A kernel that computes the whole
    square (SDPA handed a mask, eager) uses all of them, whatever the mask hides; a causal one skips the masked half,
    and flash attention with a sliding ``window`` (its window_size) also skips the blocks behind the window: query
    i (counted from 1) sees min(i, window) keys: window - window^2 / (2 seq_len) on average once the row is longer."""
    if not causal:
        return float(seq_len)
    if window is None or seq_len <= window:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops_per_token(inv: ModelInventory, seq_len: int, kernel: str, recompute: float) -> float:
    """QK^T and PV per token: forward (2 matmuls), backward, and the recomputed forward. Eager attention's backward
    is 4 matmuls (2 x forward); a fused kernel's is 5 (it recomputes QK^T instead of keeping it: 2.5 x forward).
    Causal kernels skip the masked half, and flash attention the keys behind a layer's sliding window."""
    windows = inv.attention_windows or (None,) * inv.num_layers
    keys = sum(keys_per_query(seq_len, window, kernel == "flash") for window in windows)
    forward = 4.0 * keys * inv.q_dim
    return forward * ((3.0 if kernel == "eager" else 3.5) + recompute)


def flops_per_token(inv: ModelInventory, setup: Setup, lora: LoraCount | None, kernels: Kernels) -> tuple[float, float]:
    """Hardware FLOPs per token of the matmuls and of attention, as ``kernels`` run them (recomputation included)."""
    recompute = recompute_share(setup, kernels)
    adapters = lora.total if lora is not None and setup.uses_lora else 0
    return (matmul_flops_per_token(inv, setup, adapters, recompute),
            attention_flops_per_token(inv, setup.seq_len, kernels.attention, recompute))


def layer_bytes_per_token(inv: ModelInventory, lora: LoraCount | None, kernels: Kernels, params: TimingParams,
                          recompute: float) -> float:
    """What one decoder layer's memory-bound kernels read and write per token, forward, backward and the
    recompute: norms, activations, residual adds, RoPE and casts, and the LoRA adapters' traffic (``lora``: the
    adapters trained, None for full fine-tuning)."""
    width = 2 * inv.hidden_size + inv.intermediate_size * max(1, inv.experts_per_token)
    total = width * (params.fused_elementwise_bytes if kernels.fused else params.elementwise_bytes)
    if lora is not None:
        style = "fused" if kernels.graph_fused else "eager"
        total += LORA_BYTES_PER_DIM[style] * lora.total / max(lora.r, 1) / inv.num_layers
    return total * (1 + recompute / 3)  # a forward is ~1/3 of the traffic


def memory_bytes_per_microbatch(inv: ModelInventory, setup: Setup, lora: LoraCount | None, kernels: Kernels,
                                params: TimingParams, recompute: float) -> float:
    """What one micro-batch's memory-bound kernels read and write, all layers, forward and backward."""
    tokens = setup.batch_size * setup.seq_len
    style = "fused" if kernels.graph_fused else "eager"
    adapters = lora if setup.uses_lora else None
    total = tokens * inv.num_layers * layer_bytes_per_token(inv, adapters, kernels, params, recompute)
    loss = "chunked" if kernels.graph_fused and setup.loss == "full" else setup.loss  # compiled with the model
    total += tokens * inv.vocab_size * LOSS_BYTES_PER_LOGIT[loss]
    scores = setup.batch_size * inv.num_heads * setup.seq_len ** 2 * inv.num_layers
    if kernels.attention == "eager":
        total += scores * EAGER_SCORE_BYTES[style] * (1 + recompute / 3)
    elif kernels.attention == "sdpa-mask":
        total += scores / inv.num_heads * 2 * (3 + recompute)  # the bf16 mask, read by every pass
    return total + weight_bytes(inv, setup, recompute) + dequantise_bytes(inv, setup, recompute)


def weight_bytes(inv: ModelInventory, setup: Setup, recompute: float) -> float:
    """Each pass reads the weights once per micro-batch (forward, backward's input gradient, the recompute); full
    fine-tuning adds each weight's gradient to its fp32 accumulator (read and write 4 bytes), and autocast casts
    fp32 weights to bf16 in every forward (read 4, write 2)."""
    weights = active_linear_params(inv) + inv.vocab_size * inv.hidden_size
    total = weights * 2 * (2 + recompute)
    if setup.method == "full":
        total += weights * 8
        if dtypes(setup).autocast_copies:
            total += weights * 6 * (1 + recompute)
    return total


def dequantise_bytes(inv: ModelInventory, setup: Setup, recompute: float) -> float:
    """QLoRA dequantises each NF4 weight to bf16 before its matmul: forward, backward, and the recompute."""
    if setup.method != "qlora":
        return 0.0
    linear = sum(inv.layer_linear_params)
    return (2 + recompute) * (nf4_bytes(linear, setup.nf4_double_quant) + 2 * linear)


def memory_rate(gpu: Gpu) -> float:
    return (gpu.memory_bandwidth or 1e12) * MEMORY_EFFICIENCY


def microbatch(inv: ModelInventory, setup: Setup, gpu: Gpu, peak: float, lora: LoraCount | None = None,
               kernels: Kernels | None = None, params: TimingParams = CALIBRATED) -> MicroBatch:
    """One micro-batch of ``setup`` through the whole model on one ``gpu`` computing at ``peak`` FLOP/s."""
    kernels = kernels or kernels_of(setup)
    recompute = recompute_share(setup, kernels)
    tokens = setup.batch_size * setup.seq_len
    matmul_flops, attention_flops = flops_per_token(inv, setup, lora, kernels)
    streamed = 1 / (params.tile_intensity * memory_rate(gpu))  # seconds per FLOP of streaming operand tiles
    matmul = tokens * matmul_flops * (1 / (params.matmul * peak) + streamed)
    share = params.attention * (WARPGROUP_ATTENTION if gpu.warpgroup_mma else 1.0)
    attention = tokens * attention_flops * (1 / (share * peak) + streamed)
    memory = memory_bytes_per_microbatch(inv, setup, lora, kernels, params, recompute) / memory_rate(gpu)
    return MicroBatch(matmul, attention, memory)
