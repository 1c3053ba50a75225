"""The training loss: the sum of next-token cross-entropies over the target tokens, one chunk at a time.

Sums, not means: the step divides by the target tokens of the whole global batch (``step.train_step``), which is
what keeps the loss independent of how the batch is split into processes and accumulation steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.data.encode import IGNORE as IGNORE_INDEX  # the label of a token that is no target

if TYPE_CHECKING:
    import torch

# No torch at import: the estimator reads LOSS_CHUNKS, and ``shardtune estimate`` of a catalog model imports no torch.
LOSS_CHUNKS = 8  # the fp32 upcast of the logits happens one chunk at a time (128k vocabularies make it huge)


def num_targets(labels: torch.Tensor) -> int:
    """Target positions after the shift by one (labels[:, 1:])."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _chunk_loss_sum(logit_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logit_chunk.float().flatten(0, 1), target_chunk.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the target positions, upcast to fp32 one chunk at a time.

    With a 128k vocabulary the fp32 log-softmax of a whole micro-batch is the largest tensor of the step.
    Chunking alone does not help backward, which would keep every chunk's fp32 log-softmax; so each chunk is
    checkpointed: its fp32 tensors are freed after forward and recomputed one chunk at a time in backward
    (the idea of torchtune's chunked cross-entropy). Values and gradients are unchanged.
    """
    import torch
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
