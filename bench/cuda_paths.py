"""Every CUDA-only path of shardtune run once, as a user runs it, each recorded pass/fail with its figures.

QLoRA has only run through bitsandbytes' CPU path, and paged optimizers, activation offloading's side stream,
Liger's Triton kernels and generation on CUDA have never run at all. One command runs them all and writes
bench/results/cuda_paths_DEVICE.{json,md} after every check, so a run cut short keeps what it measured:

- ``pytest-gpu``: the tests marked ``gpu`` (they skip without CUDA; Liger's unit test among them).
- ``qlora``: ``shardtune train`` of a Llama-3.2-1B-shaped model (built from the catalog config, random weights)
  with nf4, double quantisation and bf16 compute, LoRA on every linear layer, 2048-token rows: the loss must fall;
  the peak (``max_memory_reserved``) beside ``shardtune estimate --config`` of the same job (the formula) and the
  end-of-run memory check's trace.
- ``optim-adamw_8bit``, ``optim-paged_adamw_8bit``, ``optim-paged_adamw_32bit``: a tiny model trained 4 steps,
  and again from its step-2 checkpoint: the resumed steps' losses must equal the uninterrupted run's bitwise.
- ``offloading`` and ``liger``: the 1B shape, LoRA, bf16, 2048-token rows, once as it is, once with
  ``activation_offloading`` (peak must drop; its step-time cost and both estimates beside it) and once with
  ``use_liger_kernel`` (losses within 1e-2 of the plain run's, relative, in bf16).
- ``generate``: ``shardtune generate`` (KV cache, bf16 on CUDA) of the demo's pretrained model against
  transformers' ``generate`` of the same folder, greedy: the same tokens.
- ``export-gguf``: a LoRA run on CUDA, then ``shardtune export --format gguf --quantize f16``: the GGUF read back
  by shardtune's loader must give the merged model's logits (within f16 rounding).

A check that raises or whose process fails is recorded as failed with its last lines, and the next one runs.
``--max-minutes`` starts no check after that many minutes (the skipped ones are listed). ``--device cpu --tiny``
is the dry run: the same code on a CPU, the 1B shape cut to two narrow layers (paged optimizers are refused there,
as shardtune refuses them without CUDA, and that refusal is what the dry run records).

    bash bench/gpu_session.sh cuda-paths                                        # on the GPU machine
    .venv/bin/python bench/cuda_paths.py --device cpu --tiny --name cuda_paths_cpu_dry_run   # dry run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # tests.trainutil's rows, vs_trl's models and machine line
RESULTS = REPO / "bench" / "results"
DEMO_BASE = REPO / "shardtune" / "demo" / "base_model"
SHAPE = "llama-3.2-1b"
OPTIMS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
BF16_LOSS_REL_TOL = 1e-2  # Liger's kernels against transformers' in bf16 (the issue's bound)
GGUF_F16_TOL = 5e-3  # a GGUF stored in f16 against the merged fp32 model: max |logit difference| / max |logit|


class CheckFailed(Exception):
    """The path ran but did not do what it must (the message says what)."""


STOP_AT = math.inf  # time.monotonic() at which a running command is killed (--stop-minutes)


def run(cmd: list[str], log: Path, timeout: float, *, stdout_only: bool = False) -> str:
    """Run ``cmd`` from the repository root; its output (also in ``log``; with ``stdout_only`` the output is its
    stdout alone and its stderr goes to the log), or CheckFailed with its last lines. Killed after ``timeout``
    seconds or at STOP_AT, whichever comes first."""
    # the repository first, then what the caller had (on the GPU machine: the carried bitsandbytes, Liger, TRL)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    limit = max(1.0, min(timeout, STOP_AT - time.monotonic()))
    with log.open("w") as out:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE if stdout_only else out,
                                  stderr=out if stdout_only else subprocess.STDOUT, timeout=limit, text=True,
                                  env=os.environ | {"TQDM_DISABLE": "1", "PYTHONPATH": path})
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{' '.join(cmd[1:4])} was still running after {limit:.0f} s (its timeout or "
                              f"--stop-minutes); its log is {log}") from None
    text = log.read_text()
    if stdout_only and proc.returncode == 0:
        return proc.stdout
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-12:])
        raise CheckFailed(f"{' '.join(cmd[1:4])} exited with {proc.returncode}:\n{tail}")
    return text


def shardtune(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardtune", *args]


def train(ctx: dict, name: str, model: Path, data: Path, args: list[str], timeout: float = 240) -> dict:
    """``shardtune train`` into WORK/name; its per-step records and summary."""
    out = ctx["work"] / name
    shutil.rmtree(out, ignore_errors=True)
    run(shardtune("train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                  "--logging_steps", "1", "--seed", "0", "--output_dir", str(out), *args),
        ctx["work"] / f"{name}.log", timeout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"out": out, "steps": [r for r in records if "loss" in r],
            "memory": next((r for r in records if "predicted_peak_bytes" in r), None),
            "summary": json.loads((out / "summary.json").read_text())}


def formula_peak(ctx: dict, out: Path) -> int:
    """``shardtune estimate --config`` of the job a run wrote (its config.yaml): the formula's reserved peak."""
    text = run(shardtune("estimate", "--config", str(out / "config.yaml"), "--json"), ctx["work"] / "estimate.log",
               120, stdout_only=True)
    return json.loads(text)["per_gpu"]["total"]


def losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["steps"]]


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


# --- the checks: each returns its figures (a dict) or raises CheckFailed ----------------------------------------------

def check_pytest_gpu(ctx: dict) -> dict:
    # only the files that hold gpu-marked tests: collecting the whole suite would import what the GPU image lacks
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in f.read_text())
    if not ctx["cuda"]:  # every test of the marker skips without CUDA; running them proves nothing
        return {"note": f"no CUDA: the gpu-marked tests of {', '.join(files)} skip here (not run)"}
    text = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
               ctx["work"] / "pytest.log", 300)
    summary = text.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if not counts.get("passed") or counts.get("failed") or counts.get("error"):
        raise CheckFailed(f"pytest -m gpu: {summary}")
    return {"pytest": summary}


def check_qlora(ctx: dict) -> dict:
    seq, batch = ctx["seq_len"], ctx["batch"]
    result = train(ctx, "qlora", *shape(ctx), [
        "--use_peft_lora", "true", "--use_4bit_quantization", "true", "--bnb_4bit_quant_type", "nf4",
        "--use_nested_quant", "true", "--bnb_4bit_compute_dtype", "bfloat16", "--lora_r", "16",
        "--lora_target_modules", "all-linear", "--lora_dropout", "0", "--max_seq_len", str(seq),
        "--per_device_train_batch_size", str(batch), "--max_steps", "16", "--learning_rate", "1e-3",
        "--save_strategy", "no"])
    first, last = losses(result)[:4], losses(result)[-4:]
    figures = {"loss_first_4": statistics.mean(first), "loss_last_4": statistics.mean(last),
               "tokens_per_s": result["summary"]["tokens_per_s"], "mfu": result["summary"]["mfu"]}
    figures |= peak_figures(ctx, result)
    if not all(math.isfinite(x) for x in losses(result)) or figures["loss_last_4"] >= figures["loss_first_4"]:
        raise CheckFailed(f"the loss did not fall: {losses(result)}")
    return figures


def shape(ctx: dict) -> tuple[Path, Path]:
    """The 1B-shaped model and its rows, built on first use (as bench/vs_trl.py builds them)."""
    if "shape" not in ctx:
        import vs_trl

        folder = vs_trl.prepare_shape(ctx["cache"], SHAPE, ctx["tiny_shapes"])
        ctx["shape"] = folder, vs_trl.write_long_rows(ctx["cache"], folder, ctx["seq_len"], 16 * ctx["batch"])
    return ctx["shape"]


