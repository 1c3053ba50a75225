"""Pre-train the demo's base model and write it to shardtune/demo/base_model/ (what `shardtune demo` fine-tunes).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/pretrain_demo_base.py [--out DIR]

Everything that decides the model is shardtune.demo.base.BASE_SPEC; the folder records it in pretrain.json, and
tests/test_demo.py checks that the shipped folder matches the spec. About 5 minutes on one CPU core (one
thread is faster than two for a model this small), 7-8 when the machine is busy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardtune.demo.base import BASE_MODEL_DIR, BASE_SPEC, pretrain  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BASE_MODEL_DIR, help=f"output folder (default: {BASE_MODEL_DIR})")
    args = parser.parse_args()
    stats = pretrain(args.out, BASE_SPEC)
    print(f"wrote {args.out}: {stats['parameters']:,} parameters, final loss {stats['final_loss']:.4f}, "
          f"{stats['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
