"""The strategy table on a CPU machine: MP, PP, DDP and FSDP on 2 processes, for a small Llama (4 layers, 256 wide).

    .venv/bin/python bench/strategies_cpu.py [--out bench/results/strategies_cpu.json]

Builds the model (folder ``tiny-llama``, the name the results give it) and a chat data set in a temporary
folder, writes a recipe, and runs ``shardtune bench strategies`` on it. Each setup trains the same global batch per
step for MP and PP (8 rows) and 8 rows per rank for DDP and FSDP; tokens/s makes them comparable.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "strategies_cpu.json"))
    parser.add_argument("--plot", default=str(REPO / "bench" / "results" / "strategies_cpu.png"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num_processes", type=int, default=2)
    args = parser.parse_args()

    from shardtune.cli import main as shardtune
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import write_chat_data

    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        root = Path(tmp)
        # The folder's name is the model's name in the results ("measured with tiny-llama (4 layers x 256 ...)").
        model = make_model_folder(root / "tiny-llama", num_layers=4, hidden_size=256, intermediate_size=704,
                                  num_heads=8, num_kv_heads=4)
        data = write_chat_data(root / "chat.jsonl", rows=3000)
        recipe = root / "recipe.yaml"
        recipe.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\nsplits: train\nmax_seq_len: 128\n"
                          f"packing: true\nper_device_train_batch_size: 8\npipeline_microbatches: 4\n"
                          f"pipeline_schedule: 1F1B\nlearning_rate: 1.0e-4\n")
        return shardtune(["bench", "strategies", str(recipe), "--strategies", "MP,PP,DDP,FSDP",
                          "--num_processes", str(args.num_processes), "--steps", str(args.steps),
                          "--warmup_steps", "2", "--out", args.out, "--plot", args.plot])


if __name__ == "__main__":
    sys.exit(main())
