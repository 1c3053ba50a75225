"""shardtune estimate held to training steps measured on a real GPU (bench/results/estimate_cuda_nvidia-h200.json:
133 single-GPU steps of Llama-3.2-1B/3B and TinyLlama shapes, full/LoRA/QLoRA, 1x512 to 8x8192, checkpointing on and
off, autocast and pure bf16). The predictions are computed here, by the current code, on CPU; the measured peaks are
the committed ones. docs/estimator.md ("Against a real GPU") says what each bound means and why the named points
are outside it."""

import json
import statistics
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MEASURED = json.loads((REPO / "bench" / "results" / "estimate_cuda_nvidia-h200.json").read_text())
ROWS = [r for r in MEASURED["rows"] if r["status"] == "ok"]
GIB = 2**30

# The formula's reserve is a fit (formula.allocator_reserve); these steps reserve more than it, by the order in which
# the caching allocator happened to reuse its blocks, which the trace replays and the formula does not.
FORMULA_RESERVED_OUTLIERS = {
    "llama-3.2-1b/full/2x1024/ckpt-off": "2.9 GiB reserved beyond the tensors' peak; 1.4-1.6 at 1x512 and 1x4096",
    "llama-3.2-3b/full/2x1024/ckpt-off": "7.2 GiB beyond the tensors' peak; 3.9-4.8 at 1x512, 1x4096 and 4x2048",
    "tinyllama-1.1b/full/8x4096/ckpt-on": "4.6 GiB beyond the tensors' peak; 0.4-0.6 at every smaller shape",
    "llama-3.2-3b/qlora/1x4096/ckpt-on": "0.94 GiB beyond a 3.8 GiB peak, as much as at 4x2048 (0.97)",
}
# Traced on CPU (fake tensors, 10-20 s each): QLoRA (its adapters' input as bitsandbytes' layers pass it), and full
# fine-tuning of an untied model. The committed table holds the trace of every point (estimate_cuda.py --rescore).
TRACED = ["llama-3.2-1b/qlora/2x1024/ckpt-off", "tinyllama-1.1b/full/1x512/ckpt-off"]


@cache
def _bench():
    from tests.setups import load_estimate_cuda_bench

    return load_estimate_cuda_bench()


def _point(row: dict):
    bench = _bench()
    return bench.Point(**{f: row.get(f, False) for f in ("model", "method", "batch_size", "seq_len",
                                                         "gradient_checkpointing", "pure_bf16")})


@cache
def _analysis(model: str):
    from shardtune.memory.inventory import ModelAnalysis

    return ModelAnalysis(model, use_cache=False)


def _formula(row: dict) -> tuple[int, int]:
    """The formula's (reserved, allocated) for the measured step, as bench/estimate_cuda.py predicts them."""
    from shardtune.memory.formula import estimate
    from shardtune.memory.trace_setup import setup_from_config

    bench, point = _bench(), _point(row)
    setup = setup_from_config(bench.train_config(point, point.model), 1).with_(loss=bench.FORMULA_LOSS)
    analysis = _analysis(point.model)
    breakdown = estimate(analysis.inventory, setup, analysis.lora_of(setup))
    return breakdown.total, breakdown.tensors


def test_the_committed_measurements_cover_the_grid():
    assert len(ROWS) == 133
    assert {r["method"] for r in ROWS} == {"full", "lora", "qlora"}
    assert {r["gradient_checkpointing"] for r in ROWS} == {True, False}
    assert any(r.get("pure_bf16") for r in ROWS)
    assert set(FORMULA_RESERVED_OUTLIERS) | set(TRACED) <= {_point(r).key for r in ROWS}


def test_the_formula_is_within_10_percent_of_every_measured_reserved_peak():
    off = {}
    for row in ROWS:
        reserved, allocated = _formula(row)
        key = _point(row).key
        error = reserved / row["measured_reserved_bytes"] - 1
        bound = 0.12 if key in FORMULA_RESERVED_OUTLIERS else 0.10
        if abs(error) > bound:
            off[key] = f"reserved {error:+.1%}"
        # the tensors' peak, without the allocator's reserve: within 6% everywhere
        error = allocated / row["measured_allocated_bytes"] - 1
        if abs(error) > 0.06:
            off[key] = f"allocated {error:+.1%}"
    assert not off, off


def test_the_formula_tracks_the_reserve_better_than_a_flat_slack_did():
    """The median error on reserved stays where the measured fit put it (2.2%), well under the 4.1% the
    previous reserve model (8% of the changing memory + 64 MiB) gave on the same steps."""
    errors = [abs(_formula(r)[0] / r["measured_reserved_bytes"] - 1) for r in ROWS]
    assert statistics.median(errors) <= 0.03


def test_the_cuda_context_is_what_nvidia_smi_showed_beside_the_reserve():
    from shardtune.memory.formula import CUDA_CONTEXT_BYTES

    outside = [r["smi_used_bytes"] - r["reserved_at_smi_bytes"] for r in ROWS]
    assert max(abs(o - CUDA_CONTEXT_BYTES) for o in outside) <= 8 * 2**20


@pytest.mark.parametrize("key", TRACED)
def test_the_trace_is_within_5_percent_of_the_measured_peaks(key):
    from shardtune.memory.trace import trace_training_step

    row = next(r for r in ROWS if _point(r).key == key)
    point = _point(row)
    traced = trace_training_step(_bench().train_config(point, point.model), 1, target_device="cuda")
    assert traced.reserved_bytes / row["measured_reserved_bytes"] - 1 == pytest.approx(0, abs=0.05)
    assert traced.peak_bytes / row["measured_allocated_bytes"] - 1 == pytest.approx(0, abs=0.05)


def test_the_trace_of_a_tied_model_sums_its_gradients_as_the_gpu_did():
    """Llama-3.2-1B ties its head to the embeddings: autograd sums their two gradients in place on the GPU, and the
    trace now does too (GradientsSummedInPlace). When it summed them out of place it held one fp32 embedding more
    than the H200 did: +5.1% reserved and +4.7% allocated on this step; now within 1%."""
    from shardtune.memory.trace import trace_training_step

    row = next(r for r in ROWS if _point(r).key == "llama-3.2-1b/full/1x512/ckpt-on")
    point = _point(row)
    traced = trace_training_step(_bench().train_config(point, point.model), 1, target_device="cuda")
    assert traced.reserved_bytes / row["measured_reserved_bytes"] - 1 == pytest.approx(0, abs=0.02)
    assert traced.peak_bytes / row["measured_allocated_bytes"] - 1 == pytest.approx(0, abs=0.02)
