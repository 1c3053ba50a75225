"""Exact per-GPU memory of a training step: shardtune's own step run on fake tensors, every allocation counted.

The model is built by the trainer's own functions (``Precision``, ``resize_for_tokenizer``, ``apply_lora``,
``make_plan``, ``parallelize``, ``build_optimizer``) and one global batch goes through ``train_step``, the step
``shardtune train`` runs, under PyTorch's ``FakeTensorMode``: tensors carry shapes, dtypes and storages but no data,
so a 70B model costs no memory. Collectives go to the ``fake`` process group at the requested world size, so
FSDP2 shards, gathers and reduce-scatters exactly as on rank 0 of the real job. PyTorch's trackers
(``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise) attribute each live storage to a category and record the
peak, overall and per module. Two steps run, so the peak includes the optimizer states that AdamW creates lazily.

What fake tensors cannot know is data: host-side scalars (``.item()`` of token counts, the loss, the gradient norm)
read as 1 here. They steer no allocation in ``train_step``; anything else that needs data stops the trace with
:class:`TraceUnsupported`, naming the operation, and the caller falls back to the analytic formula, saying so.

The same function runs in real mode (``fake=False``) on the CPU with the same tracker: the test that the fake
trace matches a real step's measured peak compares the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.config import TrainConfig
from shardtune.strategies import NO
from shardtune.memory.allocator import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, CachingAllocatorModel
from shardtune.memory.trace_tracker import (AllocationLog, GradientsSummedInPlace, dropped_graphs_freed,
                                            fresh_module_stats_per_micro_batch, make_tracker, module_peaks,
                                            peak_breakdown, track_inputs)

if TYPE_CHECKING:
    from shardtune.dist import DistInfo
    from shardtune.train.model import Precision
    from shardtune.train.plan import Plan

log = logging.getLogger("shardtune")

class TraceUnsupported(RuntimeError):
    """Fake tensors could not follow the step; ``op`` names the operation and ``phase`` where it ran."""

    def __init__(self, op: str, phase: str, detail: str = "") -> None:
        self.op, self.phase = op, phase
        super().__init__(f"fake tensors cannot follow {op} while {phase}" + (f" ({detail})" if detail else ""))


@dataclass
class TraceResult:
    """Per-GPU memory of one rank over the traced steps, in bytes."""

    peak_bytes: int  # the most tensor bytes alive at once (what torch.cuda.max_memory_allocated reports)
    categories: dict[str, int]  # at the peak; they add up to peak_bytes
    modules: list[tuple[str, int]]  # (module, peak while it ran) for the last step
    world_size: int
    strategy: str  # NO | DDP | FSDP (and the sharding strategy)
    fake: bool
    device: str  # the device the step was modelled for (cuda: fused AdamW, as the trainer picks on a GPU)
    steps: int
    seconds: float
    parameters: int
    trainable_parameters: int
    notes: list[str] = field(default_factory=list)
    # target_device cuda: the traced allocations replayed through a model of PyTorch's CUDA caching allocator, the
    # prediction of torch.cuda.max_memory_reserved (what the job holds from the GPU, CUDA context excluded)
    reserved_bytes: int | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["modules"] = [{"module": m, "peak_bytes": b} for m, b in self.modules]
        return out


def held_bytes(result: TraceResult | dict) -> int:
    """What the traced job holds per GPU: the replayed reserved memory where there is one (a GPU target), else
    the tensors' peak. ``result`` is a ``TraceResult`` or its ``to_dict()``."""
    if isinstance(result, TraceResult):
        return result.reserved_bytes or result.peak_bytes
    return int(result.get("reserved_bytes") or result["peak_bytes"])


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The ``fake`` backend at ``world_size`` (rank 0): collectives cost nothing and move no data."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; run the trace in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _HostScalars(TorchDispatchMode):
    """Answers ``.item()`` on a fake tensor with 1 (fake tensors hold no values); every other op passes through.

    One is a value under which ``train_step`` takes its ordinary path: a finite loss and gradient norm, and AdamW's
    step counts (its bias correction divides by ``1 - beta ** step``) are positive.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        return func(*args, **(kwargs or {}))


def _grad_scaler(fsdp: bool, fake: bool):
    """The trainer's fp16 loss scaler; under fake tensors its overflow check reads "no overflow".

    The scaler steps the optimizer only when the summed ``found_inf`` flags are 0, which no fake value can say, so
    the fake run steps unconditionally. A small initial scale keeps the real-tensor check from skipping its steps on
    overflow too (the scale changes no allocation; the trainer starts from the default 2**16 and backs off).
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler("cpu", init_scale=16.0) if fsdp else torch.amp.GradScaler("cpu", init_scale=16.0)
    if fake:
        scaler._maybe_opt_step = lambda optimizer, optimizer_state, *args, **kwargs: optimizer.step(*args, **kwargs)
    return scaler


