"""Which setup to use: the decision people know, made with the estimator's numbers.

If the model, its gradients and optimizer states fit on one GPU, replicate it with DDP (fastest: one all-reduce per
step). Otherwise shard with FSDP, preferring the variant that communicates least and still fits (SHARD_GRAD_OP keeps
layers gathered from forward to backward; HYBRID_SHARD keeps all-gathers inside a node), then FULL_SHARD, then the
same global batch in smaller micro-batches (gradient accumulation), and only then CPU offload (slowest: every step
crosses PCIe) or model parallel (one GPU computes at a time). Where full fine-tuning cannot fit, LoRA, then QLoRA.
The micro-batch is the largest that fits: the "start at batch 1 and grow until OOM" advice, done by the estimator
instead of the GPU.

That order is what measurements usually show (``shardtune bench strategies``; docs/choosing-a-setup.md), but
hardware decides: with ``measured`` (the file ``shardtune bench strategies --out`` writes for the user's own model
and machine), the setups that fit are ranked by the speed measured for their kind instead, and pipeline parallel
joins the candidates when it was measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardtune.config.validation import setup_problems
from shardtune.errors import UsageError
from shardtune.hardware import Gpu
from shardtune.memory.formula import MEASURED_ERROR, Breakdown, estimate
from shardtune.memory.inventory import ModelAnalysis
from shardtune.memory.setup import Setup
from shardtune.strategies import DDP, FSDP, MP, NO, PP, lookup

MAX_BATCH = 4096


@dataclass
class Recommendation:
    setup: Setup
    breakdown: Breakdown
    fits: bool
    max_batch_size: int
    reason: str
    suggestions: list[str] = field(default_factory=list)
    tight: bool = False  # fits, within the estimate's error (Breakdown.tight)

    def to_dict(self) -> dict:
        s = self.setup
        return {
            "fits": self.fits,
            "method": s.method,
            "strategy": s.strategy.name,
            "sharding_strategy": s.sharding_name,
            "offload_params": s.offload_params,
            "gradient_checkpointing": s.gradient_checkpointing,
            "activation_offloading": s.activation_offloading,
            "num_gpus": s.num_gpus,
            "num_nodes": s.num_nodes,
            "batch_size": s.batch_size,
            "gradient_accumulation_steps": s.gradient_accumulation_steps,
            "max_batch_size": self.max_batch_size,
            "tight": self.tight,
            "reason": self.reason,
            "suggestions": self.suggestions,
        }


@dataclass(frozen=True)
class Measured:
    """Tokens/s that ``shardtune bench strategies`` measured per strategy (by its name: MP, PP, DDP, FSDP)."""

    path: str
    tokens_per_s: dict[str, float]
    model: str = ""
    num_processes: int = 0
    device: str = ""
    method: str = ""  # full | lora | qlora of the benchmarked recipe (files before it was recorded: "")

    @classmethod
    def load(cls, path: str | Path) -> "Measured":
        """Read a ``shardtune bench strategies --out`` file; a bad file is a one-line UsageError."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UsageError(f"--measured {path}: no such file; write one with 'shardtune bench strategies "
                             f"RECIPE --out {path}'") from None
        except (OSError, ValueError) as exc:
            raise UsageError(f"--measured {path}: not a JSON file ({exc}); give the file 'shardtune bench "
                             f"strategies --out' wrote") from None
        bad = UsageError(f"--measured {path}: not what 'shardtune bench strategies --out' writes (a list of "
                         f"setups with strategy and tokens_per_s); give that file")
        rows = data.get("results") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise bad
        try:
            # Any case: files written before the strategies were spelled one way name them in lower case.
            speeds = {lookup(r["strategy"]).name: float(r["tokens_per_s"]) for r in rows
                      if isinstance(r, dict) and isinstance(r.get("strategy"), str) and lookup(r["strategy"])
                      and not r.get("error") and r.get("tokens_per_s")}
            meta = data if isinstance(data, dict) else {}
            measured = cls(str(path), speeds, str(meta.get("model") or ""), int(meta.get("num_processes") or 0),
                           str(meta.get("device") or ""), str(meta.get("method") or ""))
        except (TypeError, ValueError):
            raise bad from None
        if not speeds:
            raise UsageError(f"--measured {path}: no setup that ran to completion in it; give the file 'shardtune "
                             f"bench strategies --out' wrote")
        return measured

    def speed(self, setup: Setup) -> float | None:
        """The measured tokens/s of ``setup``'s strategy (FSDP variants share FSDP's; CPU offload was not measured)."""
        if setup.offload_params:
            return None
        return self.tokens_per_s.get(setup.strategy.name)

    @property
    def model_name(self) -> str:
        """The measured model's name: the file gives its size after it ("tiny-llama (4 layers x 256 hidden, 3.2 M
        parameters)")."""
        return self.model.split(" (")[0]

    def measured_another_model(self, model: str) -> bool:
        """Whether the file was measured with a model other than ``model`` (a catalog name or a folder)."""
        return bool(self.model_name) and self.model_name not in (model, Path(model).name)

    def describe(self) -> str:
        ranked = sorted(self.tokens_per_s.items(), key=lambda kv: -kv[1])
        model = f" with {Path(self.model).name or self.model}" if self.model else ""
        where = f" on {self.device}" if self.device else ""
        procs = f", {self.num_processes} processes" if self.num_processes else ""
        return (", ".join(f"{k} {v:,.0f}" for k, v in ranked) +
                f" tokens/s measured{model}{where}{procs} ({self.path})")


