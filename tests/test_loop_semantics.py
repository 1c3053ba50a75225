"""What the training loop records, against what Transformers' Trainer records under the same names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from tests.trainutil import tiny_workspace


@pytest.fixture(autouse=True)
def _restore(restore_logging):
    """These tests run ``train`` in this process."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "loop", rows=100)


def run(root: Path, out: str, *extra: str, callbacks=()) -> list[dict]:
    """A short run of the tiny model (batch 2, no packing); its metrics.jsonl records."""
    from shardtune.train.loop import train

    train(load_train_config(["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                             "--splits", "train", "--max_seq_len", "64", "--per_device_train_batch_size", "2",
                             "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true",
                             "--output_dir", str(root / out), *extra]), callbacks)
    return [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]


def test_the_logged_learning_rate_is_the_one_the_step_used(root):
    """Each record's lr is the rate its step's update was made with, as Transformers' Trainer logs it (it reads the
    rate before stepping the schedule): 2 warm-up steps from 0, then linear decay over 4 steps. It was the next
    step's rate: step 1 of a warm-up from 0 read lr/2 and the last step 0."""

    class Used:
        def __init__(self) -> None:
            self.lr: dict[int, float] = {}

        def on_step_begin(self, args, state, control, *, optimizer, **kwargs):
            self.lr[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    used = Used()
    records = run(root, "lr", "--max_steps", "4", "--learning_rate", "1e-3", "--warmup_steps", "2",
                  "--lr_scheduler_type", "linear", callbacks=[used])
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert logged == pytest.approx({1: 0.0, 2: 5e-4, 3: 1e-3, 4: 5e-4})
    assert logged == used.lr
