"""The end-of-run memory check: the traced prediction of the job's per-device peak beside the measured one.

On CUDA the measured side is the caching allocator's ``max_memory_reserved``; on the CPU one real step runs under
PyTorch's memory tracker (``tracked_step``), the same accounting the trace does under fake tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from shardtune.config import TrainConfig
from shardtune.errors import first_line
from shardtune.train.dist import DistInfo
from shardtune.train.metrics import max_over_ranks, peak_memory_bytes
from shardtune.train.parallelize import Plan
from shardtune.train.step import StepContext, train_step

log = logging.getLogger("shardtune")


PREDICTABLE_STRATEGIES = ("NO", "DDP", "FSDP")  # what ``shardtune estimate --trace`` follows


def tracked_step(ctx: StepContext, micro_batches: list[dict[str, torch.Tensor]]):
    """One real training step under PyTorch's memory tracker: the per-rank peak of its tensors (CPU runs)."""
    from shardtune.memory.trace_tracker import (fresh_module_stats_per_micro_batch, make_tracker, peak_breakdown,
                                                track_inputs)

    fsdp = ctx.plan.strategy == "FSDP"
    tracker = make_tracker(ctx.model, ctx.optimizer, fsdp)
    track_inputs(tracker, fsdp, [t for batch in micro_batches for t in batch.values()])
    with fresh_module_stats_per_micro_batch(tracker, ctx.model), tracker:
        stats = train_step(ctx, micro_batches)
    return stats, peak_breakdown(tracker)[0]


def memory_check(cfg: TrainConfig, info: DistInfo, plan: Plan, tracked_peak: int,
                 seq_len: int) -> dict[str, Any] | None:
    """The traced prediction of this job's per-device peak beside the measured one (rank 0 gets the record).

    Measured: ``torch.cuda.max_memory_reserved`` on CUDA; on CPU the memory tracker's peak of a real step.
    ``seq_len``: the padded length of the longest micro-batch measured; the trace runs micro-batches of that
    length (rows without packing are padded to their batch's longest, often far below max_seq_len).
    A failed prediction is a warning, never a failed run.
    """
    if not cfg.run.predict_memory or plan.strategy not in PREDICTABLE_STRATEGIES:
        return None
    on_cuda = info.device.type == "cuda"
    measured = max_over_ranks(peak_memory_bytes(info.device) if on_cuda else tracked_peak, info.device)
    seq_len = max_over_ranks(seq_len, info.device)
    if not info.is_main or measured <= 0 or seq_len <= 0:
        return None
    from shardtune.memory.trace import predict_peak_bytes

    traced = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_seq_len=seq_len))
    try:
        predicted = predict_peak_bytes(traced, info.world_size)
    except Exception as exc:  # noqa: BLE001 - the run succeeded; the check is a report, not a gate
        first = first_line(str(exc), type(exc).__name__)
        log.warning("could not predict this job's peak memory (%s); the run itself is fine", first)
        return None
    return {"predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
            "peak_error": (predicted - measured) / measured, "traced_seq_len": seq_len,
            "measured_by": "torch.cuda.max_memory_reserved" if on_cuda else "memory tracker, real tensors"}