def evaluate_setup(analysis: ModelAnalysis, setup: Setup) -> Breakdown:
    """Estimate ``setup`` for the analysed model (LoRA counts looked up when the method needs them)."""
    lora = analysis.lora_of(setup)
    return estimate(analysis.inventory, setup, lora)


def candidates(base: Setup, measured: Measured | None = None, analysis: ModelAnalysis | None = None) -> list[Setup]:
    """The parallel setups worth comparing for ``base``'s GPU count, in order of preference when they fit
    (pipeline parallel too when ``base`` asks for it or ``measured`` has it), without those train would refuse: with
    ``analysis``, MP and PP over more GPUs than the model has decoder layers too."""
    # Each candidate names its own sharding: the base's fsdp_reshard_after_forward would override it.
    plain = base.with_(fsdp_offload_params=False, fsdp_reshard_after_forward=None)
    fsdp = plain.with_(distributed_type=FSDP, fsdp_sharding_strategy="FULL_SHARD")
    if base.world_size == 1:
        return [plain.with_(distributed_type=NO), fsdp.with_(fsdp_offload_params=True)]
    out = [plain.with_(distributed_type=DDP), fsdp.with_(fsdp_sharding_strategy="SHARD_GRAD_OP")]
    if base.num_nodes > 1:
        out.append(fsdp.with_(fsdp_sharding_strategy="HYBRID_SHARD"))
    out += [fsdp, fsdp.with_(fsdp_offload_params=True)]
    if base.num_nodes == 1:  # one process drives the GPUs of its own machine
        out.append(plain.with_(distributed_type=MP))
    # PP asked for is compared too: left out, the recommendation said no setup held a batch the asked PP held.
    pp_wanted = base.strategy.pipelined or bool(measured and PP.name in measured.tokens_per_s)
    if pp_wanted:
        out.append(plain.with_(distributed_type=PP))
    # None that train would refuse: nor MP or PP with a stage that would hold no decoder layer.
    layers = analysis.inventory.num_layers if analysis else None
    return [setup for setup in out if not refusals(setup)
            and not (layers and setup.strategy.leaves_a_stage_empty(setup.world_size, layers))]


def refusals(setup: Setup) -> list[str]:
    """What ``shardtune train`` would refuse of ``setup``'s job (an optimizer FSDP cannot shard, pure bf16 with
    one that loses small updates), as the recipe --emit-config writes it: pipeline parallel with one row per
    pipeline micro-batch unless the job says how many."""
    cfg = setup.config
    if setup.strategy.pipelined:  # one stage per process
        cfg = replace(cfg, distributed=replace(cfg.distributed, pipeline_microbatches=setup.microbatches,
                                               num_processes=setup.world_size))
    return setup_problems(cfg)


def max_batch_size(analysis: ModelAnalysis, setup: Setup, gpu: Gpu, roomy: bool = False) -> int:
    """The largest per-device micro-batch that fits ``gpu`` (with ``roomy``, with more to spare than the estimate's
    error: not ``tight``); 0 when even batch 1 does not."""

    def fits(b: int) -> bool:
        breakdown = evaluate_setup(analysis, setup.with_(per_device_train_batch_size=b))
        return breakdown.fits(gpu.memory_bytes) and not (roomy and breakdown.tight(gpu.memory_bytes))

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


