"""How long a training step takes, and what a data set costs: ``shardtune estimate --time``.

The step is built from first principles; the constants it needs are stated here and calibrated against published
runs in docs/estimator.md ("How long it takes"):

- **FLOPs.** Per trained token, PaLM's accounting (Chowdhery et al. 2022, appendix B), the formula the trainer's MFU
  uses (``hardware.model_flops_per_token``): 6 per trainable weight, 4 per frozen one (it skips its own gradient:
  what LoRA saves), and 12 x layers x hidden x seq_len for attention. A mixture-of-experts model counts the experts
  a token runs; an input embedding the LM head does not share is a lookup and counts nothing.
  Gradient checkpointing runs each decoder layer's forward again in backward (2 per layer weight and 4 x hidden x
  seq_len per layer): hardware FLOPs, not in the MFU, which counts the model's FLOPs as PaLM and the trainer do.
- **Compute**: each micro-batch's matmuls, attention and memory-bound kernels, timed by shardtune/memory/compute.py
  from the shapes and the card's peak and memory bandwidth, with constants fitted to published runs.
- **Communication** per GPU, ring collectives as NCCL runs them (an all-reduce sends 2(n-1)/n of the bytes, an
  all-gather or a reduce-scatter (n-1)/n), hierarchical across nodes: inside a node over its links, and 1/G of the
  bytes per GPU between nodes (G GPUs per node). Per strategy:
  DDP and NO_SHARD all-reduce the trainable gradients once per optimizer step (no_sync on the other micro-batches);
  FSDP FULL_SHARD all-gathers every unit in forward and the decoder layers again in backward (with LoRA the
  frozen weights too), and reduce-scatters the trainable gradients, every micro-batch;
  SHARD_GRAD_OP gathers in forward only; HYBRID_SHARD gathers inside the node, reduce-scatters there and
  all-reduces its shard between nodes; CPU offload first copies each shard from host memory over PCIe and copies
  the gradients back (every micro-batch), and runs the optimizer on the CPU; model parallel (MP) runs one stage
  at a time, so the step is one GPU's work, and each stage boundary passes activations forward and gradients back;
  pipeline parallel (PP) idles for its bubble, (stages - 1) / (micro-batches + stages - 1) of the step, at the pace
  of its slowest stage.
- **Latency.** Each collective also costs its link's fixed latency (``Link.latency_s``): FSDP runs one per unit
  per pass, DDP one per 25 MB gradient bucket.
- **Overlap.** FSDP prefetches the next unit's all-gather and DDP reduces its buckets during backward, so a
  micro-batch's communication hides behind up to ``overlap`` (fitted, compute.py) of its compute; at least
  1 - ``overlap`` of it stays exposed (the first gather and the last reduce have nothing to hide behind, and NCCL's
  kernels take SMs). MP's and PP's hand-overs and the CPU optimizer step are not overlapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardtune.config.schema import published_defaults
from shardtune.errors import UsageError
from shardtune.hardware import PCIE_X16_BYTES_PER_S, Gpu, Link
from shardtune.hardware import model_flops_per_token as palm_flops
from shardtune.memory.compute import CALIBRATED, Kernels, TimingParams, inactive_expert_params, kernels_of, \
    MEMORY_EFFICIENCY, memory_rate, microbatch
from shardtune.memory.formula import _Model, _optimizer_bytes_per_param
from shardtune.memory.inventory import LoraCount, ModelInventory
from shardtune.memory.setup import Setup, dtypes

OVERLAP = CALIBRATED.overlap  # what the report states
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb: one all-reduce per bucket
# AdamW on the CPU (what runs under CPU offload) is memory-bound: PyTorch's default makes about a dozen unfused
# elementwise passes over the fp32 parameter, gradient and two states (~100 bytes of traffic per parameter); the
# fused kernel (adamw_torch_fused) reads the four once and writes three back (28 bytes). Host memory moves bytes
# at the share copy-like kernels reach (MEMORY_EFFICIENCY) of its channels' line rate: a GPU server has two
# sockets of eight DDR4-3200 channels (a DGX A100's two EPYC 7742s), 25.6 GB/s each; a desktop board two channels
# (~50 GB/s). Per node: its GPUs' ranks share the host memory (torchtune and shardtune split the CPU threads
# between them).
CPU_OPTIMIZER_BYTES_PER_PARAM = {"fused": 28.0, "unfused": 100.0}
HOST_MEMORY_BYTES_PER_S = {"server": 2 * 8 * 25.6e9 * MEMORY_EFFICIENCY, "desktop": 50e9}
DEFAULT_PIPELINE_MICROBATCHES = published_defaults().distributed.pipeline_microbatches  # shardtune train's


@dataclass(frozen=True)
class Links:
    """The links a setup's traffic crosses."""

    intra: Link  # between the GPUs of a node
    inter: Link  # between nodes
    host: Link  # between a GPU and host memory (CPU offload)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of a setup: its time and what it is made of (seconds; bytes per GPU)."""

    setup: Setup
    tokens_per_step: int  # trained tokens per optimizer step, all GPUs together
    model_flops_per_token: float
    hardware_flops_per_token: float  # with the recomputation of gradient checkpointing
    compute_s: float  # the step's compute (MP: every stage in turn; PP: with its bubble)
    comm_s: float  # what the collectives, hand-overs and offload copies take on their links
    exposed_comm_s: float  # the part of comm_s not hidden behind compute
    optimizer_s: float  # the optimizer update (on the CPU with offload)
    step_s: float
    peak_flops: float  # per GPU
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per GPU per step, by link: intra, inter, host
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation over every GPU of the setup (MP's idle stages included)."""
        return self.tokens_per_s * self.model_flops_per_token / (self.setup.world_size * self.peak_flops)

    def seconds_for(self, tokens: float) -> float:
        return tokens / self.tokens_per_s

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "model_flops_per_token": self.model_flops_per_token,
                "hardware_flops_per_token": self.hardware_flops_per_token, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s, "optimizer_s": self.optimizer_s,
                "comm_bytes_per_gpu": dict(self.comm_bytes), "note": self.note}


