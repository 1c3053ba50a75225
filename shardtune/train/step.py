"""One optimizer step and one evaluation pass: the same code for one process, DDP and FSDP2.

The loss of a step is the mean over the target tokens of the whole global batch (every micro-batch of every
rank), never a mean of per-micro-batch means: that is what makes the loss and the gradients independent of how the
global batch is split into processes and accumulation steps (the 2024 gradient-accumulation bug in Transformers
was exactly this). Each micro-batch contributes ``sum of its token losses / global target tokens``; DDP and FSDP
average gradients over ranks, so the backward loss is multiplied by the world size to turn that average back
into the sum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.data.collate import varlen_kwargs
from shardtune.train.dist import DistInfo, all_reduce_sum
from shardtune.train.parallelize import Plan, unwrap

IGNORE_INDEX = -100
LOSS_CHUNKS = 8  # the fp32 upcast of the logits happens one chunk at a time (128k vocabularies make it huge)


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    tokens: int  # input tokens of the global batch, padding excluded
    target_tokens: int  # tokens the loss was computed on


def num_targets(labels: torch.Tensor) -> int:
    """Target positions after the shift by one (labels[:, 1:])."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _chunk_loss_sum(logit_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logit_chunk.float().flatten(0, 1), target_chunk.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the target positions, upcast to fp32 one chunk at a time.

    With a 128k vocabulary the fp32 log-softmax of a whole micro-batch is the largest tensor of the step.
    Chunking alone does not help backward, which would keep every chunk's fp32 log-softmax; so each chunk is
    checkpointed: its fp32 tensors are freed after forward and recomputed one chunk at a time in backward
    (the idea of torchtune's chunked cross-entropy). Values and gradients are unchanged.
    """
    from torch.utils.checkpoint import checkpoint

    logits = logits[:, :-1]
    targets = labels[:, 1:]
    total = logits.new_zeros((), dtype=torch.float32)
    for logit_chunk, target_chunk in zip(logits.chunk(LOSS_CHUNKS, dim=1), targets.chunk(LOSS_CHUNKS, dim=1)):
        if logit_chunk.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, logit_chunk, target_chunk, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(logit_chunk, target_chunk)
    return total


def uses_varlen_attention(model: nn.Module) -> bool:
    """Whether the model runs flash attention, which reads the batch's documents from ``varlen_kwargs``."""
    implementation = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None) or ""
    return implementation.startswith("flash_attention")


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, *,
                 varlen: bool = False) -> dict[str, torch.Tensor | int]:
    """The batch on ``device`` without its labels; with ``varlen`` (flash attention) also the documents' bounds."""
    inputs: dict[str, torch.Tensor | int] = {k: v.to(device, non_blocking=True) for k, v in batch.items()
                                             if k != "labels" and v is not None}
    if varlen:
        inputs.update(varlen_kwargs(batch["position_ids"], device))
    return inputs


def _autocast(plan: Plan, info: DistInfo, compute_dtype: torch.dtype):
    """autocast for one process and DDP; FSDP2 casts parameters itself (MixedPrecisionPolicy)."""
    if compute_dtype == torch.float32 or plan.strategy == "FSDP":
        return contextlib.nullcontext()
    return torch.autocast(info.device.type, dtype=compute_dtype)


