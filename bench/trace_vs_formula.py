"""The analytic formula against the fake-tensor trace on a grid of small Llama models and setups.

Both answer "per-GPU peak of one training step". Tensor bytes are compared with tensor bytes: the formula without
its "allocator cache and workspaces" item against the trace's peak. Then what a GPU would reserve: the formula's
total against the trace's allocations replayed through the caching-allocator model (shardtune/memory/allocator.py).
On models this small the allocator's fixed costs (2 and 20 MiB segments, 64 MiB of cuBLAS workspaces) dominate that
second ratio. Writes a Markdown table and a JSON file under bench/results/.

    .venv/bin/python bench/trace_vs_formula.py [--out bench/results/trace_vs_formula_cpu]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

# (hidden, intermediate, layers, heads, kv heads): two small Llama shapes.
MODELS = {"small-256": (256, 688, 4, 8, 4), "small-512": (512, 1376, 4, 8, 2)}
SETUPS = [  # (method, strategy, world size, sharding, checkpointing)
    ("full", "NO", 1, "FULL_SHARD", False), ("full", "NO", 1, "FULL_SHARD", True),
    ("lora", "NO", 1, "FULL_SHARD", False), ("lora", "NO", 1, "FULL_SHARD", True),
    ("full", "FSDP", 4, "FULL_SHARD", True), ("full", "FSDP", 4, "SHARD_GRAD_OP", False),
    ("lora", "FSDP", 4, "FULL_SHARD", True), ("qlora", "NO", 1, "FULL_SHARD", True),
    ("full", "DDP", 2, "FULL_SHARD", True),
]


def compare(folder: str, method: str, strategy: str, world: int, sharding: str, checkpointing: bool,
            batch: int = 2, seq_len: int = 256) -> dict:
    """One grid point: tensor peaks (trace, formula without its allocator item), reserved (trace replayed through
    the allocator model, formula total) and their ratios."""
    from shardtune.memory.setup import Setup
    from shardtune.memory.trace_setup import formula_and_trace

    setup = Setup.of(method=method, distributed_type=strategy, fsdp_sharding_strategy=sharding, num_gpus=world,
                     per_device_train_batch_size=batch, max_seq_len=seq_len, gradient_checkpointing=checkpointing,
                     mixed_precision="bf16", loss="shardtune")
    c = formula_and_trace(folder, setup)
    return {"method": method, "strategy": setup.label(), "world_size": world, "checkpointing": checkpointing,
            "trace_bytes": c.traced_tensors, "formula_bytes": c.formula_tensors, "ratio": c.formula_tensors /
            c.traced_tensors, "trace_reserved_bytes": c.traced_reserved, "formula_total_bytes": c.formula_total,
            "reserved_ratio": c.formula_total / c.traced_reserved}


def make_models(root: Path) -> dict[str, str]:
    """The small models (tokenizer of 512 tokens), and a config-only one with a 32k vocabulary (no tokenizer:
    the trace then uses the config's vocabulary), where the loss dominates the activations."""
    from transformers import LlamaConfig

    from shardtune.testing.tiny import make_model_folder

    big_vocab = root / "vocab-32k"
    LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, tie_word_embeddings=False, pad_token_id=0).save_pretrained(big_vocab)
    out = {"vocab-32k": str(big_vocab)}
    for name, (hidden, inter, layers, heads, kv) in MODELS.items():
        out[name] = str(make_model_folder(root / name, hidden_size=hidden, intermediate_size=inter,
                                          num_layers=layers, num_heads=heads, num_kv_heads=kv))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, folder in make_models(Path(tmp)).items():
            for point in SETUPS:
                row = {"model": model} | compare(folder, *point)
                rows.append(row)
                print(f"{model:<10} {row['method']:<6} {row['strategy']:<22} ws={row['world_size']} "
                      f"ckpt={row['checkpointing']!s:<5} trace {row['trace_bytes'] / 2**20:8.2f} MiB  formula "
                      f"{row['formula_bytes'] / 2**20:8.2f} MiB  ratio {row['ratio']:.3f}  reserved: trace "
                      f"{row['trace_reserved_bytes'] / 2**20:8.2f} MiB formula "
                      f"{row['formula_total_bytes'] / 2**20:8.2f} MiB ratio {row['reserved_ratio']:.3f}",
                      flush=True)
    if args.out:
        out = Path(args.out)
        lines = ["| model | method | setup | world | ckpt | trace MiB | formula MiB | formula/trace "
                 "| trace reserved MiB | formula total MiB | total/reserved |", "|---|" + "---|" * 10]
        lines += [f"| {r['model']} | {r['method']} | {r['strategy']} | {r['world_size']} | {r['checkpointing']} | "
                  f"{r['trace_bytes'] / 2**20:.2f} | {r['formula_bytes'] / 2**20:.2f} | {r['ratio']:.3f} | "
                  f"{r['trace_reserved_bytes'] / 2**20:.2f} | {r['formula_total_bytes'] / 2**20:.2f} | "
                  f"{r['reserved_ratio']:.3f} |" for r in rows]
        for suffix, text in ((".json", json.dumps(rows, indent=1)), (".md", "\n".join(lines))):
            path = out.with_suffix(suffix)
            tmp_path = path.with_name(path.name + ".tmp")
            tmp_path.write_text(text + "\n")
            tmp_path.replace(path)


if __name__ == "__main__":
    main()
