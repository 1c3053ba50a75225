"""shardtune's memory predictions against real training steps on a CUDA GPU: measured peaks beside predicted ones.

For each catalog model (1B-3B by default), method (full / LoRA / QLoRA), micro-batch x sequence length and gradient
checkpointing on/off, the script runs shardtune's own training step (``shardtune.train.step.train_step`` on the
model the trainer builds: same class, dtypes, adapters, checkpointing and AdamW, with random weights, so nothing is
downloaded) and records ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` over the steps after one
warm-up step. Beside them stand two predictions, and their errors (predicted / measured - 1):

- the trace (``shardtune.memory.trace.trace_training_step``: the same step on fake tensors, no GPU needed): its
  tensors' peak predicts the allocated peak, its replay of the CUDA caching allocator the reserved one;
- the analytic formula (``shardtune estimate``): its total predicts the reserved peak, the total less its
  "allocator cache and workspaces" item the allocated one.

Predictions need no GPU, and GPU time is scarce, so they are made apart: ``--predict-only`` computes them on the CPU
and stores them in bench/results/estimate_cuda_predictions.json (keyed by model, method, batch, sequence length and
checkpointing); a measuring run reads that file and computes only the points it lacks. The measuring run writes
bench/results/estimate_cuda_<device>.json and .md after every point, keeping the rows of earlier runs for the points
it did not run, so runs over subsets of the models add up to one table. A point that both predictions put above the
device's memory is skipped; one that runs out of memory is recorded as such.

The formula describes the trainer's step as ``setup_from_config`` does, with shardtune's own loss (``--loss
shardtune``: the trainer checkpoints each chunk of its cross-entropy).

    .venv/bin/python bench/estimate_cuda.py --predict-only --jobs 2   # anywhere: the default grid's predictions
    .venv/bin/python bench/estimate_cuda.py --models llama-3.2-1b --max-minutes 8   # on a CUDA machine
    .venv/bin/python bench/estimate_cuda.py --dry-run                # anywhere: tiny models on CPU, measures nothing
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields
from multiprocessing import get_context
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from shardtune import catalog  # noqa: E402
from shardtune.config import TrainConfig  # noqa: E402
from shardtune.dist import DistInfo  # noqa: E402
from shardtune.memory.formula import estimate  # noqa: E402
from shardtune.memory.inventory import ModelAnalysis  # noqa: E402
from shardtune.memory.setup import Setup, validate  # noqa: E402
from shardtune.memory.trace import TraceUnsupported, trace_training_step  # noqa: E402
from shardtune.memory.trace_setup import config_from_setup, setup_from_config  # noqa: E402
from shardtune.train.parallelize import Runner  # noqa: E402

RESULTS = REPO / "bench" / "results"
GIB = 2**30
LORA_R = 16
METHODS = ("full", "lora", "qlora")
# The catalog's models of 1B-3B parameters: two 128k-vocabulary Llamas (tied embeddings) and a 32k-vocabulary one.
DEFAULT_MODELS = ["llama-3.2-1b", "tinyllama-1.1b", "llama-3.2-3b"]
# Batch 1-8 and sequence 512-4096, from 512 to 32k tokens per step; 1x4096 and 8x512 hold the same tokens in
# different shapes (attention grows with the sequence, the rest with the tokens).
DEFAULT_SHAPES = ["1x512", "2x1024", "1x4096", "8x512", "4x2048", "8x4096"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, head_dim=16, bos_token_id=1, eos_token_id=2)
DRY_RUN_MAX_SEQ = 64
# The formula's description of shardtune train's loss (Setup.loss "shardtune": chunks checkpointed one at a time),
# as setup_from_config gives it; kept explicit because the table says which loss the formula modelled.
FORMULA_LOSS = "shardtune"
# What the predictions depend on besides torch and transformers: a stored prediction made from other sources is
# stale, and --predict-only computes it again.
CODE_GLOBS = ("shardtune/memory/*.py", "shardtune/memory/*.json", "shardtune/train/*.py", "shardtune/catalog/*.json",
              "shardtune/config/*.py", "shardtune/hardware.py", "shardtune/data/collate.py")
# Each prediction against its measured peak: (error field, predicted field, measured field).
ERROR_COLUMNS = (("error_trace_reserved", "trace_reserved_bytes", "measured_reserved_bytes"),
                 ("error_trace_allocated", "trace_allocated_bytes", "measured_allocated_bytes"),
                 ("error_formula_reserved", "formula_reserved_bytes", "measured_reserved_bytes"),
                 ("error_formula_allocated", "formula_allocated_bytes", "measured_allocated_bytes"))


@dataclass(frozen=True)
class Point:
    """One grid point: a model, a method and a single-GPU bf16 step of one shape."""

    model: str
    method: str
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    pure_bf16: bool = False  # weights, gradients and AdamW states in bf16 (torch_dtype bfloat16), no autocast

    @property
    def key(self) -> str:
        return (f"{self.model}/{self.method}/{self.batch_size}x{self.seq_len}/"
                f"ckpt-{'on' if self.gradient_checkpointing else 'off'}{'/pure-bf16' if self.pure_bf16 else ''}")

    def setup(self) -> Setup:
        return validate(Setup.of(method=self.method, distributed_type="NO", per_device_train_batch_size=self.batch_size,
                                 max_seq_len=self.seq_len, gradient_checkpointing=self.gradient_checkpointing,
                                 mixed_precision="bf16", lora_r=LORA_R, lora_target_modules="all-linear",
                                 attn_implementation="sdpa",
                                 torch_dtype="bfloat16" if self.pure_bf16 else None))


@dataclass
class Prediction:
    """Both predictions of one point, in bytes (the trace's are None where it could not follow the step)."""

    formula_reserved_bytes: int
    formula_allocated_bytes: int
    formula_phase: str
    formula_items: dict[str, int]  # its breakdown at that phase
    trace_allocated_bytes: int | None
    trace_reserved_bytes: int | None  # its replay of the CUDA caching allocator (None where it has none)
    trace_categories: dict[str, int] | None  # what was alive at the traced peak
    trace_failed: str | None
    trace_seconds: float
    made_with: str  # torch, transformers and shardtune sources (a hash) that made it


@dataclass
class Measurement:
    """The measured peaks of one point (None on a CPU, or where it did not run: ``status`` says why)."""

    measured_reserved_bytes: int | None = None
    measured_allocated_bytes: int | None = None
    status: str = "ok"
    seconds: float = 0.0
    # nvidia-smi's used memory for the whole GPU right after the steps, and what torch's allocator held then: their
    # difference is the memory outside the caching allocator (CUDA context, kernels' modules, NCCL/cuBLAS handles).
    smi_used_bytes: int | None = None
    reserved_at_smi_bytes: int | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="catalog names (default: %(default)s)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                   help="micro-batch x sequence length, e.g. 2x2048 (default: %(default)s)")
    p.add_argument("--checkpointing", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--precisions", nargs="+", default=["autocast"], choices=["autocast", "pure"],
                   help="bf16 autocast over fp32 master weights (LoRA: a bf16 base), or pure bf16 (default: "
                        "%(default)s)")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--predict-only", action="store_true",
                   help="compute the predictions the stored file lacks (or made from other code) on the CPU, and stop")
    p.add_argument("--recompute", action="store_true", help="compute every prediction again, stored or not")
    p.add_argument("--jobs", type=int, default=1, help="predictions computed in parallel processes")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new point after this many minutes of the run, predictions included (the rest are "
                        "listed as not run)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny models (2 layers, hidden 64) on CPU: checks the script end to end, measures nothing")
    p.add_argument("--rescore", action="store_true",
                   help="no GPU: put the stored predictions (made beforehand by --predict-only with the current code) "
                        "beside the measured peaks of --out's results, keeping the measuring run's errors as 'before'")
    p.add_argument("--out", default=None, help="result name (default: estimate_cuda_<device>)")
    p.add_argument("--results-dir", default=str(RESULTS), help="where the JSON and markdown go (default: %(default)s)")
    args = p.parse_args(argv)
    if args.rescore and not args.out:
        p.error("--rescore needs --out, the measured results to rescore (e.g. estimate_cuda_nvidia-h200)")
    unknown = sorted(set(args.models) - set(catalog.names()))
    if unknown:
        p.error(f"--models {' '.join(unknown)}: not in the catalog; choose from {', '.join(catalog.names())}")
    try:
        args.shapes = [tuple(int(v) for v in s.lower().split("x", 1)) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes {' '.join(args.shapes)}: write each as BATCHxSEQ_LEN, e.g. 2x2048")
    return args


def grid(args: argparse.Namespace) -> list[Point]:
    """Every point of the run, grouped by (model, method, checkpointing): one model build serves each group."""
    shapes = [(b, min(s, DRY_RUN_MAX_SEQ) if args.dry_run else s) for b, s in args.shapes]
    return [Point(m, method, b, s, ckpt == "on", precision == "pure") for m in args.models
            for precision in args.precisions for method in args.methods for ckpt in args.checkpointing
            for b, s in dict.fromkeys(shapes)]


def model_sources(models: list[str], dry_run: bool, folder: Path) -> dict[str, str]:
    """``model_name_or_path`` of each model: its catalog name, or (dry run) a folder with a tiny config.json of the
    same architecture."""
    if not dry_run:
        return {name: name for name in models}
    sources = {}
    for name in models:
        config = catalog.load(name)
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(config | TINY))
        sources[name] = str(folder / name)
    return sources


