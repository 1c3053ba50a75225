"""The probe of ``shardtune bench strategies``: a training callback (``--callbacks shardtune.bench.probe:Probe``).

On every rank it records, per optimizer step, the wall time and the step's tokens, and (CPU ranks) runs PyTorch's
profiler over the steps, which splits each step's time three ways:

- compute: time inside ATen operators on the training thread (matmuls, attention, the optimizer's kernels, the
  copies into and out of communication buffers);
- in collectives: time a collective or point-to-point transfer (gloo's all-reduce, all-gather, reduce-scatter,
  send, recv: they run on gloo's own threads) was under way while the training thread computed nothing: waiting
  for the other ranks and moving the bytes;
- other: Python between operators, the data loader, and waiting outside any collective.

Under MP, where one process drives every stage, hooks on each stage's first and last decoder layer mark which stage
is running in the profiler's timeline, so compute is reported per device (stage). On CUDA, NVML's utilisation of
each GPU is sampled during the steps instead. The records go to ``OUTPUT_DIR/probe/probe-rank-R.json`` when
training ends. Any ``shardtune train`` run can carry it; the bench adds it to every setup it starts.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from shardtune.bench import PROBE_DIR
from shardtune.train.callbacks import TrainerCallback
from shardtune.train.plan import unwrap

if TYPE_CHECKING:
    from shardtune.config import TrainConfig
    from shardtune.dist import DistInfo
    from shardtune.train.callbacks import TrainerControl
    from shardtune.train.plan import Plan
    from shardtune.train.state import TrainState
    from shardtune.train.step import StepStats

STEP_MARK = "shardtune::step"  # one profiler range per optimizer step
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

    def __init__(self, model: torch.nn.Module, bounds: tuple[tuple[int, int], ...]) -> None:
        layers = unwrap(model).model.layers
        self.running: int | None = None
        self._range = None
        for s, (start, end) in enumerate(bounds):
            layers[start].register_forward_pre_hook(lambda module, args, s=s: self.switch(s))
            layers[end - 1].register_forward_hook(self._on_output(s))

    def switch(self, stage: int | None) -> None:
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


class Probe(TrainerCallback):
    """Times every step and, once training ends, writes this rank's ``ProbeRecord`` to ``OUTPUT_DIR/probe``.

    The loop calls ``on_step_begin`` right before a step's forward, backward and optimizer work and
    ``on_step_end`` right after it, so the time between the two is the step. The profiler and NVML start with the
    first step, not with training, so that loading and setup count in neither.
    """

    def __init__(self) -> None:
        self.record = ProbeRecord(rank=0, strategy="")
        self._out_dir = Path(PROBE_DIR)
        self._gpu_indices: list[int] = []  # the torch GPUs this rank drives (MP: one per stage); none on CPU
        self._marks: StageMarks | None = None
        self._num_stages = 0
        self._profiler: torch.profiler.profile | None = None
        self._nvml: NvmlSampler | None = None
        self._watching = False
        self._step: record_function | None = None
        self._step_start_s = 0.0

    def on_train_begin(self, args: TrainConfig, state: TrainState, control: TrainerControl, *, model: torch.nn.Module,
                       plan: Plan, info: DistInfo, **kwargs: Any) -> None:
        self.record = ProbeRecord(rank=info.rank, strategy=plan.strategy.name)
        self._out_dir = Path(args.run.output_dir) / PROBE_DIR
        if info.device.type == "cuda":
            devices = [torch.device(d) for d in plan.devices] or [info.device]
            self._gpu_indices = [d.index or 0 for d in devices]
        if plan.strategy.drives_several_devices and plan.stage_bounds:
            self._marks = StageMarks(model, plan.stage_bounds)
            self._num_stages = len(plan.stage_bounds)

    def on_step_begin(self, args: TrainConfig, state: TrainState, control: TrainerControl, **kwargs: Any) -> None:
        if not self._watching:
            self._start_watching()
        if self._marks is not None:
            self._marks.switch(None)  # an evaluation's forward may have left a stage running
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # work queued before the step is not the step's
        self._step_start_s = time.perf_counter()
        self._step = record_function(STEP_MARK)
        self._step.__enter__()

    def on_step_end(self, args: TrainConfig, state: TrainState, control: TrainerControl, *, stats: StepStats,
                    **kwargs: Any) -> None:
        # The step's loss is already a Python float (its .item() waited for the device), so the clock is fair.
        self._step.__exit__(None, None, None)
        self.record.wall_s.append(time.perf_counter() - self._step_start_s)
        self.record.tokens.append(stats.tokens)

    def on_train_end(self, args: TrainConfig, state: TrainState, control: TrainerControl, **kwargs: Any) -> None:
        if self._nvml is not None:
            self.record.gpu_util = self._nvml.means()
        if self._profiler is not None:
            if self._marks is not None:
                self._marks.switch(None)
            self._profiler.__exit__(None, None, None)
            split = split_step_time(self._profiler.events(), self._num_stages)
            self.record.compute_s, self.record.comm_s = split["compute_s"], split["comm_s"]
            self.record.stage_compute_s = split["stage_compute_s"]
        self._write()

    def _start_watching(self) -> None:
        """NVML on CUDA (it may be missing: the table then says "-"), the profiler on CPU."""
        self._watching = True
        if self._gpu_indices:
            try:
                self._nvml = NvmlSampler(self._gpu_indices)
            except Exception as exc:  # noqa: BLE001 - no NVML (driver, container): the table says "-"
                print(f"shardtune bench: no GPU utilisation figures: NVML unavailable ({exc})", file=sys.stderr)
        else:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    def _write(self) -> None:
        # Written under a temporary name, then renamed: the bench never reads half a record.
        self._out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._out_dir / f".probe-rank-{self.record.rank}.json"
        tmp.write_text(json.dumps(asdict(self.record)))
        tmp.replace(self._out_dir / f"probe-rank-{self.record.rank}.json")
