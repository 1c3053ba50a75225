"""``shardtune demo``: the whole product on an embedded default, on 2 CPU processes, with nothing to download.

1. Will it fit? ``shardtune estimate`` for a few catalog models on your GPU (``--gpu``), with the recommended setup.
2. A real fine-tune: the bundled ~1M-parameter base model learns to answer sums in a chat turn, through
   ``shardtune launch --num_processes 2 train`` with FSDP2 and LoRA.
3. Before and after: eval loss and exact-match accuracy on held-out sums, and a few generations.
4. Loss plots of the run (``shardtune plot``).
"""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the embedded demo: estimate, fine-tune, evaluate, generate (no downloads)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default=None,
                   help="the GPU of the estimates (h100-80gb, h200, a100-80gb, a100-40gb, l40s, a6000, rtx4090, "
                        "rtx3090); default: a typical one per case")
    p.add_argument("--output-dir", default="out/demo", help="where the data, the run and its plots go "
                                                            "(default: out/demo)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps of the fine-tune (default: 120)")
    p.add_argument("--num-processes", type=int, default=None, help="training processes (default: 2)")
    p.add_argument("--skip-estimate", action="store_true", help="go straight to the fine-tune")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console
    from rich.rule import Rule

    from shardtune.demo.run import DemoSettings, FineTuneFailed, print_comparison, print_estimates, run_demo
    from shardtune.errors import UsageError
    from shardtune.hardware import gpu_by_name

    started = time.perf_counter()
    console = Console()
    settings = DemoSettings()
    for name, value in (("max_steps", args.max_steps), ("num_processes", args.num_processes)):
        if value is not None:
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {value}).")
            settings = dataclasses.replace(settings, **{name: value})
    if args.gpu:
        gpu_by_name(args.gpu)  # a bad name fails here, before minutes of training
    if not args.skip_estimate:
        console.print(Rule("1. Will it fit?"))
        print_estimates(console, args.gpu)
    console.print(Rule(f"2. Fine-tune on {settings.num_processes} CPU processes: FSDP2 + LoRA"))
    try:
        result = run_demo(args.output_dir, settings=settings, console=console)
    except FineTuneFailed as exc:
        console.print(f"[red]shardtune demo: {exc}[/]")
        return 1
    console.print(Rule("3. Did it work?"))
    print_comparison(console, result.before, result.after)
    console.print(Rule("4. Plots"))
    from shardtune.train.plot import write_plots

    for path in write_plots(result.run_dir):
        console.print(f"  {path}")
    final = result.run_dir / "final"
    console.print(f"\nDone in {time.perf_counter() - started:.0f} s (fine-tune {result.train_s:.0f} s). "
                  f"Chat with the tuned model: shardtune chat {final}")
    return 0