def train_config(point: Point, source: str) -> TrainConfig:
    """The ``shardtune train`` config of ``point`` (what ``shardtune estimate --emit-config`` writes)."""
    return config_from_setup(source, point.setup())


@functools.cache
def made_with() -> str:
    """torch and transformers versions and a hash of the shardtune sources the predictions depend on, as this
    process first read them (the modules it imported then are the ones it runs)."""
    import transformers

    digest = hashlib.sha256()
    for pattern in CODE_GLOBS:
        for path in sorted(REPO.glob(pattern)):
            digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return f"torch {torch.__version__}, transformers {transformers.__version__}, code {digest.hexdigest()[:12]}"


def predict(point: Point, source: str) -> Prediction:
    """The formula's and the trace's peaks of ``point`` (the trace runs on fake tensors: any size, no GPU)."""
    provenance = made_with()
    cfg = train_config(point, source)
    setup = setup_from_config(cfg, 1).with_(loss=FORMULA_LOSS)
    analysis = ModelAnalysis(source, use_cache=False)
    lora = analysis.lora_of(setup)
    breakdown = estimate(analysis.inventory, setup, lora)
    started = time.perf_counter()
    traced, failed = None, None
    try:
        traced = trace_training_step(cfg, 1, target_device="cuda")
    except TraceUnsupported as exc:
        failed = str(exc)
    return Prediction(formula_reserved_bytes=breakdown.total, formula_allocated_bytes=breakdown.tensors,
                      formula_phase=breakdown.phase, formula_items={i.label: i.bytes for i in breakdown.items},
                      trace_allocated_bytes=traced.peak_bytes if traced else None,
                      trace_reserved_bytes=traced.reserved_bytes if traced else None,
                      trace_categories=traced.categories if traced else None, trace_failed=failed,
                      trace_seconds=time.perf_counter() - started, made_with=provenance)


