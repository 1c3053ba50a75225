"""torch ``DataLoader``s over the tokenised rows, as Transformers' Trainer hands them to callbacks
(``train_dataloader``, ``eval_dataloader``); evaluation reads its batches from the eval one.

The training loop takes its steps from ``GlobalBatchSampler`` itself; the train loader is a view of the same
micro-batches for callbacks (``len(train_dataloader)``, a look at a batch): iterating it does not move the run's
place in its epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from shardtune.data.sampler import EvalSampler, GlobalBatchSampler


class Rows(Dataset):
    """The rows by index; ``None`` (``EvalSampler``'s padding place) stays ``None`` for the collator."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | None) -> Any:
        return None if index is None else self.rows[index]


class EpochMicroBatches:
    """This rank's micro-batches of the sampler's current epoch, from its first step (a batch sampler)."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch * self.sampler.gradient_accumulation_steps

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.micro_batches()


def _loader(rows: Any, batch_sampler: Any, collate: Callable) -> DataLoader:
    """A DataLoader of ``rows`` with a generator of its own: each pass over a DataLoader draws a seed for its
    workers, from torch's global generator unless it is given one, and that generator draws the training's dropout
    masks on CPU: an evaluation (or a callback reading a batch) would change every later training step."""
    return DataLoader(Rows(rows), batch_sampler=batch_sampler, collate_fn=collate, generator=torch.Generator())


def train_loader(rows: Any, sampler: GlobalBatchSampler, collate: Callable) -> DataLoader:
    """The training rows as this rank reads them in the current epoch: one collated micro-batch per item."""
    return _loader(rows, EpochMicroBatches(sampler), collate)


def eval_loader(rows: Any, *, batch_size: int, world_size: int, rank: int, collate: Callable) -> DataLoader | None:
    """This rank's eval batches (every row once over the ranks, padded so that all run as many); None without
    eval rows."""
    if rows is None or len(rows) == 0:
        return None
    sampler = EvalSampler(len(rows), batch_size=batch_size, world_size=world_size, rank=rank)
    return _loader(rows, sampler, collate)
