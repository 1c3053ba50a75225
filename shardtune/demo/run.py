"""The demo, step by step: estimate, fine-tune on 2 CPU processes with FSDP and LoRA, evaluate, generate, plot.

Every step is the real product path: the estimate is ``shardtune estimate``'s code, the fine-tune runs
``shardtune launch --num_processes 2 train ...`` as a subprocess (torchrun, gloo, FSDP2), the evaluation loads the
adapter it wrote with ``shardtune.infer.generate``, and the plots are ``shardtune plot``'s.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from shardtune.demo.base import BASE_MODEL_DIR
from shardtune.demo.evaluate import Evaluation, evaluate_model
from shardtune.demo.task import MAX_OPERAND, split_task, write_dataset
from shardtune.errors import UsageError
from shardtune.strategies import FSDP, NO

# (model, method, GPUs per node, micro-batch, GPU when the user names none): the questions people ask first.
ESTIMATE_CASES = (
    ("llama-3.1-8b", "qlora", 1, 2, "rtx4090"),
    ("llama-3.1-8b", "lora", 1, 4, "a100-80gb"),
    ("llama-3.1-8b", "full", 8, 4, "h100-80gb"),
    ("llama-2-70b", "lora", 8, 4, "h100-80gb"),
)


@dataclass(frozen=True)
class DemoSettings:
    """The size of the fine-tune; the defaults fit the demo's 5-minute budget on 2 CPU cores."""

    num_train: int = 109  # of the 169 sums; the other 60 are held out
    num_test: int = 60
    max_steps: int = 120
    per_device_train_batch_size: int = 8
    max_seq_len: int = 128
    lora_r: int = 16
    lora_alpha: int = 32
    learning_rate: float = 6e-3
    logging_steps: int = 5
    eval_steps: int = 20
    num_processes: int = 2
    seed: int = 0


@dataclass
class DemoResult:
    before: Evaluation
    after: Evaluation
    run_dir: Path
    train_s: float = 0.0


class FineTuneFailed(RuntimeError):
    """The launched fine-tune exited with an error; its own messages say why."""


# ---------------------------------------------------------------------------------------------------- estimate


def print_estimates(console: Console, gpu_name: str | None) -> None:
    """One line per case: the recommended setup, its per-GPU peak and whether it fits."""
    from shardtune.memory.report import estimate_report
    from shardtune.hardware import GIB, gpu_by_name
    from shardtune.memory.report import short_label
    from shardtune.memory.setup import Setup, validate

    defaults = Setup()  # shardtune train's defaults, which the estimate takes
    table = Table(title=f"Will it fit? shardtune estimate (seq-len {defaults.seq_len}, {defaults.mixed_precision}, "
                        f"gradient checkpointing {'on' if defaults.gradient_checkpointing else 'off'})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("model", "method", "GPUs", "recommended", "GiB/GPU", "fits", "max b"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("GiB/GPU", "max b") else "left")
    for model, method, gpus, batch, default_gpu in ESTIMATE_CASES:
        gpu = gpu_by_name(gpu_name or default_gpu)
        setup = validate(Setup.of(method=method, num_gpus=gpus, per_device_train_batch_size=batch, max_seq_len=2048,
                                  mixed_precision="bf16", gradient_checkpointing=True,
                                  distributed_type=NO if gpus == 1 else FSDP))
        rec = estimate_report(model, setup, gpu, auto=True).recommendation
        peak_gib = (rec.breakdown.total + rec.breakdown.cuda_context) / GIB
        table.add_row(model, method, f"{gpus} x {gpu.name}", short_label(rec.setup),
                      f"{peak_gib:.1f}/{gpu.memory_bytes / GIB:.0f}",
                      "[green]yes[/]" if rec.fits else "[red]no[/]", str(rec.max_batch_size))
    console.print(table)
    console.print("GiB/GPU: predicted peak (with the CUDA context) / the GPU's memory. max b: the largest "
                  "micro-batch that fits.")
    example = ESTIMATE_CASES[0]
    console.print(f"Full breakdown of any row: shardtune estimate {example[0]} --method {example[1]} "
                  f"--gpu {gpu_name or example[4]} --batch-size {example[3]}")


# --------------------------------------------------------------------------------------------------- fine-tune


def train_args(settings: DemoSettings, base_dir: Path, data_dir: Path, run_dir: Path) -> list[str]:
    """The ``shardtune train`` keys of the demo's fine-tune: FSDP2 + LoRA, packed rows, fp32. Pinned: left to the
    hardware, a CPU with AVX512-BF16 or AMX would train under bf16 autocast and print other figures than the
    README's, which any machine reproduces in fp32."""
    keys = {"model_name_or_path": base_dir, "dataset_name": data_dir, "splits": "train,test", "bf16": False,
            "max_seq_len": settings.max_seq_len, "packing": True,
            "per_device_train_batch_size": settings.per_device_train_batch_size, "max_steps": settings.max_steps,
            "distributed_type": FSDP.name, "use_peft_lora": True, "lora_r": settings.lora_r,
            "lora_alpha": settings.lora_alpha, "learning_rate": settings.learning_rate,
            "lr_scheduler_type": "cosine", "warmup_ratio": 0.05, "logging_steps": settings.logging_steps,
            "eval_strategy": "steps", "eval_steps": settings.eval_steps, "save_strategy": "no",
            "seed": settings.seed, "output_dir": run_dir,
            # a rerun replaces the earlier demo run, whose metrics.jsonl would otherwise mix into this one's plots;
            # train deletes only the files a run wrote, never one its user added
            "overwrite_output_dir": True}
    return [item for key, value in keys.items() for item in (f"--{key}", str(value))]


def launch_command(settings: DemoSettings, base_dir: Path, data_dir: Path, run_dir: Path) -> list[str]:
    return ([sys.executable, "-m", "shardtune", "launch", "--num_processes", str(settings.num_processes), "train"]
            + train_args(settings, base_dir, data_dir, run_dir))


def check_run_dir(run_dir: Path, data_dir: Path) -> None:
    """``run_dir`` is new, or an earlier demo's run (which the fine-tune replaces): a folder of the user's, or a
    training run of theirs on other data, is refused before the demo writes anything."""
    if not run_dir.exists():
        return
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir} exists and is not a shardtune run folder; choose another --output-dir.")
    import yaml

    try:
        trained_on = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("dataset_name")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        trained_on = None
    if trained_on != str(data_dir):
        raise UsageError(f"{run_dir} holds a training run on {trained_on or 'other data'}, not the demo's "
                         f"({data_dir}): it is left alone; choose another --output-dir.")


