"""What `shardtune train` dispatches per training step: operators (host time) and the bytes its memory-bound
kernels move (device time), by method, checkpointing and precision, at a Llama-3.2-1B layer's widths.

The time model (shardtune/memory/compute.py) counts the GPU's work. A small model's step can instead wait on the
host: every operator costs the CPU some microseconds of Python and dispatch whatever its size, and on an H200 the
element-wise kernels of a 1B model finish in less than that (docs/estimator.md, "Calibrated against published
runs"). Or the model may undercount those kernels' traffic. This script gives both counts from `shardtune train`
itself: it runs the trainer on Llamas of the 1B's widths (hidden 2048, MLP 8192, 32 heads, 8 KV heads) at two depths
and two row lengths, packed, bf16 autocast as on a GPU, and a TorchDispatchMode around the trainer's
``LocalRunner.forward_backward`` (checkpointing's recompute and the fused loss included, the optimizer not: on CUDA
it is one foreach kernel per group) sees every ATen operator. Per operator it counts one dispatch, and for a kernel
that is neither a matmul nor attention the bytes of every tensor it reads and writes, each once (no cache reuse:
what a kernel moves through memory at most). From the four runs, per layer and per step, per token and per
micro-batch, by difference: bytes = step + layers x (per micro-batch + tokens x per token). Beside each, what the
time model charges the same layer (``elementwise_bytes`` and the LoRA adapters' bytes, per token).

    .venv/bin/python bench/host_ops.py [--out bench/results/host_ops_cpu]   # about 10 minutes on 2 cores
    .venv/bin/python bench/host_ops.py --remodel   # the time model's column again, after its constants change
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
# Kernels the time model charges by their FLOPs (matmuls, attention), not by the bytes they move.
COMPUTE = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear"}
# Kernels that only allocate, and those that only write their output.
ALLOCATE = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided", "aten.new_empty_strided"}
WRITE_ONLY = {"aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.zero_", "aten.fill_", "aten.ones",
              "aten.ones_like", "aten.new_ones", "aten.full", "aten.full_like", "aten.new_full", "aten.scalar_tensor",
              "aten.arange"}
CASTS = {"aten._to_copy"}
LORA = ["--use_peft_lora", "true", "--lora_r", "16", "--lora_dropout", "0"]
ALL_LINEAR = [*LORA, "--lora_target_modules", "all-linear"]
NO_CKPT = ["--gradient_checkpointing", "false"]
PURE_BF16 = ["--torch_dtype", "bfloat16"]
CASES = {  # name: shardtune train arguments
    "full": [],
    "full, no checkpointing": NO_CKPT,
    "full, pure bf16": PURE_BF16,
    "full, no checkpointing, pure bf16": [*NO_CKPT, *PURE_BF16],
    "LoRA all-linear": ALL_LINEAR,
    "LoRA all-linear, no checkpointing": [*ALL_LINEAR, *NO_CKPT],
    "LoRA all-linear, pure bf16": [*ALL_LINEAR, *PURE_BF16],
    "LoRA all-linear, no checkpointing, pure bf16": [*ALL_LINEAR, *NO_CKPT, *PURE_BF16],
    "LoRA q,v": [*LORA, "--lora_target_modules", "q_proj,v_proj"],
    "LoRA q,v, no checkpointing": [*LORA, "--lora_target_modules", "q_proj,v_proj", *NO_CKPT],
    "LoRA q,v, pure bf16": [*LORA, "--lora_target_modules", "q_proj,v_proj", *PURE_BF16],
}
WIDTHS = {"hidden_size": 2048, "intermediate_size": 8192, "num_heads": 32, "num_kv_heads": 8}  # Llama-3.2-1B
DEPTHS = (2, 4)
ROW_LENGTHS = (64, 128)
ROWS = 4
STEPS = 3
FIGURES = ("ops", "kernel_ops", "bytes", "cast_bytes")


def tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def kernel_bytes(name: str, args, kwargs, out) -> int:
    """Bytes a memory-bound kernel reads and writes: each input tensor once, each output once (an in-place
    operator's output is its first input, read and then written)."""
    if name in VIEWS or name in COMPUTE or name in ALLOCATE or "attention" in name:
        return 0
    written = sum(t.numel() * t.element_size() for t in tensors(out))
    if name in WRITE_ONLY:
        return written
    read = tensors(args[1]) if name == "aten.copy_" else tensors((args, kwargs))
    return written + sum(t.numel() * t.element_size() for t in read)


def count_case(model: Path, rows: Path, work: Path, args: list[str], row_length: int) -> dict:
    """Per step of one run: operators, those that are not views, the bytes the memory-bound kernels move (and of
    them the casts'), and the tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import shardtune.train.runner as runner
    from shardtune.cli import main

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.figures: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket)
            moved = kernel_bytes(name, args, kwargs or {}, out)
            self.figures.update(ops=1, kernel_ops=name not in VIEWS, bytes=moved,
                                cast_bytes=moved if name in CASTS else 0)
            return out

    counter, tokens = Count(), []
    original = runner.LocalRunner.forward_backward

    def counted(self, micro_batches, scale):
        tokens.append(sum(b["input_ids"].numel() for b in micro_batches))
        with counter:
            return original(self, micro_batches, scale)

    runner.LocalRunner.forward_backward = counted
    try:
        code = main(["train", "--model_name_or_path", str(model), "--dataset_name", str(rows), "--splits", "train",
                     "--max_seq_len", str(row_length), "--packing", "true", "--per_device_train_batch_size",
                     str(ROWS), "--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no",
                     "--predict_memory", "false", "--bf16", "true", "--overwrite_output_dir", "true",
                     "--output_dir", str(work / "run"), *args])
    finally:
        runner.LocalRunner.forward_backward = original
    if code != 0:
        raise SystemExit(f"shardtune train {' '.join(args)} exited with {code}")
    per_step = {k: counter.figures[k] / len(tokens) for k in FIGURES}
    return per_step | {"tokens": sum(tokens) / len(tokens)}


def split(runs: dict[tuple[int, int], dict], key: str) -> dict:
    """``key`` = step + layers x (micro-batch + tokens x token), solved from two depths and two row lengths (each
    depth's two runs give the per-token slope; the two depths' difference, per layer)."""
    (d0, d1), (r0, r1) = DEPTHS, ROW_LENGTHS

    def slope_and_base(depth):
        a, b = runs[depth, r0], runs[depth, r1]
        slope = (b[key] - a[key]) / (b["tokens"] - a["tokens"])
        return slope, a[key] - slope * a["tokens"]

    (s0, c0), (s1, c1) = slope_and_base(d0), slope_and_base(d1)
    per_token, per_microbatch = (s1 - s0) / (d1 - d0), (c1 - c0) / (d1 - d0)
    return {"layer_per_token": per_token, "layer_per_microbatch": per_microbatch,
            "step_per_token": s0 - d0 * per_token, "step_per_microbatch": c0 - d0 * per_microbatch}


def modelled_layer_bytes(args: list[str]) -> float:
    """What the time model charges one layer per token for its memory-bound kernels (compute.layer_bytes_per_token:
    eager kernels, the calibrated constants), for Llama-3.2-1B (the widths above) and this case's settings."""
    from shardtune.memory.compute import CALIBRATED, Kernels, layer_bytes_per_token
    from shardtune.memory.inventory import ModelAnalysis

    analysis = ModelAnalysis("llama-3.2-1b")
    lora = (analysis.lora(int(args[args.index("--lora_r") + 1]), args[args.index("--lora_target_modules") + 1])
            if "--use_peft_lora" in args else None)
    recompute = 0.0 if "--gradient_checkpointing" in args else 1.0
    return layer_bytes_per_token(analysis.inventory, lora, Kernels(), CALIBRATED, recompute)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/host_ops_cpu")
    parser.add_argument("--case", action="append", choices=list(CASES), help="one case (repeat for more; default: all)")
    parser.add_argument("--remodel", action="store_true",
                        help="keep the counts of the .json an earlier run wrote; recompute only what the time model "
                             "charges (after its constants change: the counts do not depend on them)")
    args = parser.parse_args(argv)
    if args.remodel:
        report = json.loads(Path(args.out).with_suffix(".json").read_text())
        for row in report["cases"]:
            row["modelled_layer_bytes_per_token"] = modelled_layer_bytes(row["args"])
        write(Path(args.out), report["cases"], report["torch"], report["command"].split()[2:])
        return 0
    import torch

    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import write_sum_rows

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="host-ops-"))
    rows = write_sum_rows(work / "sums.jsonl", rows=1024)
    models = {n: make_model_folder(work / f"layers-{n}", num_layers=n, **WIDTHS) for n in DEPTHS}
    results = []
    for name in args.case or CASES:
        case = CASES[name]
        runs = {(d, r): count_case(models[d], rows, work, case, r) for d in DEPTHS for r in ROW_LENGTHS}
        row = {"case": name, "args": case, "runs": {f"{d} layers, rows of {r}": v for (d, r), v in runs.items()},
               **{k: split(runs, k) for k in FIGURES}, "modelled_layer_bytes_per_token": modelled_layer_bytes(case)}
        results.append(row)
        print(f"{name}: {row['ops']['layer_per_microbatch']:.0f} operators per layer, "
              f"{row['bytes']['layer_per_token'] / 1e3:.0f} kB per token per layer "
              f"(the model: {row['modelled_layer_bytes_per_token'] / 1e3:.0f})", file=sys.stderr)
    write(Path(args.out), results, torch.__version__, argv)
    return 0


