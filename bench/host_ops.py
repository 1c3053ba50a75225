"""How many operators `shardtune train` dispatches per training step, by model depth, method and checkpointing.

The time model (shardtune/memory/compute.py) counts the GPU's work. A small model's step can instead wait on the
host: every operator costs the CPU some microseconds of Python and dispatch whatever its size, and on an H200 the
element-wise kernels of a 1B model finish in less than that (docs/estimator.md, "Calibrated against published
runs"). The count of operators is what a host term needs, and it does not depend on the model's width: this script
runs `shardtune train` itself on two narrow Llamas (8 and 16 layers, hidden size 64), bf16 autocast as on a GPU,
counts every ATen operator its forward-and-backward dispatches (a TorchDispatchMode around the trainer's
``LocalRunner.forward_backward``: checkpointing's recompute and the fused loss included, the optimizer not: on
CUDA it is one foreach kernel per group), and splits the count into per layer and per step from the two depths.

    .venv/bin/python bench/host_ops.py [--out bench/results/host_ops_cpu]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.trainutil's rows
os.environ.setdefault("TQDM_DISABLE", "1")

# Operators that return a view of their input: dispatched (host time) but launch no kernel.
VIEWS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand", "aten.slice", "aten.select",
         "aten.unsqueeze", "aten.squeeze", "aten.as_strided", "aten.detach", "aten.alias", "aten.permute",
         "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.reshape", "aten._reshape_alias",
         "aten.lift_fresh"}
LORA = ["--use_peft_lora", "true", "--lora_r", "16", "--lora_dropout", "0"]
CASES = {  # name: shardtune train arguments
    "full": [],
    "full, no checkpointing": ["--gradient_checkpointing", "false"],
    "LoRA all-linear": [*LORA, "--lora_target_modules", "all-linear"],
    "LoRA all-linear, no checkpointing": [*LORA, "--lora_target_modules", "all-linear",
                                          "--gradient_checkpointing", "false"],
    "LoRA q,v": [*LORA, "--lora_target_modules", "q_proj,v_proj"],
    "LoRA q,v, no checkpointing": [*LORA, "--lora_target_modules", "q_proj,v_proj",
                                   "--gradient_checkpointing", "false"],
}
DEPTHS = (8, 16)
STEPS = 4


def count_case(model: Path, rows: Path, work: Path, args: list[str]) -> dict:
    """Operators per step of one run: all of them, and those that are not views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import shardtune.train.runner as runner
    from shardtune.cli import main

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    counter, steps = Count(), []
    original = runner.LocalRunner.forward_backward

    def counted(self, *a, **k):
        with counter:
            out = original(self, *a, **k)
        steps.append(1)
        return out

    runner.LocalRunner.forward_backward = counted
    out = work / "run"
    try:
        code = main(["train", "--model_name_or_path", str(model), "--dataset_name", str(rows), "--splits", "train",
                     "--max_seq_len", "64", "--per_device_train_batch_size", "4", "--max_steps", str(STEPS),
                     "--logging_steps", "1", "--save_strategy", "no", "--predict_memory", "false", "--bf16", "true",
                     "--overwrite_output_dir", "true", "--output_dir", str(out), *args])
    finally:
        runner.LocalRunner.forward_backward = original
    if code != 0:
        raise SystemExit(f"shardtune train {' '.join(args)} exited with {code}")
    counted_ops = sum(counter.ops.values()) / len(steps)
    kernels = sum(v for k, v in counter.ops.items() if k not in VIEWS) / len(steps)
    return {"ops": counted_ops, "kernel_ops": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/host_ops_cpu")
    args = parser.parse_args(argv)
    import torch

    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import write_sum_rows

    torch.set_num_threads(1)  # the host's work, not a BLAS's threads
    work = Path(tempfile.mkdtemp(prefix="host-ops-"))
    rows = write_sum_rows(work / "sums.jsonl", rows=256)
    models = {n: make_model_folder(work / f"layers-{n}", num_layers=n, hidden_size=64, intermediate_size=128,
                                   num_heads=4, num_kv_heads=1) for n in DEPTHS}
    results = []
    for name, case in CASES.items():
        by_depth = {n: count_case(models[n], rows, work, case) for n in DEPTHS}
        low, high = (by_depth[n] for n in DEPTHS)
        per_layer = {k: (high[k] - low[k]) / (DEPTHS[1] - DEPTHS[0]) for k in ("ops", "kernel_ops")}
        row = {"case": name, "args": case, "by_depth": {str(n): v for n, v in by_depth.items()},
               "per_layer": per_layer, "per_step": {k: low[k] - DEPTHS[0] * per_layer[k] for k in per_layer}}
        results.append(row)
        print(f"{name}: {per_layer['ops']:.0f} operators per layer ({per_layer['kernel_ops']:.0f} not views), "
              f"{row['per_step']['ops']:.0f} per step", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__, "depths": DEPTHS, "cases": results,
              "command": "python bench/host_ops.py " + " ".join(argv or sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Operators `shardtune train` dispatches per step (bench/host_ops.py)", "",
             f"torch {torch.__version__}; narrow Llamas of {DEPTHS[0]} and {DEPTHS[1]} layers (hidden 64), bf16 "
             "autocast, 4 rows of about 33 tokens; forward and backward (recompute and fused loss included, the "
             "optimizer not).", "",
             "| case | operators per layer | of them not views | per step besides | at 16 layers |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['per_layer']['ops']:.0f} | {r['per_layer']['kernel_ops']:.0f} | "
                     f"{r['per_step']['ops']:.0f} | {r['by_depth'][str(DEPTHS[1])]['ops']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json, .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
