"""Evaluation during training: when ``eval_strategy`` says so, the eval split's loss over every rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from shardtune.config import TrainConfig
from shardtune.train.step import evaluate

log = logging.getLogger("shardtune")


class Evaluator:
    """Decides when to evaluate (``eval_strategy``, ``eval_steps``, else ``logging_steps``) and runs the pass."""

    def __init__(self, cfg: TrainConfig, job) -> None:
        self.strategy = cfg.run.eval_strategy
        self.every = cfg.run.eval_steps or cfg.run.logging_steps
        self.batch_size = cfg.run.per_device_eval_batch_size
        self.job = job

    def should_evaluate(self, step: int, *, at_epoch_end: bool, at_end: bool = False) -> bool:
        """epoch: each epoch's end; steps: every ``every`` steps and the run's last step (``at_end``: max_steps
        reached), as Transformers' Trainer evaluates the model it ends with."""
        if self.strategy == "epoch":
            return at_epoch_end
        return self.strategy == "steps" and not at_epoch_end and (step % self.every == 0 or at_end)

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        from shardtune.data import EvalSampler

        rows = self.job.data.eval
        world, rank = self.job.plan.data_split(self.job.info)
        for indices in EvalSampler(len(rows), batch_size=self.batch_size, world_size=world, rank=rank):
            yield self.job.collator([rows[i] if i is not None else None for i in indices])

    def run(self) -> dict[str, Any] | None:
        """The eval record for the current step; None when there is no eval split."""
        if self.job.data.eval is None or len(self.job.data.eval) == 0:
            return None
        state = self.job.state
        result = evaluate(self.job.runner, self._batches(), self.job.info)
        log.info("step %d: eval_loss %.4f, perplexity %.3f", state.step, result["eval_loss"],
                 result["eval_perplexity"])
        return {"step": state.step, "epoch": state.epochs_done, **result}