def predictions_path(args: argparse.Namespace) -> Path:
    return Path(args.results_dir) / f"estimate_cuda_predictions{'_cpu-dry-run' if args.dry_run else ''}.json"


def load_predictions(path: Path) -> dict[str, dict]:
    """The stored entries by point key: the point's fields and its Prediction's."""
    return json.loads(path.read_text())["points"] if path.is_file() else {}


def _prediction(entry: dict) -> Prediction:
    return Prediction(**{f.name: entry[f.name] for f in fields(Prediction)})


def _compute(points: list[Point], sources: dict[str, str], jobs: int) -> Iterator[tuple[Point, Prediction]]:
    """Predictions of ``points`` as they finish; with ``jobs`` > 1 in that many worker processes."""
    if jobs <= 1:
        for point in points:
            yield point, predict(point, sources[point.model])
        return
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(predict, p, sources[p.model]): p for p in points}
        for future in as_completed(futures):
            yield futures[future], future.result()


def ensure_predictions(points: list[Point], sources: dict[str, str], args: argparse.Namespace) -> dict[str, Prediction]:
    """The prediction of every point: read from the stored file, the missing ones computed and added to it.

    ``--recompute`` computes all of them; ``--predict-only`` also those made by other torch, transformers or
    shardtune sources (a measuring run uses those as they are, to spend no GPU time on them).
    """
    path = predictions_path(args)
    stored = load_predictions(path)
    current = made_with()
    todo = [p for p in points if args.recompute or p.key not in stored
            or (args.predict_only and stored[p.key]["made_with"] != current)]
    print(f"predictions: {len(points) - len(todo)} of {len(points)} points read from {path}, "
          f"{len(todo)} to compute", flush=True)
    started = time.perf_counter()
    for done, (point, prediction) in enumerate(_compute(todo, sources, args.jobs), 1):
        stored[point.key] = asdict(point) | asdict(prediction)
        write_predictions(path, stored, args)
        print(f"[{done}/{len(todo)}, {time.perf_counter() - started:.0f} s] {_prediction_line(point, prediction)}",
              flush=True)
    return {p.key: _prediction(stored[p.key]) for p in points}


