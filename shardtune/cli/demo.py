"""``shardtune demo``: the main job on an embedded default, with nothing to download.

For now it answers the first question people ask, for a few catalog models and GPUs: will it fit, with which method
and which setup. Later releases grow it into a full fine-tune of a small bundled model.
"""

from __future__ import annotations

import argparse

# (model, method, GPUs per node, GPU, micro-batch): the questions the estimator gets most.
DEMO_CASES = (
    ("llama-3.1-8b", "lora", 1, "rtx4090", 2),
    ("llama-3.1-8b", "full", 8, "h100-80gb", 4),
    ("llama-2-70b", "lora", 8, "h100-80gb", 8),
    ("llama-3.1-405b", "qlora", 8, "h100-80gb", 1),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the embedded demo (no downloads)", description=__doc__)
    p.add_argument("--gpu", default=None, help="use this GPU for every case instead of the demo's choices")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.rule import Rule

    from shardtune.cli.estimate import run_estimate
    from shardtune.memory.hardware import gpu_by_name
    from shardtune.memory.report import render
    from shardtune.memory.setup import Setup, validate

    console = Console()
    for model, method, gpus, gpu_name, batch in DEMO_CASES:
        gpu = gpu_by_name(args.gpu or gpu_name)
        console.print(Rule(f"shardtune estimate {model} --method {method} --num-gpus {gpus} --gpu {gpu.name} "
                           f"--batch-size {batch}"))
        setup = validate(Setup(method=method, num_gpus=gpus, batch_size=batch,
                               strategy="single" if gpus == 1 else "fsdp"))
        render(run_estimate(model, setup, gpu, auto=True), console)
    return 0