def model_flops_per_token(inv: ModelInventory, trainable: int, seq_len: int, frozen_base: bool) -> float:
    """PaLM's FLOPs per trained token for MFU (``hardware.model_flops_per_token``, as the trainer counts them).

    ``trainable`` counts the weights with gradients; with ``frozen_base`` (LoRA, QLoRA) they are adapters on top of
    the model's frozen weights, otherwise they are the model's own. The weights a token's matmuls use are the
    model's less an untied input embedding (a lookup) and the experts it does not run."""
    lookup = 0 if inv.tied_embeddings else inv.embedding_params
    active = inv.parameters - lookup - inactive_expert_params(inv)
    trained, frozen = (trainable, active) if frozen_base else (active, 0)
    return palm_flops(trained=trained, frozen=frozen, layers=inv.num_layers, hidden=inv.hidden_size, seq_len=seq_len)


def recompute_flops_per_token(inv: ModelInventory, layer_adapters: int, seq_len: int) -> float:
    """The forward of every decoder layer once more (gradient checkpointing): weights and attention."""
    layer_weights = sum(inv.layer_params) - inactive_expert_params(inv) + layer_adapters
    return 2.0 * layer_weights + 4.0 * inv.num_layers * inv.hidden_size * seq_len


def collective_s(nbytes: float, gpus_per_node: int, nodes: int, links: Links,
                 count: float = 1) -> tuple[float, dict[str, float]]:
    """``count`` all-gathers (or reduce-scatters) moving ``nbytes`` in all over ``gpus_per_node`` x ``nodes`` GPUs:
    their seconds, and the bytes each GPU sends per link. Hierarchical: (nodes-1)/nodes of the GPU's 1/G slice
    between nodes, then (G-1)/G of the whole inside the node; each collective pays its links' latency."""
    intra = (gpus_per_node - 1) / gpus_per_node * nbytes
    inter = (nodes - 1) / nodes * nbytes / gpus_per_node
    latency = count * ((links.intra.latency_s if gpus_per_node > 1 else 0.0)
                       + (links.inter.latency_s if nodes > 1 else 0.0))
    seconds = intra / links.intra.bytes_per_s + inter / _inter_rate(links, gpus_per_node) + latency
    return seconds, {"intra": intra, "inter": inter}


def _inter_rate(links: Links, gpus_per_node: int) -> float:
    """Each GPU's share of the network between nodes while all of a node's GPUs use it at once."""
    return links.inter.bytes_per_s / (gpus_per_node if links.inter.shared_by_node else 1)


def exposed_s(comm: float, compute: float, overlap: float = OVERLAP) -> float:
    """The part of ``comm`` seconds that ``compute`` seconds running beside it do not hide."""
    return max(comm - overlap * compute, (1 - overlap) * comm) if comm > 0 else 0.0


