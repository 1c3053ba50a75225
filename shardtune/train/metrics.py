"""What a run reports: one JSON line per logged step, a progress bar on rank 0, peak memory per device."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shardtune.dist import DistInfo
from shardtune.hardware import expert_shape, inactive_expert_weights, model_flops_per_token, peak_bf16_flops
from shardtune.train.trackers import Trackers

log = logging.getLogger("shardtune")


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA's reserved memory (what nvidia-smi sees minus the context), else peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def start_peak_memory(device: torch.device) -> None:
    """Count the training peak from here: loading left cached blocks (FSDP's unsharded staging of each unit,
    rank 0's broadcasts) and a peak that belong to no step; CUDA only (the CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def max_over_ranks(value: int, device: torch.device) -> int:
    if torch.distributed.is_initialized():
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())
    return value


class MetricsLog:
    """``metrics.jsonl`` in the output folder, appended (a resumed run continues the same file); rank 0 writes,
    and hands each record to the ``report_to`` trackers (``trackers.py``)."""

    def __init__(self, output_dir: str | Path, info: DistInfo, trackers: Trackers | None = None, *,
                 strategy: str = "steps", every: int = 1, first_step: bool | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.info = info
        self.enabled = info.is_main
        self.strategy, self.every = strategy, every  # logging_strategy, logging_steps
        self.first_step = strategy == "steps" if first_step is None else first_step  # logging_first_step
        self._logged_step: int | None = None  # the step of the last record
        self._window_tokens, self._window_start = 0, time.perf_counter()
        self.trackers = trackers if trackers is not None else Trackers()
        self._write_failed = False
        self.history = history if history is not None else []  # every rank's: TrainState.log_history

    def should_log(self, step: int, *, at_epoch_end: bool, last: bool, asked: bool = False) -> bool:
        """``logging_strategy`` steps: every ``logging_steps`` and the last step; epoch: each epoch's end (a step
        logged already, not again); no: nothing. Under any of them the first step too with ``logging_first_step``,
        as Transformers' Trainer logs it whatever the strategy, and a step a callback asked for with
        ``control.should_log`` (``asked``), once."""
        if (asked or (step == 1 and self.first_step)) and step != self._logged_step:
            return True
        if self.strategy == "no":
            return False
        if at_epoch_end:
            return self.strategy == "epoch" and step != self._logged_step
        return self.strategy == "steps" and (step % self.every == 0 or last) and step != self._logged_step

    def count(self, tokens: int) -> None:
        """Tokens of a step just taken, for the tokens/s of the next record."""
        self._window_tokens += tokens

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in here (an evaluation, a checkpoint's save) is no step's: the next record's tokens/s leaves
        it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - start

    def log_step(self, state, stats) -> dict[str, Any]:
        """The record of the step just taken (written on rank 0); tokens/s over the steps since the last record.
        Every rank must call it: the peak memory is the maximum over ranks."""
        elapsed = time.perf_counter() - self._window_start
        # learning_rate beside lr: Transformers' name, which a callback's on_log (and log_history) reads
        record = {"step": state.step, "epoch": state.epochs_done, "loss": stats.loss,
                  "lr": stats.lr, "learning_rate": stats.lr, "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                  "target_tokens": stats.target_tokens, "tokens_per_s": self._window_tokens / max(elapsed, 1e-9),
                  "peak_memory_bytes": max_over_ranks(peak_memory_bytes(self.info.device), self.info.device)}
        if state.tokens_seen is not None:  # every step's, logged or not (Transformers' num_input_tokens_seen)
            record["tokens_seen"] = state.tokens_seen
        if stats.loss_scale is not None:  # fp16: its fall shows the steps skipped for overflowing gradients
            record["loss_scale"] = stats.loss_scale
        self.write(record)
        self._logged_step = state.step
        self._window_tokens, self._window_start = 0, time.perf_counter()
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a whole line. A failed write (a full disk) leaves the file as it was and the run
        going, with one warning: the next checkpoint's save says in one line whether the disk is still full."""
        # a copy, as Trainer's log_history keeps one: a callback's on_log that edits its logs leaves the history
        # (and the checkpoint's copy of it) as metrics.jsonl has it
        self.history.append(dict(record))
        if not self.enabled:
            return
        self.trackers.log(record)  # each tracker's own failures are its own: they never stop this file
        try:
            append_line(self.path, json.dumps(strict_json(record), allow_nan=False))
        except OSError as exc:
            if not self._write_failed:
                log.warning("%s: the record of step %s was not written (%s); the file keeps only whole records and "
                            "training goes on; free disk space (the next checkpoint needs it too)", self.path,
                            record.get("step"), exc.strerror or exc)
            self._write_failed = True

    def close(self, failed: bool = False) -> None:
        """Finish the trackers' runs (``failed``: the run stopped with an error); a second call does nothing."""
        self.trackers.finish(failed)


def strict_json(value: Any) -> Any:
    """``value`` (a record, and what it holds) with its non-finite numbers as null: JSON has no NaN or Infinity,
    and a strict reader (jq, a browser, most languages) refuses a file that holds one (an fp16 step the loss
    scaler skipped has no finite gradient norm; a callback's record may hold anything)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def append_line(path: Path, text: str) -> None:
    """Append ``text`` and a newline to ``path``, all of it or nothing: a write cut short is taken back."""
    data = (text + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def progress_bar(total: int, initial: int, enabled: bool, *, iterable=None, desc: str = "train", unit: str = "step",
                 leave: bool = True):
    """A tqdm bar with loss, tokens/s and ETA on rank 0 (over ``iterable`` where given); a silent stand-in
    elsewhere. ``leave`` False: it goes when done, as the evaluation's under the training bar."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, leave=leave,
                dynamic_ncols=True, file=sys.stderr)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (and on CPU)."""
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def flops_per_token(model, parameters: int, trainable: int, seq_len: int, *, frozen_base: bool) -> float:
    """Model FLOPs per trained token of the transformers ``model`` holding ``parameters`` weights, ``trainable`` of
    them with gradients (with ``frozen_base``, LoRA's, the base model's weights are frozen):
    ``hardware.model_flops_per_token`` (PaLM's accounting, recomputation not counted) over the weights its matmuls
    use. An input embedding the LM head does not share is a lookup, and a mixture of experts runs
    ``num_experts_per_tok`` of its experts per token."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, hidden = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(embed, "weight", None)
    lookup = 0 if weight is None or getattr(head, "weight", None) is weight else weight.numel()
    lookup_trained = lookup if weight is not None and weight.requires_grad else 0
    experts, per_token, width = expert_shape(config)
    idle = inactive_expert_weights(layers=layers, hidden=hidden, experts=experts, per_token=per_token,
                                   intermediate=width)
    idle_trained = 0 if frozen_base else idle
    trained = trainable - lookup_trained - idle_trained
    frozen = parameters - trainable - (lookup - lookup_trained) - (idle - idle_trained)
    return model_flops_per_token(trained=trained, frozen=frozen, layers=layers, hidden=hidden, seq_len=seq_len)