@contextlib.contextmanager
def _swappable_fake_parameters(fake_mode) -> Iterator[None]:
    """Let ``Module.to`` cast fake parameters (PEFT casts its adapters to the base layer's dtype).

    ``Module.to`` on a fake parameter swaps tensors, and ``torch.utils.swap_tensors`` refuses a tensor with a weak
    reference; the fake converter's memo holds one to every parameter made under fake mode. The memo only matters
    inside one real-to-fake conversion (no conversion is running at a swap), so it is emptied just before each swap.
    """
    if fake_mode is None:
        yield
        return
    import torch.utils

    memo = fake_mode.fake_tensor_converter.meta_converter.tensor_memo
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        memo.clear()
        original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def _model_config(cfg: TrainConfig):
    """The transformers config of ``model_name_or_path``: a model folder, a config.json, a catalog name, or the
    Hugging Face id of a catalog model (what ``--emit-config`` writes), read from the catalog without the hub."""
    from transformers import AutoConfig

    from shardtune.gguf_source import find_gguf
    from shardtune.memory.inventory import build_config, load_config_dict

    model = cfg.model.model_name_or_path
    path = Path(model).expanduser()
    if path.is_dir() and not find_gguf(path):  # a GGUF's config is read from its metadata below
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    name, config_dict = load_config_dict(model)
    return build_config(config_dict, name)


def _vocab_and_pad(cfg: TrainConfig, config) -> tuple[int, int, tuple[int, ...]]:
    """The tokenizer's length, pad id and added token ids as the trainer sees them (the model's vocabulary, and
    none added, without a tokenizer)."""
    from shardtune.memory.inventory import tokenizer_facts

    if facts := tokenizer_facts(cfg.model.model_name_or_path, cfg):
        return facts
    pad = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    return config.vocab_size, pad, ()