def peak_figures(ctx: dict, result: dict) -> dict:
    """The run's measured peak, the formula's estimate of the same job and the memory check's trace."""
    check = result["memory"]  # on CUDA max_memory_reserved, as the formula's total counts it
    measured = check["measured_peak_bytes"] if check else result["summary"]["peak_memory_bytes"]
    formula = formula_peak(ctx, result["out"])
    traced = check["predicted_peak_bytes"] if check else None
    return {"measured_peak_gib": gib(measured),
            "measured_by": check["measured_by"] if check else (
                "torch.cuda.max_memory_reserved" if ctx["cuda"] else "peak RSS"),
            "formula_gib": gib(formula),
            "formula_error": round(formula / measured - 1, 4), "trace_gib": gib(traced),
            "trace_error": round(traced / measured - 1, 4) if traced else None}


def check_optim(ctx: dict, optim: str) -> dict:
    common = ["--max_seq_len", "64", "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "4",
              "--optim", optim, "--learning_rate", "1e-3", "--predict_memory", "false"]
    try:
        ref = train(ctx, f"{optim}-ref", ctx["wide"], ctx["sums"], common, timeout=180)
    except CheckFailed as exc:
        if not ctx["cuda"] and "paged" in optim and "no CUDA GPU is visible" in str(exc):
            return {"note": "refused without CUDA, as it must be: " + str(exc).splitlines()[-1][:160]}
        raise
    step_2 = ref["out"] / "checkpoints" / "step-2"
    again = train(ctx, f"{optim}-resumed", ctx["wide"], ctx["sums"],
                  [*common, "--resume_from_checkpoint", str(step_2)], timeout=180)
    expected, found = losses(ref)[2:], losses(again)
    if len(set(losses(ref))) < 2:
        raise CheckFailed(f"the optimizer did not move the loss: {losses(ref)}")
    # Step 3's loss is a forward of the restored weights: bitwise or the checkpoint is wrong. Step 4's also went
    # through step 3's backward and the restored optimizer state; on CUDA a backward with atomic adds (flash
    # attention's, embeddings') may round differently in two processes, so it is held to 1e-5 (a state restored
    # wrongly moves it by far more) and whether it is bitwise is recorded.
    if len(found) != 2 or found[0] != expected[0] or abs(found[1] - expected[1]) > 1e-5 * abs(expected[1]):
        raise CheckFailed(f"resumed losses {found} != uninterrupted {expected}")
    return {"losses": losses(ref), "resumed_steps_3_4": found, "bitwise": found == expected}


def kernel_run(ctx: dict, name: str, extra: list[str]) -> dict:
    """A 1B-shape LoRA run; the memory check's trace is left to the QLoRA check (the estimate's formula is read
    for these runs instead)."""
    return train(ctx, name, *shape(ctx), ["--predict_memory", "false",
        "--use_peft_lora", "true", "--lora_r", "16", "--lora_target_modules", "all-linear", "--lora_dropout", "0",
        "--max_seq_len", str(ctx["seq_len"]), "--per_device_train_batch_size", str(ctx["batch"]), "--max_steps", "8",
        "--gradient_checkpointing", "true", "--save_strategy", "no", *extra])


def plain_run(ctx: dict) -> dict:
    if "plain" not in ctx:
        ctx["plain"] = kernel_run(ctx, "plain", [])
    return ctx["plain"]


def speed(result: dict) -> float:
    """Tokens/s over the logged steps after the first two (warm-up, compilation of Triton kernels)."""
    return statistics.median(r["tokens_per_s"] for r in result["steps"][2:])


def check_offloading(ctx: dict) -> dict:
    plain, offloaded = plain_run(ctx), kernel_run(ctx, "offloading", ["--activation_offloading", "true"])
    a, b = peak_figures(ctx, plain), peak_figures(ctx, offloaded)
    figures = {"plain": a, "offloaded": b, "tokens_per_s_plain": speed(plain),
               "tokens_per_s_offloaded": speed(offloaded), "step_time_ratio": speed(plain) / speed(offloaded),
               "max_loss_rel_diff": max_rel_diff(losses(offloaded), losses(plain))}
    if ctx["cuda"] and b["measured_peak_gib"] >= a["measured_peak_gib"]:  # a CPU has no device memory to spare
        raise CheckFailed(f"offloading did not lower the peak: {b['measured_peak_gib']} GiB against "
                          f"{a['measured_peak_gib']} GiB")
    if figures["max_loss_rel_diff"] > BF16_LOSS_REL_TOL:
        raise CheckFailed(f"offloading changed the losses: {losses(offloaded)} against {losses(plain)}")
    return figures


