"""The demo's task: small-number sums, known to the base model as plain text, asked as a chat question.

Pre-training text states every sum in a few phrasings ("12 + 7 = 19", "12 plus 7 is 19.", "The sum of 12 and 7 is
19.", "What is 12 plus 7? 19"), so the base model knows the facts. It has never seen a chat turn, though: the
chat template's special tokens and roles are new to it, and asked through them it does not answer. The fine-tune
teaches that format on some sums, and the held-out test set holds the others, so the accuracy measures whether the
model learned to answer in a chat, not whether it memorised its tuning rows.
This is instruction tuning in miniature: knowledge from pre-training, behaviour from the tune.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from shardtune.errors import UsageError
from shardtune.files import write_text

MAX_OPERAND = 12  # operands 0..12: 169 sums, few enough for a ~1M-parameter model to learn in minutes on a CPU


@dataclass(frozen=True)
class Sum:
    """One fact of the task: ``a + b``."""

    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def question(self) -> str:
        return f"What is {self.a} plus {self.b}?"

    def row(self) -> dict:
        """The chat row shardtune train reads (the format of most instruction data sets)."""
        return {"messages": [{"role": "user", "content": self.question()},
                             {"role": "assistant", "content": self.answer}]}


def all_sums(max_operand: int = MAX_OPERAND) -> list[Sum]:
    return [Sum(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def pretraining_lines(sums: Iterable[Sum]) -> list[str]:
    """Every sum in four phrasings, one of them the question and its answer as a flash card (never a chat turn).

    Facts stated several ways are facts a later tune can ask about in yet another way.
    """
    lines = []
    for s in sums:
        c = s.a + s.b
        lines += [f"{s.a} + {s.b} = {c}", f"{s.a} plus {s.b} is {c}.", f"The sum of {s.a} and {s.b} is {c}.",
                  f"{s.question()} {c}"]
    return lines


@dataclass
class TaskSplits:
    """Fine-tune rows and held-out test rows; no sum is in both."""

    train: list[Sum]
    test: list[Sum]


def split_task(num_train: int, num_test: int, *, seed: int = 0, max_operand: int = MAX_OPERAND) -> TaskSplits:
    """A deterministic split of the sums into ``num_train`` fine-tune rows and ``num_test`` held-out rows."""
    sums = all_sums(max_operand)
    if num_train + num_test > len(sums):
        raise ValueError(f"num_train + num_test = {num_train + num_test} exceeds the {len(sums)} sums")
    random.Random(seed).shuffle(sums)
    return TaskSplits(train=sums[:num_train], test=sums[num_train:num_train + num_test])


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON lines, to a temp name then renamed so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_splits(folder: str | Path, train: Iterable[dict], test: Iterable[dict]) -> Path:
    """``folder/train.jsonl`` and ``folder/test.jsonl``: what ``--dataset_name folder --splits train,test`` reads.
    The demo's data is the same on every run, so a file there that holds anything else is a user's data set (an
    ``--output-dir`` of their project): refused before either file is written, never replaced."""
    folder = Path(folder)
    texts = {folder / name: "".join(json.dumps(r) + "\n" for r in rows)
             for name, rows in (("train.jsonl", train), ("test.jsonl", test))}
    for path, text in texts.items():
        if path.is_symlink() or path.exists() and (not path.is_file() or path.read_bytes() != text.encode()):
            raise UsageError(f"--output-dir: {path} holds a file the demo did not write, and it is left alone; "
                             f"move it away or give another --output-dir")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        write_text(path, text)
    return folder


def write_dataset(splits: TaskSplits, folder: str | Path) -> Path:
    """The sums' ``train.jsonl`` and ``test.jsonl`` in ``folder`` (``write_splits``)."""
    return write_splits(folder, (s.row() for s in splits.train), (s.row() for s in splits.test))
