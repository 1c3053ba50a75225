"""The analytic formula calibrated against the trace of the real step, on a grid of small models and setups.

Bound: the formula (its allocator/workspace item left out, since the trace counts tensor bytes only) is within
15% of the traced per-GPU peak at every grid point. The grid's tokenizer has 512 tokens, so the loss is a small
part of the peak. Known gaps at the time of writing (bench/results/trace_vs_formula_cpu.md): LoRA without
checkpointing, formula ~13% above; DDP, ~14% below (DDP's gradient buckets are not in the formula); and with a
32k vocabulary the formula's ``loss="chunked"`` is 12-51% below the trainer, whose uncompiled chunked loss keeps
every chunk's fp32 log-softmax for backward (``loss="full"`` is 53% above), so no point of that model is asserted.
"""

from __future__ import annotations

import pytest

from shardtune.memory.setup import Setup
from shardtune.memory.trace_setup import formula_and_trace

BOUND = 0.15


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from shardtune.tiny import make_model_folder

    return str(make_model_folder(tmp_path_factory.mktemp("calib") / "small", hidden_size=256,
                                 intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4))


GRID = [  # (method, strategy, GPUs, checkpointing)
    ("full", "single", 1, False), ("full", "single", 1, True), ("lora", "single", 1, False),
    ("lora", "single", 1, True), ("qlora", "single", 1, True), ("full", "fsdp", 4, True),
    ("lora", "fsdp", 4, True), ("full", "ddp", 2, True),
]


@pytest.mark.parametrize("method, strategy, gpus, checkpointing", GRID)
def test_formula_agrees_with_the_trace(small_model, method, strategy, gpus, checkpointing):
    setup = Setup(method=method, strategy=strategy, num_gpus=gpus, batch_size=2, seq_len=256,
                  gradient_checkpointing=checkpointing, mixed_precision="bf16", loss="chunked")
    formula, traced = formula_and_trace(small_model, setup)
    assert abs(formula / traced - 1) <= BOUND, f"formula {formula:,} B vs trace {traced:,} B"