def check_liger(ctx: dict) -> dict:
    plain, liger = plain_run(ctx), kernel_run(ctx, "liger", ["--use_liger_kernel", "true"])
    figures = {"max_loss_rel_diff": max_rel_diff(losses(liger), losses(plain)), "tokens_per_s_plain": speed(plain),
               "tokens_per_s_liger": speed(liger), "peak_plain_gib": gib(plain["summary"]["peak_memory_bytes"]),
               "peak_liger_gib": gib(liger["summary"]["peak_memory_bytes"])}
    if figures["max_loss_rel_diff"] > BF16_LOSS_REL_TOL:
        raise CheckFailed(f"Liger's losses {losses(liger)} differ from the plain run's {losses(plain)} by more "
                          f"than {BF16_LOSS_REL_TOL:.0e} (relative)")
    return figures


def max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise CheckFailed(f"{len(a)} steps against {len(b)}")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_generate(ctx: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, new = "What is 17 plus 25?", 24
    dtype = torch.bfloat16 if ctx["cuda"] else torch.float32
    text = run(shardtune("generate", str(DEMO_BASE), "--prompt", prompt, "--max_new_tokens", str(new),
                         "--device", ctx["device"], "--dtype", "bfloat16" if ctx["cuda"] else "float32"),
               ctx["work"] / "generate.log", 120)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_BASE)
    model = AutoModelForCausalLM.from_pretrained(DEMO_BASE, dtype=dtype).to(ctx["device"])
    from shardtune.infer.generate import encode_prompt, stop_token_ids

    # the prompt's ids as shardtune builds them (its template, BOS as in training) and its stop tokens: what is
    # compared is the decoding
    ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=ctx["device"])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=True,
                         eos_token_id=sorted(stop_token_ids(model, tokenizer)),
                         pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    del model
    theirs = tokenizer.decode(out, skip_special_tokens=True).strip()
    ours = text.strip().splitlines()[-1].strip() if text.strip() else ""
    if not theirs or theirs not in text:
        raise CheckFailed(f"shardtune generate wrote {ours!r}; transformers' greedy generate gives {theirs!r}")
    return {"prompt": prompt, "reply": theirs, "dtype": str(dtype)}


def check_export_gguf(ctx: dict) -> dict:
    import torch

    from shardtune.gguf_source import find_gguf, load_model

    result = train(ctx, "export-run", DEMO_BASE, ctx["sums"], [
        "--use_peft_lora", "true", "--lora_r", "8", "--max_seq_len", "64", "--max_steps", "6",
        "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--save_strategy", "no"])
    gguf = ctx["work"] / "export" / "model.gguf"
    shutil.rmtree(gguf.parent, ignore_errors=True)
    run(shardtune("export", str(result["out"]), str(gguf), "--format", "gguf", "--quantize", "f16"),
        ctx["work"] / "export.log", 180)
    merged = ctx["work"] / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    run(shardtune("merge", str(result["out"] / "final"), str(merged), "--base", str(DEMO_BASE)),
        ctx["work"] / "merge.log", 180)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    read_back = load_model(find_gguf(gguf), dtype=torch.float32)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        a, b = reference(ids).logits, read_back(ids).logits
    error = float((a - b).abs().max() / a.abs().max())
    if error > GGUF_F16_TOL:
        raise CheckFailed(f"the GGUF's logits differ from the merged model's by {error:.2e} of their range")
    return {"gguf_bytes": gguf.stat().st_size, "logits_max_rel_error": error, "train_loss": losses(result)}


# The most used path first (QLoRA); the gpu-marked tests last (Liger's unit test is also covered by 'liger').
CHECKS = {"qlora": check_qlora, "liger": check_liger, "offloading": check_offloading,
          **{f"optim-{o}": (lambda ctx, o=o: check_optim(ctx, o)) for o in OPTIMS},
          "generate": check_generate, "export-gguf": check_export_gguf, "pytest-gpu": check_pytest_gpu}


# --- the driver ---------------------------------------------------------------------------------------------------

