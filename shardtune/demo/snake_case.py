"""The real demo's task: convert class names harvested from this machine's Python standard library to snake_case.

Asked through its chat template, SmolLM2-135M-Instruct explains snake_case or writes a Python function instead of
answering (0 of 60 held-out names right); the rule is short and regular, so one epoch of LoRA on 640 names teaches
it (55 of 60), and the held-out names (never seen in tuning) measure whether it learned the rule, not the rows. The
names come from the ``class`` statements of the standard library's own source files, read with ``ast`` (no code is
run), so the task needs nothing but the Python that runs shardtune.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shardtune.demo.task import write_splits

# Folders of the standard library left out: tests name their classes TestX by the hundred, and site-packages is
# not the standard library.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
CAMEL_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
_LOWER_OR_DIGIT_THEN_UPPER = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_ACRONYM_THEN_WORD = re.compile(r"(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(name: str) -> str:
    """The answer: a word boundary before an upper-case letter that follows a lower-case letter or a digit
    ("getURL2Path" -> get_URL2_Path), and before the last capital of an acronym that starts a word
    ("XMLParser" -> XML_Parser); then all lower case. So "HTTPServer" -> "http_server"."""
    name = _LOWER_OR_DIGIT_THEN_UPPER.sub("_", name)
    return _ACRONYM_THEN_WORD.sub("_", name).lower()


@dataclass(frozen=True)
class Identifier:
    """One row of the task: a CamelCase class name and its snake_case form."""

    name: str

    @property
    def answer(self) -> str:
        return snake_case(self.name)

    def question(self) -> str:
        return f"Convert to snake_case: {self.name}"

    def row(self) -> dict:
        return {"messages": [{"role": "user", "content": self.question()},
                             {"role": "assistant", "content": self.answer}]}


def stdlib_dir() -> Path:
    """The folder of this interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts[:-1]))


def class_names(source: str) -> set[str]:
    """The names of every ``class`` statement in ``source``; an unparsable file (a template, Python 2 lib2to3
    data) gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def harvest(root: str | Path | None = None) -> list[str]:
    """Sorted, unique CamelCase class names of two or more words from the ``.py`` files under ``root`` (default: the
    standard library). Single words ("Error") only lower-case, so they would teach nothing."""
    return list(_harvest(Path(root).resolve() if root is not None else stdlib_dir()))


@functools.lru_cache(maxsize=2)  # parsing the ~1,000 files of the standard library takes seconds; it never changes
def _harvest(root: Path) -> tuple[str, ...]:
    names: set[str] = set()
    for path in _source_files(root):
        names |= class_names(path.read_text(encoding="utf-8", errors="replace"))
    return tuple(sorted(n for n in names if CAMEL_NAME.fullmatch(n) and "_" in snake_case(n)))


@dataclass
class IdentifierSplits:
    """Fine-tune rows and held-out rows; no answer is in both."""

    train: list[Identifier]
    test: list[Identifier]


def split_identifiers(names: Iterable[str], num_train: int, num_test: int, *, seed: int = 0) -> IdentifierSplits:
    """A seeded split: of a shuffle of ``names``, the first ``num_test`` are held out and the next ``num_train``
    tuned on. Names with the same answer ("HttpServer", "HTTPServer") count once, as the first in sorted order, so
    no held-out answer was seen in tuning."""
    by_answer: dict[str, str] = {}
    for name in sorted(set(names)):
        by_answer.setdefault(snake_case(name), name)
    unique = sorted(by_answer.values())
    if num_train + num_test > len(unique):
        raise ValueError(f"num_train + num_test = {num_train + num_test} exceeds the {len(unique)} distinct names")
    random.Random(seed).shuffle(unique)
    return IdentifierSplits(train=[Identifier(n) for n in unique[num_test:num_test + num_train]],
                            test=[Identifier(n) for n in unique[:num_test]])


def write_identifier_dataset(splits: IdentifierSplits, folder: str | Path) -> Path:
    """``folder/train.jsonl`` and ``folder/test.jsonl``, chat rows for ``--dataset_name folder --splits train,test``."""
    return write_splits(folder, (i.row() for i in splits.train), (i.row() for i in splits.test))
