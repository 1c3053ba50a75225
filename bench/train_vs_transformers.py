"""shardtune's trainer against Transformers' Trainer, side by side: same model, rows, steps, batch and precision.

Each run is its own process (so peak memory is that run's alone): `shardtune train`, and a Transformers `Trainer`
fed the very rows shardtune's data pipeline produced (no packing, padded batches, loss on the same target tokens).
Prints tokens/s and peak memory (CUDA: max_memory_reserved; CPU: peak RSS) and their ratios, and writes
bench/results/train_vs_transformers_<device>.{json,md}.

    .venv/bin/python bench/train_vs_transformers.py                 # small Llama built here, CPU or CUDA
    .venv/bin/python bench/train_vs_transformers.py --model PATH    # any local causal LM folder
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def make_assets(root: Path, hidden: int, layers: int, rows: int) -> tuple[Path, Path]:
    """A small Llama (random weights) with the project's tokenizer, and chat rows of short sums."""
    import random

    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(root / "model", hidden_size=hidden, intermediate_size=hidden * 4 // 1,
                              num_layers=layers, num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128))
    rng = random.Random(0)
    data = root / "chat.jsonl"
    with data.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            words = " ".join(rng.choice("the quick brown fox jumps over a lazy dog".split()) for _ in range(20))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{words}. What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    return model, data


def peak_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_reserved())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hf_worker(args: argparse.Namespace) -> None:
    """Transformers' Trainer on shardtune's rows; prints one JSON line with tokens/s and peak memory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from shardtune.data import DataConfig, load_tokenizer, prepare_datasets

    data_cfg = DataConfig(dataset_name=args.data, splits="train", max_seq_len=args.seq_len)
    tokenizer = load_tokenizer(args.model, data_cfg)
    rows = prepare_datasets(data_cfg, tokenizer, seed=0).train
    rows = [{"input_ids": rows[i]["input_ids"], "labels": rows[i]["labels"]} for i in range(len(rows))]
    bf16 = args.precision == "bf16"
    dtype = torch.bfloat16 if bf16 and args.method == "lora" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    if args.method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()

    def collate(batch):
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                              max_steps=args.steps, learning_rate=1e-4, bf16=bf16, logging_steps=10**6,
                              save_strategy="no", report_to=[], seed=42, dataloader_num_workers=0,
                              remove_unused_columns=False, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate)
    counted = {"tokens": 0}
    original = trainer.training_step

    def counting_step(model, inputs, *a, **k):
        counted["tokens"] += int(inputs["attention_mask"].sum())
        return original(model, inputs, *a, **k)

    trainer.training_step = counting_step
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    print(json.dumps({"tokens": counted["tokens"], "wall_s": wall, "tokens_per_s": counted["tokens"] / wall,
                      "peak_memory_bytes": peak_bytes()}))


def run_shardtune(args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "shardtune", "train", "--model_name_or_path", args.model, "--dataset_name",
           args.data, "--splits", "train", "--max_seq_len", str(args.seq_len), "--per_device_train_batch_size",
           str(args.batch), "--max_steps", str(args.steps), "--learning_rate", "1e-4", "--save_strategy", "no",
           "--logging_steps", str(10**6), "--output_dir", str(out), "--bf16", str(args.precision == "bf16"),
           # The memory check runs step 2 under the tracker; the Trainer has no such step, so leave it out.
           "--predict_memory", "False"]
    if args.method == "lora":
        cmd += ["--use_peft_lora", "True", "--lora_r", "16", "--lora_alpha", "32"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ | {"TQDM_DISABLE": "1"})
    summary = json.loads((out / "summary.json").read_text())
    return {k: summary[k] for k in ("tokens", "wall_s", "tokens_per_s", "peak_memory_bytes")}


def run_hf(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--data", args.data, "--method",
           args.method, "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--precision", args.precision]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local model folder (default: a small Llama built here)")
    p.add_argument("--data", default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--precision", default="bf16", choices=("bf16", "no"))
    p.add_argument("--methods", default="lora,full")
    p.add_argument("--method", default="lora", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        hf_worker(args)
        return
    import torch

    root = Path(tempfile.mkdtemp(prefix="shardtune-bench-"))
    if args.model is None:
        model, data = make_assets(root, args.hidden, args.layers, rows=2000)
        args.model, args.data = str(model), str(data)
    device = f"cuda-{torch.cuda.get_device_name().replace(' ', '_')}" if torch.cuda.is_available() else "cpu"
    rows = []
    for method in args.methods.split(","):
        args.method = method
        ours = run_shardtune(args, root / f"shardtune-{method}")
        theirs = run_hf(args)
        rows.append({"method": method, "shardtune": ours, "transformers": theirs,
                     "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                     "peak_memory_ratio": ours["peak_memory_bytes"] / theirs["peak_memory_bytes"]})
    lines = [f"# shardtune vs Transformers Trainer ({device}; {args.steps} steps, batch {args.batch}, "
             f"seq <= {args.seq_len}, {args.precision})", "",
             "| method | shardtune tok/s | Trainer tok/s | ratio | shardtune peak MiB | Trainer peak MiB | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        o, t = r["shardtune"], r["transformers"]
        lines.append(f"| {r['method']} | {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s_ratio']:.2f}x | {o['peak_memory_bytes'] / 2**20:.0f} | "
                     f"{t['peak_memory_bytes'] / 2**20:.0f} | {r['peak_memory_ratio']:.2f}x |")
    if device == "cpu":
        lines += ["", "CPU peak memory is the process's peak RSS (Python, libraries and the model); tokens/s on "
                      "CPU says little about CUDA speed."]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"train_vs_transformers_{device}.json").write_text(json.dumps(
        {"device": device, "args": {k: v for k, v in vars(args).items() if k not in ("worker",)}, "rows": rows},
        indent=1))
    (RESULTS / f"train_vs_transformers_{device}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
