"""The memory estimate against real training steps on a CUDA GPU: measured peaks beside predicted ones.

For each catalog model (1B-3B by default), method (full / LoRA / QLoRA), micro-batch x sequence length and gradient
checkpointing on/off, the script builds the model from the catalog config with random weights (nothing is
downloaded), runs real training steps (forward with the transformers loss, backward, AdamW step), and records
``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` over the steps after a warm-up step, beside
``shardtune estimate``'s ``total`` (which predicts the reserved peak) and its allocated part (``total`` less the
modelled allocator cache). It writes bench/results/estimate_cuda_<device>.json and .md.

The training step is the one the estimator models: single GPU, SDPA attention, the full (unchunked) transformers
loss; full fine-tuning keeps fp32 weights under bf16 autocast (mixed precision), LoRA keeps the base and the
adapters in bf16 (pure bf16), QLoRA stores the base linear layers in NF4 (bitsandbytes, double quantisation, bf16
compute) and the rest in bf16. Out-of-memory runs are recorded as such.

    .venv/bin/python bench/estimate_cuda.py                  # on a CUDA machine: the full matrix
    .venv/bin/python bench/estimate_cuda.py --models llama-3.2-1b --methods lora qlora
    .venv/bin/python bench/estimate_cuda.py --dry-run        # anywhere: tiny models on CPU, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from shardtune import catalog  # noqa: E402
from shardtune.memory.formula import ALLOCATOR_SLACK, WORKSPACE_BYTES, estimate  # noqa: E402
from shardtune.memory.inventory import ModelAnalysis, build_config  # noqa: E402
from shardtune.memory.setup import Setup, validate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
LORA_R = 16
# Small enough that every config fits one 80 GB GPU with checkpointing (3B full fine-tuning needs ~52 GB of states).
DEFAULT_MODELS = ["llama-3.2-1b", "tinyllama-1.1b", "llama-3.2-3b"]
DEFAULT_SHAPES = ["1x1024", "2x2048", "4x1024"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, head_dim=16, bos_token_id=1, eos_token_id=2)


@dataclass
class Row:
    model: str
    method: str
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    predicted_total_gib: float
    predicted_allocated_gib: float
    peak_phase: str
    measured_reserved_gib: float | None = None
    measured_allocated_gib: float | None = None
    error_reserved: float | None = None  # predicted / measured - 1
    error_allocated: float | None = None
    status: str = "ok"
    seconds: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="catalog names")
    p.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"], choices=["full", "lora", "qlora"])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="micro-batch x sequence length, e.g. 2x2048")
    p.add_argument("--checkpointing", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny models (2 layers, hidden 64) on CPU: checks the script end to end, measures nothing")
    p.add_argument("--out", default=None, help="result name (default: estimate_cuda_<device>)")
    p.add_argument("--results-dir", default=str(RESULTS), help="where the JSON and markdown go (default: %(default)s)")
    return p.parse_args(argv)


def setup_for(method: str, batch: int, seq: int, checkpointing: bool) -> Setup:
    """The estimator's description of the step this script runs."""
    return validate(Setup(method=method, strategy="single", batch_size=batch, seq_len=seq,
                          gradient_checkpointing=checkpointing, mixed_precision="bf16",
                          pure_bf16=method != "full", optimizer="adamw", lora_r=LORA_R,
                          lora_target_modules="all-linear", attn_implementation="sdpa", loss="full"))


def model_config(name: str, dry_run: bool) -> dict:
    config = catalog.load(name)
    if dry_run:  # same architecture, tiny sizes
        config = config | TINY | {"tie_word_embeddings": config.get("tie_word_embeddings", False)}
    return config


def _quantize_linears(model: torch.nn.Module, device: torch.device) -> None:
    """Swap every nn.Linear except the LM head for a bitsandbytes NF4 layer (double quantisation, bf16 compute)."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not head:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                      quant_storage=torch.bfloat16)
                q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu", torch.bfloat16), requires_grad=False,
                                             compress_statistics=True, quant_type="nf4",
                                             quant_storage=torch.bfloat16)
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data.to(torch.bfloat16), requires_grad=False)
                setattr(parent, child_name, q.to(device))  # moving to the GPU quantises the weight


def build_model(config: dict, name: str, method: str, device: torch.device) -> torch.nn.Module:
    """The model as the estimator assumes it is trained, on ``device``, random weights."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(config, name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.float32 if method == "full" else torch.bfloat16
    with torch.device("cpu" if method == "qlora" else device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if method == "full":
        return model.to(device)
    if method == "qlora":
        _quantize_linears(model, device)
        model.to(device)
    from peft import LoraConfig, get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear",
                                             lora_dropout=0.0))
    for p in model.parameters():  # pure bf16: adapters in bf16 too (PEFT would upcast them to fp32)
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