@dataclass
class _Traffic:
    """Per-GPU communication of one micro-batch and of one optimizer step (seconds, bytes by link)."""

    per_microbatch_s: float = 0.0
    per_step_s: float = 0.0
    bytes: dict[str, float] = field(default_factory=lambda: {"intra": 0.0, "inter": 0.0, "host": 0.0})

    def add(self, seconds: float, nbytes: dict[str, float], times: float, per_step: bool) -> None:
        if per_step:
            self.per_step_s += seconds
        else:
            self.per_microbatch_s += seconds
        for link, n in nbytes.items():
            self.bytes[link] += n * times


def _data_parallel_traffic(model: _Model, setup: Setup, links: Links, reduce_bytes: int | None = None) -> _Traffic:
    """DDP and FSDP: what each GPU sends and copies per micro-batch and per optimizer step."""
    traffic = _Traffic()
    inv, accum = model.inv, setup.gradient_accumulation_steps
    gpus, nodes, units = setup.num_gpus, setup.num_nodes, inv.num_layers + 1  # FSDP: each layer and the root
    layers = sum(model.layer_gathered(i) for i in range(inv.num_layers))
    root = model.root_gathered()
    trainable = sum(model.layer_trainable(i) for i in range(inv.num_layers)) + model.root_trainable()
    grads = trainable * (reduce_bytes or model.dt.master)  # fp32 with fp32 master weights, bf16 under pure bf16
    if links.intra.name == "nvlink-bridge" and gpus > 2:  # a bridge joins pairs: the ring crosses PCIe too
        links = Links(links.host, links.inter, links.host)
    if setup.strategy.defers_gradient_sync(setup.sharding_strategy):
        buckets = units if setup.strategy.shards_parameters else max(1.0, math.ceil(grads / DDP_BUCKET_BYTES))
        s, b = collective_s(grads, gpus, nodes, links, buckets)
        traffic.add(2 * s, {k: 2 * v for k, v in b.items()}, 1, per_step=True)  # all-reduce
        return traffic
    hybrid = setup.sharding_strategy == "HYBRID_SHARD"
    shard_nodes = 1 if hybrid else nodes  # HYBRID_SHARD shards inside a node
    regather = setup.reshards_after_forward
    s, b = collective_s(root + layers * (2 if regather else 1), gpus, shard_nodes, links,
                        units + (inv.num_layers if regather else 0))
    traffic.add(s, b, accum, per_step=False)
    # The gradients are reduce-scattered (and, offloaded, copied to the host) every micro-batch: sharded gradients
    # are not held back (Strategy.defers_gradient_sync).
    s, b = collective_s(grads, gpus, shard_nodes, links, units)
    traffic.add(s, b, accum, per_step=False)  # reduce-scatter
    if hybrid and nodes > 1:  # each GPU's gradient shard all-reduced with its peers on the other nodes
        inter = 2 * (nodes - 1) / nodes * grads / gpus
        traffic.add(inter / _inter_rate(links, gpus) + units * links.inter.latency_s, {"inter": inter}, accum,
                    per_step=False)
    if setup.offload_params:
        world = setup.world_size
        storage = sum(model.layer_storage(i) for i in range(inv.num_layers))
        copied_in = (model.root_storage() + 2 * storage) / world  # the shard, before each all-gather
        copied_out = trainable * model.dt.master / world
        traffic.add((copied_in + copied_out) / links.host.bytes_per_s, {"host": copied_in + copied_out}, accum,
                    per_step=False)
    return traffic


def _stage_share(inv: ModelInventory, bounds: tuple[tuple[int, int], ...]) -> float:
    """The largest stage's share of the model's matmul work (the LM head runs on the last stage)."""
    head = inv.vocab_size * inv.hidden_size
    work = [sum(inv.layer_params[a:b]) + (head if b == inv.num_layers else 0) for a, b in bounds]
    return max(work) / sum(work)