# Why each FSDP sharding strategy (the other strategies' reasons are their registry entries' ``why``).
_SHARDING_WHY = {
    "SHARD_GRAD_OP": "a full replica does not fit one GPU; sharding gradients and optimizer states (ZeRO-2) does, "
                     "and keeping layers gathered from forward to backward saves one all-gather per layer",
    "HYBRID_SHARD": "sharding inside each node and replicating across nodes fits, and keeps the all-gathers on the "
                    "fast intra-node links",
    "FULL_SHARD": "only sharding parameters too (ZeRO-3) fits: each layer is gathered just before it runs",
}
_OFFLOAD_WHY = ("even fully sharded it does not fit in GPU memory; CPU offload keeps parameters, gradients and "
                "optimizer states in host RAM (slow: every step crosses PCIe)")


def _why(setup: Setup) -> str:
    if setup.offload_params:
        return _OFFLOAD_WHY
    if setup.strategy.shards_parameters:
        return _SHARDING_WHY.get(setup.sharding_strategy, setup.strategy.why)
    return setup.strategy.why


# Measured speeds this close count as equal: a benchmark re-run on a busy machine moves them more than that.
MEASURED_TIE = 0.05


def by_measured_speed(options: list[Setup], measured: Measured) -> list[Setup]:
    """``options`` (in the usual order) fastest first by measured tokens/s, unmeasured ones last.

    Speeds within ``MEASURED_TIE`` of the fastest of a band form one band, kept in the usual order: noise must not
    pick a setup that the usual reasons would not.
    """
    ranked = sorted(options, key=lambda s: -(measured.speed(s) or 0.0))  # stable: the usual order among equals
    bands: list[tuple[float, list[Setup]]] = []
    for setup in ranked:
        speed = measured.speed(setup) or 0.0
        if bands and speed >= bands[-1][0] * (1 - MEASURED_TIE):
            bands[-1][1].append(setup)
        else:
            bands.append((speed, [setup]))
    usual = {id(s): i for i, s in enumerate(options)}
    return [s for _, band in bands for s in sorted(band, key=lambda s: usual[id(s)])]


def recommend(analysis: ModelAnalysis, base: Setup, gpu: Gpu, measured: Measured | None = None) -> Recommendation:
    """The preferred setup that fits ``gpu`` at ``base``'s batch size, or the closest one and what would fit.

    Without ``measured``, preferred means the order of ``candidates``, model parallel last (one GPU computes at a
    time: it is recommended only where nothing else fits); with it, the fastest measured kind that fits, then the
    unmeasured ones in that order.
    """
    options = candidates(base, measured, analysis)
    if measured is None:
        options = [s for s in options if not s.splits_layers] + [s for s in options if s.splits_layers]
    else:
        options = by_measured_speed(options, measured)
    for setup in options:
        breakdown = evaluate_setup(analysis, setup)
        if breakdown.fits(gpu.memory_bytes):
            if measured is None and _last_resort(setup) and (
                    smaller := _smaller_micro_batch(analysis, options, gpu, held_by=setup)):
                return smaller
            biggest = max_batch_size(analysis, setup, gpu)
            reason = (f"{setup.label()}: {_why(setup)}." if measured is None
                      else _measured_reason(setup, measured, base, analysis, gpu))
            if setup.uses_lora or setup.method == "full":
                up_to = f"{biggest} or more" if biggest >= MAX_BATCH else f"up to {biggest}"
                reason += f" Micro-batch {up_to} fits (at sequence length {setup.seq_len})."
            return Recommendation(setup, breakdown, True, biggest,
                                  reason + _host_memory(breakdown) + _margin(analysis, breakdown, gpu),
                                  _on_the_gpus(analysis, base, gpu) if _last_resort(setup) else [],
                                  breakdown.tight(gpu.memory_bytes))
    # Nothing fits at the asked micro-batch: a smaller one, on the GPUs, else with a last resort.
    if measured is None and (smaller := _smaller_micro_batch(analysis, options, gpu)
                             or _smaller_micro_batch(analysis, options, gpu, last_resorts=True)):
        return smaller
    # Nothing fits at all: show the least memory-hungry setup and say what would fit.
    smallest = min((evaluate_setup(analysis, s) for s in options), key=lambda b: b.total)
    return Recommendation(smallest.setup, smallest, False, 0,
                          f"Nothing fits {gpu.label or gpu.name} with {base.method} at batch {base.batch_size}.",
                          what_would_fit(analysis, base, gpu))