def train_steps(model: torch.nn.Module, setup: Setup, vocab: int, steps: int, device: torch.device) -> None:
    """One warm-up step, a reset of the peak counters, then ``steps`` measured steps."""
    if setup.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    autocast = setup.method == "full" and not setup.pure_bf16
    for step in range(steps + 1):
        if step == 1 and device.type == "cuda":  # measure the steady state: states exist, caches are warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, vocab, (setup.batch_size, setup.seq_len), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    del optimizer


def predict(analysis: ModelAnalysis, setup: Setup) -> tuple[int, int, str]:
    """(total, allocated part, peak phase): total predicts max_memory_reserved; less the modelled allocator
    cache it predicts max_memory_allocated."""
    lora = analysis.lora(setup.lora_r, setup.lora_target_modules) if setup.uses_lora else None
    b = estimate(analysis.inventory, setup, lora)
    cache = sum(i.bytes for i in b.items if i.label == "allocator cache and workspaces")
    return b.total, b.total - cache, b.phase


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --dry-run to check the script on CPU")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    if args.dry_run:
        shapes = [(b, min(s, 64)) for b, s in shapes]
    rows: list[Row] = []
    for name in args.models:
        config = model_config(name, args.dry_run)
        folder = Path(args.results_dir) / f".config-{name}{'-tiny' if args.dry_run else ''}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        analysis = ModelAnalysis(str(folder), use_cache=False)
        for method in args.methods:
            try:
                model = build_model(config, name, method, device)
            except torch.OutOfMemoryError:
                print(f"{name} {method}: the model alone does not fit", flush=True)
                continue
            for batch, seq in shapes:
                for ckpt in args.checkpointing:
                    setup = setup_for(method, batch, seq, ckpt == "on")
                    total, allocated, phase = predict(analysis, setup)
                    row = Row(name, method, batch, seq, ckpt == "on", total / GIB, allocated / GIB, phase)
                    start = time.perf_counter()
                    try:
                        train_steps(model, setup, config["vocab_size"], args.steps, device)
                        if device.type == "cuda":
                            row.measured_reserved_gib = torch.cuda.max_memory_reserved() / GIB
                            row.measured_allocated_gib = torch.cuda.max_memory_allocated() / GIB
                            row.error_reserved = row.predicted_total_gib / row.measured_reserved_gib - 1
                            row.error_allocated = row.predicted_allocated_gib / row.measured_allocated_gib - 1
                    except torch.OutOfMemoryError:
                        row.status = "out of memory"
                    row.seconds = time.perf_counter() - start
                    rows.append(row)
                    print(_line(row), flush=True)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()  # the next config starts from what is really alive
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _remove_tree(folder)
    return rows


def _remove_tree(folder: Path) -> None:
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _gib(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _line(r: Row) -> str:
    return (f"{r.model:15s} {r.method:5s} b{r.batch_size} s{r.seq_len} ckpt={'on ' if r.gradient_checkpointing else 'off'}"
            f" predicted {r.predicted_total_gib:6.2f} (alloc {r.predicted_allocated_gib:6.2f})"
            f" measured {_gib(r.measured_reserved_gib):>6s} (alloc {_gib(r.measured_allocated_gib):>6s})"
            f" {_pct(r.error_reserved):>7s} {r.status}")


def write_results(rows: list[Row], args: argparse.Namespace) -> tuple[Path, Path]:
    """bench/results/<name>.json and .md, each written through a temporary file and a rename."""
    device = "cpu-dry-run" if args.dry_run else torch.cuda.get_device_name().replace(" ", "-").lower()
    name = args.out or f"estimate_cuda_{device}"
    meta = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "steps": args.steps, "lora_r": LORA_R,
            "allocator_slack": ALLOCATOR_SLACK, "workspace_bytes": WORKSPACE_BYTES,
            "note": "dry run on CPU: tiny models, nothing measured" if args.dry_run else ""}
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results / f"{name}.json", results / f"{name}.md"
    lines = [f"# shardtune estimate against measured CUDA peaks ({device})", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}; {args.steps} measured steps after a warm-up step; "
             f"LoRA/QLoRA r={LORA_R} on all linear layers. Predicted total = max_memory_reserved, predicted "
             "allocated = total less the modelled allocator cache." + (f" {meta['note']}." if meta["note"] else ""), "",
             "| model | method | batch x seq | ckpt | predicted GiB | measured reserved | error | predicted alloc "
             "| measured alloc | error | status |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r.model} | {r.method} | {r.batch_size} x {r.seq_len} | "
                     f"{'on' if r.gradient_checkpointing else 'off'} | {r.predicted_total_gib:.2f} | "
                     f"{_gib(r.measured_reserved_gib)} | {_pct(r.error_reserved)} | {r.predicted_allocated_gib:.2f} | "
                     f"{_gib(r.measured_allocated_gib)} | {_pct(r.error_allocated)} | {r.status} |")
    for path, text in ((json_path, json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1)),
                       (md_path, "\n".join(lines) + "\n")):
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    for path in write_results(rows, args):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