def step_time(inv: ModelInventory, setup: Setup, gpu: Gpu, links: Links, lora: LoraCount | None = None,
              stage_bounds: tuple[tuple[int, int], ...] = (),
              pipeline_microbatches: int = DEFAULT_PIPELINE_MICROBATCHES, kernels: Kernels | None = None,
              params: TimingParams = CALIBRATED) -> StepTime:
    """One optimizer step of ``setup`` on ``gpu``s joined by ``links``. ``stage_bounds`` are MP/PP's layers per
    stage (the memory estimate's); without them the layers are split evenly. ``kernels`` say how the step's
    kernels run (default: shardtune train's), ``params`` the time model's fitted constants."""
    peak = gpu.peak_flops(setup.mixed_precision)
    if not peak:
        raise ValueError(f"no peak FLOPs known for {gpu.name}")
    dt = dtypes(setup)
    adapters = lora.total if lora else 0
    model_flops = model_flops_per_token(inv, adapters, setup.seq_len, setup.uses_lora)
    # The base's trained biases (lora_bias) are in the layers' own weights already.
    layer_adapters = sum(lora.per_layer) - sum(lora.bias_per_layer) if lora else 0
    hw_flops = model_flops + (recompute_flops_per_token(inv, layer_adapters, setup.seq_len)
                              if setup.gradient_checkpointing else 0.0)
    kernels = kernels or kernels_of(setup)
    if links.intra.name in PCIE_X16_BYTES_PER_S:  # peer-to-peer PCIe: its achieved share is fitted
        links = replace(links, intra=replace(links.intra, bytes_per_s=PCIE_X16_BYTES_PER_S[links.intra.name]
                                             * params.pcie_share))
    micro = microbatch(inv, setup, gpu, peak, lora, kernels, params)
    work = _Work(micro_tokens=setup.batch_size * setup.seq_len, micro_s=micro.seconds,
                 trainable=adapters if setup.uses_lora else inv.parameters,
                 overlap=params.overlap if kernels.overlap_comm else 0.0, reduce_bytes=kernels.reduce_bytes)
    # The optimizer update reads and writes the weight and its states and reads the gradient.
    states = _optimizer_bytes_per_param(setup, dt.master, inv)
    work.optimizer_bytes = work.trainable * (3 * dt.master + 2 * states)
    if setup.splits_layers:
        parts = _split_layers_step(inv, setup, gpu, links, work, stage_bounds, pipeline_microbatches)
    else:
        parts = _data_parallel_step(_Model(inv, setup, dt, lora), setup, gpu, links, work)
    step = parts.compute_s + parts.exposed_comm_s + parts.optimizer_s
    return StepTime(setup, parts.tokens_per_step, model_flops, hw_flops, parts.compute_s, parts.comm_s,
                    parts.exposed_comm_s, parts.optimizer_s, step, peak, parts.comm_bytes, parts.note)


@dataclass
class _Work:
    """What one micro-batch asks of a GPU, before any parallelism."""

    micro_tokens: int
    micro_s: float  # its compute, the whole model on one GPU
    trainable: int
    overlap: float = OVERLAP
    reduce_bytes: int | None = None  # of a reduced gradient element, where not the master weights' size
    optimizer_bytes: float = 0.0  # memory traffic of the optimizer update over every trainable weight


@dataclass
class _Parts:
    tokens_per_step: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    comm_bytes: dict[str, float]
    note: str


def _split_layers_step(inv: ModelInventory, setup: Setup, gpu: Gpu, links: Links, work: _Work,
                       stage_bounds: tuple[tuple[int, int], ...], microbatches: int) -> _Parts:
    """MP and PP: stages of whole layers; one batch, no data parallelism; hand-overs not overlapped."""
    world, accum = setup.world_size, setup.gradient_accumulation_steps
    bounds = stage_bounds or _even_stages(inv.num_layers, world)
    stages = len(bounds)
    handover = work.micro_tokens * inv.hidden_size * dtypes(setup).residual * 2  # activations on, gradients back
    comm = accum * (stages - 1) * handover / links.intra.bytes_per_s
    optimizer_s = work.optimizer_bytes / stages / memory_rate(gpu)  # each stage updates its own layers
    if not setup.strategy.pipelined:
        compute = accum * work.micro_s  # the stages run one after another
        idle = world - stages
        note = f"one of {world} GPUs computes at a time" + (
            f" ({idle} {'holds' if idle == 1 else 'hold'} no layers)" if idle else "")
    else:
        per_turn = _stage_share(inv, bounds) * work.micro_s / microbatches  # the slowest stage sets the pace
        compute = accum * (microbatches + stages - 1) * per_turn
        bubble = (stages - 1) / (microbatches + stages - 1)
        note = f"pipeline bubble {bubble:.0%} ({stages} stages, {microbatches} micro-batches)"
    return _Parts(work.micro_tokens * accum, compute, comm, comm, optimizer_s,
                  {"intra": accum * (stages - 1) * handover}, note)


