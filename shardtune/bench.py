"""``shardtune bench strategies``: the same short job under MP, PP, DDP and FSDP, measured side by side.

Each setup runs as a real training job (``shardtune train`` for MP, torchrun for the others) through a small worker
that wraps the training step with a probe. The probe records, per rank and per optimizer step, the wall time and
the step's tokens, and (CPU ranks) runs PyTorch's profiler over every step to split each step's time three ways:

- compute: time inside ATen operators on the training thread (matmuls, attention, the optimizer's kernels, the
  copies into and out of communication buffers);
- in collectives: time a collective or point-to-point transfer (gloo's all-reduce, all-gather, reduce-scatter,
  send, recv: they run on gloo's own threads) was under way while the training thread computed nothing: waiting
  for the other ranks and moving the bytes;
- other: Python between operators, the data loader, and waiting outside any collective.

Under MP, where one process drives every stage, hooks on each stage's first and last decoder layer mark which stage
is running in the profiler's timeline, so compute is reported per device (stage). On CUDA, NVML's utilisation of
each GPU is sampled during the steps instead.

The first ``warmup_steps`` steps (allocation, schedule shape inference) are left out of every figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STRATEGIES = ("mp", "pp", "ddp", "fsdp")
DISTRIBUTED_TYPE = {"mp": "MP", "pp": "PP", "ddp": "DDP", "fsdp": "FSDP"}
PROBE_ENV = "SHARDTUNE_BENCH_PROBE"  # the worker writes probe-rank-R.json into this folder
STEP_MARK = "shardtune::step"
STAGE_MARK = "shardtune::stage "
# Profiler events of communication: the backends' own (gloo runs them on its threads) and c10d's dispatch.
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "c10d::", "record_param_comms")


# ----------------------------------------------------------------------------------------------------------------
# The probe, inside the training processes
# ----------------------------------------------------------------------------------------------------------------

class StageMarks:
    """Marks in the profiler's timeline which MP stage is running (``shardtune::stage S`` ranges).

    One thread drives every stage, one after the other: a stage becomes the running one when its first decoder
    layer starts its forward, and again when the gradient reaches its last layer's output in the backward; the
    backward pass ends with no stage running (the optimizer step is nobody's). The head and the loss count for the
    last stage, the embeddings for none.
    """

    def __init__(self, model, bounds: tuple[tuple[int, int], ...]) -> None:
        from shardtune.train.parallelize import unwrap

        layers = unwrap(model).model.layers
        self.running: int | None = None
        self._range = None
        for s, (start, end) in enumerate(bounds):
            layers[start].register_forward_pre_hook(lambda module, args, s=s: self.switch(s))
            layers[end - 1].register_forward_hook(self._on_output(s))

    def switch(self, stage: int | None) -> None:
        from torch.autograd.profiler import record_function

        if stage == self.running:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self.running = stage
        if stage is not None:
            self._range = record_function(f"{STAGE_MARK}{stage}")
            self._range.__enter__()

    def _on_output(self, s: int):
        def hook(module, args, output):  # noqa: ARG001
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: self._backward_reaches(s))
        return hook

    def _backward_reaches(self, s: int) -> None:
        import torch

        self.switch(s)
        if s == 0:  # the first stage's backward ends with the backward pass
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.switch(None))


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of ``intervals``."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(merged: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in merged if b > lo and a < hi]


def split_step_time(events, num_stages: int = 0) -> dict[str, list]:
    """Per step (one ``shardtune::step`` range each, in order): seconds of compute, of collectives not overlapped
    by compute, and (MP) of compute while each stage ran. ``events`` are the profiler's ``FunctionEvent``s."""
    steps = sorted((e.time_range.start, e.time_range.end, e.thread) for e in events if e.name == STEP_MARK)
    if not steps:
        return {"compute_s": [], "comm_s": [], "stage_compute_s": []}
    main_thread = steps[0][2]

    def is_comm(e) -> bool:
        return e.name.startswith(COMM_PREFIXES)

    def under_comm(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if is_comm(parent):
                return True
            parent = parent.cpu_parent
        return False

    compute = _merge([(e.time_range.start, e.time_range.end) for e in events
                      if e.thread == main_thread and e.name.startswith("aten::") and not under_comm(e)])
    comm = _merge([(e.time_range.start, e.time_range.end) for e in events if is_comm(e)])
    stages = [_merge([(e.time_range.start, e.time_range.end) for e in events if e.name == f"{STAGE_MARK}{s}"])
              for s in range(num_stages)]
    out: dict[str, list] = {"compute_s": [], "comm_s": [], "stage_compute_s": []}
    for lo, hi, _ in steps:  # the profiler's times are microseconds
        step_compute, step_comm = _clip(compute, lo, hi), _clip(comm, lo, hi)
        out["compute_s"].append(sum(b - a for a, b in step_compute) / 1e6)
        out["comm_s"].append((sum(b - a for a, b in step_comm) - _overlap(step_comm, step_compute)) / 1e6)
        if stages:
            out["stage_compute_s"].append([_overlap(_clip(st, lo, hi), step_compute) / 1e6 for st in stages])
    return out


class NvmlSampler:
    """Mean NVML utilisation of each visible GPU while it runs (CUDA only)."""

    def __init__(self, indices: list[int], period_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.sums = [0.0] * len(indices)
        self.samples = 0
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            for i, h in enumerate(self._handles):
                self.sums[i] += self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100
            self.samples += 1

    def means(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return [s / max(self.samples, 1) for s in self.sums]


@dataclass
class ProbeRecord:
    rank: int
    strategy: str
    wall_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # CPU ranks, from the profiler
    comm_s: list[float] = field(default_factory=list)
    stage_compute_s: list[list[float]] = field(default_factory=list)  # MP: compute while each stage ran
    gpu_util: list[float] = field(default_factory=list)


def install_probe(out_dir: Path) -> None:
    """Wrap the loop's ``train_step`` so every step is timed (and profiled on CPU); the records are written when
    training returns."""
    import torch
    from torch.autograd.profiler import record_function

    from shardtune.train import loop

    original = loop.train_step
    rank = int(os.environ.get("RANK", "0"))
    record = ProbeRecord(rank=rank, strategy="")
    state: dict[str, Any] = {}

    def timed_step(ctx, micro_batches):
        if not state:
            record.strategy = ctx.plan.strategy
            if ctx.plan.strategy == "MP" and ctx.plan.stage_bounds:
                state["marks"] = StageMarks(ctx.model, ctx.plan.stage_bounds)
                state["stages"] = len(ctx.plan.stage_bounds)
            if ctx.info.device.type == "cuda":
                indices = [torch.device(d).index or 0 for d in ctx.plan.devices] if ctx.plan.devices else \
                    [ctx.info.device.index or 0]
                try:
                    state["nvml"] = NvmlSampler(indices)
                except ImportError:  # no pynvml (nvidia-ml-py): no busy figures
                    pass
            else:
                state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                state["profiler"].__enter__()
        if "marks" in state:
            state["marks"].switch(None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter()
        with record_function(STEP_MARK):
            stats = original(ctx, micro_batches)  # .item() inside syncs the device before it returns
        record.wall_s.append(time.perf_counter() - wall)
        record.tokens.append(stats.tokens)
        return stats

    loop.train_step = timed_step
    original_train = loop.train

    def train_and_write(cfg):
        try:
            return original_train(cfg)
        finally:
            if "nvml" in state:
                record.gpu_util = state["nvml"].means()
            if "profiler" in state:
                if "marks" in state:
                    state["marks"].switch(None)
                state["profiler"].__exit__(None, None, None)
                split = split_step_time(state["profiler"].events(), state.get("stages", 0))
                record.compute_s, record.comm_s = split["compute_s"], split["comm_s"]
                record.stage_compute_s = split["stage_compute_s"]
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = out_dir / f".probe-rank-{rank}.json"
            tmp.write_text(json.dumps(asdict(record)))
            tmp.replace(out_dir / f"probe-rank-{rank}.json")

    loop.train = train_and_write


def worker_main(argv: list[str]) -> int:
    """``python -m shardtune.bench TRAIN_ARGS...``: ``shardtune train`` with the probe installed."""
    install_probe(Path(os.environ[PROBE_ENV]))
    from shardtune.config import load_train_config
    from shardtune.errors import UsageError
    from shardtune.train import loop

    try:
        loop.train(load_train_config(argv))
    except (UsageError, loop.TrainingStopped) as exc:
        print(f"shardtune bench: rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The driver: run each setup, summarise, estimate, explain
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    """One row of the table."""

    strategy: str
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


def job_args(config: str, strategy: str, out: Path, *, num_processes: int, steps: int, extra: list[str]) -> list[str]:
    """``shardtune train`` arguments of one setup."""
    args = [config, "--distributed_type", DISTRIBUTED_TYPE[strategy], "--output_dir", str(out),
            "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no"]
    if strategy == "mp" and not _cuda_devices():
        # No GPUs: one CPU "device" per stage, the same count as the other setups' processes.
        args += ["--mp_devices", ",".join(["cpu"] * num_processes)]
    return args + extra


def run_setup(config: str, strategy: str, work: Path, *, num_processes: int, steps: int, extra: list[str],
              timeout_s: float) -> tuple[int, str]:
    """Run one setup to completion; returns (exit code, the tail of its output)."""
    out = work / strategy
    env = dict(os.environ, **{PROBE_ENV: str(out / "probe")})
    env.setdefault("OMP_NUM_THREADS", "1")
    args = job_args(config, strategy, out, num_processes=num_processes, steps=steps, extra=extra)
    if strategy == "mp":
        cmd = [sys.executable, "-m", "shardtune.bench", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(num_processes), "-m", "shardtune.bench", *args, "--num_processes", str(num_processes)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


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


def estimate_for(config_model: str, strategy: str, setup_kwargs: dict[str, Any], n: int) -> tuple[int, str]:
    """The estimator's per-device total for this setup and, for MP/PP, its layer layout."""
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.recommend import evaluate
    from shardtune.memory.setup import Setup

    breakdown = evaluate(ModelAnalysis(config_model), Setup(strategy=strategy, num_gpus=n, **setup_kwargs))
    return breakdown.total, breakdown.stage_note


def explain(res: Result, microbatches: int) -> str:
    """One line that says why the numbers look the way they do."""
    if res.error:
        return f"did not run: {res.error}"
    busy = ", ".join(f"{b:.0%}" for b in res.busy)
    if res.strategy == "mp":
        return (f"one stage busy at a time: stages busy {busy} of each step (together {sum(res.busy):.0%}); "
                f"the others wait for the activations")
    waiting = (f"; waiting in communication {', '.join(f'{c:.0%}' for c in res.in_collectives)}"
               if res.in_collectives else "")
    if res.strategy == "pp":
        return (f"{microbatches} micro-batches keep the stages working at once; stages busy {busy}{waiting} "
                f"(the pipeline's fill and drain, the bubble, and the hand-over of activations)")
    if res.strategy == "ddp":
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
    from shardtune.config import load_train_config

    cfg = load_train_config([config, "--output_dir", str(work_dir), *extra])
    method = "qlora" if cfg.lora.use_4bit_quantization else "lora" if cfg.lora.use_peft_lora else "full"
    setup_kwargs = dict(method=method, batch_size=cfg.run.per_device_train_batch_size, seq_len=cfg.data.max_seq_len,
                        gradient_checkpointing=cfg.run.gradient_checkpointing, mixed_precision=cfg.mixed_precision,
                        lora_r=cfg.lora.lora_r, lora_target_modules=cfg.lora.lora_target_modules,
                        gradient_accumulation_steps=cfg.run.gradient_accumulation_steps)
    results = []
    for strategy in strategies:
        code, tail = run_setup(config, strategy, work_dir, num_processes=num_processes, steps=steps, extra=extra,
                               timeout_s=timeout_s)
        if code != 0:
            last = [line for line in tail.splitlines() if line.strip()][-1:] or ["no output"]
            res = Result(strategy=strategy, processes=num_processes, stages_or_ranks=num_processes,
                         error=f"exit {code}: {last[0][:200]}")
        else:
            res = summarise(strategy, work_dir / strategy / "probe", warmup_steps)
            summary = json.loads((work_dir / strategy / "summary.json").read_text())
            res.peak_memory_bytes = summary["peak_memory_bytes"]
            metrics = [json.loads(line) for line in (work_dir / strategy / "metrics.jsonl").read_text().splitlines()]
            res.losses = [m["loss"] for m in metrics if "loss" in m]
        try:
            res.estimate_bytes, res.layout = estimate_for(cfg.model.model_name_or_path, strategy, setup_kwargs,
                                                          num_processes)
        except Exception as exc:  # noqa: BLE001 - an architecture the estimator cannot read still gets its row
            res.layout = f"no estimate ({type(exc).__name__})"
        res.explanation = explain(res, cfg.distributed.pipeline_microbatches)
        res.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        results.append(res)
    meta = {"model": cfg.model.model_name_or_path, "num_processes": num_processes, "device": device_name(),
            "steps": steps, "warmup_steps": warmup_steps} | setup_kwargs
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
        lines.append(f"| {r.strategy.upper()} | {r.processes} | "
                     f"{'-' if r.wall_per_step_s is None else f'{r.wall_per_step_s:.3f}'} | "
                     f"{'-' if r.tokens_per_s is None else f'{r.tokens_per_s:.0f}'} | {busy} | {comm} | "
                     f"{_gib(r.peak_memory_bytes)} | {_gib(r.estimate_bytes)} |")
    lines.append("")
    lines += [f"- {r.strategy.upper()}: {r.explanation}" for r in results]
    sources = sorted({r.busy_source for r in results if r.busy_source})
    lines += ["", f"Busy fraction: {'; '.join(sources)}.", caveat]
    return "\n".join(lines)


def default_caveat(num_processes: int, load_average: float | None = None) -> str:
    import torch

    if torch.cuda.is_available():
        return ("Peak memory is torch.cuda.max_memory_reserved of the fullest device; the estimate excludes the "
                "CUDA context.")
    return (f"CPU run: the {num_processes} ranks (or MP's {num_processes} CPU 'devices', which share one process) "
            f"share {os.cpu_count()} cores with each other and with anything else on the machine"
            f"{f' (1-minute load average {load_average:.1f} during the runs)' if load_average is not None else ''}, so busy "
            f"fractions and speeds say how the setups schedule work, not what GPUs would do. Measured memory is "
            f"each process's peak RSS (Python, torch and the data included); the estimate is the GPU-side "
            f"memory of one device, so the two are not comparable on CPU.")


def write_plot(results: list[Result], path: Path) -> Path:
    """Bars of tokens/s and of the mean busy fraction per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if not r.error]
    names = [r.strategy.upper() for r in ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [r.tokens_per_s for r in ok], color="tab:blue")
    left.set_title("tokens/s")
    right.bar(names, [sum(r.busy) / len(r.busy) for r in ok], color="tab:orange")
    right.set_ylim(0, 1)
    right.set_title("mean busy fraction per device")
    fig.tight_layout()
    tmp = path.with_name("." + path.name)
    fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    tmp.replace(path)
    return path


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
