"""Presenting an estimate: a JSON object for machines, rich tables for people."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from shardtune.errors import UsageError
from shardtune.files import figure_metadata, replacing
from shardtune.hardware import GIB, GPUS, PRICES_AS_OF, SPEC_EXAMPLE, TYPICAL_PRICE_PER_GPU_HOUR, Gpu
from shardtune.memory.formula import Breakdown
from shardtune.memory.inventory import LoraCount, ModelInventory, spoken_count
from shardtune.memory.recommend import MAX_BATCH, Measured, Recommendation
from shardtune.memory.setup import Setup
from shardtune.memory.timing import OVERLAP, DataTokens, Links, StepTime, duration


@dataclass
class Report:
    inventory: ModelInventory
    trainable_parameters: int
    gpu: Gpu
    breakdown: Breakdown  # the setup asked for (or the recommended one with --strategy auto)
    table: list[tuple[Breakdown, int]]  # every compared setup with its largest micro-batch
    recommendation: Recommendation
    lora: LoraCount | None = None  # the adapters' counts, with --method lora or qlora


def to_dict(r: Report) -> dict:
    b = r.breakdown
    inv = r.inventory
    return {
        "model": inv.name,
        "model_type": inv.model_type,
        "parameters": inv.parameters,
        "trainable_parameters": r.trainable_parameters,
        "setup": b.setup.to_dict(),
        "gpu": {"name": r.gpu.name, "memory_bytes": r.gpu.memory_bytes},
        "per_gpu": b.per_gpu(),
        "cuda_context": b.cuda_context,
        "nvidia_smi_bytes": b.total + b.cuda_context,
        "fits": b.fits(r.gpu.memory_bytes),
        "spare_bytes": b.spare(r.gpu.memory_bytes),
        "tight": b.tight(r.gpu.memory_bytes),
        "peak_phase": b.phase,
        "phases": b.phases,
        "items": [asdict(i) for i in b.items],
        "cpu_bytes_per_node": b.cpu_bytes_per_node,
        "stage_note": b.stage_note or None,
        "stages": [{"layers": [lo, hi - 1], "bytes": n} for (lo, hi), n in zip(b.stage_bounds, b.stage_totals)]
        or None,  # MP and PP: each GPU's peak (bytes as per_gpu's total), the first stage's GPU first
        "strategies": [
            {"setup": s.setup.label(), "strategy": s.setup.strategy.name,
             "sharding_strategy": s.setup.sharding_name,
             "offload_params": s.setup.offload_params, "per_gpu": s.per_gpu(), "cuda_context": s.cuda_context,
             "fits": s.fits(r.gpu.memory_bytes), "max_batch_size": batch}
            for s, batch in r.table
        ],
        "recommendation": r.recommendation.to_dict(),
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def short_label(setup) -> str:
    """A setup's name in at most 18 characters, for the side-by-side table."""
    if setup.offload_params:
        return f"{setup.strategy.label} FULL + offload"
    return setup.label()


def _row_label(r: Report, setup, rows: list) -> str:
    """A table row's name, starred where it is the recommended kind of setup; with its micro-batch and
    accumulation where they are not the asked ones (a smaller micro-batch recommended in place of a last resort)."""
    rec = r.recommendation.setup
    kind = setup.with_(per_device_train_batch_size=rec.batch_size,
                       gradient_accumulation_steps=rec.gradient_accumulation_steps)
    asked = r.table[0][0].setup if r.table else setup
    batch = "" if setup.batch_size == asked.batch_size else \
        f" b{setup.batch_size}x{setup.gradient_accumulation_steps}"
    # The recommended row itself where the table (its setups ``rows``) has it, else its kind's row (at the asked
    # micro-batch).
    chosen = r.recommendation.fits and (setup == rec if rec in rows else kind == rec)
    return short_label(setup) + batch + (" *" if chosen else "")


SIDE_COLUMNS = ("setup", "params", "grads", "optim", "activ", "ovhd", "total", "fits", "max b")