def _micro_batches(cfg: TrainConfig, pad_id: int,
                   target_tokens: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """A global batch of this rank at its largest: every row ``max_seq_len`` tokens, every token a target, or
    ``target_tokens[i]`` targets in micro-batch ``i`` (what a real step had). Each carries its ``target_index``,
    computed here from the real labels: the head's work follows the targets, and fake labels hold no values."""
    from shardtune.data import Collator
    from shardtune.train.loss import TARGET_INDEX, target_index
    from shardtune.train.model import attn_implementation

    seq_len, rows = cfg.data.max_seq_len, cfg.run.per_device_train_batch_size
    # The mask of the configured attention: asked as for a CPU, the flash-attention choice is never made here.
    collator = Collator(pad_id, attn_implementation=attn_implementation(cfg.model, torch.device("cpu"),
                                                                        torch.float32))
    row = {"input_ids": [pad_id + 1 if pad_id == 0 else 0] * seq_len, "labels": [1] * seq_len, "seq_lens": [seq_len]}
    batches = []
    for i in range(cfg.run.gradient_accumulation_steps):
        batch = collator([row] * rows)
        if target_tokens is not None:
            batch["labels"] = _labels_with_targets(rows, seq_len, target_tokens[i])
        batch[TARGET_INDEX] = target_index(batch["labels"])
        batches.append(batch)
    return batches


def _labels_with_targets(rows: int, seq_len: int, count: int) -> torch.Tensor:
    """Labels [rows, seq_len] with ``count`` targets after the shift by one (row by row, from the first)."""
    from shardtune.data.encode import IGNORE

    labels = torch.full((rows, seq_len), IGNORE, dtype=torch.long)
    for r in range(rows):
        take = min(count, seq_len - 1)
        labels[r, 1:1 + take] = 1
        count -= take
    return labels


@contextlib.contextmanager
def _phase(name: str, fake: bool) -> Iterator[None]:
    """Turn failures under fake tensors into TraceUnsupported naming the operation (or the error) and the phase.

    Besides the fake-tensor exceptions, an op's shape check can fail on fake inputs where real ones pass (and
    the other way round cannot be told apart here), so any RuntimeError of a fake run is reported, not raised.
    """
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedOperatorException)

    try:
        yield
    except (UnsupportedOperatorException, DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise TraceUnsupported(str(getattr(exc, "func", exc)), name, type(exc).__name__) from exc
    except RuntimeError as exc:
        if not fake or isinstance(exc, TraceUnsupported):
            raise
        raise TraceUnsupported(_failing_call(exc), name,
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


_NAMED_PLACES = ("torch/optim/", "torch/nn/", "torch/distributed/", "transformers/", "peft/", "bitsandbytes/",
                 "shardtune/")


def _failing_call(exc: BaseException) -> str:
    """The deepest call of the traceback in a library a user knows (not torch's internal checks), as file:function."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    # The trace's own dispatch modes and the trackers sit under every op: they are not where it failed.
    named = [f for f in frames if any(place in f.co_filename for place in _NAMED_PLACES)
             and "shardtune/memory/trace" not in f.co_filename and "distributed/_tools" not in f.co_filename]
    named = named or frames
    code = named[-1]
    path = code.co_filename.replace("\\", "/")
    short = "/".join(path.split("/")[-2:])
    return f"{code.co_name} ({short})"


def trace_training_step(cfg: TrainConfig, world_size: int, *, num_nodes: int = 1, fake: bool = True,
                        target_device: str = "cuda", steps: int = 2,
                        target_tokens: list[int] | None = None) -> TraceResult:
    """Run ``steps`` training steps of the job ``cfg`` describes as rank 0 of ``world_size`` and measure memory.

    ``fake``: on fake tensors (any model size, no memory); otherwise on real CPU tensors (small models, to check
    the fake trace). ``target_device``: the GPU job (``cuda``: fused AdamW) or a CPU one (``cpu``: foreach AdamW).
    Tensors live on the CPU either way; the trace counts bytes, not where they are. ``target_tokens``: the
    targets of each micro-batch (the head projects only those); default every token.
    """
    from shardtune.dist import DistInfo
    from shardtune.train.build import plan_for
    from shardtune.train.model import Precision

    if world_size < 1 or world_size % num_nodes:
        raise ValueError(f"world size {world_size} must be a positive multiple of num_nodes {num_nodes}")
    started = time.perf_counter()
    info = DistInfo(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size // num_nodes,
                    device=torch.device("cpu"))
    cfg = cfg.with_4bit_dtypes()  # a --dry_run's config has not been through the trainer's decide_precision
    precision = Precision(cfg.mixed_precision, pure_bf16=cfg.model.pure_bf16)
    plan, ddp = _traceable_plan(plan_for(cfg, info, precision), world_size)
    # bitsandbytes' Params4bit cannot wrap a fake tensor: trace the QLoRA job with its 4-bit layers as packed
    # stand-ins (trace_qlora.PackedNF4Linear); for DoRA with its base in bf16, and the formula's NF4 bytes put in
    # place of the quantised weights afterwards (_add_nf4_bytes).
    nf4_fallback = fake and cfg.lora.use_4bit_quantization
    job, packs = cfg, None  # what the stand-in stands in for; what packs its 4-bit layers
    if nf4_fallback:
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, use_4bit_quantization=False))
        packs = _packs_4bit_layers(job)
    run = _run_steps(cfg, plan, precision, info, fake=fake, target_device=target_device, steps=steps, job=job,
                     target_tokens=target_tokens, prepare_base=packs)
    notes: list[str] = []
    if ddp:
        _add_ddp_buckets(run, notes)
    saving = 0
    if packs is not None:
        notes.append("QLoRA: bitsandbytes.nn.Params4bit (a tensor subclass) cannot wrap a fake tensor, so each "
                     "4-bit layer was traced as its NF4 bytes in a bf16 parameter (what FSDP shards and gathers) "
                     "and a matmul that dequantises it for its forward and its backward")
    elif nf4_fallback:
        saving = _add_nf4_bytes(run, cfg, plan, info, notes)
    reserved = None if run.log is None else _replayed_reserved(run, steps, saving, notes)
    if fake:
        notes.append("host-side scalars (token counts, loss, gradient norm) read as 1 under fake tensors, and an "
                     "fp16 loss scaler finds no overflow: the step takes its ordinary path")
    strategy = plan.strategy.name + (f" {plan.sharding}" if run.fsdp else "")
    return TraceResult(peak_bytes=run.peak, categories=run.categories, modules=run.modules, world_size=world_size,
                       strategy=strategy, fake=fake, device=target_device, steps=steps,
                       seconds=time.perf_counter() - started, parameters=run.total, trainable_parameters=run.trainable,
                       notes=notes, reserved_bytes=reserved)


class _FusedDropout(torch.autograd.Function):
    """What CUDA's fused dropout holds: its output and, for backward, a bool mask. CUDA draws the mask inside the
    kernel; the values do not change memory, so the trace keeps every element (no random tensor to make)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, p: float) -> torch.Tensor:
        ctx.scale = 1 / (1 - p)
        ctx.save_for_backward(torch.ones_like(input, dtype=torch.bool))
        return input * ctx.scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None


@contextlib.contextmanager
def _dropout_as_on(target_device: str) -> Iterator[None]:
    """``F.dropout`` as the target device runs it. On a GPU ATen takes its fused kernel (native_dropout), which keeps
    a bool mask for backward; on CPU tensors, the trace's fake ones included, dropout multiplies by a mask in the
    input's dtype and keeps that: 4 bytes a value instead of 1 for LoRA's fp32 adapter inputs."""
    import torch.nn.functional as F

    if target_device != "cuda":
        yield
        return
    plain = F.dropout

    def fused(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or inplace or not 0 < p < 1 or input.numel() == 0:
            return plain(input, p, training, inplace)
        return _FusedDropout.apply(input, p)

    F.dropout = fused
    try:
        yield
    finally:
        F.dropout = plain


def _traceable_plan(plan: Plan, world_size: int) -> tuple[Plan, bool]:
    """The plan the trace runs, and whether it is DDP traced as one replica; TraceUnsupported for the setups the
    trace cannot follow (a split model, host-resident shards)."""
    if plan.strategy.splits_layers:
        raise TraceUnsupported(f"{plan.strategy.label} (distributed_type {plan.strategy})", "planning",
                               "the trace follows the data-parallel step: one process, DDP or FSDP")
    if plan.strategy.shards_parameters and plan.offload:
        # Every traced tensor lives on one device, so host-resident shards cannot be told from GPU memory.
        raise TraceUnsupported("FSDP CPU offload (fsdp_offload_params)", "planning",
                               "the trace cannot separate host RAM from GPU memory")
    ddp = plan.strategy.replicates and world_size > 1
    if ddp:
        # DDP's C++ reducer reads parameter data when it is built, which fake tensors do not have: trace the
        # replica as one process and add the reducer's gradient buckets (one copy of the trainable gradients).
        plan = dataclasses.replace(plan, strategy=NO)
    return plan, ddp


@dataclass
class _Run:
    """What the traced steps left: the model, the peak and where it was, every allocation (a GPU target)."""

    model: torch.nn.Module
    fsdp: bool
    peak: int
    categories: dict[str, int]
    modules: list[tuple[str, int]]
    log: AllocationLog | None
    total: int
    trainable: int


def _run_steps(cfg: TrainConfig, plan: Plan, precision: Precision, info: DistInfo, *, fake: bool,
               target_device: str, steps: int, job: TrainConfig, target_tokens: list[int] | None,
               prepare_base: Callable[[torch.nn.Module], None] | None) -> _Run:
    """Build the job as the trainer does and run ``steps`` of ``train_step`` under the tracker (the last one).
    ``cfg`` may be a stand-in for ``job`` (QLoRA without its 4-bit weights under fake tensors), ``prepare_base``
    what build_model runs on its base (the packing of its 4-bit layers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardtune.train.build import build_model
    from shardtune.train.model import keep_lora_input_dtype
    from shardtune.train.optim import build_optimizer, build_scheduler
    from shardtune.train.step import StepContext, train_step

    config = _model_config(cfg)
    vocab_size, pad_id, added_token_ids = _vocab_and_pad(cfg, config)
    real_batches = _micro_batches(cfg, pad_id, target_tokens)
    fsdp = plan.strategy.shards_parameters
    fake_mode = FakeTensorMode() if fake else contextlib.nullcontext()
    if fake:
        # PEFT deep-copies each module of lora_modules_to_save. Tensor.__deepcopy__ copies a fake tensor's __dict__,
        # its fake mode with it, and tensors of two fake modes cannot meet: the copies must stay in this one.
        fake_mode.__deepcopy__ = lambda memo: fake_mode
    with fake_process_group(info.world_size) if fsdp else contextlib.nullcontext(), \
            torch.random.fork_rng(devices=[]), fake_mode, _dropout_as_on(target_device):
        with _phase("building the model", fake), _swappable_fake_parameters(fake_mode if fake else None):
            # The trainer's own model building, with initialised weights (their values do not change memory).
            model, runner, trainable, total = build_model(cfg, plan, precision, info, vocab_size, weights="init",
                                                          config=config, stands_in_for=job,
                                                          prepare_base=prepare_base, added_token_ids=added_token_ids)
            if job.lora.use_4bit_quantization and not cfg.lora.use_4bit_quantization and target_device == "cuda":
                # bitsandbytes' 4-bit LoRA layers skip PEFT's input cast under CUDA autocast (peft/tuners/lora/bnb.py)
                keep_lora_input_dtype(model)
        batches = real_batches
        if fake:
            batches = [{k: fake_mode.from_tensor(v) for k, v in b.items()} for b in real_batches]
        with _phase("building the optimizer", fake):  # bitsandbytes' 8-bit maps are made from real values
            optimizer = build_optimizer(model, cfg.optim, torch.device(target_device),
                                        sharded_scaler=plan.sharded_grad_scaler, pure_bf16=precision.pure_bf16)
        scheduler = build_scheduler(optimizer, cfg.optim, max(steps, 1))
        if runner.scaler is not None:  # fp16's loss scaler, in a form fake tensors can run
            runner.scaler = _grad_scaler(fsdp, fake)
        ctx = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, runner=runner, info=info,
                          max_grad_norm=cfg.optim.max_grad_norm, pad_token_id=pad_id)
        # On a GPU each micro-batch is copied to the device when its forward starts: one is there at a time.
        on_device = batches[:1] if target_device == "cuda" else batches
        scalars = _HostScalars() if fake else contextlib.nullcontext()
        # On a GPU, the order of every allocation decides what the caching allocator reserves: log them all.
        log = AllocationLog() if target_device == "cuda" else None
        if log is not None:
            log.add(*model.parameters(), *model.buffers(), *(t for b in on_device for t in b.values()))
        # The first steps are not measured by the tracker: they create the optimizer states (AdamW makes them
        # lazily) and fill DTensor's sharding-propagation cache, whose first run allocates under the trace's own
        # fake mode. A later step holds everything the first one did plus the optimizer states, so its peak is the
        # job's. The allocation log covers every step: the first one shapes the allocator's cache.
        with log or contextlib.nullcontext():
            with scalars, GradientsSummedInPlace():
                for step in range(steps - 1):
                    with _phase(f"running training step {step + 1}", fake):
                        train_step(ctx, batches)
            tracker = make_tracker(model, optimizer, fsdp)
            track_inputs(tracker, fsdp, [t for b in on_device for t in b.values()])
            with fresh_module_stats_per_micro_batch(tracker, model), dropped_graphs_freed(model), tracker, scalars, \
                    GradientsSummedInPlace():
                with _phase(f"running training step {steps}", fake):
                    train_step(ctx, batches)
        peak, categories = peak_breakdown(tracker)
        modules = module_peaks(tracker)
    return _Run(model, fsdp, peak, categories, modules, log, total, trainable)


def _packs_4bit_layers(job: TrainConfig) -> Callable[[torch.nn.Module], None] | None:
    """What build_model runs on the base of a QLoRA job's stand-in (traced without 4-bit weights): its 4-bit
    layers packed at their NF4 size (trace_qlora.pack_linears); None where they cannot be (DoRA)."""
    from shardtune.memory.trace_qlora import pack_linears, packable

    return (lambda model: pack_linears(model, job.lora)) if packable(job.lora) else None


def _add_ddp_buckets(run: _Run, notes: list[str]) -> None:
    buckets = sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad)
    run.categories["ddp_gradient_buckets"] = buckets
    run.peak += buckets
    notes.append("DDP traced as one replica: its C++ reducer cannot be built on fake tensors; its gradient "
                 "buckets (one copy of the trainable gradients) are added from the parameter count")


def _add_nf4_bytes(run: _Run, cfg: TrainConfig, plan: Plan, info: DistInfo, notes: list[str]) -> int:
    """The QLoRA job traced with a bf16 base: its quantised weights' bytes in place of the bf16 ones; returns the
    bytes saved (the reserved memory is adjusted by the same)."""
    from shardtune.memory.trace_qlora import nf4_adjustment

    saving, dequant = nf4_adjustment(run.model, cfg, plan, info)
    key = "params_sharded" if run.fsdp else "params"
    run.categories[key] = run.categories.get(key, 0) - saving
    run.categories["nf4_dequantize_buffer"] = dequant
    run.peak += dequant - saving
    notes.append("QLoRA: bitsandbytes.nn.Params4bit (a tensor subclass) cannot wrap a fake tensor, so the base "
                 "was traced in bf16 and its quantised weights' bytes replaced by the formula's NF4 bytes, plus "
                 "one dequantised weight for the running matmul; FSDP's gathered layer copies are those of the "
                 "bf16 stand-in")
    return saving


def _replayed_reserved(run: _Run, steps: int, nf4_saving: int, notes: list[str]) -> int:
    """Every traced allocation replayed through the caching-allocator model: what the GPU job reserves."""
    extra = list(_ddp_bucket_sizes(run.categories.get("ddp_gradient_buckets", 0)))
    allocator = CachingAllocatorModel()
    for i, nbytes in enumerate([CUBLAS_WORKSPACE_BYTES] * CUBLAS_WORKSPACES + extra):
        allocator.malloc(("before the steps", i), nbytes)
    reserved = allocator.replay(run.log.events).peak_reserved
    if "nf4_dequantize_buffer" in run.categories:
        reserved += run.categories["nf4_dequantize_buffer"] - nf4_saving
    notes.append(f"reserved memory: every allocation of the {steps} traced steps replayed through a model of "
                 f"PyTorch's CUDA caching allocator (default settings, a pool per stream), with {CUBLAS_WORKSPACES} "
                 f"cuBLAS workspaces of {CUBLAS_WORKSPACE_BYTES // 2**20} MiB; "
                 f"{reserved / max(run.peak, 1) - 1:+.1%} over the tensors' peak")
    return reserved


def _ddp_bucket_sizes(total: int) -> Iterator[int]:
    """DDP's gradient buckets for ``total`` bytes: the first of 1 MiB, the others of ``bucket_cap_mb`` (25 MiB)."""
    import torch.distributed as dist

    cap = dist._DEFAULT_FIRST_BUCKET_BYTES
    while total > 0:
        yield min(cap, total)
        total -= cap
        cap = 25 * 2**20


def predict_peak_bytes(cfg: TrainConfig, world_size: int, target_tokens: list[int] | None = None) -> int:
    """The traced per-GPU peak of the job ``cfg`` describes, at ``world_size``: on a GPU the modelled reserved
    memory (what ``torch.cuda.max_memory_reserved`` reports), on the CPU the tensors' peak per process.
    ``target_tokens``: each micro-batch's targets (``trace_training_step``).

    Inside a running distributed job (a process group already exists) the trace runs in a child process, since
    it needs its own fake process group.
    """
    import torch.distributed as dist

    target = "cuda" if torch.cuda.is_available() else "cpu"
    nodes = max(1, cfg.distributed.num_machines)
    if world_size % nodes:
        nodes = 1
    if not dist.is_initialized():
        result = trace_training_step(cfg, world_size, num_nodes=nodes, target_device=target,
                                     target_tokens=target_tokens)
        return held_bytes(result)
    import json
    import subprocess
    import sys
    import tempfile

    from shardtune.config import save_resolved

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        save_resolved(cfg, path)
        out = subprocess.run([sys.executable, "-m", "shardtune.memory.trace", str(path), str(world_size),
                              str(nodes), target, json.dumps(target_tokens)], capture_output=True, text=True)
    if out.returncode != 0:
        # The child's last words say why (a TraceUnsupported message, say); the exit status alone would not.
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(lines[-1] if lines else f"the trace process exited with {out.returncode}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return held_bytes(result)


def _main(argv: list[str]) -> int:
    """``python -m shardtune.memory.trace CONFIG.yaml WORLD_SIZE NUM_NODES DEVICE TARGET_TOKENS``: one JSON line
    (TARGET_TOKENS: a JSON list of each micro-batch's targets, or null)."""
    import json

    from shardtune.config import load_train_config

    cfg = load_train_config([argv[0]])
    result = trace_training_step(cfg, int(argv[1]), num_nodes=int(argv[2]), target_device=argv[3],
                                 target_tokens=json.loads(argv[4]))
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
