"""``shardtune export CHECKPOINT OUT`` and ``shardtune merge ADAPTER [--base M] OUT``: checkpoints to Hugging Face
folders.

``export`` turns any ``output_dir/checkpoints/step-N`` (sharded or full, written on any number of processes) into
what ``output_dir/final`` holds: a PEFT adapter folder for LoRA/QLoRA, a Transformers model folder for full
fine-tuning. ``merge`` folds a LoRA adapter into its base model and writes a plain Transformers model folder.
Both run on one process and load weights without executing code (DCP, safetensors).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from shardtune.errors import UsageError

QUANTIZE = ("f16", "bf16", "q8_0")  # shardtune.gguf_export.QUANTIZE, without importing gguf for --help
OVERWRITE_HELP = ("replace an earlier shardtune export in OUT: only the files it wrote are replaced or removed, "
                  "nothing else there is touched (without it, an OUT that holds anything is refused)")


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a checkpoint as a PEFT adapter or Transformers model folder, or a run "
                                      "as a GGUF file for llama.cpp / Ollama",
                       description="Write CHECKPOINT (OUTPUT_DIR/checkpoints/step-N) as OUTPUT_DIR/final would be: "
                                   "a PEFT adapter folder for LoRA/QLoRA runs, a Transformers model folder for "
                                   "full fine-tuning. One process, whatever the number the run used. With --format "
                                   "gguf: RUN_OR_CHECKPOINT (a run's output_dir, its final/, a checkpoint, a merged "
                                   "model folder or a GGUF) becomes one GGUF file, LoRA merged, with an Ollama "
                                   "Modelfile beside it.")
    e.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint folder (it holds manifest.json); with --format gguf also a run's output_dir, "
                        "a final/ folder or a model folder")
    e.add_argument("out", metavar="OUT", help="the folder to write: new or empty (see --overwrite); with --format "
                                              "gguf a file ending in .gguf, or a folder that gets model-QUANTIZE.gguf "
                                              "and a Modelfile")
    e.add_argument("--format", default="hf", choices=("hf", "gguf"),
                   help="hf: a Transformers/PEFT folder (default); gguf: one GGUF file for llama.cpp, Ollama, "
                        "LM Studio")
    e.add_argument("--quantize", default=None, metavar="|".join(QUANTIZE),
                   help="--format gguf only: how the weights are stored (default q8_0; f16 and bf16 keep them "
                        "almost exact, q8_0 halves the file)")
    e.add_argument("--base", default=None,
                   help="the base model folder, when it moved since training (default: the checkpoint's "
                        "model_name_or_path)")
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    e.set_defaults(func=stopped_by_sigterm_reported(main_export))
    m = sub.add_parser("merge", help="fold a LoRA adapter into its base model (a full Transformers folder)",
                       description="Merge the LoRA adapter in ADAPTER (OUTPUT_DIR/final of a LoRA run, or a "
                                   "'shardtune export' folder) into its base model (--base, else the one the "
                                   "adapter names) and write a Transformers model folder.")
    m.add_argument("adapter", metavar="ADAPTER", help="a PEFT adapter folder")
    m.add_argument("--base", default=None,
                   help="the base model folder the adapter was trained on (default: the one its "
                        "adapter_config.json names, as given or relative to ADAPTER)")
    m.add_argument("out", metavar="OUT", help="the folder to write: new or empty (see --overwrite)")
    m.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    m.set_defaults(func=stopped_by_sigterm_reported(main_merge))


def stopped_by_sigterm_reported(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` with SIGTERM answered: the write it interrupts removes its temporary files on the way out
    (``sigterm_raises``), then one line says so, and the exit code is 143 (128 + SIGTERM, what a shell reports)."""
    from shardtune.cli.common import sigterm_raises
    from shardtune.errors import EXIT_PREEMPTED, Terminated

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            with sigterm_raises():
                return command(args)
        except Terminated:
            print(f"shardtune {args.command}: stopped by SIGTERM before {args.out} was complete; the temporary "
                  f"files of the write in progress were removed: run the command again", file=sys.stderr)
            return EXIT_PREEMPTED

    return run


def _check_base(base: str | None, fix: str) -> None:
    """--base is a folder or a GGUF file: a missing one is refused at once, not looked up on the hub (a minute of
    retries)."""
    from shardtune.gguf_source import find_gguf

    if base is not None and not Path(base).is_dir() and not find_gguf(base):
        raise UsageError(f"--base {base}: no such folder; {fix}")