@dataclass
class Trainee:
    """The trainer's model on the measuring device, and what its step needs besides the optimizer."""

    model: torch.nn.Module
    runner: Runner
    info: DistInfo
    pad_token_id: int


def build(cfg: TrainConfig, device: torch.device) -> Trainee:
    """The model ``shardtune train`` would train for ``cfg``, on ``device``, with initialised weights.

    ``build.build_model`` itself (dtypes by ``Precision``, bitsandbytes NF4 layers for QLoRA, ``apply_lora``,
    ``parallelize`` with the plan's checkpointing), as the trace calls it: from the model's config, not its weights.
    """
    from shardtune.memory.trace import _model_config, _vocab_and_pad
    from shardtune.train.build import build_model, plan_for
    from shardtune.train.model import Precision

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device)
    precision = Precision(cfg.mixed_precision, pure_bf16=cfg.model.pure_bf16)
    config = _model_config(cfg)
    vocab_size, pad_id, added_token_ids = _vocab_and_pad(cfg, config)
    torch.manual_seed(cfg.run.seed)
    model, runner, _, _ = build_model(cfg, plan_for(cfg, info, precision), precision, info, vocab_size,
                                      weights="init", config=config, added_token_ids=added_token_ids)
    return Trainee(model, runner, info, pad_id)


def smi_used_bytes() -> int | None:
    """nvidia-smi's used memory of the GPU this process runs on (None where nvidia-smi is missing or fails)."""
    import subprocess

    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def measure(trainee: Trainee, cfg: TrainConfig, steps: int, row: Measurement) -> None:
    """Fill ``row``: max_memory_reserved and max_memory_allocated over ``steps`` training steps after a warm-up
    step, and nvidia-smi's used memory beside the allocator's reserve right after them.

    The warm-up creates AdamW's states and cuBLAS's workspaces, as the trainer's first step does; the optimizer is
    new for every point, so each starts from the weights alone. On a CPU the steps run and nothing is measured.
    """
    from shardtune.memory.trace import _micro_batches
    from shardtune.train.optim import build_optimizer, build_scheduler
    from shardtune.train.step import StepContext, train_step

    device = trainee.info.device
    optimizer = build_optimizer(trainee.model, cfg.optim, device, pure_bf16=cfg.model.pure_bf16)
    # The grid is bf16 (autocast over fp32 master weights, or a bf16 base under LoRA): no loss scaler, as the loop.
    ctx = StepContext(model=trainee.model, optimizer=optimizer,
                      scheduler=build_scheduler(optimizer, cfg.optim, steps + 1), runner=trainee.runner,
                      info=trainee.info, max_grad_norm=cfg.optim.max_grad_norm, pad_token_id=trainee.pad_token_id)
    batches = _micro_batches(cfg, trainee.pad_token_id)
    train_step(ctx, batches)
    if device.type != "cuda":
        for _ in range(steps):
            train_step(ctx, batches)
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        train_step(ctx, batches)
    torch.cuda.synchronize()
    row.measured_reserved_bytes, row.measured_allocated_bytes = (torch.cuda.max_memory_reserved(),
                                                                 torch.cuda.max_memory_allocated())
    row.reserved_at_smi_bytes, row.smi_used_bytes = torch.cuda.memory_reserved(), smi_used_bytes()


def _free(device: torch.device) -> None:
    """Drop what a point left behind, so the next one starts from what is really alive."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _failure(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}" + (f": {first[:160]}" if first else "")


def too_big(prediction: Prediction, capacity: int | None) -> bool:
    """Both predictions (the trace's reserved peak, else its tensors' peak) exceed the device's memory."""
    if capacity is None:
        return False
    traced = prediction.trace_reserved_bytes or prediction.trace_allocated_bytes
    return prediction.formula_reserved_bytes > capacity and (traced is None or traced > capacity)


