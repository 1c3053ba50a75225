"""``shardtune bench strategies``: the same short job under MP, PP, DDP and FSDP, measured side by side.

Each setup runs as a real training job (``shardtune train`` for MP, ``shardtune launch`` for the others) with the
callback in ``probe``, which records every step's wall time and tokens and, on CPU ranks, the profiler's split of
the step into compute, waiting in collectives and other time (NVML utilisation on CUDA). This module runs the setups,
turns the records into one row each (the first ``warmup_steps`` steps left out), asks the estimator for each
setup's figure, and explains the result in one line per setup.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.bench import PROBE_CALLBACK, PROBE_DIR
from shardtune.strategies import STRATEGIES, Strategy, strategy_named

if TYPE_CHECKING:
    from shardtune.config import TrainConfig

# What the bench compares: every strategy that spreads a job over several devices, by its registry name.
BENCHED = tuple(s.name for s in STRATEGIES if not s.one_device)


# ----------------------------------------------------------------------------------------------------------------
# Before anything runs: the recipe must be able to train
# ----------------------------------------------------------------------------------------------------------------

def load_recipe(config: str, extra: list[str], output_dir: Path) -> TrainConfig:
    """The recipe loaded and checked as ``shardtune train`` does before it loads a model (no download, no network):
    what would make every setup fail at once is a UsageError here, before any setup starts."""
    from shardtune.config import load_run_config
    from shardtune.errors import UsageError

    try:
        # No setup resumes (job_args), so a saved config.yaml's checkpoint, rotated away since, does not matter.
        return load_run_config([config, "--output_dir", str(output_dir), "--resume_from_checkpoint", "false", *extra])
    except UsageError as exc:
        raise UsageError(f"CONFIG {config} cannot train, so no setup was started: {exc}") from None


# ----------------------------------------------------------------------------------------------------------------
# The driver: run each setup, summarise, estimate, explain
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    """One row of the table."""

    strategy: str  # its registry name
    processes: int
    stages_or_ranks: int
    wall_per_step_s: float | None = None
    tokens_per_s: float | None = None
    busy: list[float] = field(default_factory=list)  # per device (MP: per stage; else per rank)
    in_collectives: list[float] = field(default_factory=list)  # per rank, CPU runs: waiting in communication
    busy_source: str = ""
    peak_memory_bytes: int | None = None
    estimate_bytes: int | None = None
    layout: str = ""
    explanation: str = ""
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    load_average: float | None = None  # the machine's 1-minute load average when the run ended (POSIX)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


# The keys job_args sets for every setup, and what to give ``bench strategies`` instead of ``--set KEY=VALUE``.
SET_BY_BENCH = {
    "output_dir": "give --work_dir to keep the setups' folders",
    "max_steps": "give --steps",
    "distributed_type": "choose the setups with --strategies",
    "mp_devices": "MP runs on --num_processes devices",
    "logging_strategy": "the figures need a record of every step",
    "logging_steps": "the figures need a record of every step",
    "save_strategy": "a setup saves no checkpoint, which would count in its step times",
    "eval_strategy": "a setup evaluates nothing, which would count in its step times",
    "predict_memory": "a setup runs no memory check, which would count in its step times",
    # A run's saved config.yaml holds the processes it ran on and the checkpoint it resumed from.
    "num_processes": "give --num_processes (MP runs in one process)",
    "num_machines": "the setups run on this machine",
    "resume_from_checkpoint": "every setup starts afresh, so that their steps compare",
}


def job_args(config: str, strategy: Strategy | str, out: Path, *, num_processes: int, steps: int,
             extra: list[str], callbacks: Sequence[str] = ()) -> list[str]:
    """``shardtune train`` arguments of one setup; ``callbacks``: the recipe's own, which run beside the probe."""
    # No memory check: on CPU it runs step 2 of DDP and FSDP (not MP, PP) under the memory tracker, several times
    # slower than the others, which would count against those two setups.
    strategy = strategy_named(strategy)
    processes = 1 if strategy.drives_several_devices else num_processes  # MP: one process drives every stage
    args = [config, "--distributed_type", strategy.name, "--output_dir", str(out),
            "--num_processes", str(processes), "--num_machines", "1", "--resume_from_checkpoint", "false",
            "--max_steps", str(steps), "--logging_strategy", "steps", "--logging_steps", "1", "--save_strategy", "no",
            "--eval_strategy", "no",
            "--predict_memory", "false"]
    if strategy.drives_several_devices and not _cuda_devices():
        # No GPUs: one CPU "device" per stage, the same count as the other setups' processes.
        args += ["--mp_devices", ",".join(["cpu"] * num_processes)]
    # Last, so that a --set callbacks=... cannot leave the probe out (its classes are in ``callbacks`` already).
    return args + extra + ["--callbacks", ",".join(dict.fromkeys([*callbacks, PROBE_CALLBACK]))]


