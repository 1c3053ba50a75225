"""One optimizer step and one evaluation pass: the same code for every strategy.

The loss of a step is the mean over the target tokens of the whole global batch (every micro-batch of every
rank), never a mean of per-micro-batch means: that is what makes the loss and the gradients independent of how the
global batch is split into processes and accumulation steps (the 2024 gradient-accumulation bug in Transformers
was exactly this). Each micro-batch contributes ``sum of its token losses / global target tokens``. How forward and
backward run (one process, DDP, FSDP2, MP, a pipeline) is the runner's business (``parallelize``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.dist import DistInfo, all_reduce_sum
from shardtune.train.loss import num_targets
from shardtune.train.optim import moves_on_evaluations
from shardtune.train.parallelize import Runner


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    tokens: int  # input tokens of the global batch, padding excluded
    target_tokens: int  # tokens the loss was computed on
    lr: float  # the learning rate this step's update used (the schedule has moved on to the next step's)
    loss_scale: float | None = None  # fp16's loss scale after this step (None without a scaler)
    skipped: bool = False  # fp16's scaler found inf/NaN gradients: no update, the scale backed off


@dataclass
class StepContext:
    """What a step needs besides the batch; built once by the loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    runner: Runner
    info: DistInfo
    max_grad_norm: float
    pad_token_id: int  # never a real token (the data pipeline guarantees pad != eos), so it counts padding

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def _loss_and_count(loss_sum: torch.Tensor, count: int, device: torch.device, copies: int) -> tuple[float, float]:
    """A summed loss and a token count over every rank. Under PP only the last stage holds the loss, while every
    stage counted the same tokens (``copies`` of them): the count is divided, the loss is not."""
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=device)]),
                            device)
    return totals[0].item(), totals[1].item() / copies


def train_step(ctx: StepContext, micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
    """Forward and backward every micro-batch of this rank, then one optimizer step."""
    runner, device = ctx.runner, ctx.info.device
    local_targets = sum(num_targets(b["labels"]) for b in micro_batches)
    global_targets = all_reduce_sum([float(local_targets)], device)[0].item() / runner.copies
    # A global batch of prompts only (no targets anywhere) contributes no gradient; avoid 0/0.
    denominator = max(global_targets, 1.0)
    loss_sum = runner.forward_backward(micro_batches, scale=1.0 / denominator)
    tokens = sum(int((b["input_ids"] != ctx.pad_token_id).sum()) for b in micro_batches)
    scaler = runner.scaler
    if scaler:
        scaler.unscale_(ctx.optimizer)
    grad_norm = float(runner.grad_norm_and_clip(ctx.trainable, ctx.max_grad_norm))
    total_loss, total_tokens = _loss_and_count(loss_sum, tokens, device, runner.copies)
    mean_loss = total_loss / denominator
    lr = ctx.scheduler.get_last_lr()[0]  # before the schedule moves on, as Transformers' Trainer logs it
    stepped, loss_scale = True, None
    if scaler:
        scale = scaler.get_scale()
        scaler.step(ctx.optimizer)
        scaler.update()
        # An overflow skips the update and backs the scale off; the schedule then waits too (as in Transformers'
        # Trainer and Accelerate), so the learning rate follows the updates actually made.
        loss_scale = scaler.get_scale()
        stepped = loss_scale >= scale
    elif math.isfinite(grad_norm):
        ctx.optimizer.step()
    if stepped and not moves_on_evaluations(ctx.scheduler):
        ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    if not math.isfinite(mean_loss) or (not scaler and not math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"loss {mean_loss}, gradient norm {grad_norm}")
    return StepStats(loss=mean_loss, grad_norm=grad_norm, tokens=int(total_tokens), target_tokens=int(global_targets),
                     lr=lr, loss_scale=loss_scale, skipped=not stepped)


@torch.no_grad()
def evaluate(runner: Runner, batches: Iterable[dict[str, torch.Tensor]], info: DistInfo) -> dict[str, float]:
    """Mean loss over every target token of the eval split (all ranks), and its perplexity."""
    model = runner.model
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    targets = 0
    for batch in batches:
        loss_sum += runner.eval_loss_sum(batch)
        targets += num_targets(batch["labels"])
    model.train(was_training)
    total_loss, total_targets = _loss_and_count(loss_sum, targets, info.device, runner.copies)
    loss = total_loss / max(total_targets, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(total_targets)}