def measure_group(group: list[Point], source: str, predictions: dict[str, Prediction], args: argparse.Namespace,
                  device: torch.device, capacity: int | None, deadline: float) -> Iterator[tuple[Point, Measurement]]:
    """Measure the points of one (model, method, checkpointing) group on one model build."""
    results = {p: Measurement(status="skipped: predicted > device memory") for p in group
               if too_big(predictions[p.key], capacity)}
    todo = [p for p in group if p not in results]
    trainee, build_failure = None, ""
    if todo and time.monotonic() < deadline:  # past the deadline, the loop below says so for every point
        try:
            trainee = build(train_config(todo[0], source), device)
        except Exception as exc:  # noqa: BLE001 - recorded per point; the other groups still run
            build_failure = f"{_failure(exc)} (building the model)"
        _free(device)
    for point in group:
        if point in results:
            yield point, results[point]
            continue
        if time.monotonic() >= deadline:
            yield point, Measurement(status="not run: --max-minutes reached")
            continue
        if trainee is None:
            yield point, Measurement(status=build_failure)
            continue
        row = Measurement()
        started = time.perf_counter()
        try:
            measure(trainee, train_config(point, source), args.steps, row)
        except Exception as exc:  # noqa: BLE001 - out of memory and the like are results, not the end of the run
            row.status = _failure(exc)
        row.seconds = time.perf_counter() - started
        for param in trainee.model.parameters():  # a step that failed half way leaves gradients behind
            param.grad = None
        _free(device)
        yield point, row
    del trainee
    _free(device)


def run(args: argparse.Namespace) -> list[dict]:
    """Predict every point (reading stored predictions), then measure each; returns the rows of this run."""
    device = torch.device("cpu" if args.dry_run else "cuda:0")  # the trainer's device on one process
    if not args.predict_only and device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, use --predict-only for the predictions, or --dry-run "
                         "to check the script on CPU")
    deadline = math.inf if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    points = grid(args)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="estimate-cuda-") as tmp:
        sources = model_sources(args.models, args.dry_run, Path(tmp))
        predictions = ensure_predictions(points, sources, args)
        if args.predict_only:
            return rows
        capacity = torch.cuda.mem_get_info()[1] if device.type == "cuda" else None
        for _, points_of_build in itertools.groupby(points, lambda p: (p.model, p.pure_bf16, p.method,
                                                                            p.gradient_checkpointing)):
            group = list(points_of_build)
            for point, measured in measure_group(group, sources[group[0].model], predictions, args, device,
                                                 capacity, deadline):
                rows.append(make_row(point, predictions[point.key], measured))
                print(_row_line(rows[-1]), flush=True)
                write_results(rows, args)
    return rows


def _error(predicted: int | None, measured: int | None) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


def make_row(point: Point, prediction: Prediction, measured: Measurement) -> dict:
    """One result: the point, both predictions, the measured peaks and each prediction's error."""
    row = asdict(point) | asdict(prediction) | asdict(measured)
    for name, predicted, actual in ERROR_COLUMNS:
        row[name] = _error(row[predicted], row[actual])
    return row


def _gib(x: int | None) -> str:
    return "" if x is None else f"{x / GIB:.3f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _point_cells(r: dict) -> str:
    return (f"| {r['model']} | {r['method']}{' (pure bf16)' if r.get('pure_bf16') else ''} | "
            f"{r['batch_size']} x {r['seq_len']} | {'on' if r['gradient_checkpointing'] else 'off'} |")


def _prediction_line(point: Point, p: Prediction) -> str:
    trace = f"trace {_gib(p.trace_allocated_bytes)} (reserved {_gib(p.trace_reserved_bytes) or '-'}) GiB" \
        if p.trace_failed is None else f"trace failed: {p.trace_failed}"
    return (f"{point.key:42s} {trace}, formula {_gib(p.formula_allocated_bytes)} (reserved "
            f"{_gib(p.formula_reserved_bytes)}) GiB, {p.trace_seconds:.0f} s")


def _row_line(r: dict) -> str:
    cells = [_cell(r[predicted], r[error]) or "-" for error, predicted, _ in ERROR_COLUMNS]
    return (f"{_key(r):42s} measured {_gib(r['measured_reserved_bytes']) or '-'} / "
            f"{_gib(r['measured_allocated_bytes']) or '-'} GiB (reserved / allocated); trace {cells[0]} / {cells[1]}; "
            f"formula {cells[2]} / {cells[3]}; {r['status']} in {r['seconds']:.1f} s")