def _last_resort(setup: Setup) -> bool:
    """CPU offload (every step crosses PCIe) and model parallel (one GPU computes at a time): slower than a smaller
    micro-batch on a setup that keeps its work on the GPUs."""
    return setup.offload_params or setup.splits_layers


def _smaller_micro_batch(analysis: ModelAnalysis, options: list[Setup], gpu: Gpu, last_resorts: bool = False,
                         held_by: Setup | None = None) -> Recommendation | None:
    """The first of ``options`` (in order; the last resorts only with ``last_resorts``) that fits at a smaller
    micro-batch, with the gradient accumulation that keeps the asked global batch (the micro-batch a divisor of the
    rows each GPU takes per optimizer step), at the largest such micro-batch; None where none does. ``held_by``:
    the last resort that holds the asked micro-batch (None: nothing does)."""
    for setup in (s for s in options if _last_resort(s) == last_resorts):
        if hit := _at_smaller_micro_batch(analysis, setup, gpu):
            fitted, breakdown = hit
            rows = setup.batch_size * setup.gradient_accumulation_steps
            held = f"only {held_by.label()} holds it, slower than a smaller one" if held_by else "no setup holds it"
            reason = (f"{fitted.label()} at micro-batch {fitted.batch_size} x {fitted.gradient_accumulation_steps} "
                      f"accumulation steps (the asked {rows} rows per GPU per optimizer step): at micro-batch "
                      f"{setup.batch_size} {held}; {_why(fitted)}.{_host_memory(breakdown)}"
                      f"{_margin(analysis, breakdown, gpu)}")
            return Recommendation(fitted, breakdown, True, max_batch_size(analysis, fitted, gpu), reason,
                                  tight=breakdown.tight(gpu.memory_bytes))
    return None


def _host_memory(breakdown: Breakdown) -> str:
    """What offloading asks of each node's RAM, which the estimate cannot see: said beside the recommendation."""
    if not breakdown.cpu_bytes_per_node:
        return ""
    return (f" It keeps {breakdown.cpu_bytes_per_node / 2**30:,.0f} GiB per node in host RAM: check that each node "
            f"has that much free.")


def _margin(analysis: ModelAnalysis, breakdown: Breakdown, gpu: Gpu) -> str:
    """Where ``breakdown``'s setup fits ``gpu`` within the estimate's error: what it leaves, and the smaller
    micro-batch (same rows per optimizer step) that leaves more than the error; "" where it is not tight."""
    if not breakdown.tight(gpu.memory_bytes):
        return ""
    text = (f" Tight: {breakdown.spare(gpu.memory_bytes) / 2**30:.2f} GiB to spare is less than the estimate's mean "
            f"error on measured peaks ({MEASURED_ERROR:.1%}, {MEASURED_ERROR * breakdown.total / 2**30:.2f} GiB here)")
    if hit := _at_smaller_micro_batch(analysis, breakdown.setup, gpu, roomy=True):
        smaller, roomier = hit
        return (f"{text}: micro-batch {smaller.batch_size} x {smaller.gradient_accumulation_steps} accumulation "
                f"steps leaves {roomier.spare(gpu.memory_bytes) / 2**30:.2f} GiB.")
    return f"{text}; --trace runs the step itself on fake tensors."


def _at_smaller_micro_batch(analysis: ModelAnalysis, setup: Setup, gpu: Gpu,
                            roomy: bool = False) -> tuple[Setup, Breakdown] | None:
    """``setup`` at the largest micro-batch below its own that fits ``gpu`` (with ``roomy``, with more to spare
    than the estimate's error) and divides the rows each GPU takes per optimizer step, the accumulation making up
    the rest; None where not even one row does."""
    rows = setup.batch_size * setup.gradient_accumulation_steps
    for micro in range(setup.batch_size - 1, 0, -1):
        if rows % micro:
            continue
        smaller = setup.with_(per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro)
        breakdown = evaluate_setup(analysis, smaller)
        if breakdown.fits(gpu.memory_bytes) and not (roomy and breakdown.tight(gpu.memory_bytes)):
            return smaller, breakdown
    return None


