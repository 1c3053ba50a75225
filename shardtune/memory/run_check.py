"""The end-of-run memory check: the traced prediction of the job's per-device peak beside the measured one.

A callback of the training loop (``shardtune train`` adds it unless ``predict_memory`` is off). On CUDA the
measured side is the caching allocator's ``max_memory_reserved``; on the CPU one real step runs under PyTorch's
memory tracker, the same accounting the trace does under fake tensors: step 2, the first in which the optimizer
states exist, or a resumed run's first (they came with the checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from shardtune.config import TrainConfig
from shardtune.errors import first_line
from shardtune.train.metrics import max_over_ranks

logger = logging.getLogger("shardtune")


class MemoryCheck:
    """Measures the run's per-device peak and, at the end, compares it with the trace of the same job."""

    def __init__(self) -> None:
        self.active = False
        self.tracked_peak = 0
        # The padded length of the longest micro-batch measured (unpacked rows are padded to the batch's longest,
        # not to max_seq_len): the prediction traces that shape. On CPU the tracked step's; on CUDA the run's.
        self.seq_len = 0
        # The targets of each micro-batch measured (the head projects only those): on CPU the tracked step's, on
        # CUDA the most any step had at that place.
        self.target_tokens: list[int] = []
        self._tracking: contextlib.ExitStack | None = None
        self._tracker = None

    def on_train_begin(self, args: TrainConfig, state, control, *, model, optimizer, plan, info, **kwargs) -> None:
        self.active = not plan.strategy.splits_layers  # ``shardtune estimate --trace`` follows the data-parallel step
        self.model, self.optimizer, self.plan, self.info = model, optimizer, plan, info
        self.on_cpu = info.device.type == "cpu"
        self.start_step = state.step
        self.tracked_step = state.step + 1 if state.step else min(2, state.max_steps)

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs) -> None:
        if not self.active:
            return
        from shardtune.train.loss import num_targets

        longest = max(b["input_ids"].shape[1] for b in micro_batches)
        targets = [num_targets(b["labels"]) for b in micro_batches]
        if not self.on_cpu:
            self.seq_len = max(self.seq_len, longest)
            self.target_tokens = [max(pair) for pair in zip(targets, self.target_tokens or targets)]
        elif state.step + 1 == self.tracked_step:
            self.target_tokens = targets
            from shardtune.memory.trace_tracker import (dropped_graphs_freed, fresh_module_stats_per_micro_batch,
                                                           make_tracker, track_inputs)

            self.seq_len = longest
            fsdp = self.plan.strategy.shards_parameters
            self._tracker = make_tracker(self.model, self.optimizer, fsdp)
            track_inputs(self._tracker, fsdp, [t for batch in micro_batches for t in batch.values()])
            self._tracking = contextlib.ExitStack()
            self._tracking.enter_context(fresh_module_stats_per_micro_batch(self._tracker, self.model))
            self._tracking.enter_context(dropped_graphs_freed(self.model))
            self._tracking.enter_context(self._tracker)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._tracking is not None:
            from shardtune.memory.trace_tracker import peak_breakdown

            self._tracking.close()
            self._tracking = None
            self.tracked_peak = peak_breakdown(self._tracker)[0]

    def on_train_end(self, args: TrainConfig, state, control, *, summary: dict[str, Any], log, **kwargs) -> None:
        # A run that trained nothing (resumed at its last step) has no step to measure: no record, not a wrong one.
        # A run stopped by SIGTERM has a scheduler's grace period left, for its checkpoint: the trace (seconds to a
        # minute) would spend it before the checkpoint is verified, and its record would stand in metrics.jsonl
        # beside the one of the resumed run's end.
        if not self.active or state.step == self.start_step or summary.get("stopped_by") == "SIGTERM":
            return
        # On CUDA the run's peak as summary.json has it, read before the best checkpoint loaded (which may reserve
        # more): the step's peak is what the trace predicts. On CPU the tracked step's.
        measured = summary["peak_memory_bytes"] if self.info.device.type == "cuda" else self.tracked_peak
        memory = memory_check(args, self.info, measured, self.seq_len, self.target_tokens)
        if memory:
            summary.update(memory)
            log({"step": state.step, **memory})
            logger.info(
                "peak memory per %s: predicted %.3f GiB (traced at %d-token rows), measured %.3f GiB (%s), error "
                "%+.1f%%", "GPU" if self.info.device.type == "cuda" else "process",
                memory["predicted_peak_bytes"] / 2**30, memory["traced_seq_len"],
                memory["measured_peak_bytes"] / 2**30, memory["measured_by"], 100 * memory["peak_error"])


def memory_check(cfg: TrainConfig, info, measured_peak: int, seq_len: int,
                 target_tokens: list[int] | None = None) -> dict[str, Any] | None:
    """The traced prediction of this job's per-device peak beside the measured one (rank 0 gets the record).

    ``measured_peak``: this rank's ``torch.cuda.max_memory_reserved`` on CUDA; on CPU the memory tracker's peak of
    a real step.
    ``seq_len``: the padded length of the longest micro-batch measured; the trace runs micro-batches of that
    length, with ``target_tokens`` targets each (the most any rank had there), as the head projects only those.
    A failed prediction is a warning, never a failed run.
    """
    measured = max_over_ranks(measured_peak, info.device)
    seq_len = max_over_ranks(seq_len, info.device)
    targets = [max_over_ranks(count, info.device) for count in target_tokens] if target_tokens else None
    if not info.is_main or measured <= 0 or seq_len <= 0:
        return None
    from shardtune.memory.trace import predict_peak_bytes

    traced = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_seq_len=seq_len))
    # The trace takes seconds to a minute (every operator of two steps on fake tensors): say what the wait is.
    logger.info("predicting this job's peak memory by tracing two of its steps (predict_memory: false skips this)")
    try:
        predicted = predict_peak_bytes(traced, info.world_size, targets)
    except Exception as exc:  # noqa: BLE001 - the run succeeded; the check is a report, not a gate
        first = first_line(str(exc), type(exc).__name__)
        logger.warning("could not predict this job's peak memory (%s); the run itself is fine", first)
        return None
    return {"predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
            "peak_error": (predicted - measured) / measured, "traced_seq_len": seq_len, "traced_target_tokens": targets,
            "measured_by": "torch.cuda.max_memory_reserved" if info.device.type == "cuda"
            else "memory tracker, real tensors"}
