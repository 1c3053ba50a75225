"""The fused linear cross-entropy against the loss on full logits, on a CPU: peak RSS and time of a training step.

    .venv/bin/python bench/fused_loss.py [--vocab 32000 --seq_len 512 --batch 4 --hidden 256 --layers 4]
                                         [--steps 5] [--out bench/results/fused_loss_cpu.json]

One randomly initialised Llama, one packed batch, AdamW, the trainer's own step (``step.train_step`` through
``LocalRunner``). ``full_logits`` is the path the trainer took before the loss was fused with the head (the model's
logits, then ``loss.token_loss_sum``; the runner still takes it for a model whose forward cannot skip its logits);
``fused`` is the default. Each variant runs in a fresh process, so its peak RSS is its own: after a warm-up step
(which makes AdamW's states) the peak is reset (``/proc/self/clear_refs``), so ``step_peak_rss`` is what the
measured steps add above the weights, gradients and optimizer states. Large blocks go straight to mmap
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave RSS and the peak is the tensors' own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = [(precision, path) for precision in ("fp32", "bf16") for path in ("full_logits", "fused")]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _batch(args, vocab: int):
    """Packed rows of four documents each, the first tokens of each document a masked prompt."""
    import torch

    from shardtune.data.collate import Collator
    from shardtune.data.encode import IGNORE

    gen = torch.Generator().manual_seed(0)
    docs = [args.seq_len // 4] * 4
    rows = []
    for _ in range(args.batch):
        ids = torch.randint(3, vocab, (args.seq_len,), generator=gen).tolist()
        labels = list(ids)
        for start in range(0, args.seq_len, docs[0]):
            labels[start:start + 16] = [IGNORE] * 16
        rows.append({"input_ids": ids, "labels": labels, "seq_lens": docs})
    return Collator(0)(rows)


def run_variant(args, precision: str, path: str) -> dict:
    """One variant in this process: warm-up step, reset the peak, then ``args.steps`` timed steps."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.dist import DistInfo
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan
    from shardtune.train.step import StepContext, train_step

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         tie_word_embeddings=False, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    model, runner = parallelize(model, Plan(strategy="NO", compute_dtype=compute,
                                            gradient_checkpointing=args.checkpointing), info)
    model.train()
    runner.fused_loss = path == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    ctx = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, runner=runner, info=info,
                      max_grad_norm=1.0, pad_token_id=0)
    batch = _batch(args, args.vocab)
    losses = [train_step(ctx, [batch]).loss]  # AdamW makes its states here
    baseline_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        losses.append(train_step(ctx, [batch]).loss)
        seconds.append(time.perf_counter() - started)
    peak_kib = _status_kib("VmHWM")
    return {"precision": precision, "path": path, "losses": losses, "step_seconds": statistics.median(seconds),
            "baseline_rss_bytes": baseline_kib * 1024, "peak_rss_bytes": peak_kib * 1024,
            "step_peak_rss_bytes": (peak_kib - baseline_kib) * 1024, "threads": torch.get_num_threads()}


def _child(args, precision: str, path: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", precision, path, "--vocab", str(args.vocab), "--seq_len",
           str(args.seq_len), "--batch", str(args.batch), "--hidden", str(args.hidden), "--layers",
           str(args.layers), "--steps", str(args.steps)] + (["--checkpointing"] if args.checkpointing else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{precision} {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the layers")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", nargs=2, metavar=("PRECISION", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args, *args.child)))
        return 0
    results = [_child(args, precision, path) for precision, path in VARIANTS]
    mib = 2**20
    print(f"Llama {args.layers} layers x {args.hidden}, vocabulary {args.vocab}, {args.batch} x {args.seq_len} "
          f"tokens, checkpointing {'on' if args.checkpointing else 'off'}, {results[0]['threads']} threads")
    print(f"{'precision':9} {'loss path':12} {'step s':>7} {'peak RSS MiB':>13} {'step adds MiB':>14} {'loss':>9}")
    for r in results:
        print(f"{r['precision']:9} {r['path']:12} {r['step_seconds']:7.2f} {r['peak_rss_bytes'] / mib:13.0f} "
              f"{r['step_peak_rss_bytes'] / mib:14.0f} {r['losses'][-1]:9.5f}")
    summary = {}
    for precision in ("fp32", "bf16"):
        old, new = (next(r for r in results if r["precision"] == precision and r["path"] == p)
                    for p in ("full_logits", "fused"))
        summary[precision] = {
            "step_peak_rss_ratio": new["step_peak_rss_bytes"] / old["step_peak_rss_bytes"],
            "peak_rss_ratio": new["peak_rss_bytes"] / old["peak_rss_bytes"],
            "step_time_ratio": new["step_seconds"] / old["step_seconds"],
            "max_loss_difference": max(abs(a - b) for a, b in zip(old["losses"], new["losses"]))}
        s = summary[precision]
        print(f"{precision}: fused / full logits: step's peak RSS x{s['step_peak_rss_ratio']:.2f}, "
              f"whole peak RSS x{s['peak_rss_ratio']:.2f}, step time x{s['step_time_ratio']:.2f}, "
              f"largest loss difference {s['max_loss_difference']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "child"},
                                              "results": results, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
