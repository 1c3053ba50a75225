"""``TrainState``: where a run stands, everything a checkpoint must hold to resume it exactly.

The optimizer step, the epoch, the data sampler's position, the learning-rate schedule, fp16's loss scaler, and
every random generator. It follows DCP's ``Stateful`` protocol (``state_dict`` / ``load_state_dict``); the
checkpoint stores the plain values as JSON (``trainer_state.json``, readable and never unpickled) and each rank's
RNG states as tensors (``rng/rank-R.pt``, loaded with ``weights_only=True``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune.data.sampler import GlobalBatchSampler
from shardtune.train.best import Best
from shardtune.train.metrics import strict_json
from shardtune.train.optim import load_schedule_state


def rng_state() -> dict[str, Any]:
    """Every RNG that training draws from, as tensors and plain values (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}
    if torch.cuda.is_available():
        # Every visible GPU's generator (host-side state, no context is made): MP's stages draw dropout masks on
        # their own devices.
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_all"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        if len(state.get("cuda_all", ())) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_all"])
        torch.cuda.set_rng_state(state["cuda"])


class TrainState:
    """The run's position: ``step`` (optimizer steps done), ``epochs_completed`` (the sampler's next epoch; ``epoch``
    is Transformers' float), the sampler, scheduler and loss scaler, the best checkpoint and early-stopping count
    (``best``), and
    ``log_history`` (every record metrics.jsonl got, as Transformers' ``TrainerState`` keeps them; a checkpoint
    carries it, so a resumed run's holds the earlier run's records). ``last_stats`` (the last step's) is not saved."""

    def __init__(self, sampler: GlobalBatchSampler, scheduler, scaler, max_steps: int,
                 best: Best | None = None, output_dir: str | None = None) -> None:
        self.sampler, self.scheduler, self.scaler = sampler, scheduler, scaler
        self.max_steps = max_steps
        self.best = best or Best()
        self.step = 0
        self.epochs_completed = 0  # the sampler's next epoch; ``epoch`` is Transformers' float
        self.steps_cut = 0  # the steps of epochs that should_epoch_stop cut short: never trained
        # input tokens of every step trained (all ranks, padding excluded), carried through resumes; None after a
        # resume from a checkpoint that did not count them
        self.tokens_seen: int | None = 0
        self.last_stats = None
        self.log_history: list[dict[str, Any]] = []
        self.output_dir = output_dir  # where best_model_checkpoint lies
        # the gradient_accumulation_steps this run was given, where a resume on other processes derived another
        self.configured_accumulation: int | None = None

    @property
    def global_step(self) -> int:
        """Transformers' name for ``step``, for callbacks written against ``TrainerState``."""
        return self.step

    @property
    def num_input_tokens_seen(self) -> int | None:
        """``TrainerState``'s name for ``tokens_seen``."""
        return self.tokens_seen

    @property
    def is_world_process_zero(self) -> bool:
        """``TrainerState``'s: whether this process is rank 0 of the job (Transformers' own callbacks ask it)."""
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0

    @property
    def is_local_process_zero(self) -> bool:
        """``TrainerState``'s: whether this process is the first on its machine."""
        import os

        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    @property
    def best_metric(self) -> float | None:
        """``TrainerState``'s: the best evaluation's ``metric_for_best_model`` so far (None before one)."""
        return self.best.eval_value

    @property
    def best_model_checkpoint(self) -> str | None:
        """``TrainerState``'s: the folder of the best checkpoint so far (None before one), as summary.json
        names it."""
        step = self.best.checkpoint_step
        if step is None:
            return None
        here = Path(self.output_dir or ".") / "checkpoints" / f"step-{step}"
        # saved by the run this one resumed from, in its own output_dir (a resume into another folder)
        saved = Path(self.best.checkpoint_dir) / f"step-{step}" if self.best.checkpoint_dir else here
        return str(here if here.is_dir() or not saved.is_dir() else saved)

    @property
    def epoch(self) -> float:
        """``TrainerState``'s ``epoch``: the float ``epochs_done`` (a callback ported from Transformers reads it so;
        1.5 halfway through the second epoch), not the whole epochs completed (``epochs_completed``)."""
        return self.epochs_done

    @property
    def epochs_done(self) -> float:
        """Epochs trained so far, as Transformers counts them: 2.5 halfway through the third; 5.0 at the end of the
        fifth. Counted from the steps done (and those should_epoch_stop skipped), not from the sampler, which is a
        step ahead while one trains: on_step_begin sees the epoch as the last step left it, as in Transformers."""
        return round((self.step + self.steps_cut) / self.sampler.steps_per_epoch, 4)

    def epoch_batches(self) -> Iterator[list[list[int]]]:
        """The rows of each remaining step of the current epoch (a resumed run starts where it stopped)."""
        self.sampler.set_epoch(self.epochs_completed)
        return iter(self.sampler)

    @property
    def num_train_epochs(self) -> int:
        """The epochs the run may begin, as Transformers' Trainer counts them: as many as ``max_steps`` reaches into
        (fewer steps in all where a callback's should_epoch_stop cut epochs short)."""
        return math.ceil(self.max_steps / self.sampler.steps_per_epoch)

    def cut_epoch(self) -> None:
        """A callback's should_epoch_stop: skip the rest of this epoch. The sampler then stands at the next epoch's
        first step, where a checkpoint saved now resumes; the skipped steps are counted (``steps_cut``). Once an
        epoch (a second call does nothing)."""
        sampler = self.sampler
        if sampler.epoch == self.epochs_completed and sampler.step_in_epoch < sampler.steps_per_epoch:
            self.steps_cut += sampler.steps_per_epoch - sampler.step_in_epoch
            sampler.set_epoch(self.epochs_completed + 1)

    def end_epoch(self) -> None:
        """After an epoch's last step: count it done when it ran to its end or was cut short; a run that stopped
        inside an epoch (max_steps, a stop) leaves it unfinished."""
        if self.sampler.epoch > self.epochs_completed or self.sampler.step_in_epoch == self.sampler.steps_per_epoch:
            self.epochs_completed += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epochs_done, "steps_cut": self.steps_cut,
                **({} if self.tokens_seen is None else {"tokens_seen": self.tokens_seen}),
                "sampler": self.sampler.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "best": self.best.state_dict(), "log_history": strict_json(self.log_history),
                **({} if self.configured_accumulation is None else
                   {"configured_gradient_accumulation_steps": self.configured_accumulation})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.steps_cut = state.get("steps_cut", 0)  # none in checkpoints from before should_epoch_stop acted
        self.tokens_seen = state.get("tokens_seen")  # none in checkpoints from before it was counted: unknown
        best = state.get("best") or {}
        same_metric = (best.get("metric"), best.get("greater_is_better")) == (self.best.metric,
                                                                               self.best.greater_is_better)
        load_schedule_state(self.scheduler, state["scheduler"], steps_done=self.step, same_metric=same_metric)
        self.sampler.load_state_dict(state["sampler"])
        # Epochs completed, from where the sampler stopped: a checkpoint taken at an epoch's last step (save_steps
        # or the run's last step) resumes with the next epoch, whichever strategy wrote it.
        self.epochs_completed = self.sampler.epoch + int(self.sampler.step_in_epoch == self.sampler.steps_per_epoch)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("best"):  # checkpoints from before best-model tracking have none
            self.best.load_state_dict(state["best"])
        history = state.get("log_history")
        self.log_history[:] = history if isinstance(history, list) else []  # none in checkpoints before it was kept


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def trainer_state_problem(state: Any, *, folder_step: int | None, manifest_step: Any) -> str | None:
    """What in a checkpoint's ``trainer_state.json`` cannot be a real run's position (one line), or None.

    The manifest's hashes prove a file unchanged since it was saved, not that it was saved right (or that whoever
    made the folder wrote sane values): the step must be a whole number matching the folder's ``step-N`` and the
    manifest, and the sampler's position must lie within its data and add up to that step.
    """
    if not isinstance(state, dict):
        return "trainer_state.json holds no object"
    step, sampler = state.get("step"), state.get("sampler")
    if not _whole(step):
        return f"trainer_state.json: step {step!r} is not a whole number >= 0"
    if folder_step is not None and step != folder_step:
        return f"trainer_state.json: step {step} does not match the folder's step-{folder_step}"
    if manifest_step is not None and step != manifest_step:
        return f"trainer_state.json: step {step} does not match manifest.json's step {manifest_step}"
    epoch = state.get("epoch")
    if not isinstance(epoch, (int, float)) or isinstance(epoch, bool) or not 0 <= epoch < float("inf"):
        return f"trainer_state.json: epoch {epoch!r} is not a finite number >= 0"
    if not isinstance(sampler, dict) or not all(_whole(sampler.get(k)) for k in
                                                ("epoch", "step_in_epoch", "num_rows", "global_batch_size")):
        return "trainer_state.json: the sampler's position (epoch, step_in_epoch, num_rows, global_batch_size) is " \
               "missing or not whole numbers >= 0"
    steps_cut = state.get("steps_cut", 0)
    if not _whole(steps_cut):
        return f"trainer_state.json: steps_cut {steps_cut!r} is not a whole number >= 0"
    if "tokens_seen" in state and not _whole(state["tokens_seen"]):
        return f"trainer_state.json: tokens_seen {state['tokens_seen']!r} is not a whole number >= 0"
    if sampler["global_batch_size"] == 0:
        return "trainer_state.json: the sampler's global_batch_size is 0"
    per_epoch = sampler["num_rows"] // sampler["global_batch_size"]
    if sampler["step_in_epoch"] > per_epoch:
        return (f"trainer_state.json: the sampler is at step {sampler['step_in_epoch']} of an epoch that has "
                f"{per_epoch} ({sampler['num_rows']} rows, {sampler['global_batch_size']} a step)")
    if sampler["epoch"] * per_epoch + sampler["step_in_epoch"] - steps_cut != step:
        cut = f", less steps_cut {steps_cut}" if steps_cut else ""  # the steps should_epoch_stop skipped
        return (f"trainer_state.json: the sampler's position (epoch {sampler['epoch']}, step {sampler['step_in_epoch']}"
                f" of {per_epoch}{cut}) is not step {step}")
    return None