def run_setup(config: str, strategy: Strategy | str, work: Path, *, num_processes: int, steps: int,
              extra: list[str], timeout_s: float, callbacks: Sequence[str] = ()) -> tuple[int, str]:
    """Run one setup to completion; returns (exit code, its output: stdout then stderr)."""
    strategy = strategy_named(strategy)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    args = job_args(config, strategy, work / strategy.name, num_processes=num_processes, steps=steps, extra=extra,
                    callbacks=callbacks)
    shardtune = [sys.executable, "-m", "shardtune"]
    if strategy.drives_several_devices:  # one process drives every stage
        cmd = [*shardtune, "train", *args]
    else:
        cmd = [*shardtune, "launch", "--num_processes", str(num_processes), "train", *args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    return proc.returncode, proc.stdout + proc.stderr


# A rank's own report: ``shardtune train: rank 1: stopped: ...`` or ``shardtune train: error: ...``; torch may
# prefix a rank's lines with ``[rank0]:``.
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_SHARDTUNE_ERROR = re.compile(r"^shardtune [\w ]+: (?:rank \d+: |error: )")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Failure)\b:? ?.*")
_LAUNCHER_FAILED = "ChildFailedError"  # torchrun's own exception, which only says a rank failed


def failure_line(output: str) -> str:
    """The line that says why a setup failed: a rank's own error line, else the last exception a rank raised,
    else the last line before torchrun's failure report (its traceback and ``====`` banner), which is torchrun's
    own "failed (exitcode: -9)" where a rank was killed."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    own = [line for line in lines if _SHARDTUNE_ERROR.match(line)]
    if own:
        return own[0]  # the first: later ones are usually other ranks reacting to it
    raised = [line for line in lines if _EXCEPTION.match(line) and _LAUNCHER_FAILED not in line]
    if raised:
        return raised[-1]
    if "=" * 20 in output:  # torchrun's report runs from its traceback to the end; the line before says why
        cut = next((i for i, line in enumerate(lines) if line.startswith(("Traceback", "=" * 20))), len(lines))
        lines = lines[:cut]
    return lines[-1] if lines else "no output"


def summarise(strategy: str, probe_dir: Path, warmup_steps: int) -> Result:
    """Per-step figures over the measured steps, busy fraction per device."""
    records = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("probe-rank-*.json"))]
    if not records:
        raise FileNotFoundError(f"no probe records in {probe_dir}")
    records.sort(key=lambda r: r["rank"])
    main = records[0]
    steps = range(min(warmup_steps, len(main["wall_s"]) - 1), len(main["wall_s"]))
    wall = [max(r["wall_s"][i] for r in records) for i in steps]  # a step ends when its slowest rank ends
    wall_total = sum(wall)
    tokens = sum(main["tokens"][i] for i in steps)
    res = Result(strategy=strategy, processes=len(records), stages_or_ranks=len(records),
                 wall_per_step_s=wall_total / len(wall), tokens_per_s=tokens / wall_total)
    if any(r["gpu_util"] for r in records):
        res.busy = [u for r in records for u in r["gpu_util"]]
        res.busy_source = "NVML utilisation of each GPU, sampled every 50 ms"
    elif main["stage_compute_s"]:
        stages = len(main["stage_compute_s"][0])
        res.busy = [sum(main["stage_compute_s"][i][s] for i in steps) / wall_total for s in range(stages)]
        res.stages_or_ranks = stages
        res.busy_source = ("MP: profiler time inside ATen operators while each stage runs / step time (one process "
                           "drives every stage)")
    elif main["compute_s"]:
        walls = [sum(r["wall_s"][i] for i in steps) for r in records]
        res.busy = [sum(r["compute_s"][i] for i in steps) / w for r, w in zip(records, walls)]
        res.in_collectives = [sum(r["comm_s"][i] for i in steps) / w for r, w in zip(records, walls)]
        res.busy_source = ("profiler: time inside ATen operators on each rank's training thread / step time; "
                           "in collectives: time a collective or send/recv was under way while that thread "
                           "computed nothing")
    return res


def estimate_for(cfg: TrainConfig, strategy: str, n: int) -> tuple[int, str]:
    """The estimator's per-device total for the recipe ``cfg`` under ``strategy`` on ``n`` devices and, for MP/PP,
    its layer layout."""
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.recommend import evaluate_setup
    from shardtune.memory.setup import Setup

    setup = Setup(cfg, num_gpus=n).with_(distributed_type=strategy)
    breakdown = evaluate_setup(analysis_for(cfg.model.model_name_or_path, cfg), setup)
    return breakdown.total, breakdown.stage_note


def model_label(model_name_or_path: str) -> str:
    """What the saved results call the model: its folder (or hub) name and its size, never the path it was read
    from (a benchmark's model may live in a temporary folder). ``shardtune estimate --measured`` quotes it
    ("measured with tiny-llama (4 layers x 256 hidden, 3.2 M parameters) on ..."), so it has no slash."""
    name = Path(model_name_or_path.rstrip("/")).name or model_name_or_path
    try:
        from shardtune.memory.inventory import ModelAnalysis, spoken_count

        inventory = ModelAnalysis(model_name_or_path).inventory
    except Exception:  # noqa: BLE001 - a model the estimator cannot read is still named
        return name
    kind = "" if inventory.model_type.lower() in name.lower() else f"{inventory.model_type}, "
    return (f"{name} ({kind}{inventory.num_layers} layers x {inventory.hidden_size} hidden, "
            f"{spoken_count(inventory.parameters)} parameters)")


def explain(res: Result, microbatches: int) -> str:
    """One line that says why the numbers look the way they do."""
    if res.error:
        return f"did not run: {res.error}"
    busy = ", ".join(f"{b:.0%}" for b in res.busy)
    strategy = strategy_named(res.strategy)
    if strategy.drives_several_devices:
        return (f"one stage busy at a time: stages busy {busy} of each step (together {sum(res.busy):.0%}); "
                f"the others wait for the activations")
    waiting = (f"; waiting in communication {', '.join(f'{c:.0%}' for c in res.in_collectives)}"
               if res.in_collectives else "")
    if strategy.pipelined:
        return (f"{microbatches} micro-batches keep the stages working at once; stages busy {busy}{waiting} "
                f"(the pipeline's fill and drain, the bubble, and the hand-over of activations)")
    if strategy.replicates:
        return (f"every rank trains on its own rows and all-reduces gradients once per step; ranks busy "
                f"{busy}{waiting}")
    return (f"every rank trains on its own rows and all-gathers each layer's weights and reduce-scatters its "
            f"gradients; ranks busy {busy}{waiting}")


def device_name() -> str:
    """What the setups ran on, for the saved results."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def bench_strategies(config: str, strategies: list[str], *, num_processes: int, steps: int, warmup_steps: int,
                     work_dir: Path, extra: list[str], timeout_s: float = 600.0) -> tuple[list[Result], dict]:
    """Run each setup; returns its measured rows (a row with ``error`` when the setup failed) and what the runs
    were: model, method, batch, sequence length, processes and device (``shardtune estimate --measured`` reads
    these from the saved file)."""
    from shardtune.train.plot import read_metrics

    from shardtune.memory.setup import Setup

    cfg = load_recipe(config, extra, work_dir)
    described = Setup(cfg).to_dict()
    setup_kwargs = {key: described[key] for key in ("method", "batch_size", "seq_len", "gradient_checkpointing",
                                                     "mixed_precision", "lora_r", "lora_target_modules",
                                                     "gradient_accumulation_steps")}
    results = []
    for strategy in (strategy_named(s).name for s in strategies):
        code, output = run_setup(config, strategy, work_dir, num_processes=num_processes, steps=steps, extra=extra,
                                 timeout_s=timeout_s, callbacks=cfg.run.callbacks)
        if code != 0:
            res = Result(strategy=strategy, processes=num_processes, stages_or_ranks=num_processes,
                         error=f"exit {code}: {failure_line(output)[:400]}")
        else:
            res = summarise(strategy, work_dir / strategy / PROBE_DIR, warmup_steps)
            summary = json.loads((work_dir / strategy / "summary.json").read_text())
            res.peak_memory_bytes = summary["peak_memory_bytes"]
            res.losses = read_metrics(work_dir / strategy).series("loss")[1]
        try:
            res.estimate_bytes, res.layout = estimate_for(cfg, strategy, num_processes)
        except Exception as exc:  # noqa: BLE001 - an architecture the estimator cannot read still gets its row
            res.layout = f"no estimate ({type(exc).__name__})"
        res.explanation = explain(res, cfg.distributed.pipeline_microbatches)
        res.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        results.append(res)
    meta = {"model": model_label(cfg.model.model_name_or_path), "num_processes": num_processes,
            "device": device_name(), "steps": steps, "warmup_steps": warmup_steps} | setup_kwargs  # with the method
    return results, meta


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def format_table(results: list[Result], caveat: str) -> str:
    """A Markdown table, one row per setup, then one explanation line per setup and the caveat."""
    lines = ["| setup | procs | s/step | tokens/s | busy per device | in collectives | peak memory GiB (measured) | "
             "estimate GiB/device |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        busy = " / ".join(f"{b:.0%}" for b in r.busy) or "-"
        comm = " / ".join(f"{c:.0%}" for c in r.in_collectives) or "-"
        lines.append(f"| {r.strategy} | {r.processes} | "
                     f"{'-' if r.wall_per_step_s is None else f'{r.wall_per_step_s:.3f}'} | "
                     f"{'-' if r.tokens_per_s is None else f'{r.tokens_per_s:.0f}'} | {busy} | {comm} | "
                     f"{_gib(r.peak_memory_bytes)} | {_gib(r.estimate_bytes)} |")
    lines.append("")
    lines += [f"- {r.strategy}: {r.explanation}" for r in results]
    sources = sorted({r.busy_source for r in results if r.busy_source})
    lines += [""] + ([f"Busy fraction: {'; '.join(sources)}."] if sources else []) + [caveat]
    return "\n".join(lines)


def default_caveat(num_processes: int, load_average: float | None = None) -> str:
    import torch

    if torch.cuda.is_available():
        return ("Peak memory is torch.cuda.max_memory_reserved of the fullest device; the estimate excludes the "
                "CUDA context.")
    load = f" (1-minute load average {load_average:.1f} during the runs)" if load_average is not None else ""
    return (f"CPU run: the {num_processes} ranks (or MP's {num_processes} CPU 'devices', which share one process) "
            f"share {os.cpu_count()} cores with each other and with anything else on the machine{load}, so busy "
            f"fractions and speeds say how the setups schedule work, not what GPUs would do. Measured memory is "
            f"each process's peak RSS (Python, torch and the data included); the estimate is the GPU-side "
            f"memory of one device, so the two are not comparable on CPU.")


def strategy_figure(results: list[Result]):
    """Bars of tokens/s, and of each setup's mean step split: busy, waiting in collectives (CPU ranks), the rest."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in results if not r.error]
    names = [r.strategy for r in ok]
    fig = Figure(figsize=(9, 3.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.bar(names, [r.tokens_per_s for r in ok], color="tab:blue")
    left.set_title("tokens/s")
    busy = [sum(r.busy) / len(r.busy) if r.busy else 0.0 for r in ok]
    waiting = [sum(r.in_collectives) / len(r.in_collectives) if r.in_collectives else 0.0 for r in ok]
    right.bar(names, busy, color="tab:orange", label="busy")
    if any(waiting):
        right.bar(names, waiting, bottom=busy, color="tab:gray", label="in collectives")
        right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=2, fontsize="small", frameon=False)
    right.set_ylim(0, 1)
    right.set_title("share of each step, mean per device")
    return fig


def write_plot(results: list[Result], path: Path) -> Path:
    """``strategy_figure`` as a PNG (written to a temporary name, then renamed)."""
    from shardtune.files import figure_metadata, replacing

    fmt = path.suffix.lstrip(".").lower() or "png"
    with replacing(path) as tmp:
        strategy_figure(results).savefig(tmp, format=fmt, metadata=figure_metadata(fmt))
    return path