def _check_out(out: str, *, whole_folder: bool, merged: str | None = None) -> None:
    """OUT refused before anything loads when it cannot be made: a file or a dangling symlink in the way, or a
    name ending in .gguf for a folder (a forgotten --format gguf wrote a PEFT adapter folder called
    'model.gguf', which llama.cpp and Ollama cannot open); ``merged``: the adapter a merge folds in. What a
    folder may already hold (nothing, or an earlier export with --overwrite; never the current folder or a
    source) is ``train.destination``'s to say."""
    from shardtune.cli.common import check_output_path

    if whole_folder and out.lower().rstrip("/").endswith(".gguf"):
        fix = ("add --format gguf to write a GGUF file, or give a folder name" if merged is None else
               f"give a folder name, or write a GGUF with 'shardtune export {merged} {out} --format gguf'")
        raise UsageError(f"OUT {out}: a name ending in .gguf, but {'export' if merged is None else 'merge'} writes "
                         f"a Transformers/PEFT folder there; {fix}")
    check_output_path(out, "OUT", folder=whole_folder or not out.lower().endswith(".gguf"))


def main_export(args: argparse.Namespace) -> int:
    _check_base(args.base, "give the folder of the base model the run trained (or leave --base out)")
    _check_out(args.out, whole_folder=args.format != "gguf")
    if args.format == "gguf":
        from shardtune.train.export_gguf import export_gguf

        quantize = "q8_0" if args.quantize is None else args.quantize  # an empty --quantize "" is refused
        path = export_gguf(args.checkpoint, args.out, quantize=quantize, base=args.base,
                           overwrite=args.overwrite)
        from shardtune.cli.common import say_base_unquantised

        say_base_unquantised(args.checkpoint, "the GGUF holds its adapters merged into its base unquantised")
        print(f"wrote {path} and {path.parent / 'Modelfile'}")
        return 0
    if args.quantize is not None:
        raise UsageError(f"--quantize {args.quantize}: applies to --format gguf only; add --format gguf or leave "
                         f"--quantize out")
    from shardtune.train.export import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out, base=args.base, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def main_merge(args: argparse.Namespace) -> int:
    _check_base(args.base, "give the base model folder the adapter was trained on")
    _check_out(args.out, whole_folder=True, merged=args.adapter)
    label = f"--base {args.base}"
    if args.base is None:
        from shardtune.hub import adapter_base, adapter_folder_problem

        if problem := adapter_folder_problem(Path(args.adapter)):
            raise UsageError(problem)
        try:
            args.base = str(adapter_base(Path(args.adapter)))
        except UsageError as exc:
            raise UsageError(f"{exc} Or give it as --base") from None
        label = f"the base model {args.base} (the adapter's base_model_name_or_path)"
    _check_merge_inputs(Path(args.adapter), args.base, Path(args.out), overwrite=args.overwrite, label=label)
    from shardtune.bitsandbytes_use import model_needs_bitsandbytes
    from shardtune.cli.common import leave_out_bitsandbytes_unless
    from shardtune.hub import pickled_weights_refused

    leave_out_bitsandbytes_unless(lambda: model_needs_bitsandbytes(args.base))  # before PEFT is imported
    from shardtune.train.export import merge_adapter

    with pickled_weights_refused(Path(args.adapter), Path(args.base)):
        path = merge_adapter(args.adapter, args.base, args.out, overwrite=args.overwrite)
    from shardtune.cli.common import say_base_unquantised
    from shardtune.train.export import stored_dtype

    say_base_unquantised(args.adapter, f"it is merged into the unquantised base {args.base} "
                                       f"({str(stored_dtype(args.base)).removeprefix('torch.')})")
    print(f"wrote {path}")
    return 0


def _check_merge_inputs(adapter: Path, base: str, out: Path, *, overwrite: bool, label: str) -> None:
    """What ``merge`` reads and writes, checked before anything is loaded: OUT, the adapter's files and the base
    model folder (config.json, weights, no code of its own: merge runs none), named in messages as ``label``."""
    from shardtune.hub import (adapter_folder_problem, adapter_weights_problem, model_folder_problem,
                               tokenizer_problem)
    from shardtune.train.destination import refuse_destination

    refuse_destination(out, "OUT", sources=[adapter, base], overwrite=overwrite)
    if problem := adapter_folder_problem(adapter):
        raise UsageError(problem)
    if problem := model_folder_problem(base, label, trust_remote_code=False,
                                       trust_fix="merge it in Python with PEFT (PeftModel.from_pretrained(...)"
                                                 ".merge_and_unload()), where trust_remote_code=True can be passed"):
        raise UsageError(problem)
    if problem := tokenizer_problem(label, adapter, base) or adapter_weights_problem(adapter):
        raise UsageError(problem)
