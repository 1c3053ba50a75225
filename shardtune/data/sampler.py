"""Samplers that give the same global batches whatever the number of ranks and gradient-accumulation steps.

Each epoch is one seeded permutation of the rows, cut into global batches of
``micro_batch_size * gradient_accumulation_steps * world_size`` rows; the last incomplete global batch is dropped
(those rows come back, in another order, next epoch). Optimizer step k always sees the same set of rows, so losses
compare across setups, and a resumed run (with any split of the same global batch) continues at step k + 1.

``group_by_length`` (unpacked rows, Transformers' key) keeps that contract while cutting padding: the permutation is
cut into groups of ``LENGTH_GROUP_BATCHES`` global batches, each group sorted by row length and cut into global
batches, the global batches shuffled (the one holding the longest row first, so a batch that does not fit shows
at step 1), and every global batch keeps its rows longest first, so each micro-batch, padded to its own longest
row, holds rows of about one length. All of it depends on the seed, the epoch, the lengths and the global batch
size only, so any world size and accumulation see the same steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from shardtune.errors import UsageError

# Global batches sorted together by group_by_length: Transformers' LengthGroupedSampler sorts 50 batches at a time.
LENGTH_GROUP_BATCHES = 50


class GlobalBatchSampler:
    """Yields, per optimizer step, this rank's ``gradient_accumulation_steps`` micro-batches of row indices."""

    def __init__(self, num_rows: int, *, micro_batch_size: int, gradient_accumulation_steps: int, world_size: int,
                 rank: int, seed: int, shuffle: bool = True, lengths: Sequence[int] | None = None,
                 rows_sha256: str = ""):
        """``lengths``: each row's length in tokens, to group rows of similar length (``group_by_length``);
        ``rows_sha256``: the rows' digest (``DataReport.rows_sha256``), which a resumed order must have too."""
        if min(micro_batch_size, gradient_accumulation_steps, world_size) < 1 or not 0 <= rank < world_size:
            raise ValueError("micro_batch_size, gradient_accumulation_steps and world_size must be >= 1 and "
                             "0 <= rank < world_size")
        self.num_rows, self.rows_sha256 = num_rows, rows_sha256
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        if lengths is not None and len(lengths) != num_rows:
            raise ValueError(f"lengths has {len(lengths)} entries for {num_rows} rows")
        self.lengths = list(lengths) if lengths is not None else None
        self.global_batch_size = micro_batch_size * gradient_accumulation_steps * world_size
        if num_rows < self.global_batch_size:
            raise UsageError(f"the data set has {num_rows} rows, fewer than one global batch of "
                             f"{self.global_batch_size} (per_device_train_batch_size x gradient_accumulation_steps "
                             "x processes): lower them or add data.")
        self.epoch = 0
        self.step_in_epoch = 0  # optimizer steps of this epoch already handed out

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the incomplete last global batch is dropped)."""
        return self.num_rows // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``; setting the epoch the sampler is already in keeps its position (resume)."""
        if epoch != self.epoch:
            self.epoch, self.step_in_epoch = epoch, 0

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = (torch.randperm(self.num_rows, generator=generator).tolist() if self.shuffle
                 else list(range(self.num_rows)))
        return order if self.lengths is None else self._grouped_by_length(order, generator)

    def _grouped_by_length(self, order: list[int], generator: torch.Generator) -> list[int]:
        """``order`` with each global batch made of rows of about one length (see the module's docstring)."""
        g, lengths = self.global_batch_size, self.lengths
        used = self.steps_per_epoch * g  # the rows past the last whole global batch stay out, as without grouping
        batches = []
        for start in range(0, used, g * LENGTH_GROUP_BATCHES):
            group = sorted(order[start:min(start + g * LENGTH_GROUP_BATCHES, used)], key=lambda i: -lengths[i])
            batches += [group[i:i + g] for i in range(0, len(group), g)]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        longest = max(range(len(batches)), key=lambda b: lengths[batches[b][0]])
        batches.insert(0, batches.pop(longest))
        return [row for batch in batches for row in batch] + order[used:]

    def global_batch(self, step: int) -> list[int]:
        """All rows of optimizer step ``step`` of the current epoch, over every rank."""
        return self._step_rows(self._order(), step)

    def _step_rows(self, order: list[int], step: int) -> list[int]:
        g = self.global_batch_size
        return order[step * g:(step + 1) * g]

    def _split(self, rows: list[int]) -> list[list[int]]:
        # micro-step a of rank r reads a contiguous slice; which slice is immaterial to the set of rows in the step
        per_step = self.micro_batch_size * self.world_size
        start = self.rank * self.micro_batch_size
        return [rows[a * per_step + start:a * per_step + start + self.micro_batch_size]
                for a in range(self.gradient_accumulation_steps)]

    def __len__(self) -> int:
        """Optimizer steps left in the current epoch."""
        return self.steps_per_epoch - self.step_in_epoch

    def __iter__(self) -> Iterator[list[list[int]]]:
        order = self._order()
        while self.step_in_epoch < self.steps_per_epoch:
            step = self.step_in_epoch
            # advance before yielding: a checkpoint taken after this step's update must point at the next one
            self.step_in_epoch += 1
            yield self._split(self._step_rows(order, step))

    def micro_batches(self) -> Iterator[list[int]]:
        """This rank's micro-batches of the whole current epoch, in the order its steps train them, leaving the
        position (``step_in_epoch``) as it is."""
        order = self._order()
        for step in range(self.steps_per_epoch):
            yield from self._split(self._step_rows(order, step))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed,
                "num_rows": self.num_rows, "global_batch_size": self.global_batch_size, "shuffle": self.shuffle,
                "group_by_length": self.lengths is not None, "rows_sha256": self.rows_sha256}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` stopped; the world size and accumulation may differ, the global batch may not."""
        mine = self.state_dict()
        for key in ("seed", "num_rows", "global_batch_size", "shuffle", "group_by_length"):
            if state.get(key, False) != mine[key]:  # checkpoints from before group_by_length did not group
                why = " (the training rows changed: the data, splits or eval_split_ratio)" if key == "num_rows" else ""
                raise UsageError(f"cannot resume: the checkpoint's data order has {key}={state.get(key, False)}, this "
                                 f"run has {mine[key]}{why}; keep the data set, splits, eval_split_ratio, seed, "
                                 "group_by_length and global batch size (per_device_train_batch_size x "
                                 "gradient_accumulation_steps x processes).")
        if state.get("rows_sha256") and self.rows_sha256 and state["rows_sha256"] != self.rows_sha256:
            raise UsageError(f"cannot resume: the {self.num_rows} training rows are not the checkpoint's (as many, "
                             f"other tokens: the data, the tokenizer or its chat template changed); resume with the "
                             f"data the run was started with, or start a new run in another output_dir.")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]


class EvalSampler:
    """Yields this rank's eval batches; every row is evaluated exactly once and every rank runs as many batches.

    Missing places are ``None`` (the Collator makes them padding rows without targets).
    """

    def __init__(self, num_rows: int, *, batch_size: int, world_size: int, rank: int):
        self.num_rows, self.batch_size, self.world_size, self.rank = num_rows, batch_size, world_size, rank

    def __len__(self) -> int:
        return -(-self.num_rows // (self.batch_size * self.world_size))

    def __iter__(self) -> Iterator[list[int | None]]:
        for b in range(len(self)):
            start = (b * self.world_size + self.rank) * self.batch_size
            yield [i if i < self.num_rows else None for i in range(start, start + self.batch_size)]