def _sync_context(model: nn.Module, plan: Plan, is_last: bool):
    """Hold back the gradient reduction on all but the last micro-batch, where that costs no memory."""
    if not plan.defers_gradient_sync or not torch.distributed.is_initialized():
        return contextlib.nullcontext()
    if plan.strategy == "DDP":
        return contextlib.nullcontext() if is_last else model.no_sync()
    model.set_requires_gradient_sync(is_last)
    return contextlib.nullcontext()


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm (correct for sharded DTensor gradients), clipped to ``max_norm`` when > 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        # Each rank holds the norm of its shards: full_tensor() reduces the partial squares across ranks.
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@dataclass
class StepContext:
    """What a step needs besides the batch; built once by the loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: Plan
    info: DistInfo
    compute_dtype: torch.dtype
    max_grad_norm: float
    pad_token_id: int  # never a real token (the data pipeline guarantees pad != eos), so it counts padding
    scaler: torch.amp.GradScaler | None = None
    pipeline: Any = None  # PP: a pipeline.PipelineRunner that runs forward and backward through the stages

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def train_step(ctx: StepContext, micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
    """Forward and backward every micro-batch of this rank, then one optimizer step."""
    info = ctx.info
    local = [num_targets(b["labels"]) for b in micro_batches]
    # Under PP every rank reads the same batch: the sums over ranks count it once per stage.
    copies = ctx.pipeline.num_stages if ctx.pipeline is not None else 1
    global_targets = all_reduce_sum([float(sum(local))], info.device)[0].item() / copies
    # A global batch of prompts only (no targets anywhere) contributes no gradient; avoid 0/0.
    denominator = max(global_targets, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    tokens = 0
    if ctx.pipeline is not None:  # no gradient averaging over ranks: the scale is 1 / global targets
        loss_sum = ctx.pipeline.forward_backward(micro_batches, scale=1.0 / denominator)
        tokens = sum(int((b["input_ids"] != ctx.pad_token_id).sum()) for b in micro_batches)
        micro_batches = []  # forward and backward are done: skip the per-micro-batch loop below
    varlen = uses_varlen_attention(ctx.model)
    for i, batch in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        labels = batch["labels"].to(info.device, non_blocking=True)
        with _sync_context(ctx.model, ctx.plan, is_last), _autocast(ctx.plan, info, ctx.compute_dtype):
            inputs = model_inputs(batch, info.device, varlen=varlen)
            # No name holds the logits: the loss's graph frees them once its chunks' backward has run, instead of
            # their living through the whole backward of the layers (a vocabulary-sized tensor per token).
            micro_sum = token_loss_sum(ctx.model(**inputs, use_cache=False).logits, labels)
        loss = micro_sum * (info.world_size / denominator)
        (ctx.scaler.scale(loss) if ctx.scaler else loss).backward()
        loss_sum += micro_sum.detach().double()
        tokens += int((batch["input_ids"] != ctx.pad_token_id).sum())
    if ctx.scaler:
        ctx.scaler.unscale_(ctx.optimizer)
    norm = (ctx.pipeline.grad_norm_and_clip if ctx.pipeline is not None else grad_norm_and_clip)(
        ctx.trainable, ctx.max_grad_norm)
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64,
                                                                  device=info.device)]), info.device)
    mean_loss = totals[0].item() / denominator
    totals[1] /= copies
    grad_norm = float(norm)
    stepped = True
    if ctx.scaler:
        scale = ctx.scaler.get_scale()
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
        # An overflow skips the update and backs the scale off; the schedule then waits too (as in Transformers'
        # Trainer and Accelerate), so the learning rate follows the updates actually made.
        stepped = ctx.scaler.get_scale() >= scale
    elif math.isfinite(grad_norm):
        ctx.optimizer.step()
    if stepped:
        ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    if not math.isfinite(mean_loss) or (not ctx.scaler and not math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"loss {mean_loss}, gradient norm {grad_norm}")
    return StepStats(loss=mean_loss, grad_norm=grad_norm, tokens=int(totals[1].item()),
                     target_tokens=int(global_targets))


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterator[dict[str, torch.Tensor]], plan: Plan, info: DistInfo,
             compute_dtype: torch.dtype, pipeline: Any = None) -> dict[str, float]:
    """Mean loss over every target token of the eval split (all ranks), and its perplexity.

    ``pipeline`` (PP): every rank reads the same batches and runs its stage; the last stage has the loss, and the
    sums over ranks give every rank the same result.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    targets = 0
    varlen = uses_varlen_attention(model)
    for batch in batches:
        labels = batch["labels"].to(info.device)
        if pipeline is not None:
            loss_sum += pipeline.forward_only(batch)
        else:
            with _autocast(plan, info, compute_dtype):
                inputs = model_inputs(batch, info.device, varlen=varlen)
                logits = model(**inputs, use_cache=False).logits
                loss_sum += token_loss_sum(logits, labels).double()
        targets += num_targets(labels)
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(targets), dtype=torch.float64,
                                                                  device=info.device)]), info.device)
    totals[1] /= pipeline.num_stages if pipeline is not None else 1  # PP: each stage counted the same batches
    model.train(was_training)
    loss = totals[0].item() / max(totals[1].item(), 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(totals[1].item())}