def _measured_reason(chosen: Setup, measured: Measured, base: Setup, analysis: ModelAnalysis, gpu: Gpu) -> str:
    """Why the measurements chose ``chosen``, and what they were measured on."""
    usual = recommend(analysis, base, gpu)
    same = usual.fits and usual.setup == chosen
    if base.world_size == 1:
        return (f"{chosen.label()}: {_why(chosen)}. The measurements ({measured.describe()}) compare setups of "
                f"several GPUs, so they do not apply to one.")
    fitting = [measured.speed(s) or 0.0 for s in candidates(base, measured, analysis)
               if evaluate_setup(analysis, s).fits(gpu.memory_bytes)]
    if measured.speed(chosen) is None:
        text = f"{chosen.label()}: no measured setup fits; this is the usual choice among the rest"
    elif measured.speed(chosen) < max(fitting):
        text = (f"{chosen.label()}: within {MEASURED_TIE:.0%} of the fastest measured setup that fits, a tie the "
                f"usual order decides")
    else:
        text = f"{chosen.label()}: the fastest measured setup that fits"
    text += f" ({measured.describe()})."
    text += f" It is also the usual choice: {_why(chosen)}." if same else \
        f" Without measurements it would be {usual.setup.label()}." if usual.fits else ""
    if measured.measured_another_model(analysis.inventory.name):
        text += (f" Caution: the speeds were measured with {measured.model_name}, not {analysis.inventory.name}; run "
                 f"'shardtune bench strategies' with this model's recipe for figures that apply to it.")
    if measured.method and measured.method != base.method:
        text += (f" Caution: the speeds were measured with --method {measured.method}, this estimate is for "
                 f"{base.method}; give --method {measured.method} to compare like with like.")
    if measured.device.startswith("cpu"):
        text += " CPU measurements show how the setups schedule their work, not how fast GPUs run them."
    if measured.num_processes and measured.num_processes != base.world_size:
        text += (f" The measurements used {measured.num_processes} processes, this estimate {base.world_size} GPUs: "
                 f"re-run the benchmark at that size where you can.")
    return text


# The methods that hold less than each, lightest last: what to try where it does not fit.
LIGHTER = {"full": ("lora", "qlora"), "lora": ("qlora",), "qlora": ()}


