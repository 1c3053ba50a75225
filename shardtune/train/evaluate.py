"""Evaluation during training: when ``eval_strategy`` says so, the eval split's loss over every rank."""

from __future__ import annotations

import logging
from typing import Any

from shardtune.config import TrainConfig
from shardtune.data.loaders import eval_loader
from shardtune.train.metrics import progress_bar
from shardtune.train.step import evaluate

log = logging.getLogger("shardtune")


class Evaluator:
    """Decides when to evaluate (``eval_strategy``, ``eval_steps``, else ``logging_steps``) and runs the pass."""

    def __init__(self, cfg: TrainConfig, job) -> None:
        self.strategy = cfg.run.eval_strategy
        self.every = cfg.run.eval_steps or cfg.run.logging_steps
        self.delay = cfg.run.eval_delay
        self.job = job
        self.show_bar = job.info.is_main and not cfg.run.disable_tqdm
        world, rank = job.plan.data_split(job.info)
        # this rank's eval batches; callbacks get it too, as Transformers' eval_dataloader
        self.loader = eval_loader(job.data.eval, batch_size=cfg.run.per_device_eval_batch_size, world_size=world,
                                  rank=rank, collate=job.collator)

    def should_evaluate(self, step: int, *, at_epoch_end: bool, at_end: bool = False) -> bool:
        """epoch: each epoch's end; steps: every ``every`` steps and the run's last step (``at_end``: max_steps
        reached), as Transformers' Trainer evaluates the model it ends with; none before ``eval_delay`` (a step, or
        with epoch an epoch)."""
        if self.strategy == "epoch":
            return at_epoch_end and self.job.state.epochs_done >= self.delay
        return self.strategy == "steps" and not at_epoch_end and (step % self.every == 0 or at_end) and \
            step >= self.delay

    def run(self) -> dict[str, Any] | None:
        """The eval record for the current step; None when there is no eval split."""
        if self.loader is None:
            return None
        state = self.job.state
        # a bar of this rank's batches, as Transformers shows one: a long evaluation is not a hung run
        bar = progress_bar(len(self.loader), 0, self.show_bar, iterable=self.loader, desc="eval", unit="batch",
                           leave=False)
        try:
            result = evaluate(self.job.runner, bar, self.job.info)
        finally:
            bar.close()
        log.info("step %d: eval_loss %.4f, perplexity %.3f", state.step, result["eval_loss"],
                 result["eval_perplexity"])
        return {"step": state.step, "epoch": state.epochs_done, **result}