def write(out: Path, results: list[dict], torch_version: str, argv: list[str] | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch_version, "widths": WIDTHS, "depths": DEPTHS, "row_lengths": ROW_LENGTHS, "rows": ROWS,
              "cases": results, "command": "python bench/host_ops.py " + " ".join(argv or sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    h = WIDTHS["hidden_size"]
    lines = ["# What `shardtune train` dispatches per step (bench/host_ops.py)", "",
             f"torch {torch_version}; Llamas of Llama-3.2-1B's widths (hidden {h}, MLP {WIDTHS['intermediate_size']}, "
             f"{WIDTHS['num_heads']} heads, {WIDTHS['num_kv_heads']} KV heads) at {DEPTHS[0]} and {DEPTHS[1]} layers, "
             f"{ROWS} packed rows of {ROW_LENGTHS[0]} and {ROW_LENGTHS[1]} tokens, bf16 autocast (pure bf16: "
             "`--torch_dtype bfloat16`); forward and backward, recompute and fused loss included, the optimizer not. "
             "Bytes: what the kernels other than matmuls and attention read and write, each tensor once.", "",
             "| case | operators per layer | of them not views | per step besides | at 16 layers | memory-bound "
             "kB per token per layer | of them casts | the time model charges | per layer per micro-batch (MB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ops = r["ops"]
        figures = (ops["layer_per_microbatch"], r["kernel_ops"]["layer_per_microbatch"], ops["step_per_microbatch"],
                   ops["step_per_microbatch"] + 16 * ops["layer_per_microbatch"], r["bytes"]["layer_per_token"] / 1e3,
                   r["cast_bytes"]["layer_per_token"] / 1e3, r["modelled_layer_bytes_per_token"] / 1e3,
                   r["bytes"]["layer_per_microbatch"] / 1e6)
        lines.append(f"| {r['case']} | " + " | ".join(f"{round(x)}" for x in figures) + " |")  # no '-0
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json, .md", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
