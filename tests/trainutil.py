"""Shared helpers for trainer tests: a tiny model, chat data, and runs on 1 process or 2 gloo processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_chat_data(path: Path, rows: int = 1500, seed: int = 0) -> Path:
    """Short addition dialogues: enough rows that packing at 64 tokens gives a few hundred training rows."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    return path


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """``train`` in this process sets up logging and warning filters as a training process does: undo it, so
    the tests after these see the interpreter as it was."""
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in ("shardtune", "bitsandbytes")}
    try:
        with warnings.catch_warnings():
            yield
    finally:
        for name, (level, handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate


def flags(*args: str) -> list[str]:
    """``--key value`` arguments with a later value of a key replacing the earlier one in place.

    ``shardtune train`` refuses a key given two values on its command line, so tests that add to a shared base
    command line build it with this (a ``--key`` followed by another ``--key``, or by nothing, is a boolean flag).
    """
    pairs: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        key = args[i]
        assert key.startswith("--"), f"expected --key, got {key!r} in {args}"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs[key.replace("-", "_")] = [key, args[i + 1]]
            i += 2
        else:
            pairs[key.replace("-", "_")] = [key]
            i += 1
    return [item for pair in pairs.values() for item in pair]


def write_sum_rows(path: Path, rows: int = 400) -> Path:
    """Addition dialogues in a fixed order (no random generator): the resume and optimizer tests' data."""
    dialogues = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                               {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
                 for a, b in ((i * 7 % 50, i * 13 % 50) for i in range(rows))]
    path.write_text("".join(json.dumps(r) + "\n" for r in dialogues))
    return path


def tiny_workspace(tmp_path_factory, name: str, *, model: str = "model", rows: int = 200) -> Path:
    """A folder with the tiny model (``model``) and ``rows`` chat rows (``chat.jsonl``), for a module's runs."""
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp(name)
    make_model_folder(root / model)
    write_chat_data(root / "chat.jsonl", rows=rows)
    return root


def shardtune_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", SHARDTUNE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_shardtune(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``shardtune ARGS`` as a user runs it (a separate process), output captured."""
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=tmp_path, env=shardtune_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


# What a command may print on stderr around its one line: progress bars, the training log, library loading bars.
NOISE = re.compile(r"it/s\]|s/it\]|step/s\]|examples/s\]|^\[\d\d:\d\d:\d\d shardtune rank \d+\]|^Loading weights"
                   r"|^Writing model|^\s*$|^  ")


def refused(capsys, argv: list[str], *expected: str) -> str:
    """Run ``shardtune ARGV`` in this process: it must exit with code 2 and print one line (besides progress
    bars and the training log) holding every ``expected`` text; that line is returned."""
    from shardtune.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not NOISE.search(line)]
    assert code == 2, err
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def make_lora_adapter(model: Path, out: Path) -> Path:
    """A LoRA adapter folder for the model folder ``model`` (q_proj and v_proj, rank 4), as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out
