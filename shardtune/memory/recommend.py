"""Which setup to use: the decision people know, made with the estimator's numbers.

If the model, its gradients and optimizer states fit on one GPU, replicate it with DDP (fastest: one all-reduce per
step). Otherwise shard with FSDP, preferring the variant that communicates least and still fits (SHARD_GRAD_OP keeps
layers gathered from forward to backward; HYBRID_SHARD keeps all-gathers inside a node), then FULL_SHARD, then CPU
offload (slowest: every step crosses PCIe). Where full fine-tuning cannot fit, LoRA, then QLoRA. The micro-batch is
the largest that fits: the "start at batch 1 and grow until OOM" advice, done by the estimator instead of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.memory.formula import Breakdown, estimate
from shardtune.memory.hardware import Gpu
from shardtune.memory.inventory import ModelAnalysis
from shardtune.memory.setup import Setup

MAX_BATCH = 4096


@dataclass
class Recommendation:
    setup: Setup
    breakdown: Breakdown
    fits: bool
    max_batch_size: int
    reason: str
    suggestions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        s = self.setup
        return {
            "fits": self.fits,
            "method": s.method,
            "strategy": s.strategy,
            "sharding_strategy": s.sharding_strategy if s.strategy == "fsdp" else None,
            "offload_params": s.offload_params,
            "gradient_checkpointing": s.gradient_checkpointing,
            "num_gpus": s.num_gpus,
            "num_nodes": s.num_nodes,
            "batch_size": s.batch_size,
            "max_batch_size": self.max_batch_size,
            "reason": self.reason,
            "suggestions": self.suggestions,
        }


def evaluate(analysis: ModelAnalysis, setup: Setup) -> Breakdown:
    """Estimate ``setup`` for the analysed model (LoRA counts looked up when the method needs them)."""
    lora = analysis.lora(setup.lora_r, setup.lora_target_modules) if setup.uses_lora else None
    return estimate(analysis.inventory, setup, lora)


def candidates(base: Setup) -> list[Setup]:
    """The parallel setups worth comparing for ``base``'s GPU count, in order of preference when they fit."""
    if base.world_size == 1:
        return [base.with_(strategy="single", offload_params=False),
                base.with_(strategy="fsdp", sharding_strategy="FULL_SHARD", offload_params=True)]
    fsdp = base.with_(strategy="fsdp", offload_params=False)
    out = [base.with_(strategy="ddp", offload_params=False), fsdp.with_(sharding_strategy="SHARD_GRAD_OP")]
    if base.num_nodes > 1:
        out.append(fsdp.with_(sharding_strategy="HYBRID_SHARD"))
    out += [fsdp.with_(sharding_strategy="FULL_SHARD"), fsdp.with_(sharding_strategy="FULL_SHARD", offload_params=True),
            base.with_(strategy="mp", offload_params=False)]
    return out


def max_batch_size(analysis: ModelAnalysis, setup: Setup, gpu: Gpu) -> int:
    """The largest per-device micro-batch that fits ``gpu`` (0 when even batch 1 does not)."""

    def fits(b: int) -> bool:
        return evaluate(analysis, setup.with_(batch_size=b)).fits(gpu.memory_bytes)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH + 1)
    while hi - lo > 1:  # lo fits, hi does not (or is past the search limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


_WHY = {
    "single": "it fits on the one GPU",
    "ddp": "the model, gradients and optimizer states fit on one GPU, so DDP replicates them and only all-reduces "
           "gradients (fastest)",
    "SHARD_GRAD_OP": "a full replica does not fit one GPU; sharding gradients and optimizer states (ZeRO-2) does, "
                     "and keeping layers gathered from forward to backward saves one all-gather per layer",
    "HYBRID_SHARD": "sharding inside each node and replicating across nodes fits, and keeps the all-gathers on the "
                    "fast intra-node links",
    "FULL_SHARD": "only sharding parameters too (ZeRO-3) fits: each layer is gathered just before it runs",
    "offload": "even fully sharded it does not fit in GPU memory; CPU offload keeps parameters, gradients and "
               "optimizer states in host RAM (slow: every step crosses PCIe)",
    "mp": "naive model parallel fits, but only one GPU works at a time",
}