def _write(path: Path, text: str) -> None:
    """Through a temporary file and a rename, so an interrupted run leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _key(entry: dict) -> str:
    """The point key of a stored prediction or a result row."""
    return Point(*(entry.get(f.name, f.default) for f in fields(Point))).key


def _order(entry: dict) -> tuple:
    return (entry["model"], entry.get("pure_bf16", False), METHODS.index(entry["method"]),
            not entry["gradient_checkpointing"],
            entry["batch_size"] * entry["seq_len"], entry["batch_size"])


def _cell(nbytes: int | None, error: float | None) -> str:
    return _gib(nbytes) + (f" ({_pct(error)})" if error is not None else "")


def write_predictions(path: Path, stored: dict[str, dict], args: argparse.Namespace) -> None:
    """The predictions file (JSON) and a markdown table of the formula against the trace beside it."""
    meta = {"lora_r": LORA_R, "formula_loss": FORMULA_LOSS,
            "trace": "trace_training_step(cfg, 1, target_device='cuda'): peak_bytes predicts max_memory_allocated, "
                     "reserved_bytes max_memory_reserved",
            "formula": "total predicts max_memory_reserved; total less 'allocator cache and workspaces' predicts "
                       "max_memory_allocated", "note": "tiny models (dry run)" if args.dry_run else ""}
    entries = sorted(stored.values(), key=_order)
    _write(path, json.dumps({"meta": meta, "points": {_key(e): e for e in entries}}, indent=1) + "\n")
    lines = ["# shardtune's memory predictions for one GPU: the formula against the trace (no GPU needed)", "",
             f"Single GPU, bf16, AdamW, LoRA/QLoRA r={LORA_R} on all linear layers; formula loss '{FORMULA_LOSS}'. "
             "Allocated: the trace's tensor peak, the formula's total less its allocator item. Reserved: the "
             "trace's caching-allocator replay, the formula's total. In brackets: formula / trace - 1.", "",
             "| model | method | batch x seq | ckpt | trace alloc GiB | formula alloc GiB | trace reserved GiB "
             "| formula reserved GiB | trace s | trace failure |", "|" + "---|" * 10]
    apart = {"allocated": 0, "reserved": 0}
    for e in entries:
        error_alloc = _error(e["formula_allocated_bytes"], e["trace_allocated_bytes"])
        error_reserved = _error(e["formula_reserved_bytes"], e["trace_reserved_bytes"])
        apart["allocated"] += error_alloc is not None and abs(error_alloc) > 0.15
        apart["reserved"] += error_reserved is not None and abs(error_reserved) > 0.15
        lines.append(f"{_point_cells(e)} {_gib(e['trace_allocated_bytes'])} | "
                     f"{_cell(e['formula_allocated_bytes'], error_alloc)} | {_gib(e['trace_reserved_bytes'])} | "
                     f"{_cell(e['formula_reserved_bytes'], error_reserved)} | {e['trace_seconds']:.0f} | "
                     f"{e['trace_failed'] or ''} |")
    made = "; ".join(sorted({e["made_with"] for e in entries}))
    lines += ["", f"Formula and trace differ by more than 15% at {apart['allocated']} of {len(entries)} points "
              f"(allocated) and at {apart['reserved']} (reserved). Made with {made}."]
    _write(path.with_suffix(".md"), "\n".join(lines) + "\n")


def _summary(rows: list[dict]) -> list[str]:
    """Per prediction, over the measured points: median and largest absolute error, and how many are within 5% and
    within 10%."""
    lines = ["| prediction | measured points | median abs error | max abs error | within 5% | within 10% |",
             "|---|---|---|---|---|---|"]
    for name, _, _ in ERROR_COLUMNS:
        errors = [abs(r[name]) for r in rows if r[name] is not None]
        label = name.removeprefix("error_").replace("_", " ")
        lines.append(f"| {label} | {len(errors)} | " + (
            f"{statistics.median(errors):.1%} | {max(errors):.1%} | {sum(e <= 0.05 for e in errors)} of {len(errors)} "
            f"| {sum(e <= 0.10 for e in errors)} of {len(errors)} |" if errors else " | | | |"))
    return lines


def results_path(args: argparse.Namespace) -> Path:
    """bench/results/estimate_cuda_<device>.json (or --out); the markdown table goes beside it."""
    if args.out:
        return Path(args.results_dir) / f"{args.out}.json"
    device = "cpu-dry-run" if args.dry_run else torch.cuda.get_device_name().replace(" ", "-").lower()
    return Path(args.results_dir) / f"estimate_cuda_{device}.json"


def rescore(args: argparse.Namespace) -> list[dict]:
    """The measured rows of ``--out`` with the stored predictions in place of those the measuring run used; each
    row keeps the errors of the predictions it was first measured against under ``before``."""
    path = results_path(args)
    if not path.is_file():
        raise SystemExit(f"--rescore: {path} does not exist; measure on a GPU first (see bench/gpu_session.sh)")
    stored = load_predictions(predictions_path(args))
    rows = []
    for row in json.loads(path.read_text())["rows"]:
        point = Point(**{f.name: row.get(f.name, f.default) for f in fields(Point)})
        if point.key not in stored:
            raise SystemExit(f"--rescore: no stored prediction for {point.key}: run --predict-only with that "
                             "point's arguments first")
        before = row.get("before") or {"made_with": row["made_with"],
                                        **{name: row[name] for name, _, _ in ERROR_COLUMNS}}
        measured = Measurement(**{f.name: row.get(f.name, f.default) for f in fields(Measurement)})
        rows.append(make_row(point, _prediction(stored[point.key]), measured) | {"before": before})
    return rows


def write_results(rows: list[dict], args: argparse.Namespace) -> None:
    """The results JSON and markdown: this run's rows, and an earlier run's rows for the points it did not run."""
    import transformers

    path = results_path(args)
    earlier = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    ours = {_key(r) for r in rows}
    kept = [r for r in earlier["rows"] if _key(r) not in ours]
    rows = sorted(kept + rows, key=_order)
    meta = {"device": path.stem.removeprefix("estimate_cuda_"), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "steps": args.steps, "lora_r": LORA_R, "formula_loss": FORMULA_LOSS,
            "note": "dry run on CPU: tiny models, nothing measured" if args.dry_run else ""}
    if args.rescore:  # the measurement's machine, not this one's
        meta = earlier["meta"]
    lines = [f"# shardtune's memory predictions against measured CUDA peaks ({meta['device']})", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, CUDA {meta['cuda']}. shardtune's training "
             f"step (single GPU, bf16, AdamW, LoRA/QLoRA r={LORA_R} on all linear layers, random weights); peaks of "
             f"{args.steps} steps after a warm-up step. In brackets: predicted / measured - 1. Trace: its tensor peak "
             "for allocated, its caching-allocator replay for reserved. Formula: its total for reserved, the total "
             f"less its allocator item for allocated. Predictions made with "
             f"{'; '.join(sorted({r['made_with'] for r in rows}))}." + (f" {meta['note']}." if meta["note"] else ""),
             "", "| model | method | batch x seq | ckpt | measured reserved GiB | measured alloc GiB | trace reserved "
             "| trace alloc | formula reserved | formula alloc | outside allocator GiB | status |", "|" + "---|" * 12]
    for r in rows:
        cells = " | ".join(_cell(r[predicted], r[error]) for error, predicted, _ in ERROR_COLUMNS)
        outside = (r["smi_used_bytes"] - r["reserved_at_smi_bytes"]
                   if r.get("smi_used_bytes") is not None and r.get("reserved_at_smi_bytes") is not None else None)
        lines.append(f"{_point_cells(r)} {_gib(r['measured_reserved_bytes'])} | "
                     f"{_gib(r['measured_allocated_bytes'])} | {cells} | {_gib(outside)} | {r['status']} |")
    lines += ["", *_summary(rows)]
    if any("before" in r for r in rows):
        lines += ["", "The same errors for the predictions the measuring run was held against (made with "
                  f"{'; '.join(sorted({r['before']['made_with'] for r in rows if 'before' in r}))}):", "",
                  *_summary([r["before"] | {"status": r["status"]} for r in rows if "before" in r])]
    _write(path, json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    _write(path.with_suffix(".md"), "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rescore:
        write_results(rescore(args), args)
    else:
        run(args)
    path = predictions_path(args) if args.predict_only else results_path(args)
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
