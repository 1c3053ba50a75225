"""QLoRA loaded two ways on a CUDA GPU train alike: quantised on the GPU (one process) and quantised in CPU RAM,
then moved to the GPU by FSDP2 (``launch --num_processes 1`` with FSDP, the path that lets a 4-bit model larger
than one GPU start).

Both runs take the same steps on the same data; the script writes each run's per-step losses, their largest
difference and each run's peak reserved memory to ``bench/results/qlora_load_cuda.{json,md}``. The two runs differ
in where bitsandbytes quantised (its CPU and CUDA kernels) and in FSDP's fp32 gradient reduction, so the losses
agree closely rather than bitwise.

    python bench/qlora_load_cuda.py            # needs a CUDA GPU and bitsandbytes
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 8


def train(work: Path, out: str, launch: list[str], extra: list[str]) -> dict:
    args = ["--model_name_or_path", "M", "--dataset_name", "chat.jsonl", "--splits", "train", "--max_seq_len", "128",
            "--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--packing", "True",
            "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--bf16", "True", "--use_peft_lora",
            "True", "--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16",
            "--output_dir", out, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardtune", *launch, "train", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    records = [json.loads(line) for line in (work / out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"losses": [r["loss"] for r in steps], "peak_memory_bytes": max(r["peak_memory_bytes"] for r in steps)}


def main() -> int:
    import torch

    from shardtune.demo.task import all_sums, write_jsonl
    from shardtune.testing.tiny import make_model_folder

    if not torch.cuda.is_available():
        print("qlora_load_cuda.py needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="shardtune-qlora-load-") as tmp:
        work = Path(tmp)
        make_model_folder(work / "M", hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                          num_kv_heads=4)
        write_jsonl((s.row() for s in all_sums(max_operand=24)), work / "chat.jsonl")  # the demo's task, 625 rows
        on_gpu = train(work, "gpu_load", [], [])
        on_cpu = train(work, "cpu_load", ["launch", "--num_processes", "1"], ["--distributed_type", "FSDP"])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": STEPS,
              "quantised_on_gpu": on_gpu, "quantised_on_cpu_fsdp": on_cpu}
    if "losses" in on_gpu and "losses" in on_cpu:
        result["max_abs_loss_difference"] = max(abs(a - b) for a, b in zip(on_gpu["losses"], on_cpu["losses"]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "qlora_load_cuda.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# QLoRA quantised on the GPU vs in CPU RAM then moved by FSDP2", "",
             f"{result['device']}, torch {result['torch']}, {STEPS} steps, tiny Llama (4 layers, hidden 256).", ""]
    for name, run in (("quantised on the GPU, 1 process", on_gpu), ("quantised on the CPU, FSDP2", on_cpu)):
        if "error" in run:
            lines.append(f"- {name}: failed: {run['error']}")
        else:
            lines.append(f"- {name}: losses {', '.join(f'{x:.4f}' for x in run['losses'])}; peak reserved "
                         f"{run['peak_memory_bytes'] / 2**20:.0f} MiB")
    if "max_abs_loss_difference" in result:
        lines.append(f"- largest loss difference: {result['max_abs_loss_difference']:.2e}")
    (RESULTS / "qlora_load_cuda.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if "max_abs_loss_difference" in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
