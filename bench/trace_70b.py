"""Time the fake-tensor trace of a 70B model at world size 8 (FSDP2 FULL_SHARD), the issue's target: < 2 minutes.

    .venv/bin/python bench/trace_70b.py [MODEL] [--method full|lora] [--out bench/results/trace_70b_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default="llama-2-70b")
    parser.add_argument("--method", default="full", choices=("full", "lora"))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    from shardtune.config import build_config
    from shardtune.memory.trace import trace_training_step

    values = {"model_name_or_path": args.model, "output_dir": "unused", "dataset_name": "unused",
              "distributed_type": "FSDP", "bf16": True, "gradient_checkpointing": True,
              "max_seq_len": args.seq_len, "per_device_train_batch_size": 1,
              "use_peft_lora": args.method == "lora"}
    cfg = build_config([(values, {})])
    imported = time.perf_counter() - started
    result = trace_training_step(cfg, args.world_size)
    wall = time.perf_counter() - started
    record = {"model": args.model, "method": args.method, "world_size": args.world_size, "seq_len": args.seq_len,
              "peak_bytes": result.peak_bytes, "peak_gib": round(result.peak_bytes / 2**30, 3),
              "reserved_bytes": result.reserved_bytes, "reserved_gib": round(result.reserved_bytes / 2**30, 3),
              "categories": result.categories, "trace_s": round(result.seconds, 1), "wall_s": round(wall, 1),
              "import_s": round(imported, 1), "cpus": os.cpu_count(), "python": platform.python_version()}
    print(json.dumps(record, indent=1))
    if args.out:
        path = Path(args.out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    main()
