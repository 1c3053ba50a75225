"""The probe of ``shardtune bench strategies``, inside each training process: ``python -m shardtune.bench_probe``.

It runs ``shardtune train`` with the loop's ``train_step`` wrapped: per rank and per optimizer step, the wall time
and the step's tokens, and (CPU ranks) PyTorch's profiler over every step, which splits each step's time three ways:

- compute: time inside ATen operators on the training thread (matmuls, attention, the optimizer's kernels, the
  copies into and out of communication buffers);
- in collectives: time a collective or point-to-point transfer (gloo's all-reduce, all-gather, reduce-scatter,
  send, recv: they run on gloo's own threads) was under way while the training thread computed nothing: waiting
  for the other ranks and moving the bytes;
- other: Python between operators, the data loader, and waiting outside any collective.

Under MP, where one process drives every stage, hooks on each stage's first and last decoder layer mark which stage
is running in the profiler's timeline, so compute is reported per device (stage). On CUDA, NVML's utilisation of
each GPU is sampled during the steps instead. The records go to ``probe-rank-R.json`` in ``$SHARDTUNE_BENCH_PROBE``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROBE_ENV = "SHARDTUNE_BENCH_PROBE"  # the worker writes probe-rank-R.json into this folder
STEP_MARK = "shardtune::step"
STAGE_MARK = "shardtune::stage "
# Profiler events of communication: the backends' own (gloo runs them on its threads) and c10d's dispatch.
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "c10d::", "record_param_comms")



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
    """Mean NVML utilisation of each of the torch GPUs ``indices`` while it runs (CUDA only)."""

    def __init__(self, indices: list[int], period_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        # NVML numbers every GPU of the machine; torch only the visible ones (CUDA_VISIBLE_DEVICES, its order).
        import torch

        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(i)) for i in indices]
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
        if not state:  # the first step: set up once (NVML may fail; "ready" keeps it from being retried)
            state["ready"] = True
            record.strategy = ctx.plan.strategy
            if ctx.plan.strategy == "MP" and ctx.plan.stage_bounds:
                state["marks"] = StageMarks(ctx.model, ctx.plan.stage_bounds)
                state["stages"] = len(ctx.plan.stage_bounds)
            if ctx.info.device.type == "cuda":
                indices = [torch.device(d).index or 0 for d in ctx.plan.devices] if ctx.plan.devices else \
                    [ctx.info.device.index or 0]
                try:
                    state["nvml"] = NvmlSampler(indices)
                except Exception as exc:  # noqa: BLE001 - no NVML (driver, container): the table says "-"
                    print(f"shardtune bench: no GPU utilisation figures: NVML unavailable ({exc})", file=sys.stderr)
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
    """``python -m shardtune.bench_probe TRAIN_ARGS...``: ``shardtune train`` with the probe installed."""
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


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
