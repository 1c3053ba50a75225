"""The analytic memory model: per-GPU bytes of one training step, phase by phase.

A training step goes through phases whose live memory differs; the peak is the largest of them, and the breakdown
shown is the one *at* that peak, so its parts add up to the total:

- forward at the loss: saved activations of every layer, plus the logits and their fp32 upcast (shardtune's loss:
  one chunk's);
- backward at the loss: saved activations, plus the gradients of the logits (shardtune's loss: one recomputed
  chunk's, beside the head's weight gradient being summed);
- backward at the head: the logits' gradient complete, the logits gone (shardtune's loss: just before its
  backward); FSDP gathers its root unit again here;
- backward through the last decoder layer: a recomputed layer (gradient checkpointing) and its temporaries;
- backward through the first decoder layer: nearly every gradient made, that layer's activations still alive;
- backward through the embeddings: every gradient, and a tied head's waiting to be summed with the embedding's;
- FSDP after backward: the root's unsharded gradients and their fp32 copy, reduce-scattered;
- optimizer step: parameters, gradients and optimizer states, no activations.

Where the bytes come from:
- Bytes per parameter (4 fp32 master + 2 bf16 compute copy, 4 gradient, 8 AdamW) follow the Hugging Face
  "Model training anatomy" accounting and Rajbhandari et al. 2020 (ZeRO, sec. 3.1); sharding divides them by the
  shard group as in ZeRO stages 2/3 (FSDP SHARD_GRAD_OP / FULL_SHARD). DDP adds its reducer's gradient buckets.
- Saved activations per token and decoder layer are counted tensor by tensor from what the transformers
  implementation saves for backward (RMSNorm upcasts to fp32; SDPA/flash keeps q, k, v, output and the fp32
  log-sum-exp, and sdpa under the block-causal mask of shardtune's packed batches also keeps that mask in the
  compute dtype and k, v repeated to every head; the gated MLP keeps four intermediate-sized tensors). Korthikanti
  et al. 2022 ("Reducing Activation Recomputation", eq. 1) gives the same structure for GPT; tests/test_activations.py
  checks these numbers against the bytes the real model saves on CPU, on the trainer's batches.
- With the base frozen (LoRA/QLoRA) autograd keeps an op's input only where a gradient needs it: frozen
  projections and norms keep less, adapters keep their own inputs (adapters in the activations' dtype share one
  copy per norm; fp32 adapters under autocast each keep their own compute-dtype copy).
  tests/test_estimate_lora_activations.py checks this against real PEFT models.
- ``--loss shardtune`` is the trainer's own (shardtune.train.loss.head_loss_sum, the head fused with the loss): no
  logits are kept; the head runs on one checkpointed chunk of tokens at a time (``loss_chunk_tokens``), so forward
  holds one chunk's fp32 logits and log-softmax, and backward recomputes them chunk by chunk (12 bytes a value at
  the log-softmax's backward) while the gradients of the head's input and weight are summed.
  ``--loss full`` follows transformers' ``ForCausalLMLoss``: logits in compute dtype, an fp32 upcast, log-softmax
  output kept for backward, and two fp32 vocab-sized gradients at the start of backward. ``--loss chunked`` is
  torchtune's CEWithChunkedOutputLoss as its recipes run it (8 chunks, compiled by training.compile_loss): the
  compute-dtype logits are kept, no fp32 copy is materialised, and backward holds one chunk's gradient at a time.
- FSDP2 (``fully_shard`` per decoder layer): a layer's parameters are all-gathered in the compute dtype while it
  runs, the next one is prefetched, and the root (embeddings, final norm, head) is not resharded after forward
  (torch/distributed/fsdp/_fully_shard/_fsdp_state.py); with FULL_SHARD no decoder layer is gathered while the
  loss runs. Gradients are reduce-scattered in fp32 with fp32 master weights, in bf16 under pure bf16.
- NF4 (QLoRA): 4 bits per weight plus one absmax per 64 weights, stored in 8 bits with a second fp32 absmax per
  256 blocks when double quantisation is on (Dettmers et al. 2023, sec. 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.config.optimizers import PURE_BF16_SLICE_BYTES_PER_ELEMENT, PURE_BF16_SLICE_ELEMENTS
from shardtune.hardware import MIB
from shardtune.memory.activations import Activations
from shardtune.memory.inventory import LoraCount, ModelInventory
from shardtune.memory.optimizer_state import bytes_per_param
from shardtune.memory.setup import Dtypes, Setup, dtypes
from shardtune.strategies import NO

CATEGORIES = ("params", "grads", "optimizer", "activations", "overhead")
# Activation offloading: the checkpointed layer inputs on the GPU at once, the rest in host memory. In backward,
# the layer being recomputed and the next one, whose copy back starts early (train/offload.py's prefetch).
OFFLOADED_LAYERS_ON_GPU = 2

# What the CUDA driver, cuBLAS/cuDNN kernels and NCCL hold outside PyTorch's allocator. nvidia-smi shows it,
# torch.cuda.max_memory_reserved does not. Measured: 767-771 MiB beside the allocator's reserve on every one of 133
# training steps on an H200 (torch 2.11, CUDA 13.0, lazy module loading; bench/results/estimate_cuda_nvidia-h200.md).
CUDA_CONTEXT_BYTES = 768 * MIB
NCCL_BUFFER_BYTES = 256 * MIB


def cuda_context_bytes(setup: Setup) -> int:
    """What each GPU holds outside PyTorch's allocator: the CUDA context, and NCCL's buffers where the job's
    processes communicate (DDP, FSDP and PP's stages; MP's one process drives all its GPUs without NCCL)."""
    several_processes = setup.world_size > 1 and not setup.strategy.drives_several_devices
    return CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if several_processes else 0)


# The caching allocator reserves more than the tensors' peak: freed blocks stay cached, split and rounded, and a
# request that fits none of them reserves a new segment. Fitted to the reserved-minus-allocated of 133 measured
# single-GPU steps on an H200 (docs/estimator.md, "Against a real GPU"), in four parts of the step that come and go:
RESERVE_FIXED_BYTES = 160 * MIB  # cuBLAS workspaces, the small-block pool, and rounding
RESERVE_PER_GRADIENT = 0.17  # gradients are freed (set to None) and allocated again every step, among activations
RESERVE_PER_ACTIVATION = 0.05  # activations saved to the end of forward, freed layer by layer in backward
RESERVE_PER_RECOMPUTED = 0.12  # checkpointing: each layer's activations made again and freed in backward
RESERVE_PER_RECOMPUTED_NF4 = 0.22  # QLoRA with checkpointing: dequantised weights come and go between them


def allocator_reserve(setup: Setup, activations: float, grads: float) -> int:
    """What the caching allocator holds beyond the tensors' peak, for a step whose peak holds ``activations``
    bytes that come and go (saved activations, gathered or dequantised weights) and ``grads`` bytes of gradients."""
    if not setup.gradient_checkpointing:
        per_activation = RESERVE_PER_ACTIVATION
    else:
        per_activation = RESERVE_PER_RECOMPUTED_NF4 if setup.method == "qlora" else RESERVE_PER_RECOMPUTED
    return round(RESERVE_FIXED_BYTES + per_activation * activations + RESERVE_PER_GRADIENT * grads)


# The item of what the caching allocator reserves beyond the tensors (Breakdown.tensors leaves it out).
ALLOCATOR_CACHE = "allocator cache and workspaces"
# The item of what FSDP1's CPU offload keeps reserved in its own streams' pools (Breakdown.tensors leaves it out).
FSDP1_OFFLOAD_POOLS = "FSDP1 offload: a unit's shard copied in, the gradient shards (their streams' pools)"
# torch/distributed/fsdp/_init_utils.py: PARAM_BROADCAST_BUCKET_SIZE, the bucket of sync_module_states' broadcast.
FSDP1_BROADCAST_BUCKET = 250 * 1024 * 1024


def _broadcast_buckets(sizes: list[int]) -> list[list[int]]:
    """c10d compute_bucket_assignment_by_size: tensors in order, a bucket closed once it holds >= the limit."""
    buckets, cur, total = [], [], 0
    for n in sizes:
        cur.append(n)
        total += n
        if total >= FSDP1_BROADCAST_BUCKET:
            buckets.append(cur)
            cur, total = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def fsdp1_init_cache(units: list[list[int]], shard: int, offload: bool) -> int:
    """Bytes the caching allocator keeps cached (not allocated) on the default stream after FSDP1 wraps a model
    held on the CPU with ``device_id`` and ``sync_module_states`` (torch 2.2 _init_utils.py
    _init_param_handle_from_module): for each unit, innermost first and the root last, its tensors are moved to the
    GPU one by one, broadcast from rank 0 in buckets (_sync_params_and_buffers -> broadcast_coalesced flattens each
    bucket of more than one tensor into a new buffer), flattened into one FlatParameter (torch.cat) and sharded
    (the local chunk cloned, the unsharded storage freed; flat_param.py FlatParamHandle.shard). The originals are
    held by the caller's ``managed_params`` list until the handle is built. CPU offload moves each shard to the
    host. ``units``: each unit's tensor sizes in bytes, as stored."""
    from shardtune.memory.allocator import CachingAllocatorModel

    alloc = CachingAllocatorModel()
    for u, sizes in enumerate(units):
        for t, n in enumerate(sizes):
            alloc.malloc(("orig", u, t), n)
        for b, bucket in enumerate(_broadcast_buckets(sizes)):
            if len(bucket) > 1:
                alloc.malloc(("bucket", u, b), sum(bucket))
                alloc.free(("bucket", u, b))
        flat = sum(sizes)
        alloc.malloc(("flat", u), flat)
        if shard > 1:
            alloc.malloc(("shard", u), -(-flat // shard))
            alloc.free(("flat", u))
        for t in range(len(sizes)):
            alloc.free(("orig", u, t))
        if offload:
            alloc.free(("shard", u))
            alloc.free(("flat", u))
    return alloc.reserved - alloc.allocated


def fsdp1_offload_pools(units: list[list[int]], shard: int, grad_bytes: float) -> int:
    """Bytes FSDP1's CPU offload (torch 2.2; 2.0 and 2.13 alike) keeps reserved on the GPU in the pools of two of
    its own streams, which the caching allocator keeps apart from the default stream's (a freed block serves its own
    stream only):

    - pre-unshard stream: before its all-gather, a unit's shard is copied from the host into a new GPU tensor
      (_flat_param.py FlatParamHandle.pre_unshard -> flat_param_to, under _runtime_utils.py _unshard), dropped
      when the unsharded parameter takes its place and reusable once the all-gather that reads it is done (its
      block is recorded on the stream that reads it). Units are copied one
      after another, each shard the same size every step, so the pool keeps at least the largest one: counted.
      More than one in flight (the prefetched unit's copy made before the running one's all-gather is done)
      depends on timing: not counted.
    - post-backward stream: each trainable unit's reduce-scattered gradient shard is made there
      (_runtime_utils.py _reduce_grad -> _get_reduce_scatter_tensors) and kept as ``_saved_grad_shard``
      (_accumulate_sharded_grad) after its copy to the host (_offload_grad), until backward ends
      (_post_backward_final_callback -> _finalize_params -> FlatParamHandle.prepare_gradient_for_optim): all of
      them at once, ``grad_bytes`` (every trainable gradient, unsharded, in the parameters' dtype) over the shard
      group.

    ``units``: each unit's tensor sizes in bytes, as stored (the flat parameter's)."""
    largest_shard = max(-(-sum(sizes) // shard) for sizes in units)
    return round(largest_shard + grad_bytes / shard)


def _fsdp1_units(dp: "_DataParallel") -> list[list[int]]:
    """The frozen units of a LoRA/QLoRA model as fsdp_qlora wraps it: a decoder layer each (its linear weights
    as stored, then its two norms), the root last (embeddings, final norm, head). The adapters' own tiny units are
    left out (small pool)."""
    inv, s, fr = dp.inv, dp.setup, dp.dt.frozen
    h, i = inv.hidden_size, inv.intermediate_size
    q, kv = h * inv.num_heads * inv.head_dim, h * inv.num_kv_heads * inv.head_dim
    linear = [q, kv, kv, q, h * i, h * i, h * i]
    per = [(n // 2 if s.method == "qlora" else n * fr) for n in linear] + [h * fr, h * fr]
    root = [inv.embedding_params * fr, h * fr] + ([inv.head_params * fr] if inv.head_params else [])
    return [per] * inv.num_layers + [root]


# The formula's mean error on the published and shardtune's own measured peaks (bench/results/calibration.md;
# test_tight_margin_is_the_calibrated_error holds it to bench/results/calibration.json): a setup with less to spare
# than this share of its peak fits by the estimate, but within its error.
MEASURED_ERROR = 0.086


@dataclass(frozen=True)
class Item:
    category: str
    label: str
    bytes: int


@dataclass
class Breakdown:
    """Per-GPU memory at the peak phase of one training step."""

    setup: Setup
    phase: str
    items: list[Item]
    cuda_context: int
    cpu_bytes_per_node: int = 0  # what CPU offload (parameters, activations) keeps in host RAM
    stage_note: str = ""
    stage_bounds: tuple[tuple[int, int], ...] = ()  # model parallel: [first, end) decoder layers per GPU
    stage_totals: tuple[int, ...] = ()  # MP and PP: each GPU's peak as ``total`` counts the fullest's
    phases: dict[str, int] = field(default_factory=dict)

    def category(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.category == name)

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def tensors(self) -> int:
        """What torch.cuda.max_memory_allocated should report: the tensors of the fullest phase, which need not be
        the one whose tensors and allocator cache together make the reserved peak (the total)."""
        at_peak = self.total - sum(i.bytes for i in self.items if i.label in (ALLOCATOR_CACHE, FSDP1_OFFLOAD_POOLS))
        return max([at_peak, *self.phases.values()])

    def per_gpu(self) -> dict[str, int]:
        out = {c: self.category(c) for c in CATEGORIES}
        out["total"] = self.total
        return out

    def fits(self, gpu_bytes: int) -> bool:
        return self.total + self.cuda_context <= gpu_bytes

    def spare(self, gpu_bytes: int) -> int:
        """What the card keeps free at the peak (negative where it does not fit)."""
        return gpu_bytes - self.total - self.cuda_context

    def tight(self, gpu_bytes: int) -> bool:
        """Fits, with less to spare than the estimate's mean error on measured peaks (``MEASURED_ERROR``)."""
        return 0 <= self.spare(gpu_bytes) < MEASURED_ERROR * self.total


def nf4_bytes(numel: int, double_quant: bool) -> float:
    """Bytes of a weight stored in NF4 with block size 64."""
    return numel / 2 + nf4_stats_bytes(numel, double_quant)


def nf4_stats_bytes(numel: int, double_quant: bool) -> float:
    """Bytes of the quantisation statistics of an NF4 weight: an absmax per 64 weights, in 8 bits with an fp32
    absmax per 256 blocks when double quantisation is on, else in fp32."""
    return numel / 64 * (1 + 4 / 256 if double_quant else 4)


def _optimizer_bytes_per_param(setup: Setup, master: int, inv: ModelInventory) -> float:
    """State bytes per trainable weight: the table the trainer builds its optimizers from (config/optimizers.py).
    Only Adafactor's factored state depends on shape: LoRA trains r x hidden adapters, full fine-tuning
    hidden-sized matrices."""
    matrix = (setup.lora_r, inv.hidden_size) if setup.uses_lora else (inv.hidden_size, inv.hidden_size)
    return bytes_per_param(setup.optimizer, master, matrix)


def _embedding_state_extra(setup: Setup, master: int, inv: ModelInventory) -> float:
    """What a trained embedding's optimizer state holds beyond the rate of the other weights: 8-bit optimizers
    keep it in fp32 (config/optimizers.py); LoRA leaves the embeddings frozen."""
    if setup.method != "full":
        return 0.0
    rate = _optimizer_bytes_per_param(setup, master, inv)
    matrix = (inv.hidden_size, inv.hidden_size)
    return inv.embedding_params * (bytes_per_param(setup.optimizer, master, matrix, embedding=True) - rate)


class _Model:
    """Parameter bytes of the model as a given method stores it, per decoder layer and for the root."""

    def __init__(self, inv: ModelInventory, setup: Setup, dt: Dtypes, lora: LoraCount | None):
        self.inv, self.setup, self.dt = inv, setup, dt
        self.lora_layer = lora.per_layer if lora else (0,) * inv.num_layers
        self.lora_root = lora.outside_layers if lora else 0
        # The base's biases that train (lora_bias) are among the trainable weights above: the frozen base less them.
        self.frozen_layer = [n - (lora.layer_bias(i) if lora else 0) for i, n in enumerate(inv.layer_params)]
        self.frozen_root = inv.root_params - (lora.bias_outside if lora else 0)

    def layer_storage(self, i: int) -> float:
        inv, s, dt = self.inv, self.setup, self.dt
        if s.method == "full":
            return inv.layer_params[i] * dt.master
        base = self.frozen_layer[i] * dt.frozen
        if s.method == "qlora":
            linear = inv.layer_linear_params[i]
            base = (self.frozen_layer[i] - linear) * dt.frozen + nf4_bytes(linear, s.nf4_double_quant)
        return base + self.lora_layer[i] * dt.master

    def root_storage(self) -> float:
        if self.setup.method == "full":
            return self.inv.root_params * self.dt.master
        return self.frozen_root * self.dt.frozen + self.lora_root * self.dt.master

    def layer_gathered(self, i: int) -> float:
        """A layer as FSDP gathers it: everything in compute dtype, NF4 weights as they are stored."""
        inv, s, e = self.inv, self.setup, self.dt.compute
        if s.method == "qlora":
            linear = inv.layer_linear_params[i]
            return (self.frozen_layer[i] - linear + self.lora_layer[i]) * e + nf4_bytes(linear, s.nf4_double_quant)
        return (self.frozen_layer[i] + self.lora_layer[i]) * e

    def root_gathered(self) -> float:
        return (self.frozen_root + self.lora_root) * self.dt.compute

    def head_gathered(self) -> float:
        """The head as its own FSDP unit gathers it (the embeddings when tied)."""
        inv = self.inv
        return (inv.head_params or inv.embedding_params) * self.dt.compute

    def layer_trainable(self, i: int) -> int:
        return self.inv.layer_params[i] if self.setup.method == "full" else self.lora_layer[i]

    def root_trainable(self) -> int:
        return self.inv.root_params if self.setup.method == "full" else self.lora_root

    def autocast_copy_of_layer(self, i: int) -> float:
        """torch.autocast's compute-dtype copy of a layer's fp32 matmul weights (kept while saved for backward)."""
        if self.dt.autocast_copies:
            return self.inv.layer_linear_params[i] * self.dt.compute
        return self.lora_layer[i] * self.dt.compute if self.dt.master == 4 else 0

    def autocast_copy_of_head(self) -> float:
        if self.dt.autocast_copies:
            return self.inv.vocab_size * self.inv.hidden_size * self.dt.compute
        return 0


def estimate(inv: ModelInventory, setup: Setup, lora: LoraCount | None = None) -> Breakdown:
    """Per-GPU peak memory of ``setup`` for the model ``inv`` (``lora`` is required for lora/qlora)."""
    if setup.uses_lora and lora is None:
        raise ValueError("lora/qlora estimates need the LoRA trainable counts")
    if setup.splits_layers:  # a pipeline stage holds its layers as a model-parallel GPU does
        return _estimate_model_parallel(inv, setup, lora)
    return _estimate_data_parallel(inv, setup, lora)


def _shard_group(setup: Setup) -> int:
    if not setup.strategy.shards_parameters or setup.sharding_strategy == "NO_SHARD":
        return 1
    if setup.sharding_strategy == "HYBRID_SHARD":
        return setup.num_gpus  # shard inside a node, replicate across nodes
    return setup.world_size


def _estimate_data_parallel(inv: ModelInventory, setup: Setup, lora: LoraCount | None) -> Breakdown:
    """One GPU, DDP and FSDP: every GPU runs the whole model on its own micro-batch. The peak is the fullest of
    the step's phases (module docstring), each the model states plus what that phase holds besides."""
    dp = _DataParallel.of(inv, setup, lora)
    states, saved, copies = _model_states(dp), _saved_activations(dp), _weight_copies(dp)
    grads = _pending_gradients(dp, states)
    return _at_peak(dp, states, copies, grads, _phases(dp, states, saved, copies, grads))


@dataclass(frozen=True)
class _DataParallel:
    """What every phase of a data-parallel step reads: the setup, its element sizes and its parts."""

    inv: ModelInventory
    setup: Setup
    dt: Dtypes
    model: _Model
    act: Activations
    shard: int  # the GPUs each parameter, gradient and optimizer state is sharded over (1: replicated)
    fsdp: bool
    offload: bool  # FSDP's CPU offload
    tokens: int  # per micro-batch

    @classmethod
    def of(cls, inv: ModelInventory, setup: Setup, lora: LoraCount | None) -> _DataParallel:
        dt = dtypes(setup)
        fsdp = setup.strategy.shards_parameters
        return cls(inv, setup, dt, _Model(inv, setup, dt, lora), Activations(inv, setup, dt), _shard_group(setup),
                   fsdp, fsdp and setup.offload_params, setup.batch_size * setup.seq_len)

    @property
    def biggest_layer(self) -> int:
        return max(range(self.inv.num_layers), key=self.model.layer_gathered)


@dataclass(frozen=True)
class _States:
    """The model states: unsharded bytes of all of them, and what one GPU holds of them."""

    storage: float  # every parameter as stored
    grads: float  # every trainable parameter's gradient
    optim: float  # the optimizer's states
    shard: int
    on_gpu: int  # 0: CPU offload keeps the sharded parameters, gradients and optimizer states on the host
    whole: float = 0  # of ``storage``, what each GPU holds whole, neither sharded nor offloaded (nf4_stats_whole)

    @property
    def params_b(self) -> float:
        return self.on_gpu * (self.storage - self.whole) / self.shard + self.whole

    @property
    def grads_b(self) -> float:
        return self.on_gpu * self.grads / self.shard

    @property
    def optim_b(self) -> float:
        return self.on_gpu * self.optim / self.shard


def _model_states(dp: _DataParallel) -> _States:
    model, layers = dp.model, range(dp.inv.num_layers)
    storage = sum(model.layer_storage(i) for i in layers) + model.root_storage()
    trainable = sum(model.layer_trainable(i) for i in layers) + model.root_trainable()
    optim = trainable * _optimizer_bytes_per_param(dp.setup, dp.dt.master, dp.inv) \
        + _embedding_state_extra(dp.setup, dp.dt.master, dp.inv)
    whole = 0.0
    if dp.setup.nf4_stats_whole and dp.setup.method == "qlora":
        whole = sum(nf4_stats_bytes(dp.inv.layer_linear_params[i], dp.setup.nf4_double_quant) for i in layers)
    return _States(storage, trainable * dp.dt.master, optim, dp.shard, 0 if dp.offload else 1, whole)


@dataclass(frozen=True)
class _Saved:
    """Activation bytes of one micro-batch, by when they are alive."""

    layers: float  # every decoder layer's saved tensors (the checkpointed inputs only, with checkpointing)
    all: float  # those and what is saved outside the layers (embeddings, final norm, head input)
    layer_backward: float  # a layer's temporaries during its backward
    recompute: float  # a recomputed layer's saved tensors (gradient checkpointing)
    batch: float  # the micro-batch itself: what is left outside the layers once backward is past the head
    first_layer: float  # the first layer at the end of backward: its saved tensors beside its checkpointed input
    dora: float  # DoRA's weight norm while a layer's forward (or its recompute) runs: not per token


def _saved_activations(dp: _DataParallel) -> _Saved:
    act, tokens, ckpt = dp.act, dp.tokens, dp.setup.gradient_checkpointing
    per_layer = tokens * act.layer_checkpointed() if ckpt else act.layer_bytes(tokens)
    layers = _layers_on_gpu(dp.setup, dp.inv.num_layers) * per_layer + act.rope_tables()
    recompute = act.layer_recomputed_bytes(tokens) if ckpt else 0
    first_layer = per_layer + recompute
    if dp.setup.activation_offloading:  # at the second layer's backward the first one's input is back already
        first_layer += tokens * act.layer_checkpointed()
    return _Saved(layers, layers + tokens * act.outside_layers(), tokens * act.layer_backward_temporaries(),
                  recompute, tokens * act.batch_inputs(), first_layer, act.dora_weight_norm())


@dataclass(frozen=True)
class _Copies:
    """Compute-dtype copies of weights (torch.autocast's, or FSDP's gathered units) in each phase."""

    label: str
    loss: float  # while the loss runs forward
    loss_backward: float  # while the loss runs backward
    head: float  # as the head's backward begins
    backward: float  # through the last decoder layer
    end: float  # through the first decoder layer
    embeddings: float = 0  # while the embedding's backward runs
    forward_start: float = 0  # as the first decoder layer's forward begins
    # FSDP with fp32 master weights: a layer's fp32 reduce-scatter input, made after its backward, once the layer's
    # own temporaries are gone (``backward`` and ``end`` leave it out)
    reduce_input: float = 0


def _weight_copies(dp: _DataParallel) -> _Copies:
    return _fsdp_gathered(dp) if dp.fsdp else _autocast_copies(dp)


def _autocast_copies(dp: _DataParallel) -> _Copies:
    """torch.autocast's compute-dtype copy of each fp32 weight it casts, kept while saved for backward."""
    model, biggest = dp.model, dp.biggest_layer
    layer_copies = sum(model.autocast_copy_of_layer(i) for i in range(dp.inv.num_layers))
    if dp.setup.gradient_checkpointing:  # recomputation re-casts: only one layer's copies at a time
        layer_copies = model.autocast_copy_of_layer(biggest)
    copies = layer_copies + model.autocast_copy_of_head()
    return _Copies("autocast compute-dtype weight copies", copies, copies, copies, copies,
                   model.autocast_copy_of_layer(biggest))


def _fsdp_gathered(dp: _DataParallel) -> _Copies:
    """FSDP2's units gathered in the compute dtype: the running layer and the prefetched next one, the root."""
    model, setup, biggest = dp.model, dp.setup, dp.biggest_layer
    unit = model.layer_gathered(biggest)
    # A layer's unsharded gradient in compute dtype, and the fp32 copy reduce-scattered when the master weights are
    # fp32 (MixedPrecisionPolicy reduce_dtype), made after the layer's backward (``_phases`` weighs it against the
    # layer's temporaries); pure bf16 reduces the bf16 gradient.
    reduce_input = model.layer_trainable(biggest) * (4 if dp.dt.master == 4 else 0)
    unit_grad = model.layer_trainable(biggest) * dp.dt.compute
    root = model.root_gathered()
    # FSDP2 copies a unit into its gathered parameters even when the shard is the whole unit (NO_SHARD), so what
    # it holds follows resharding alone; but that copy is made as the unit runs, not prefetched. FSDP1 (the
    # published runs that set fsdp1_init_cache) computes on a whole shard in place.
    copies = dp.shard > 1 or not setup.fsdp1_init_cache
    prefetched = 0 if copies and dp.shard == 1 else 1
    # Near the end of backward (the second layer's, the first one's prefetched) two layers are gathered, whether or
    # not they were resharded after forward: each is resharded after its backward.
    gathered_end = min(1 + prefetched, dp.inv.num_layers) * unit
    if not setup.reshards_after_forward and copies:  # kept gathered from forward to backward
        gathered_fwd = gathered_at_loss = sum(model.layer_gathered(i) for i in range(dp.inv.num_layers))
    else:
        gathered_fwd = gathered_end  # the running layer and the prefetched next one
        # Each layer is resharded after its forward, and the last one is gathered again only when backward
        # reaches it (its pre-backward hook): while the loss runs, only the root is unsharded.
        gathered_at_loss = 0 if copies else gathered_fwd
    # The decoder layers' part of the backward phases: through the last layer, and near the end (the first one).
    layers_backward, layers_end = gathered_fwd + unit_grad, gathered_end + unit_grad
    loss, backward, end = root + gathered_at_loss, root + layers_backward, root + layers_end
    loss_backward = head = loss
    # The embedding's backward runs inside the root unit, which its post-backward reshards only after it.
    embeddings = root
    if setup.separate_root_units and dp.shard > 1 and setup.reshards_after_forward:
        # Embeddings and head are units of their own (torchtune custom_sharded_layers), resharded after their
        # forward: nothing of them is gathered while the decoder layers run backward. The head is gathered again
        # by its pre-backward hook (with its unsharded gradient beside it when it trains).
        head_unit = model.head_gathered()
        head_grad = head_unit if setup.method == "full" else 0  # its unsharded gradient, the same size
        loss, backward, end = gathered_at_loss, layers_backward, layers_end
        loss_backward, head = loss, head_unit + head_grad
        embeddings = root - model.head_gathered()  # gathered again by its own pre-backward hook
    # In forward FSDP2 keeps each unit's all-gather output until the next unit's copy-out is done (to overlap
    # them): as the first decoder layer's parameters are copied out of its all-gather output, the root's output
    # is still there beside the root's parameters.
    # FSDP1 (the published runs that set fsdp1_init_cache) gathers straight into a unit's flat parameter: no
    # copy-out, no output kept.
    first_unit = root - model.head_gathered() if setup.separate_root_units else root
    forward_start = 2 * (first_unit + unit) if dp.shard > 1 and not setup.fsdp1_init_cache else 0
    if setup.loss == "shardtune" and dp.shard > 1 and setup.reshards_after_forward:
        # FSDP2 reshards the root after forward (unless told not to, as SHARD_GRAD_OP does) and gathers it again
        # from the pre-backward hook on its output, the loss: before the chunks' backward, the all-gather's output
        # beside the unsharded parameters it is copied into; the chunks then run with the root gathered and the
        # last layer's all-gather, which that hook prefetches, in flight beside it.
        loss_backward, head = root + gathered_at_loss + unit, 2 * root + gathered_at_loss
    return _Copies("FSDP all-gathered units (compute dtype)", loss, loss_backward, head, backward, end, embeddings,
                   forward_start, reduce_input)


@dataclass(frozen=True)
class _Gradients:
    """Gradient bytes on a GPU besides the finished ones, and those not made yet, at given points."""

    carry: float  # from earlier micro-batches of the accumulation
    head: float  # the head's, made first in backward (full fine-tuning)
    not_yet: float  # not yet made while the first decoder layer runs its backward
    tied_pending: float  # a tied head's gradient waiting to be summed with the embedding's
    head_buffer: float  # the fused loss's sum of the head's weight gradient over its chunks
    # FSDP, at the embedding's backward: the root's unsharded gradients made so far (the head's, and the
    # embedding's), the first layer's reduce-scatter input, less the root's gradient shards not made yet
    at_embeddings: float = 0
    # FSDP: the head's gradient, held unsharded through every decoder layer's backward (in ``head`` too)
    head_unsharded: float = 0


def _pending_gradients(dp: _DataParallel, states: _States) -> _Gradients:
    """FSDP2 makes a unit's sharded gradients by reduce-scattering them after its backward, and the root's
    (embeddings, head) after the whole backward. Otherwise the layer's own backward peaks in its MLP, after the
    down projection's weight gradient and before the others (gate, up, attention); and the embedding's gradient is
    the last one backward makes. A tied embedding has the head's gradient instead: cast up to the master dtype, it
    waits in autograd's input buffer until the embedding's backward makes the other one, and the two are summed in
    place, so the very end of backward holds one embedding-sized gradient more than the gradients themselves."""
    inv, setup, model, dt, on_gpu = dp.inv, dp.setup, dp.model, dp.dt, states.on_gpu
    full = setup.method == "full"
    carry = states.grads_b if setup.gradient_accumulation_steps > 1 else 0
    head_params = (inv.head_params or inv.embedding_params) if full else 0
    head = head_params * dt.master / dp.shard * on_gpu
    tied_pending = at_embeddings = head_unsharded = 0
    if dp.fsdp:
        not_yet = (model.layer_trainable(0) + model.root_trainable()) * dt.master / dp.shard * on_gpu
        # What the unit holding the embeddings reduce-scatters after their backward: the whole root, or (as its
        # own unit, torchtune's custom_sharded_layers) the embeddings alone, the head's reduce-scattered already.
        root_unit = unsummed = model.root_trainable()
        if not (setup.separate_root_units and dp.shard > 1):
            # The head is in the root unit, reduce-scattered after the whole backward: until then its gradient is
            # unsharded, in the compute dtype (a tied one waits in autograd's buffer, the same size).
            head = head_unsharded = head_params * dt.compute
            unsummed += inv.embedding_params if full and inv.tied_embeddings else 0
        elif full:
            root_unit = unsummed = root_unit - inv.head_params
        # At the embedding's backward those gradients are unsharded, in the compute dtype (a tied pair not yet
        # summed), and their shards not made; the first layer's reduce-scatter input (fp32 when the master weights
        # are; FSDP reduces in the master weights' dtype, Precision.reduce_dtype) is kept until the next one.
        at_embeddings = (unsummed * dt.compute + model.layer_trainable(0) * dt.master
                         - root_unit * dt.master / dp.shard * on_gpu)
    else:
        down = inv.hidden_size * inv.intermediate_size if full and inv.num_experts == 1 else 0
        not_yet = max(model.layer_trainable(0) - down, 0) * dt.master * on_gpu
        if full:
            embedding_grad = inv.embedding_params * dt.master * on_gpu
            if inv.tied_embeddings:
                tied_pending = embedding_grad
            else:
                not_yet += embedding_grad
    buffer = 0
    if setup.loss == "shardtune" and full:
        # The head's weight gradient is made chunk by chunk: autograd sums the chunks' gradients in a buffer of
        # the matmul's dtype (the compute dtype under autocast and for FSDP's gathered weights).
        buffer = (inv.head_params or inv.embedding_params) * (dt.compute if dt.autocast_copies or dp.fsdp
                                                              else dt.master)
    return _Gradients(carry, head, not_yet, tied_pending, buffer, at_embeddings, head_unsharded)


def _phases(dp: _DataParallel, states: _States, saved: _Saved, copies: _Copies,
            grads: _Gradients) -> dict[str, dict[str, float]]:
    """The bytes of each phase besides the parameters and optimizer states: gradients, activations, copies."""
    act, tokens, fused = dp.act, dp.tokens, dp.setup.loss == "shardtune"
    # With checkpointing a layer's backward starts by recomputing its forward, DoRA's weight norm included.
    in_layer = max(saved.layer_backward, saved.dora if dp.setup.gradient_checkpointing else 0)
    # Under FSDP with fp32 masters a layer's fp32 reduce-scatter input comes once its temporaries are gone.
    after_layer = max(copies.reduce_input - in_layer, 0)
    phases = {
        "forward (loss)": dict(grads=grads.carry, act=saved.all + act.loss_forward_bytes(tokens),
                               copies=copies.loss),
        "backward (loss)": dict(grads=grads.carry if fused else max(grads.carry, grads.head),
                                act=saved.all + act.loss_backward_bytes(tokens, grads.head_buffer) + grads.head_buffer,
                                copies=copies.loss_backward),
        # The loss's backward is about to start (shardtune's: before its chunks, with the head inside them) or
        # the gradient of the logits is complete and the logits are gone (the other losses: the gradient takes
        # their place in ``saved``) and the head's backward begins; under FSDP the root's pre-backward hook (on
        # its output) gathers it now, the all-gather's output beside the unsharded parameters it is copied into.
        "backward (head)": dict(grads=grads.carry, act=saved.all, copies=copies.head),
        "backward (last layer)": dict(grads=max(grads.carry, grads.head),
                                      act=saved.layers + saved.batch + saved.recompute + in_layer,
                                      copies=copies.backward + after_layer),
        # The first layer's backward: the other layers' saved tensors (their autocast weight copies among them)
        # are gone, and nearly every gradient is there.
        "backward (first layer)": dict(grads=states.grads_b - grads.not_yet + grads.head_unsharded,
                                       act=act.rope_tables() + saved.batch + saved.first_layer + in_layer,
                                       copies=copies.end + after_layer),
        # The embedding's backward reads the gradient of its output (the residual stream's first tensor).
        "backward (embeddings)": dict(grads=states.grads_b + grads.tied_pending + grads.at_embeddings,
                                      act=act.rope_tables() + saved.batch + tokens * act.layer_checkpointed(),
                                      copies=copies.embeddings),
        "optimizer step": dict(grads=states.grads_b, act=0, copies=0, step=_optimizer_step_bytes(dp, states)),
    }
    if copies.forward_start:
        phases["forward (first layer)"] = dict(grads=grads.carry, act=act.rope_tables() + saved.batch,
                                               copies=copies.forward_start)
    if saved.dora and not dp.setup.gradient_checkpointing:
        # The last layer's DoRA weight norm, every layer's saved tensors beside it.
        phases["forward (last layer)"] = dict(grads=grads.carry, act=saved.layers + saved.batch + saved.dora,
                                              copies=copies.loss)
    if dp.fsdp:
        # After the whole backward FSDP2 reduce-scatters the root's gradients (embeddings, head). It copies the
        # unsharded gradient (compute dtype) into the reduce-scatter input (fp32 with fp32 master weights), frees
        # it, then reduce-scatters into the new gradient shard: first the gradient beside the input with the root's
        # shards not made yet, then the input beside the shards, which is the larger when the shard is the whole
        # gradient (NO_SHARD). Large for full fine-tuning of a large vocabulary. On more than one GPU the
        # reduce-scatter (torch 2.13's foreach_reduce) keeps the unit's last gradient, an untied head's in the
        # root, alive through it in a loop variable.
        root_trainable = dp.model.root_trainable()
        root_shards = root_trainable * dp.dt.master / dp.shard * states.on_gpu
        last = dp.inv.head_params * dp.dt.compute if dp.setup.method == "full" and dp.shard > 1 else 0
        phases["backward (root gradients)"] = {
            "grads": states.grads_b - root_shards, "act": saved.batch,
            "copies": root_trainable * dp.dt.master + max(root_trainable * dp.dt.compute, root_shards + last)}
    return phases


def _optimizer_step_bytes(dp: _DataParallel, states: _States) -> float:
    """What the optimizer step allocates on the GPU besides the states: pure bf16's AdamW steps each weight (each
    rank's shard of it under FSDP) one slice at a time in fp32 (config/optimizers.py). torch's fused AdamW works
    in place."""
    setup, inv = dp.setup, dp.inv
    if not setup.pure_bf16 or not states.on_gpu:
        return 0
    if setup.method == "full":
        largest = max(inv.embedding_params, inv.head_params, inv.largest_linear_params)
    else:
        largest = setup.lora_r * max(inv.hidden_size, inv.intermediate_size)
    return min(-(-largest // dp.shard), PURE_BF16_SLICE_ELEMENTS) * PURE_BF16_SLICE_BYTES_PER_ELEMENT


def _at_peak(dp: _DataParallel, states: _States, copies: _Copies, grads: _Gradients,
             phases: dict[str, dict[str, float]]) -> Breakdown:
    """The breakdown at the fullest phase, its items adding up to the total."""
    setup, inv, shard = dp.setup, dp.inv, dp.shard
    dequant = inv.largest_linear_params * dp.dt.compute if setup.method == "qlora" else 0
    # DDP's reducer copies every gradient into flat buckets for its all-reduce (gradient_as_bucket_view is off), a
    # second copy of the trainable gradients that it allocates when the model is wrapped and keeps.
    buckets = states.grads if setup.strategy.replicates and setup.world_size > 1 else 0
    # What FSDP1's wrapping left cached on the default stream is in the reserved peak from the start; the step's
    # default-stream tensors made after it (gradients, optimizer states, activations) reuse it first. FSDP1 gathers
    # units on its unshard stream, whose pool cannot use these blocks. The same for every phase: replayed once.
    init = fsdp1_init_cache(_fsdp1_units(dp), shard, dp.offload) if setup.fsdp1_init_cache and dp.fsdp else None
    # FSDP1's CPU offload copies, in pools of their own: reserved in every phase from the first step on. FSDP2's
    # offload (shardtune's own) is modelled by the states and copies above.
    offload_pools = 0
    if setup.fsdp1_init_cache and dp.offload:
        offload_pools = fsdp1_offload_pools(_fsdp1_units(dp), shard, states.grads)

    def reserve(ph: dict[str, float]) -> int:
        """What the caching allocator holds beyond the tensors of phase ``ph``. Weight copies (autocast's, FSDP's
        gathered layers) come back at the same sizes layer after layer and step after step: they reuse their
        blocks."""
        dynamic = ph["act"] + (dequant if ph["act"] else 0)
        cache = allocator_reserve(setup, dynamic, ph["grads"])
        if init is not None:
            cache = max(cache, round(init - states.optim_b - ph["grads"] - dynamic))
        return cache

    totals, reserves = {}, {}
    for name, ph in phases.items():
        dyn = ph["act"] + ph["copies"] + (dequant if ph["act"] else 0)
        totals[name] = states.params_b + states.optim_b + buckets + ph["grads"] + dyn + ph.get("step", 0)
        reserves[name] = reserve(ph) + offload_pools
    # The peak of reserved memory: the phase whose tensors and cache together are the most.
    phase = max(totals, key=lambda name: totals[name] + reserves[name])
    ph = phases[phase]
    part = f" (1/{shard} shard)" if shard > 1 else ""
    pending = ""
    if phase == "backward (embeddings)" and grads.tied_pending:
        pending = " + the tied head's, not yet summed"
    elif phase == "backward (embeddings)" and grads.at_embeddings:
        pending = ", the root's still unsharded, and the first layer's reduce-scatter input"
    elif grads.head_unsharded and phase == "backward (first layer)":
        pending = " + the head's, unsharded until the root's reduce-scatter"
    grads_label = "gradients" + part + pending
    if grads.head_unsharded and phase == "backward (last layer)" and ph["grads"] == grads.head_unsharded:
        grads_label = "the head's gradient, unsharded until the root's reduce-scatter"
    items = [Item("params", _param_label(setup, shard, dp.offload, states.whole > 0), round(states.params_b)),
             Item("grads", grads_label, round(ph["grads"]))]
    if buckets:
        items.append(Item("grads", "DDP gradient buckets (a copy of the gradients)", round(buckets)))
    items += [Item("optimizer", f"{setup.optimizer} states" + part, round(states.optim_b)),
              Item("activations", _activation_label(setup), round(ph["act"]))]
    if ph.get("step"):
        items.append(Item("optimizer", "its step's fp32 work on one slice of a weight (pure bf16)", round(ph["step"])))
    if dequant and ph["act"]:
        items.append(Item("activations", "NF4 weight dequantised for its matmul", round(dequant)))
    if ph["copies"]:
        items.append(Item("overhead" if dp.fsdp else "params", copies.label, round(ph["copies"])))
    if offload_pools:
        items.append(Item("overhead", FSDP1_OFFLOAD_POOLS, offload_pools))
    items.append(Item("overhead", ALLOCATOR_CACHE, reserves[phase] - offload_pools))
    context = cuda_context_bytes(setup)
    cpu = round((states.storage + states.grads + states.optim) / shard * setup.num_gpus) if dp.offload else 0
    cpu += _offloaded_activation_bytes(inv, setup, dp.act, setup.num_gpus)
    return Breakdown(setup=setup, phase=phase, items=items, cuda_context=context, cpu_bytes_per_node=cpu,
                     phases={k: round(v) for k, v in totals.items()})


def _param_label(setup: Setup, shard: int, offload: bool, stats_whole: bool) -> str:
    """``stats_whole``: each GPU holds the NF4 quantisation statistics whole (``_States.whole``)."""
    kind = {"full": "weights", "lora": "frozen base + LoRA adapters", "qlora": "NF4 base + LoRA adapters"}
    text = kind[setup.method]
    if offload:
        return text + (" (on CPU; its quantisation statistics whole on each GPU)" if stats_whole else " (on CPU)")
    return (text + (f" (1/{shard} shard)" if shard > 1 else "")
            + (" (quantisation statistics whole on each GPU)" if stats_whole else ""))


def _layers_on_gpu(setup: Setup, num_layers: int) -> int:
    """Decoder layers whose saved activations are on the GPU at once: all, or the few offloading brings back."""
    return min(num_layers, OFFLOADED_LAYERS_ON_GPU) if setup.activation_offloading else num_layers


def _offloaded_activation_bytes(inv: ModelInventory, setup: Setup, act: Activations, replicas: int) -> int:
    """Pinned host memory per node that activation offloading fills: every layer's checkpointed input, for each of
    the node's ``replicas`` (one per GPU in data parallel; one model split over the GPUs in model parallel)."""
    if not setup.activation_offloading:
        return 0
    return setup.batch_size * setup.seq_len * inv.num_layers * act.layer_checkpointed() * replicas


def _activation_label(setup: Setup) -> str:
    ckpt = "checkpointed layers" if setup.gradient_checkpointing else "all layers"
    if setup.activation_offloading:
        ckpt = f"checkpointed layers offloaded to CPU, {OFFLOADED_LAYERS_ON_GPU} back at a time"
    return f"activations ({ckpt}, logits and loss)"


def _estimate_model_parallel(inv: ModelInventory, setup: Setup, lora: LoraCount | None) -> Breakdown:
    """Naive model parallel: decoder layers split across the GPUs, balanced by memory; the fullest GPU is reported.

    Each GPU holds its layers' weights, gradients, optimizer states and activations; the first also holds the
    embeddings, the last the final norm, the head and the loss. Stages are contiguous and chosen to minimise the
    largest per-GPU total (a small dynamic programme over layer boundaries). MP: one micro-batch, the whole batch,
    is in flight at a time. PP: the batch is cut into ``setup.microbatches`` pipeline micro-batches; a stage keeps
    the activations of those in flight there (``_Stages.in_flight``) and recomputes, and runs the loss for, one at
    a time.
    """
    one = setup.with_(distributed_type=NO, num_gpus=1, num_nodes=1)
    if setup.world_size == 1:
        return estimate(inv, one, lora)
    stages = _Stages.of(inv, setup, one, lora)
    return stages.breakdown(stages.balanced(setup.world_size))


PARTS = ("params", "grads", "optimizer", "activations")  # what a stage holds, by category


@dataclass(frozen=True)
class _Stages:
    """The bytes each decoder layer adds to the GPU that holds it, and what the first and last GPUs hold more."""

    inv: ModelInventory
    setup: Setup
    dt: Dtypes
    act: Activations
    layer_parts: list[dict[str, float]]  # activations: one micro-batch's
    first: dict[str, float]  # the embeddings
    last: dict[str, float]  # the final norm, the head and the loss (its activations: per micro-batch in flight)
    transient: float  # every stage recomputes one layer and holds its gradient temporaries during backward
    last_once: float  # the last stage's loss backward, one micro-batch at a time

    @classmethod
    def of(cls, inv: ModelInventory, setup: Setup, one: Setup, lora: LoraCount | None) -> _Stages:
        """``one``: ``setup`` on one GPU, whose element sizes and activations each stage has."""
        dt = dtypes(one)
        model, act = _Model(inv, one, dt, lora), Activations(inv, one, dt)
        # One micro-batch's tokens: PP's pipeline micro-batch, MP's whole batch.
        rows = setup.batch_size // setup.microbatches if setup.strategy.pipelined else setup.batch_size
        tokens, ckpt = max(rows, 1) * setup.seq_len, setup.gradient_checkpointing
        opt = _optimizer_bytes_per_param(setup, dt.master, inv)
        per_layer_act = tokens * act.layer_checkpointed() if ckpt else act.layer_bytes(tokens)
        if setup.activation_offloading:  # the layers' inputs wait in host memory; a few are back (``transient``)
            per_layer_act = 0

        def parts(storage: float, trainable: float, activations: float, copies: float) -> dict[str, float]:
            return {"params": storage + copies, "grads": trainable * dt.master, "optimizer": trainable * opt,
                    "activations": activations}

        layer_parts = [parts(model.layer_storage(i), model.layer_trainable(i), per_layer_act,
                             0 if ckpt else model.autocast_copy_of_layer(i)) for i in range(inv.num_layers)]
        root_fraction = inv.embedding_params / max(inv.root_params, 1)
        root = parts(model.root_storage(), model.root_trainable(), 0, 0)
        first = {k: v * root_fraction for k, v in root.items()}
        last = {k: v - first[k] for k, v in root.items()}
        first["optimizer"] += _embedding_state_extra(setup, dt.master, inv)
        if setup.strategy.pipelined and inv.tied_embeddings:
            # PP's last stage holds the tied head as its own copy of the embeddings, with its gradient and state
            # (the two ends add their gradients: train/pipeline_parallel.py); MP's head stays on the first GPU.
            for c in last:
                last[c] += first[c]
        last["params"] += model.autocast_copy_of_head()
        # The last stage runs the loss: its peak is the backward at the loss, one micro-batch's.
        last["activations"] += tokens * act.outside_layers()
        last_once = act.loss_backward_bytes(tokens)
        # A layer's forward (or its recompute) may hold more than its backward: DoRA's weight norm.
        transient = max(tokens * act.layer_backward_temporaries(), act.dora_weight_norm())
        if ckpt:
            transient += act.layer_recomputed_bytes(tokens)
        if setup.activation_offloading:
            transient += tokens * _layers_on_gpu(setup, inv.num_layers) * act.layer_checkpointed()
        return cls(inv, setup, dt, act, layer_parts, first, last, transient, last_once)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at once: MP runs one; PP's GPipe runs every
        forward before any backward; 1F1B (torch.distributed.pipelining's Schedule1F1B) starts backward as soon as
        the last stage can, so stage s holds at most (stages - s) of them."""
        setup = self.setup
        if not setup.strategy.pipelined:
            return 1
        microbatches = setup.microbatches
        if setup.config.distributed.pipeline_schedule.upper() == "GPIPE":
            return microbatches
        return max(1, min(microbatches, setup.world_size - stage))

    def holds_head(self, a: int, b: int) -> bool:
        """Whether the GPU holding layers [a, b) runs the final norm, the head and the loss (``last``): the last
        one, but MP keeps a head tied to the embeddings on the first (train/model_parallel.py)."""
        if self.setup.strategy.drives_several_devices and self.inv.tied_embeddings:
            return a == 0
        return b == self.inv.num_layers

    def parts(self, a: int, b: int, stage: int) -> dict[str, float]:
        """What GPU ``stage``, holding layers [a, b), holds, by category."""
        out = {c: sum(self.layer_parts[i][c] for i in range(a, b)) for c in PARTS}
        head = self.holds_head(a, b)
        for extra, on in ((self.first, a == 0), (self.last, head)):
            if on:
                for c in out:
                    out[c] += extra[c]
        out["activations"] = out["activations"] * self.in_flight(stage) + self.transient
        if head:
            out["activations"] += self.last_once
        return out

    def balanced(self, gpus: int) -> list[tuple[int, int]]:
        """Contiguous [first, end) layers per GPU that minimise the fullest GPU (more GPUs than layers: some
        idle). ``best[g][j]``: the smallest possible largest-stage total placing the first j layers on g GPUs."""
        layers = self.inv.num_layers
        held, acts = [0.0], [0.0]  # prefix sums of the layers' weights, gradients and states; of their activations
        for lp in self.layer_parts:
            held.append(held[-1] + sum(v for c, v in lp.items() if c != "activations"))
            acts.append(acts[-1] + lp["activations"])
        flights = [self.in_flight(stage) for stage in range(gpus)]

        def ends(part: dict[str, float]) -> tuple[float, float]:
            return sum(v for c, v in part.items() if c != "activations"), part["activations"]

        (first_held, first_act), (last_held, last_act) = ends(self.first), ends(self.last)

        def cost(a: int, b: int, stage: int) -> float:
            """sum(self.parts(a, b, stage).values()), in constant time."""
            at_first, at_last = a == 0, self.holds_head(a, b)
            activations = acts[b] - acts[a] + (first_act if at_first else 0) + (last_act if at_last else 0)
            return (held[b] - held[a] + (first_held if at_first else 0) + (last_held if at_last else 0)
                    + activations * flights[stage] + self.transient + (self.last_once if at_last else 0))

        inf = float("inf")
        best = [[inf] * (layers + 1) for _ in range(gpus + 1)]
        cut = [[0] * (layers + 1) for _ in range(gpus + 1)]
        best[0][0] = 0.0
        for g in range(1, gpus + 1):
            for j in range(1, layers + 1):
                for i in range(0, j):
                    if best[g - 1][i] == inf:
                        continue
                    c = max(best[g - 1][i], cost(i, j, g - 1))
                    if c < best[g][j]:
                        best[g][j], cut[g][j] = c, i
        # A pipeline has a stage on every GPU (its in-flight counts assume as many); MP may leave GPUs idle.
        used = gpus if self.setup.strategy.pipelined and gpus <= layers else \
            min(range(1, gpus + 1), key=lambda g: best[g][layers])
        bounds, j = [], layers
        for g in range(used, 0, -1):
            bounds.append((cut[g][j], j))
            j = cut[g][j]
        return bounds[::-1]

    def breakdown(self, bounds: list[tuple[int, int]]) -> Breakdown:
        """The fullest GPU's bytes, and the layers per GPU."""
        setup = self.setup
        held = [self.parts(a, b, stage) for stage, (a, b) in enumerate(bounds)]
        totals = [sum(parts.values()) for parts in held]
        worst = max(range(len(bounds)), key=totals.__getitem__)
        a, b = bounds[worst]
        fullest = held[worst]
        items = [
            Item("params", "weights of this GPU's layers" + (" + autocast copies" if self.dt.autocast_copies else ""),
                 round(fullest["params"])),
            Item("grads", "gradients of this GPU's layers", round(fullest["grads"])),
            Item("optimizer", f"{setup.optimizer} states of this GPU's layers", round(fullest["optimizer"])),
            Item("activations", _activation_label(setup) + ", this GPU's layers", round(fullest["activations"])),
            Item("overhead", ALLOCATOR_CACHE,
                 allocator_reserve(setup, fullest["activations"], fullest["grads"])),
        ]
        each = [round(sum(parts.values())) + allocator_reserve(setup, parts["activations"], parts["grads"])
                for parts in held]
        note = (f"layers per GPU: {', '.join(str(hi - lo) for lo, hi in bounds)} (peak GiB: "
                f"{', '.join(f'{n / 2**30:.2f}' for n in each)}); GPU {worst} (layers {a}-{b - 1}) is the fullest")
        if setup.strategy.pipelined:
            note += (f" (its activations: {self.in_flight(worst)} of the {setup.microbatches} pipeline micro-batches "
                     f"in flight under {setup.config.distributed.pipeline_schedule})")
        if setup.world_size > len(bounds):
            note += f"; {setup.world_size - len(bounds)} GPU(s) left idle"
        return Breakdown(setup=setup, phase="backward (loss)" if self.holds_head(a, b) else "backward", items=items,
                         cuda_context=cuda_context_bytes(setup), stage_note=note, stage_bounds=tuple(bounds),
                         stage_totals=tuple(each),
                         cpu_bytes_per_node=_offloaded_activation_bytes(self.inv, setup, self.act, 1))
