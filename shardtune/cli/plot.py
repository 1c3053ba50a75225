"""shardtune plot: PNGs of a training run's loss (train and eval, against steps and tokens), learning rate and
gradient norm, read from OUTPUT_DIR/metrics.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardtune.errors import UsageError

PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write PNGs of a run's loss, learning rate and grad norm", description=__doc__)
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="a training run's output_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the PNGs (default: OUTPUT_DIR/plots)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from shardtune.cli.common import check_output_path
    from shardtune.train.plot import write_plots

    if args.out is not None:
        out = Path(args.out)
        if out.suffix.lower() in PICTURE_SUFFIXES and not out.is_dir():  # it would become a folder of that name
            raise UsageError(f"--out {args.out}: plot writes one PNG per chart (loss, learning rate, grad norm) "
                             f"into a folder; give a folder, e.g. --out {out.with_suffix('')}")
        check_output_path(args.out, "--out", folder=True)

    for path in write_plots(args.output_dir, args.out):
        print(path)
    return 0