def _why(setup: Setup) -> str:
    if setup.strategy == "fsdp":
        return _WHY["offload"] if setup.offload_params else _WHY[setup.sharding_strategy]
    return _WHY[setup.strategy]


def recommend(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> Recommendation:
    """The preferred setup that fits ``gpu`` at ``base``'s batch size, or the closest one and what would fit."""
    options = [s for s in candidates(base) if s.strategy != "mp"]  # MP is shown, never preferred over FSDP
    for setup in options:
        breakdown = evaluate(analysis, setup)
        if breakdown.fits(gpu.memory_bytes):
            biggest = max_batch_size(analysis, setup, gpu)
            reason = f"{setup.label()}: {_why(setup)}."
            if setup.uses_lora or setup.method == "full":
                reason += f" Micro-batch up to {biggest} fits (at sequence length {setup.seq_len})."
            return Recommendation(setup, breakdown, True, biggest, reason)
    # Nothing fits as asked: show the least memory-hungry setup and say what would fit.
    smallest = min((evaluate(analysis, s) for s in options), key=lambda b: b.total)
    return Recommendation(smallest.setup, smallest, False, 0,
                          f"Nothing fits {gpu.label or gpu.name} with {base.method} at batch {base.batch_size}.",
                          what_would_fit(analysis, base, gpu))


def what_would_fit(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> list[str]:
    """Changes that make it fit, each with the per-GPU total it leads to, cheapest change first."""
    out = []

    def first_fit(setups: list[Setup]) -> tuple[Setup, Breakdown] | None:
        for s in setups:
            b = evaluate(analysis, s)
            if b.fits(gpu.memory_bytes):
                return s, b
        return None

    def gib(b: Breakdown) -> str:
        return f"{(b.total + b.cuda_context) / 2**30:.1f} GiB"

    if base.batch_size > 1 and (hit := first_fit(candidates(base.with_(batch_size=1)))):
        out.append(f"batch size 1 with {hit[0].label()} ({gib(hit[1])}); keep the global batch with "
                   f"--gradient-accumulation-steps {base.batch_size * base.gradient_accumulation_steps}")
    if not base.gradient_checkpointing and (hit := first_fit(candidates(base.with_(gradient_checkpointing=True)))):
        out.append(f"--gradient-checkpointing with {hit[0].label()} ({gib(hit[1])})")
    methods = {"full": ("lora", "qlora"), "lora": ("qlora",), "qlora": ()}[base.method]
    for method in methods:
        if hit := first_fit(candidates(base.with_(method=method))):
            out.append(f"--method {method} with {hit[0].label()} ({gib(hit[1])})")
            break
    if hit := _more_gpus(analysis, base, gpu):
        out.append(hit)
    return out or ["nothing within 4096 GPUs of this size: pick a smaller model or a GPU with more memory"]


def _more_gpus(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> str | None:
    per_node = max(base.num_gpus, 8) if base.world_size > 1 else 8
    world = 2
    while world <= 4096:
        gpus, nodes = (world, 1) if world <= per_node else (per_node, world // per_node)
        setup = base.with_(strategy="fsdp", sharding_strategy="FULL_SHARD", num_gpus=gpus, num_nodes=nodes,
                           offload_params=False)
        if world > base.world_size:
            b = evaluate(analysis, setup)
            if b.fits(gpu.memory_bytes):
                where = f"{gpus} GPUs" if nodes == 1 else f"{nodes} nodes x {gpus} GPUs"
                return f"{where} with FSDP FULL_SHARD ({(b.total + b.cuda_context) / 2**30:.1f} GiB per GPU)"
        world *= 2
    return None
