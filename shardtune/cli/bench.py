"""``shardtune bench strategies CONFIG --strategies MP,PP,DDP,FSDP``: the same short job under each setup.

Prints and saves a table per setup: wall time per step, tokens/s, how busy each device was, peak memory and the
estimator's figure beside it, and one line that explains the result. ``--set key=value`` (repeatable) overrides a
training key for every setup (e.g. ``--set per_device_train_batch_size=4``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from shardtune.bench.strategies import BENCHED, SET_BY_BENCH
from shardtune.config.schema import ALIASES
from shardtune.errors import UsageError
from shardtune.files import PICTURE_FIELDS, WRITTEN_BY, with_digest, with_json_digest, write_text
from shardtune.strategies import lookup


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare MP, PP, DDP and FSDP on the same short job", description=__doc__)
    what = p.add_subparsers(dest="bench_command", metavar="WHAT")
    s = what.add_parser("strategies", help="run CONFIG under each setup and tabulate speed, busy fraction, memory",
                        description=__doc__)
    s.add_argument("config", metavar="CONFIG", help="a training YAML recipe (model, data, batch, ...)")
    s.add_argument("--strategies", default=None,
                   help=f"comma-separated, any case: {', '.join(BENCHED)} (default: all of them)")
    s.add_argument("--num_processes", "--num-processes", type=int, default=2,
                   help="processes for PP/DDP/FSDP and devices for MP (default: 2)")
    s.add_argument("--steps", type=int, default=6, help="optimizer steps per setup (default: 6)")
    s.add_argument("--warmup_steps", "--warmup-steps", type=int, default=1,
                   help="first steps left out of the figures (default: 1)")
    s.add_argument("--out", default=None, metavar="FILE.json",
                   help="where to save the rows (a .md table is written beside it); default: print only")
    s.add_argument("--plot", default=None, metavar="FILE.png", help="write a bar chart of tokens/s and busy fraction")
    s.add_argument("--work_dir", "--work-dir", default=None, help="keep the runs' output folders here")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="extra",
                   help="a training key applied to every setup (repeatable)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per setup (default: 600)")
    s.set_defaults(func=main)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def parse_strategies(text: str | None) -> list[str]:
    """The strategies' registry names that ``--strategies`` lists (any case); all the bench compares without it."""
    if text is None:
        return list(BENCHED)
    names = [n.strip() for n in text.split(",") if n.strip()]
    found = [lookup(n) for n in names]
    bad = [n for n, s in zip(names, found) if s is None or s.name not in BENCHED]
    if bad or not names:
        raise UsageError(f"--strategies {text!r}: unknown {', '.join(bad) or 'empty list'}; use a comma-separated "
                         f"list of {', '.join(BENCHED)}")
    return [s.name for s in found]


def main(args: argparse.Namespace) -> int:
    """Run the comparison and print (and save) the table."""
    from shardtune.bench.strategies import (
        bench_strategies,
        default_caveat,
        format_table,
        write_plot,
    )

    strategies = parse_strategies(args.strategies)
    if args.num_processes < 1:
        raise UsageError(f"--num_processes {args.num_processes}: give 1 or more (default 2)")
    if args.warmup_steps < 0 or args.steps <= args.warmup_steps:
        raise UsageError(f"--steps {args.steps} --warmup_steps {args.warmup_steps}: the figures come from the steps "
                         f"after the warm-up ones, so give --warmup_steps 0 or more and --steps above it (defaults 6 "
                         f"and 1)")
    if not Path(args.config).is_file():
        raise UsageError(f"CONFIG {args.config}: no such file; give a training YAML recipe")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout {args.timeout:g}: give the seconds allowed per setup, above 0 (default 600)")
    from shardtune.cli.common import check_output_file, check_output_path

    # Before minutes of runs, not after them.
    for option, path in (("--out", args.out), ("--out", args.out and Path(args.out).with_suffix(".md")),
                         ("--plot", args.plot)):
        if path:
            check_output_file(path, option)
    if args.work_dir:
        check_output_path(args.work_dir, "--work_dir", folder=True)
        for folder in (Path(args.work_dir) / strategy for strategy in strategies):
            if folder.is_dir() and any(folder.iterdir()):  # each setup would refuse it, after the ones before ran
                raise UsageError(f"--work_dir {args.work_dir}: {folder} holds an earlier run; give a new or empty "
                                 f"--work_dir (nothing in it is deleted)")
    if args.plot and Path(args.plot).suffix.lstrip(".").lower() not in PICTURE_FIELDS:
        raise UsageError(f"--plot {args.plot}: give a picture file of {', '.join(PICTURE_FIELDS)} (by its suffix)")
    extra = []
    for pair in args.extra:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise UsageError(f"--set {pair!r}: write KEY=VALUE, e.g. --set per_device_train_batch_size=4")
        name = key.strip().lstrip("-").replace("-", "_")
        own = ALIASES.get(name, name)
        if own in SET_BY_BENCH:
            raise UsageError(f"--set {pair!r}: the bench sets {own} for every setup itself; {SET_BY_BENCH[own]}")
        extra += [f"--{key.strip()}", value]
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        results, meta = bench_strategies(args.config, strategies, num_processes=args.num_processes, steps=args.steps,
                                   warmup_steps=args.warmup_steps, work_dir=work, extra=extra,
                                   timeout_s=args.timeout)
    if all(r.error for r in results):
        # Nothing was measured: a table of dashes, files of dashes and "rank setups by these speeds" would only
        # mislead. Each setup's error, then why nothing was saved.
        for r in results:
            print(f"- {r.strategy}: {r.explanation}", file=sys.stderr)
        unsaved = " or ".join(path for path in (args.out, args.plot) if path)
        print(f"shardtune bench: error: none of the setups ran ({', '.join(strategies)}: "
              f"errors above){f'; nothing was written to {unsaved}' if unsaved else ''}; fix what they say "
              f"in {args.config} and run again",
              file=sys.stderr)
        return 1
    loads = [r.load_average for r in results if r.load_average is not None]
    table = format_table(results, default_caveat(args.num_processes, sum(loads) / len(loads) if loads else None))
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        saved = {"written_by": "shardtune bench strategies"} | meta | {"results": [asdict(r) for r in results]}
        for path, text in ((out, json.dumps(with_json_digest(saved), indent=1)),
                           (out.with_suffix(".md"),
                            with_digest(f"<!-- {WRITTEN_BY} bench strategies -->\n{table}\n", comment="<!--"))):
            write_text(path, text)
        print(f"saved {out} and {out.with_suffix('.md')} (rank setups by these speeds: shardtune estimate "
              f"MODEL --num-gpus {args.num_processes} --measured {out})")
    if args.plot:
        print(f"wrote {write_plot(results, Path(args.plot))}")
    return 1 if any(r.error for r in results) else 0