def context(args: argparse.Namespace, work: Path) -> dict:
    """What the checks share: addition rows and, for the optimizers, a small model whose embedding and MLP
    weights have over 1e5 elements (bitsandbytes pages only such tensors); the 1B shape is built on first use."""
    import torch

    from shardtune.testing.tiny import make_model_folder

    args.cache.mkdir(parents=True, exist_ok=True)
    wide = work / "wide"
    if not (wide / "config.json").is_file():
        make_model_folder(wide, hidden_size=256, intermediate_size=512)
    from tests.trainutil import write_sum_rows

    sums = write_sum_rows(work / "sums.jsonl", rows=256)  # the resume tests' rows
    return {"work": work, "device": args.device, "cuda": args.device == "cuda" and torch.cuda.is_available(),
            "cache": args.cache, "tiny_shapes": args.tiny, "seq_len": 256 if args.tiny else 2048,
            "batch": args.batch, "wide": wide, "sums": sums}


def markdown(report: dict) -> str:
    lines = [f"# CUDA-only paths, each run once ({report['device']})", "",
             f"{report['date']}; {report['machine']}. Command: `{report['command']}`.", "",
             "| check | result | seconds | figures |", "|---|---|---:|---|"]
    for r in report["checks"]:
        result = "pass" if r["ok"] else "FAIL"
        detail = json.dumps(r["figures"]) if r["ok"] else r["error"].replace("\n", " / ")[:600]
        lines.append(f"| {r['check']} | {result} | {r['seconds']:.0f} | {detail.replace('|', '/')} |")
    if report["skipped"]:
        lines += ["", f"Not run (past --max-minutes {report['max_minutes']}): {', '.join(report['skipped'])}"]
    return "\n".join(lines) + "\n"


def machine() -> str:
    import vs_trl

    m = vs_trl.machine()
    return (f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, transformers {m['transformers']}, peft {m['peft']}, "
            f"Python {m['python']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the 1B shape cut to two narrow layers, 256-token rows")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch of the 1B runs")
    p.add_argument("--max-minutes", type=float, default=None, help="start no check after this many minutes")
    p.add_argument("--stop-minutes", type=float, default=None,
                   help="kill a command still running this many minutes from the start (its check fails)")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "shardtune-bench")
    p.add_argument("--work", type=Path, default=None, help="the runs' folders and logs (default: a new temp folder)")
    p.add_argument("--name", default=None, help="results file name (default: cuda_paths_DEVICE)")
    args = p.parse_args(argv)
    unknown = [c for c in args.checks.split(",") if c not in CHECKS]
    if unknown:
        p.error(f"--checks: {', '.join(unknown)} unknown; choose from {', '.join(CHECKS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; on a CPU run the dry run (--device cpu --tiny)")
    global STOP_AT
    now = time.monotonic()
    deadline = now + 60 * args.max_minutes if args.max_minutes else math.inf
    STOP_AT = now + 60 * args.stop_minutes if args.stop_minutes else math.inf
    work = args.work or Path(tempfile.mkdtemp(prefix="cuda-paths-"))
    work.mkdir(parents=True, exist_ok=True)
    name = args.name or f"cuda_paths_{args.device}"
    report = {"device": args.device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "max_minutes": args.max_minutes, "checks": [], "skipped": []}
    ctx = context(args, work)
    for check in args.checks.split(","):
        if time.monotonic() > deadline:
            report["skipped"].append(check)
            continue
        started = time.monotonic()
        try:
            row = {"check": check, "ok": True, "figures": CHECKS[check](ctx)}
        except Exception as exc:  # noqa: BLE001 - a failed path is a result; the next check still runs
            error = str(exc) if isinstance(exc, CheckFailed) else traceback.format_exc(limit=4)
            row = {"check": check, "ok": False, "error": error}
        row["seconds"] = time.monotonic() - started
        report["checks"].append(row)
        print(f"{check}: {'pass' if row['ok'] else 'FAIL'} ({row['seconds']:.0f} s) "
              f"{json.dumps(row.get('figures')) if row['ok'] else row['error']}", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (RESULTS / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["ok"] for r in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
