"""Presenting an estimate: a JSON object for machines, rich tables for people."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from shardtune.errors import UsageError
from shardtune.hardware import GIB, Gpu
from shardtune.memory.formula import Breakdown
from shardtune.memory.inventory import ModelInventory
from shardtune.memory.recommend import Recommendation
from shardtune.memory.setup import Setup


@dataclass
class Report:
    inventory: ModelInventory
    trainable_parameters: int
    gpu: Gpu
    breakdown: Breakdown  # the setup asked for (or the recommended one with --strategy auto)
    table: list[tuple[Breakdown, int]]  # every compared setup with its largest micro-batch
    recommendation: Recommendation


def to_dict(r: Report) -> dict:
    b = r.breakdown
    inv = r.inventory
    return {
        "model": inv.name,
        "model_type": inv.model_type,
        "parameters": inv.parameters,
        "trainable_parameters": r.trainable_parameters,
        "setup": asdict(b.setup) | {"world_size": b.setup.world_size},
        "gpu": {"name": r.gpu.name, "memory_bytes": r.gpu.memory_bytes},
        "per_gpu": b.per_gpu(),
        "cuda_context": b.cuda_context,
        "nvidia_smi_bytes": b.total + b.cuda_context,
        "fits": b.fits(r.gpu.memory_bytes),
        "peak_phase": b.phase,
        "phases": b.phases,
        "items": [asdict(i) for i in b.items],
        "cpu_bytes_per_node": b.cpu_bytes_per_node,
        "stage_note": b.stage_note or None,
        "strategies": [
            {"setup": s.setup.label(), "strategy": s.setup.strategy,
             "sharding_strategy": s.setup.sharding_strategy if s.setup.strategy == "fsdp" else None,
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
    if setup.strategy == "fsdp":
        return "FSDP FULL + offload" if setup.offload_params else f"FSDP {setup.sharding_strategy}"
    return setup.label()


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
        chosen = sb.setup == r.recommendation.setup and r.recommendation.fits
        side.add_row(short_label(sb.setup) + (" *" if chosen else ""),
                     *(f"{pg[k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations", "overhead",
                                                       "total")),
                     "[green]yes[/]" if ok else "[red]no[/]", str(batch))
    return side


def side_by_side_note(r: Report) -> str:
    context = max((b.cuda_context for b, _ in r.table), default=0)
    return (f"fits: total + {context / GIB:.2f} GiB CUDA context <= {r.gpu.memory_bytes / GIB:.1f} GiB. "
            "max b: the largest micro-batch that fits. * recommended.")


def render(r: Report, console: Console) -> None:
    b, inv, s = r.breakdown, r.inventory, r.breakdown.setup
    gpus = f"{s.world_size} GPU" + ("s" if s.world_size > 1 else "")
    if s.num_nodes > 1:
        gpus += f" ({s.num_nodes} nodes x {s.num_gpus})"
    precision = "pure bf16" if s.pure_bf16 else {"no": "fp32", "bf16": "bf16 mixed (fp32 master)",
                                                  "fp16": "fp16 mixed (fp32 master)"}[s.mixed_precision]
    console.print(f"[bold]{inv.name}[/] ({inv.model_type}): {inv.parameters:,} parameters, "
                  f"{r.trainable_parameters:,} trainable ({s.method}"
                  + (f", r={s.lora_r} on {s.lora_target_modules}" if s.uses_lora else "") + ")")
    console.print(f"{gpus} x {r.gpu.label or r.gpu.name} ({r.gpu.memory_bytes / GIB:.1f} GiB), micro-batch "
                  f"{s.batch_size} x {s.seq_len} tokens, {precision}, {s.optimizer}, gradient checkpointing "
                  f"{'on' if s.gradient_checkpointing else 'off'}, {s.attn_implementation} attention")

    table = Table(title=f"Per-GPU memory: {s.label()} (peak at {b.phase})", title_justify="left")
    table.add_column("category")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    for item in b.items:
        table.add_row(item.category, item.label, _gib(item.bytes))
    table.add_section()
    table.add_row("[bold]total[/]", "peak that torch.cuda.max_memory_reserved reports", f"[bold]{_gib(b.total)}[/]")
    table.add_row("", "CUDA context and NCCL (outside PyTorch's allocator)", _gib(b.cuda_context))
    fits = b.fits(r.gpu.memory_bytes)
    verdict = "[green]fits[/]" if fits else "[red]does not fit[/]"
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
    else:
        console.print(f"[bold red]{rec.reason}[/] What would fit:")
        for line in rec.suggestions:
            console.print(f"  - {line}")


def estimate_report(model: str, setup: Setup, gpu: Gpu, auto: bool = True, measured=None) -> Report:
    """Estimate ``setup`` for ``model`` on ``gpu``; with ``auto`` the strategy is the recommended one (ranked by
    ``measured`` speeds, a ``recommend.Measured``, when given)."""
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.recommend import candidates, evaluate_setup, max_batch_size, recommend

    analysis = ModelAnalysis(model)
    inv = analysis.inventory
    if setup.strategy == "pp" and inv.tied_embeddings:
        raise UsageError(f"--strategy pp: {model} ties its LM head to its input embeddings, which would live on "
                         f"different pipeline stages; use ddp, fsdp or mp")
    trainable = inv.parameters
    if setup.uses_lora:
        trainable = analysis.lora(setup.lora_r, setup.lora_target_modules).total
    rec = recommend(analysis, setup, gpu, measured)
    breakdown = rec.breakdown if auto else evaluate_setup(analysis, setup)
    rows = [(evaluate_setup(analysis, s), max_batch_size(analysis, s, gpu))
            for s in candidates(setup, measured, analysis)]
    return Report(inventory=inv, trainable_parameters=trainable, gpu=gpu, breakdown=breakdown, table=rows,
                  recommendation=rec)