def fine_tune(settings: DemoSettings, base_dir: Path, data_dir: Path, run_dir: Path, *,
              capture: bool = False) -> float:
    """Run the fine-tune through ``shardtune launch``; returns its wall time. Raises when the job fails."""
    check_run_dir(run_dir, data_dir)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per process: 2 processes on 2 cores, no oversubscription
    cmd = launch_command(settings, base_dir, data_dir, run_dir)
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=capture, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:] if capture else "see the messages above"
        raise FineTuneFailed(f"the fine-tune failed (exit code {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------------------------ report


def print_comparison(console: Console, before: Evaluation, after: Evaluation, num_examples: int = 6, *,
                     held_out: str = "held-out sums") -> None:
    table = Table(title=f"Before and after the fine-tune ({held_out}, never seen in training)", title_justify="left")
    for col in ("", "base model", "fine-tuned"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("eval loss (assistant tokens)", f"{before.eval_loss:.3f}", f"{after.eval_loss:.3f}")
    table.add_row("exact-match accuracy (greedy)", f"{before.accuracy:.1%}", f"{after.accuracy:.1%}")
    console.print(table)
    examples = Table(title="Generations (greedy, chat template, KV cache)", title_justify="left")
    for col in ("question", "expected", "base model says", "fine-tuned says"):
        examples.add_column(col)
    for b, a in list(zip(before.answers, after.answers))[:num_examples]:
        examples.add_row(b.question, b.expected, repr(b.reply[:30]),
                         f"[green]{a.reply!r}[/]" if a.correct else f"[red]{a.reply!r}[/]")
    console.print(examples)


def run_demo(output_dir: str | Path, *, settings: DemoSettings = DemoSettings(), base_dir: Path = BASE_MODEL_DIR,
             console: Console | None = None, capture_training: bool = False) -> DemoResult:
    """Fine-tune the bundled base model on the bundled task and measure it before and after (steps b-d)."""
    console = console or Console()
    output_dir = Path(output_dir).resolve()
    data_dir, run_dir = output_dir / "data", output_dir / "run"
    check_run_dir(run_dir, data_dir)
    splits = split_task(settings.num_train, settings.num_test, seed=settings.seed)
    write_dataset(splits, data_dir)
    console.print(f"Task: answer 'What is A plus B?' (A, B <= {MAX_OPERAND}) in a chat turn. {len(splits.train)} "
                  f"sums to tune on, {len(splits.test)} held out. Base model: {base_dir} (pre-trained by "
                  f"scripts/pretrain_demo_base.py on sums written as plain text, never as a chat).")
    started = time.perf_counter()
    before = evaluate_model(base_dir, data_dir, splits.test)
    console.print(f"base model: eval loss {before.eval_loss:.3f}, accuracy {before.accuracy:.1%} "
                  f"({time.perf_counter() - started:.0f} s)")
    console.print("$ " + shlex.join(["shardtune", *launch_command(settings, base_dir, data_dir, run_dir)[3:]]))
    train_s = fine_tune(settings, base_dir, data_dir, run_dir, capture=capture_training)
    after = evaluate_model(run_dir / "final", data_dir, splits.test)
    return DemoResult(before=before, after=after, run_dir=run_dir, train_s=train_s)
