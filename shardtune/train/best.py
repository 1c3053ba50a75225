"""The best checkpoint and early stopping: ``load_best_model_at_end``, ``metric_for_best_model``,
``greater_is_better``, ``early_stopping_patience`` and ``early_stopping_threshold``, as Transformers names them.

The best checkpoint is decided when a checkpoint is saved, from the evaluation of that same step (the config check
makes every save step an eval step), so the best is always a checkpoint that exists; ``save_total_limit`` never
deletes it. Early stopping counts evaluations, saved or not, that do not beat the best evaluation so far by more
than the threshold. Both live in ``TrainState`` (as ``best``), so a resumed run carries on with them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from shardtune.config import TrainConfig
from shardtune.config.validation import metric_name

log = logging.getLogger("shardtune")


@dataclass
class Best:
    """What the run has seen of its metric: the best checkpoint, and the evaluations since the best evaluation."""

    metric: str = "eval_loss"
    greater_is_better: bool = False
    threshold: float = 0.0
    checkpoint_step: int | None = None  # checkpoints/step-N holds the best weights saved so far
    checkpoint_value: float | None = None
    checkpoint_dir: str | None = None  # the checkpoints folder it was saved in (another run's, after a resume there)
    eval_value: float | None = None  # the best evaluation so far, saved or not
    evals_without_improvement: int = 0

    def better(self, value: float, than: float | None, threshold: float = 0.0) -> bool:
        if than is None:
            return math.isfinite(value)
        return value > than + threshold if self.greater_is_better else value < than - threshold

    def on_evaluate(self, record: dict[str, Any]) -> None:
        """Count an evaluation for early stopping, as Transformers' EarlyStoppingCallback does: patience starts again
        where it beats the best so far by more than the threshold, and any better evaluation is the best from then
        on (so small gains do not add up to one that resets patience)."""
        value = record[self.metric]
        self.evals_without_improvement = 0 if self.better(value, self.eval_value, self.threshold) else \
            self.evals_without_improvement + 1
        if self.better(value, self.eval_value):
            self.eval_value = value

    def on_save(self, step: int, record: dict[str, Any] | None, folder: str | None = None) -> None:
        """Before checkpoint ``step`` is saved (in the checkpoints ``folder``): is it the best so far (by ``record``,
        that step's evaluation)?"""
        if record is None or record["step"] != step:
            return
        if self.better(record[self.metric], self.checkpoint_value):
            self.checkpoint_step, self.checkpoint_value, self.checkpoint_dir = step, record[self.metric], folder

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's best and count; where it chose them by another metric or direction, they would be compared
        with this run's values as if they were of one kind (a loss against perplexities): start afresh instead."""
        then = (state.get("metric", self.metric), state.get("greater_is_better", self.greater_is_better))
        if then != (self.metric, self.greater_is_better):
            log.warning("resume: the checkpoint's best was chosen by %s (%s is better), this run's by %s (%s is "
                        "better): the best checkpoint and early stopping's count start afresh from here", then[0],
                        _direction(then[1]), self.metric, _direction(self.greater_is_better))
            return
        for key in ("checkpoint_step", "checkpoint_value", "eval_value", "evals_without_improvement"):
            setattr(self, key, state[key])
        self.checkpoint_dir = state.get("checkpoint_dir")  # none in checkpoints from before it was kept


def _direction(greater: bool) -> str:
    return "higher" if greater else "lower"


def greater_is_better(cfg: TrainConfig) -> bool:
    """``greater_is_better``, or Transformers' default for the metric: lower is better for a loss."""
    if cfg.checkpoint.greater_is_better is not None:
        return cfg.checkpoint.greater_is_better
    return not metric_name(cfg.checkpoint.metric_for_best_model).endswith(("loss", "perplexity"))


def best_for(cfg: TrainConfig) -> Best:
    return Best(metric=metric_name(cfg.checkpoint.metric_for_best_model), greater_is_better=greater_is_better(cfg),
                threshold=cfg.run.early_stopping_threshold)
