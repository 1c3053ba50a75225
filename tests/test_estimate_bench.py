"""bench/estimate_cuda.py runs end to end (its CPU --dry-run: tiny models, real training steps, nothing measured)."""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "estimate_cuda.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("estimate_cuda", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_trains_and_writes_the_tables(tmp_path):
    bench = _load_bench()
    assert bench.main(["--dry-run", "--models", "llama-3.2-1b", "--methods", "lora", "qlora", "--shapes", "2x32",
                       "--checkpointing", "on", "--steps", "1", "--results-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "estimate_cuda_cpu-dry-run.json").read_text())
    rows = data["rows"]
    assert [(r["method"], r["status"]) for r in rows] == [("lora", "ok"), ("qlora", "ok")]
    assert all(r["measured_reserved_gib"] is None for r in rows)  # a CPU run measures nothing
    # QLoRA's NF4 base is smaller than LoRA's bf16 one, so its predicted peak is lower.
    assert rows[1]["predicted_total_gib"] < rows[0]["predicted_total_gib"]
    assert "| llama-3.2-1b | qlora | 2 x 32 | on |" in (tmp_path / "estimate_cuda_cpu-dry-run.md").read_text()
    assert not list(tmp_path.glob(".config-*"))


def test_qlora_model_is_quantised_and_counts_like_the_estimator():
    import bitsandbytes as bnb

    from shardtune.memory.inventory import ModelAnalysis

    bench = _load_bench()
    config = bench.model_config("llama-3.2-1b", dry_run=True)
    model = bench.build_model(config, "llama-3.2-1b", "qlora", torch.device("cpu"))
    quantised = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 7 * config["num_hidden_layers"]  # every projection of every layer, not the head
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        assert trainable == ModelAnalysis(d, use_cache=False).lora(bench.LORA_R, "all-linear").total