def _data_parallel_step(model: _Model, setup: Setup, gpu: Gpu, links: Links, work: _Work) -> _Parts:
    """One GPU, DDP and FSDP: every GPU computes its own micro-batches; communication partly hidden."""
    world, accum = setup.world_size, setup.gradient_accumulation_steps
    traffic = (_Traffic() if not setup.strategy.data_parallel
               else _data_parallel_traffic(model, setup, links, work.reduce_bytes))
    compute = accum * work.micro_s
    comm = accum * traffic.per_microbatch_s + traffic.per_step_s
    # The per-step collective (all-reduce, reduce-scatter) runs in the last micro-batch's backward.
    exposed = ((accum - 1) * exposed_s(traffic.per_microbatch_s, work.micro_s, work.overlap)
               + exposed_s(traffic.per_microbatch_s + traffic.per_step_s, work.micro_s, work.overlap))
    if setup.offload_params:
        kind = "fused" if setup.optimizer == "adamw_torch_fused" else "unfused"
        optimizer_s = (work.trainable / setup.num_nodes * CPU_OPTIMIZER_BYTES_PER_PARAM[kind]  # its GPUs' shards
                       / HOST_MEMORY_BYTES_PER_S[gpu.host])
        note = f"CPU optimizer step {optimizer_s:.1f} s"
        if optimizer_s > compute:
            note += ": more tokens per step (micro-batch, accumulation) spread it thinner"
    else:
        shard = 1
        if setup.strategy.shards_parameters and setup.sharding_strategy != "NO_SHARD":
            shard = setup.num_gpus if setup.sharding_strategy == "HYBRID_SHARD" else world
        optimizer_s = work.optimizer_bytes / shard / memory_rate(gpu)
        note = f"communication {exposed / (compute + exposed):.0%} of the step" if comm else ""
    data_parallel = world if setup.strategy.data_parallel else 1
    return _Parts(work.micro_tokens * accum * data_parallel, compute, comm, exposed, optimizer_s,
                  {k: v for k, v in traffic.bytes.items() if v}, note)