def _on_the_gpus(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> list[str]:
    """Where only a last resort (CPU offload, model parallel) holds ``base``'s method: the lighter methods that fit
    without one, each with its setup and per-GPU total (the question of full fine-tuning or LoRA or QLoRA)."""
    out = []
    for method in LIGHTER[base.method]:
        options = [s for s in candidates(base.with_(method=method), analysis=analysis) if not _last_resort(s)]
        if hit := _first_fit(analysis, options, gpu):
            out.append(f"--method {method} with {hit[0].label()} ({_gib_on_gpu(hit[1])}), micro-batch up to "
                       f"{max_batch_size(analysis, hit[0], gpu)}")
        elif hit := next(filter(None, (_at_smaller_micro_batch(analysis, s, gpu) for s in options)), None):
            out.append(f"--method {method} with {hit[0].label()} at micro-batch {hit[0].batch_size} x "
                       f"{hit[0].gradient_accumulation_steps} accumulation steps, the same rows per optimizer step "
                       f"({_gib_on_gpu(hit[1])})")
    return out


def _first_fit(analysis: ModelAnalysis, setups: list[Setup], gpu: Gpu) -> tuple[Setup, Breakdown] | None:
    """The first of ``setups`` that fits ``gpu``, with its breakdown; None where none does."""
    for setup in setups:
        breakdown = evaluate_setup(analysis, setup)
        if breakdown.fits(gpu.memory_bytes):
            return setup, breakdown
    return None


def _gib_on_gpu(breakdown: Breakdown) -> str:
    """A setup's per-GPU total as nvidia-smi shows it, and the host RAM it keeps per node where it offloads."""
    host = (f", {breakdown.cpu_bytes_per_node / 2**30:,.0f} GiB of host RAM per node"
            if breakdown.cpu_bytes_per_node else "")
    return f"{(breakdown.total + breakdown.cuda_context) / 2**30:.1f} GiB{host}"


def what_would_fit(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> list[str]:
    """Changes that make it fit, each with the per-GPU total it leads to, cheapest change first."""
    out = []
    # The largest smaller micro-batch alone, or (where checkpointing is off) with checkpointing as well: the first
    # setup, in order, that fits one.
    as_asked = [base] + ([] if base.gradient_checkpointing else [base.with_(gradient_checkpointing=True)])
    smaller = (_at_smaller_micro_batch(analysis, s, gpu) for asked in as_asked
               for s in candidates(asked, analysis=analysis))
    if base.batch_size > 1 and (hit := next(filter(None, smaller), None)):
        also = " and --gradient-checkpointing" if hit[0].gradient_checkpointing != base.gradient_checkpointing else ""
        out.append(f"batch size {hit[0].batch_size}{also} with {hit[0].label()} ({_gib_on_gpu(hit[1])}); keep the "
                   f"global batch with --gradient-accumulation-steps {hit[0].gradient_accumulation_steps}")
    checkpointed = base.with_(gradient_checkpointing=True)
    if not base.gradient_checkpointing and (
            hit := _first_fit(analysis, candidates(checkpointed, analysis=analysis), gpu)):
        out.append(f"--gradient-checkpointing with {hit[0].label()} ({_gib_on_gpu(hit[1])})")
    if base.mixed_precision == "no":  # fp32 (a T4's or V100's default): half precision halves the activations
        half = "bf16" if gpu.bf16 else "fp16"  # and a frozen base; fp16 on cards without bf16
        if hit := _first_fit(analysis, candidates(base.with_(mixed_precision=half), analysis=analysis), gpu):
            out.append(f"--mixed-precision {half} with {hit[0].label()} ({_gib_on_gpu(hit[1])})")
    for method in LIGHTER[base.method]:
        if hit := next(filter(None, (_fitting(analysis, asked.with_(method=method), gpu) for asked in as_asked)),
                       None):
            fitted, breakdown = hit
            also = " and --gradient-checkpointing" if fitted.gradient_checkpointing != base.gradient_checkpointing \
                else ""
            batch = (f" at micro-batch {fitted.batch_size} x {fitted.gradient_accumulation_steps} accumulation steps"
                     if fitted.batch_size != base.batch_size else "")
            out.append(f"--method {method}{also} with {fitted.label()}{batch} ({_gib_on_gpu(breakdown)})")
    if hit := _more_gpus(analysis, base, gpu):
        out.append(hit)
    return out or ["nothing within 4096 GPUs of this size: pick a smaller model or a GPU with more memory"]


def _fitting(analysis: ModelAnalysis, asked: Setup, gpu: Gpu) -> tuple[Setup, Breakdown] | None:
    """A setup of ``asked``'s job that fits, in the recommender's order: on the GPUs alone at the asked micro-batch,
    then at a smaller one keeping the global batch, then the same with a last resort (CPU offload, model parallel);
    with its breakdown, or None where none fits."""
    options = candidates(asked, analysis=analysis)
    for group in ([s for s in options if not _last_resort(s)], [s for s in options if _last_resort(s)]):
        if hit := _first_fit(analysis, group, gpu) or next(
                filter(None, (_at_smaller_micro_batch(analysis, s, gpu) for s in group)), None):
            return hit
    return None


def _more_gpus(analysis: ModelAnalysis, base: Setup, gpu: Gpu) -> str | None:
    per_node = max(base.num_gpus, 8) if base.world_size > 1 else 8
    world = 2
    while world <= 4096:
        gpus, nodes = (world, 1) if world <= per_node else (per_node, world // per_node)
        setup = base.with_(distributed_type=FSDP, fsdp_sharding_strategy="FULL_SHARD", num_gpus=gpus,
                           num_nodes=nodes, fsdp_offload_params=False)
        if refusals(setup):  # FSDP is not for this job (adafactor): more GPUs hold no less each
            return None
        if world > base.world_size:
            b = evaluate_setup(analysis, setup)
            if b.fits(gpu.memory_bytes):
                where = f"{gpus} GPUs" if nodes == 1 else f"{nodes} nodes x {gpus} GPUs"
                return f"{where} with FSDP FULL_SHARD ({(b.total + b.cuda_context) / 2**30:.1f} GiB per GPU)"
        world *= 2
    return None