def side_by_side(r: Report) -> Table:
    """Every compared setup on one row, in GiB per GPU; fits 80 columns (one decimal, short names)."""
    side = Table(title="Setups side by side, GiB per GPU", title_justify="left", box=box.SIMPLE_HEAD,
                 pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in SIDE_COLUMNS:
        side.add_column(col, justify="left" if col == "setup" else "right", no_wrap=True)
    for sb, batch in r.table:
        pg = sb.per_gpu()
        ok = sb.fits(r.gpu.memory_bytes)
        side.add_row(_row_label(r, sb.setup, [b.setup for b, _ in r.table]),
                     *(_gib_cell(pg[k]) for k in ("params", "grads", "optimizer", "activations", "overhead",
                                                  "total")),
                     "[green]yes[/]" if ok else "[red]no[/]", micro_batch_count(batch))
    return side


def micro_batch_count(batch: int) -> str:
    """A largest micro-batch as read: the search stops at MAX_BATCH, so one that reaches it is "4096+" (pipeline
    parallel's one row in flight per stage holds any batch), not a limit."""
    return f"{batch}+" if batch >= MAX_BATCH else str(batch)


def _gib_cell(nbytes: float) -> str:
    """GiB in a table cell of the 80-column tables: one decimal below 1,000, whole GiB above (a 405B model's DDP
    total of 7,826 GiB was cut to '7826…')."""
    gib = nbytes / GIB
    return f"{gib:.1f}" if gib < 999.95 else f"{gib:,.0f}"


def side_by_side_note(r: Report) -> str:
    context = max((b.cuda_context for b, _ in r.table), default=0)
    searched = (f" (searched up to {MAX_BATCH})" if any(batch >= MAX_BATCH for _, batch in r.table) else "")
    return (f"fits: total + {context / GIB:.2f} GiB CUDA context <= {r.gpu.memory_bytes / GIB:.1f} GiB. "
            f"max b: the largest micro-batch that fits{searched}. * recommended.")


def training_words(s: Setup) -> str:
    """The batch, precision, optimizer, checkpointing and attention of ``s``, as the header states them."""
    precision = "pure bf16" if s.pure_bf16 else {"no": "fp32", "bf16": "bf16 mixed (fp32 master)",
                                                  "fp16": "fp16 mixed (fp32 master)"}[s.mixed_precision]
    return (f"micro-batch {s.batch_size} x {s.seq_len} tokens, {precision}, {s.optimizer}, gradient checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}"
            f"{' (inputs offloaded to CPU)' if s.activation_offloading else ''}, {s.attn_implementation} attention"
            f"{f', torch_compile ({s.torch_compile})' if s.torch_compile else ''}"
            f"{', Liger kernels' if s.use_liger_kernel else ''}"
            f"{f', {OTHER_LOSSES[s.loss]} (--loss {s.loss})' if s.loss in OTHER_LOSSES else ''}")


# The losses --loss counts besides shardtune train's own (fused with the head, no logits kept), as the header says
# them: a job with one of them is not the one train runs.
OTHER_LOSSES = {"full": "transformers' loss, whole fp32 logits", "full-shifted": "transformers <= 4.44's loss, "
                "fp32 logits and a shifted copy", "chunked": "torchtune's chunked loss"}


# Said under the header where the job compiles its layers or runs Liger's kernels: the trace and the formula follow
# transformers' eager modules, which keep at least what those kernels keep for backward.
EAGER_MEMORY_NOTE = ("  memory counted as transformers' eager modules keep it (fused kernels keep no more); time with "
                     "the fused kernels")


def train_defaults(gpu: Gpu) -> Setup:
    """What ``shardtune train`` runs with no flags on ``gpu`` (its precision follows the card's bf16)."""
    return Setup(native_bf16=gpu.bf16)


def render(r: Report, console: Console) -> None:
    b, inv, s = r.breakdown, r.inventory, r.breakdown.setup
    gpus = f"{s.world_size} GPU" + ("s" if s.world_size > 1 else "")
    if s.num_nodes > 1:
        gpus += f" ({s.num_nodes} nodes x {s.num_gpus})"
    console.print(f"[bold]{inv.name}[/] ({inv.model_type}): {inv.parameters:,} parameters, "
                  f"{r.trainable_parameters:,} trainable ({s.method}"
                  + (f", r={s.lora_r} on {s.lora_target_modules}" if s.uses_lora else "")
                  + (f", lora_bias {s.lora_bias}" if s.uses_lora and s.lora_bias != "none" else "") + ")")
    console.print(f"{gpus} x {r.gpu.label or r.gpu.name} ({r.gpu.memory_bytes / GIB:.1f} GiB), {training_words(s)}")
    defaults = training_words(train_defaults(r.gpu))
    console.print("  (what shardtune train runs with no flags)" if defaults == training_words(s)
                  else f"  (shardtune train with no flags runs: {defaults})")
    if s.torch_compile == "inductor" or s.use_liger_kernel:
        console.print(EAGER_MEMORY_NOTE)

    table = Table(title=f"Per-GPU memory: {s.label()} (peak at {b.phase})", title_justify="left")
    table.add_column("category")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    for item in b.items:
        table.add_row(item.category, item.label, _gib(item.bytes))
    table.add_section()
    table.add_row("[bold]total[/]", "peak that torch.cuda.max_memory_reserved reports", f"[bold]{_gib(b.total)}[/]")
    table.add_row("", "CUDA context and NCCL (outside PyTorch's allocator)", _gib(b.cuda_context))
    verdict = ("[yellow]fits, tight[/]" if b.tight(r.gpu.memory_bytes) else "[green]fits[/]"
               if b.fits(r.gpu.memory_bytes) else "[red]does not fit[/]")
    table.add_row("", f"what nvidia-smi shows, against {r.gpu.memory_bytes / GIB:.1f} GiB: {verdict}",
                  _gib(b.total + b.cuda_context))
    console.print(table)
    if b.stage_note:
        console.print(f"  {b.stage_note}")
    if b.cpu_bytes_per_node:
        console.print(f"  CPU offload keeps {_gib(b.cpu_bytes_per_node)} GiB per node in host RAM.")

    console.print(side_by_side(r))
    console.print(side_by_side_note(r))

    rec = r.recommendation
    if rec.fits:
        console.print(f"[bold green]Recommended:[/] {rec.reason}")
        if rec.suggestions:  # a last resort was needed: what a lighter method fits without one
            resort = "CPU offload" if rec.setup.offload_params else "model parallel (one GPU computing at a time)"
            console.print(f"Without {resort}, a lighter method fits:")
            for line in rec.suggestions:
                console.print(f"  - {line}")
    else:
        console.print(f"[bold red]{rec.reason}[/] What would fit:")
        for line in rec.suggestions:
            console.print(f"  - {line}")


def estimate_report(model: str, setup: Setup, gpu: Gpu, auto: bool = True, measured=None) -> Report:
    """Estimate ``setup`` for ``model`` on ``gpu``; with ``auto`` the strategy is the recommended one (ranked by
    ``measured`` speeds, a ``recommend.Measured``, when given)."""
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.recommend import (
        candidates,
        evaluate_setup,
        max_batch_size,
        recommend,
    )

    analysis = analysis_for(model, setup.config)
    inv = analysis.inventory
    lora = analysis.lora_of(setup)
    trainable = lora.total if lora else inv.parameters
    rec = recommend(analysis, setup, gpu, measured)
    breakdown = rec.breakdown if auto else evaluate_setup(analysis, setup)
    rows = [(evaluate_setup(analysis, s), max_batch_size(analysis, s, gpu))
            for s in candidates(setup, measured, analysis)]
    return Report(inventory=inv, trainable_parameters=trainable, gpu=gpu, breakdown=breakdown, table=rows,
                  recommendation=rec, lora=lora)


# --- Time and cost (--time) -------------------------------------------------------------------------------------

PER_TOKENS = 1_000_000_000  # without a data set, time and cost are shown per billion tokens


@dataclass
class TimeReport:
    """Every compared setup's step time, and what the data set takes and costs with it."""

    rows: list[tuple[Breakdown, StepTime]]  # Report.table's setups (and the asked one where it is not among them)
    links: Links
    data: DataTokens | None
    price_per_gpu_hour: float | None
    price_given: bool  # False: the typical list price of the card
    measured: Measured | None = None  # --measured: what 'shardtune bench strategies' measured, to compare
    caution: str | None = None  # host_bound_caution: a small model's step may take longer than the model says
    epochs: float = 1.0  # the job's num_train_epochs: passes over the data
    max_steps: int = -1  # the job's max_steps: where positive, the run is that many optimizer steps, whatever the data

    @property
    def per_billion(self) -> bool:
        """No data and no step count: time and cost are shown per billion trained tokens."""
        return self.data is None and self.max_steps <= 0

    @property
    def tokens(self) -> int:
        """The data's tokens: every epoch's pass over it (one pass where max_steps decides; per billion without
        data)."""
        if self.data is None:
            return PER_TOKENS
        return round(self.data.tokens * self.epochs) if self.max_steps <= 0 else self.data.tokens

    def trained_tokens(self, t: StepTime) -> int:
        """The tokens the run trains with setup ``t``: max_steps of its global batch, else the data's epochs."""
        return self.max_steps * t.tokens_per_step if self.max_steps > 0 else self.tokens

    def seconds(self, t: StepTime) -> float:
        return self.max_steps * t.step_s if self.max_steps > 0 else t.seconds_for(self.tokens)

    def data_text(self) -> str:
        """What the time and cost are of, as the notes and the figure say it."""
        if self.max_steps > 0:
            return (f"max_steps {self.max_steps:,}: that many optimizer steps of each setup's global batch"
                    + (", whatever the data holds" if self.data else ""))
        if self.data is None:
            return "per billion trained tokens"
        if self.epochs == 1:
            return self.data.describe()
        return f"{self.data.describe()} x {self.epochs:g} epochs (num_train_epochs) = {self.tokens:,} tokens"

    def cost(self, t: StepTime) -> float | None:
        if self.price_per_gpu_hour is None:
            return None
        return self.seconds(t) / 3600 * t.setup.world_size * self.price_per_gpu_hour

    def price_text(self) -> str:
        if self.price_per_gpu_hour is None:
            return "no price known for this GPU: give --price-per-gpu-hour"
        if self.price_given:
            return f"${self.price_per_gpu_hour:.2f} per GPU-hour (--price-per-gpu-hour)"
        return (f"${self.price_per_gpu_hour:.2f} per GPU-hour, a typical on-demand list price ({PRICES_AS_OF}; "
                f"--price-per-gpu-hour sets yours)")


def time_report(r: Report, links: Links, data: DataTokens | None = None, price_per_gpu_hour: float | None = None,
                measured: Measured | None = None, fix: Callable[[], str] | None = None) -> TimeReport:
    """Step time of every setup in ``r.table`` at its asked micro-batch (PP's at the pipeline micro-batches its
    recipe runs), and the data set's time and cost; with ``measured``, the measured speeds beside the predicted
    ones. ``fix``: how to change the precision where the setup came from files (their key, not an option), asked
    only for a refusal."""
    from shardtune.memory.timing import step_time

    precision = r.breakdown.setup.mixed_precision
    if precision == "bf16" and not r.gpu.bf16 and r.gpu.peak_flops("fp16"):
        how = fix() if fix else "give --mixed-precision fp16 (or no)"
        raise UsageError(f"--time: the {r.gpu.label or r.gpu.name} has no bf16 (it emulates it, at no speed a data "
                         f"sheet states); {how}")
    if not r.gpu.peak_flops(precision):
        known = ", ".join(name for name, gpu in GPUS.items() if gpu.peak_flops(precision))
        raise UsageError(f"--time needs the GPU's peak FLOPs ({precision}), unknown for {r.gpu.label or r.gpu.name}: "
                         f"name the card with --gpu (one of {known}) or give its numbers with {SPEC_EXAMPLE}")
    compared = [b for b, _ in r.table]
    if all(b.setup != r.breakdown.setup for b in compared):  # an asked setup the table leaves out (PP)
        compared.append(r.breakdown)
    rows = [(b, step_time(r.inventory, b.setup, r.gpu, links, r.lora, b.stage_bounds, b.setup.microbatches))
            for b in compared]
    given = price_per_gpu_hour is not None
    price = price_per_gpu_hour if given else TYPICAL_PRICE_PER_GPU_HOUR.get(r.gpu.name)
    run = r.breakdown.setup.config.run
    return TimeReport(rows, links, data, price, given, measured, host_bound_caution(r), run.num_train_epochs,
                      run.max_steps)


def time_to_dict(t: TimeReport, gpu: Gpu) -> dict:
    return {
        "data_tokens": t.tokens,
        "data_tokens_counted": None if t.data is None else "given" if not t.data.rows else
        "tokenizer" if t.data.exact else "approximate (4 characters per token)",
        "data": t.data_text(),
        "num_train_epochs": t.epochs,
        "max_steps": t.max_steps,
        "price_per_gpu_hour": t.price_per_gpu_hour,
        "price_source": "given" if t.price_given else f"typical on-demand list price ({PRICES_AS_OF})"
        if t.price_per_gpu_hour is not None else "none known for this GPU: give --price-per-gpu-hour",
        "links": {"intra_node": t.links.intra.name, "inter_node": t.links.inter.name, "host": t.links.host.name},
        "overlap": OVERLAP,
        "setups": [{"setup": b.setup.label(), "fits": b.fits(gpu.memory_bytes), **st.to_dict(),
                    "trained_tokens": t.trained_tokens(st), "data_seconds": t.seconds(st), "cost_usd": t.cost(st),
                    **_against_measured(t, st)}
                   for b, st in t.rows],
        "measured_file": t.measured.path if t.measured else None,
        "caution": t.caution,
    }


def _against_measured(t: TimeReport, st: StepTime) -> dict:
    speed = t.measured.speed(st.setup) if t.measured else None
    if speed is None:
        return {}
    return {"measured_tokens_per_s": speed, "predicted_over_measured": st.tokens_per_s / speed}


def measured_table(t: TimeReport) -> Table | None:
    """Predicted tokens/s beside what 'shardtune bench strategies' measured, per setup it measured."""
    rows = [(st, _against_measured(t, st)) for _, st in t.rows]
    rows = [(st, m) for st, m in rows if m]
    if not rows:
        return None
    table = Table(title="Tokens/s predicted against measured (--measured)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in ("setup", "predicted", "measured", "predicted/measured"):
        table.add_column(col, justify="left" if col == "setup" else "right", no_wrap=True)
    for st, m in rows:
        table.add_row(short_label(st.setup), f"{st.tokens_per_s:,.0f}", f"{m['measured_tokens_per_s']:,.0f}",
                      f"{m['predicted_over_measured']:.2f}")
    return table


def measured_notes(r: Report, t: TimeReport) -> list[str]:
    """What the measured speeds are comparable with, so a ratio is read for what it is."""
    m = t.measured
    lines = [f"measured: {m.describe()}."]
    if m.measured_another_model(r.inventory.name):
        lines.append(f"Caution: measured with {m.model}, predicted for {r.inventory.name}: compare the ratios "
                     f"between setups, not the figures.")
    if m.device and not m.device.startswith("cuda"):
        lines.append(f"Caution: measured on {m.device}; the prediction is for {r.gpu.label or r.gpu.name}. CPU "
                     f"runs show how the setups schedule their work, not how fast a GPU runs them.")
    if m.num_processes and m.num_processes != r.breakdown.setup.world_size:
        lines.append(f"Caution: measured on {m.num_processes} processes, predicted for "
                     f"{r.breakdown.setup.world_size} GPUs.")
    return lines


_MONEY_SCALES = ((1e12, "T"), (1e9, "B"), (1e6, "M"))  # US short scale: million, billion, trillion


def _money(usd: float | None) -> str:
    """Dollars to the cent under $100, whole dollars under a million, then $1.23M, $4.56B, $7.89T: at most 9
    characters, so the cost column keeps its width."""
    if usd is None:
        return "-"
    if usd < 1e6:
        return f"${usd:,.0f}" if usd >= 100 else f"${usd:,.2f}"
    rounded = float(f"{usd:.3g}")  # $999.7M reads $1B, not $1e+03M
    if rounded >= 1e15:
        return f"${rounded:.3g}"
    scale, suffix = next((scale, suffix) for scale, suffix in _MONEY_SCALES if rounded >= scale)
    return f"${rounded / scale:.3g}{suffix}"


def _mfu(mfu: float) -> str:
    return f"{mfu:.0%}" if mfu >= 0.1 else f"{mfu:.1%}"


def time_table(r: Report, t: TimeReport) -> Table:
    """Every compared setup's step time, speed, MFU, and the data set's time and cost; fits 80 columns."""
    per = " /1B tok" if t.per_billion else ""
    table = Table(title="Time and cost side by side", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1), collapse_padding=True)
    for col in ("setup", "fits", "step", "tokens/s", "MFU", "time" + per, "cost" + per):
        # The setup's name wraps where 80 columns are too few (a setup at another micro-batch, "FSDP SHARD_GRAD_OP
        # b16x4 *", beside the per-billion headers): the figures are never cut to "16.7…".
        table.add_column(col, justify="left" if col == "setup" else "right", no_wrap=col != "setup")
    for b, st in t.rows:
        ok = b.fits(r.gpu.memory_bytes)
        cells = [duration(st.step_s), f"{st.tokens_per_s:,.0f}", _mfu(st.mfu), duration(t.seconds(st)),
                 _money(t.cost(st))]
        table.add_row(_row_label(r, b.setup, [row.setup for row, _ in t.rows]), "[green]yes[/]" if ok else "[red]no[/]",
                      *(c if ok else f"[dim]{c}[/]" for c in cells))
    return table


# Models up to this size (Llama-3.2-3B's 3.2B parameters) can run slower than the time model says in eager PyTorch:
# their kernels are short enough for the launches to keep the GPU waiting (their memory-bound traffic, counted by
# bench/host_ops.py, explains at most a quarter of the 1B run's shortfall; docs/estimator.md). Measured:
# shardtune's own Llama-3.2-1B LoRA (r16 on every linear layer, 4 x 2048 tokens, bf16, checkpointing) on an H200
# ran at 25,972 tokens/s (bench/results/cuda_paths_cuda.md) where `estimate --time` predicts 38,806 for that job;
# torchtune's eager Llama-3.2-3B on an A100 ran 1.25x slower than predicted, its compiled runs within 5%
# (docs/estimator.md; tests/test_estimate_time.py holds the quoted ratio to the calibration point).
HOST_BOUND_PARAMETERS = 3.5e9
SMALL_MODEL_MEASURED = "shardtune's own Llama-3.2-1B LoRA on an H200 ran 1.5x slower than predicted"


def host_bound_caution(r: Report) -> str | None:
    """A caution where the model is small enough for its step to run slower than the time model says, as shardtune's
    own 1B runs did (None elsewhere)."""
    if r.inventory.parameters > HOST_BOUND_PARAMETERS:
        return None
    s = r.breakdown.setup
    return (f"caution: with {spoken_count(r.inventory.parameters)} parameters and {s.batch_size * s.seq_len:,} tokens "
            f"per micro-batch, the step may take longer than this ({SMALL_MODEL_MEASURED} at 8,192 tokens): its many "
            f"short kernels can leave the GPU waiting on their launches (the bytes they move, counted, explain at "
            f"most a quarter of that); torch_compile launches fewer, and more tokens per micro-batch make each "
            f"kernel longer.")


def time_notes(r: Report, t: TimeReport) -> list[str]:
    s = r.breakdown.setup
    accum = s.gradient_accumulation_steps
    lines = [f"data: {t.data_text()}." if not t.per_billion else
             "data: per billion trained tokens (--tokens N or --data FILE for yours).",
             f"step: micro-batch {s.batch_size} x {s.seq_len} tokens x {accum} accumulation step"
             f"{'s' if accum > 1 else ''} per GPU" + (f"; MFU counts all {s.world_size} GPUs of a setup."
                                                       if s.world_size > 1 else ".")]
    link = f"links: {t.links.intra.label} in a node"
    if s.num_nodes > 1:
        link += f", {t.links.inter.label} between nodes"
    if any(b.setup.offload_params for b, _ in t.rows):
        link += f", {t.links.host.label} to the host"
    lines.append(link + f"; communication hides behind up to {OVERLAP:.0%} of compute.")
    lines.append(f"cost: {t.price_text()}.")
    fitting = [(b, st) for b, st in t.rows if b.fits(r.gpu.memory_bytes)]
    if fitting:
        b, st = max(fitting, key=lambda row: row[1].tokens_per_s)
        cost = t.cost(st)
        lines.append(f"fastest that fits: {b.setup.label()} ({duration(t.seconds(st))}"
                     + (f", {_money(cost)}" if cost is not None else "") + ")" + (f"; {st.note}" if st.note else "")
                     + ".")
    if len(fitting) < len(t.rows):
        lines.append("dim: does not fit; timed as if it did.")
    return lines + ([t.caution] if t.caution else [])


def render_time(r: Report, t: TimeReport, console: Console) -> None:
    console.print(time_table(r, t))
    for line in time_notes(r, t):
        console.print(line)
    if t.measured and (table := measured_table(t)) is not None:
        console.print(table)
        for line in measured_notes(r, t):
            console.print(line)


def time_figure(r: Report, t: TimeReport):
    """Two bar charts: the data set's time (hours) and cost per setup; setups that do not fit are hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8.0, 1.6 * len(t.rows) + 3), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    names = [short_label(b.setup).replace(" ", "\n", 1) for b, _ in t.rows]
    fits = [b.fits(r.gpu.memory_bytes) for b, _ in t.rows]
    per = " per 1B tokens" if t.per_billion else ""
    seconds = [t.seconds(st) for _, st in t.rows]
    panels = [("time" + per + " (hours)", [x / 3600 for x in seconds], [duration(x) for x in seconds], "#4c72b0")]
    if t.price_per_gpu_hour is not None:
        costs = [t.cost(st) for _, st in t.rows]
        panels.append(("cost" + per + " (US$)", costs, [_money(c) for c in costs], "#55a868"))
    rec = r.recommendation
    chosen = [rec.fits and b.setup == rec.setup for b, _ in t.rows]
    for i, (title, values, labels, color) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        bars = ax.bar(range(len(values)), values, color=[color if ok else "white" for ok in fits],
                      edgecolor=color, width=0.6, gid="setup")
        for bar, ok, pick, value, label in zip(bars, fits, chosen, values, labels):
            if not ok:
                bar.set_hatch("//")
            if pick:
                bar.set_edgecolor("black")
                bar.set_linewidth(2.5)
            text = label + ("" if ok else "\nno fit") + ("\nrecommended" if pick else "")
            ax.text(bar.get_x() + bar.get_width() / 2, value, text, ha="center", va="bottom", fontsize=8,
                    fontweight="bold" if pick else "normal")
        ax.set_xticks(range(len(values)), names, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(values) * 1.25 or 1)
    s = r.breakdown.setup
    data = t.data_text()
    fig.suptitle(f"{r.inventory.name}, {s.method}, {s.world_size} x {r.gpu.label or r.gpu.name}: {data}", fontsize=10)
    return fig


def write_time_plot(r: Report, t: TimeReport, path: str | Path) -> Path:
    """Write ``time_figure`` as a PNG at ``path`` (through a temporary file and a rename)."""
    path = Path(path).expanduser()
    with replacing(path) as tmp:
        time_figure(r, t).savefig(tmp, format="png", dpi=110, metadata=figure_metadata("png"))
    return path