def _even_stages(layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    stages = min(stages, layers)
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    return tuple((cuts[i], cuts[i + 1]) for i in range(stages))


SECONDS_PER_YEAR = 365.25 * 86400


def duration(seconds: float) -> str:
    """``seconds`` as people read a duration: 950 ms, 42 s, 12 min, 3.5 h, 4.2 d, 2.7 y; at most 10 characters, so
    a table's time column keeps its width however long the job."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 100:
        return f"{seconds:.3g} s"
    if seconds < 100 * 60:
        return f"{seconds / 60:.3g} min" if seconds < 600 else f"{seconds / 60:.0f} min"
    if seconds < 72 * 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds < SECONDS_PER_YEAR:
        return f"{seconds / 86400:.3g} d"
    return f"{seconds / SECONDS_PER_YEAR:.3g} y"


@dataclass(frozen=True)
class DataTokens:
    """The tokens one pass over a data set trains on, and how they were counted."""

    tokens: int
    rows: int = 0
    exact: bool = True  # counted with the model's tokenizer (else about 4 characters per token)
    source: str = ""
    held_out: int = 0  # rows eval_split_ratio holds out of the file for evaluation (not in ``rows``)

    def describe(self) -> str:
        if not self.rows:
            return f"{self.tokens:,} tokens"
        how = ("the model's tokenizer" if self.exact else "about 4 characters per token, approximate: a model "
               "folder's tokenizer.json, or one 'hf download ID tokenizer.json' puts in the cache, counts exactly")
        held = (f"; eval_split_ratio holds out {self.held_out:,} more rows for evaluation, not trained on (their "
                f"tokens taken at the rows' mean)") if self.held_out else ""
        return f"{self.tokens:,} tokens in {self.rows:,} rows of {self.source} ({how}{held})"

    def without_eval_rows(self, held: int) -> DataTokens:
        """What training takes of a file that ``shardtune train`` splits itself (no eval split of its own), ``held``
        of its rows held out for evaluation (``DataConfig.rows_held_out``); their tokens are taken at the rows' mean
        (which rows go depends on the seed)."""
        if not held:
            return self
        kept = self.rows - held
        return replace(self, tokens=round(self.tokens * kept / self.rows), rows=kept, held_out=held)


CHARS_PER_TOKEN = 4  # English text with a Llama-style BPE vocabulary: a rough figure, shown as approximate


def _row_text(value) -> str:
    """Every string in a row (messages' roles and contents, prompt and completion, text), one per line."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return ""
    return "\n".join(t for t in (_row_text(v) for v in value) if t)


def _row_format(row, text_field: str, data_format: str) -> str | None:
    """The format the trainer reads ``row`` in: ``data_format`` where given, else the one its columns say (None
    where they say none)."""
    from shardtune.data.formats import detect_format

    if data_format != "auto":
        return data_format
    try:
        return detect_format(row, text_field) if isinstance(row, dict) else None
    except UsageError:
        return None


def _read_text(row, fmt: str | None, text_field: str, alpaca_as_chat: bool) -> str:
    """What of ``row`` the trainer tokenises in format ``fmt``: its example as data/formats.py's to_example makes it
    (a chat's roles and contents and tools, a prompt and its completion, the Alpaca prompt around its fields, the
    text field). A column it does not read (an id, a source, UltraChat's prompt that its messages repeat) trains no
    token; a row of no known format, or one the trainer would refuse, is counted whole."""
    from shardtune.data.formats import to_example
    from shardtune.data.readers import BadRow

    if not isinstance(row, dict) or fmt is None:
        return _row_text(row)
    try:
        example = to_example(row, "", fmt, text_field, alpaca_as_chat)
    except (BadRow, UsageError):
        return _row_text(row)
    return _row_text([example["messages"], example["tools"], example["prompt"], example["completion"]])


def _tokenizer_file(model: str) -> Path | None:
    """The fast tokenizer of a local model folder (or of the folder of its config.json), if it has one; of a hub
    model (a catalog model's by its Hugging Face id) where the local Hugging Face cache holds it."""
    path = Path(model).expanduser()
    if path.exists():
        folder = path if path.is_dir() else path.parent
        return folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None
    from shardtune import catalog
    from shardtune.hub import cached_config_file, looks_like_local_path

    if looks_like_local_path(model):
        return None
    name = catalog.canonical(model)
    ids = [model] + ([catalog.metadata(name).get("hf_id") or ""] if name in catalog.names() else [])
    return next(filter(None, (cached_config_file(i, "tokenizer.json") for i in dict.fromkeys(ids) if "/" in i)),
                None)


def count_data_tokens(data: str, model: str, seq_len: int, text_field: str = "text",
                      data_format: str = "auto", alpaca_as_chat: bool = False) -> DataTokens:
    """Tokens of one pass over the data file ``data``, each row cut at ``seq_len`` as the trainer truncates it,
    counting only what the trainer reads in the rows' format (``data_format``, or the one each row's columns say;
    ``text_field`` is its dataset_text_field; ``alpaca_as_chat``: Alpaca rows go through a named chat template,
    DataConfig.alpaca_as_chat).

    With a local model folder holding ``tokenizer.json`` the rows are tokenised by it (the ``tokenizers`` library,
    no torch); otherwise about 4 characters make a token, which the result says is approximate. A chat template's
    own tokens are not counted (its roles are)."""
    from shardtune.data.readers import BadRow, iter_file
    from shardtune.hub import EXTENSIONS, data_file_kind

    path = Path(data).expanduser()
    if path.is_dir():  # shardtune train's dataset_name may be one; its files may be splits
        raise UsageError(f"--data {data}: a folder, not a data file; give its training file (the one file whose "
                         f"rows you train on), or the token count with --tokens N")
    if not path.exists():
        raise UsageError(f"--data {data}: no such file; check the path, or give the token count with --tokens N")
    if not path.is_file() or data_file_kind(path) is None:
        raise UsageError(f"--data {data}: not a data file; give a {', '.join(EXTENSIONS)} file, or the token "
                         f"count with --tokens N")
    texts = [_read_text(row, _row_format(row, text_field, data_format), text_field, alpaca_as_chat)
             for _, row in iter_file(path) if not isinstance(row, BadRow)]
    if not texts:
        raise UsageError(f"--data {data}: no readable rows in it; give the file you will train on, or --tokens N")
    tokenizer_file = _tokenizer_file(model)
    if tokenizer_file is None:
        lengths = [math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts]
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    return DataTokens(sum(min(n, seq_len) for n in lengths), len(texts), tokenizer_file is not None, path.name)
