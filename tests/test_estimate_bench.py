"""bench/estimate_cuda.py end to end on CPU (--dry-run: tiny models, real training steps, nothing measured): the
predictions it reports are the trace's and the formula's own, and stored predictions are read back, not recomputed."""

import dataclasses
import json
from pathlib import Path

import torch

DRY = ["--dry-run", "--models", "llama-3.2-1b", "--checkpointing", "on", "--steps", "1"]


def _load_bench():
    from tests.setups import load_estimate_cuda_bench

    return load_estimate_cuda_bench()


def _tiny_folder(bench, root: Path) -> str:
    from shardtune import catalog

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(catalog.load("llama-3.2-1b") | bench.TINY))
    return str(root)


def test_dry_run_rows_carry_the_trace_and_formula_numbers(tmp_path):
    from shardtune.memory.formula import estimate
    from shardtune.memory.inventory import ModelAnalysis
    from tests.setups import checked_setup
    from shardtune.memory.trace import trace_training_step
    from shardtune.memory.trace_setup import config_from_setup

    bench = _load_bench()
    results = tmp_path / "results"
    assert bench.main([*DRY, "--methods", "lora", "qlora", "--shapes", "2x32", "--results-dir", str(results)]) == 0
    rows = json.loads((results / "estimate_cuda_cpu-dry-run.json").read_text())["rows"]
    assert [(r["method"], r["batch_size"], r["seq_len"], r["status"]) for r in rows] == [
        ("lora", 2, 32, "ok"), ("qlora", 2, 32, "ok")]
    assert all(r["measured_reserved_bytes"] is None and r["error_trace_allocated"] is None for r in rows)

    # The same job, described independently: the Setup the trainer config comes from, traced and estimated here.
    folder = _tiny_folder(bench, tmp_path / "model")
    analysis = ModelAnalysis(folder, use_cache=False)
    for row in rows:
        setup = checked_setup(method=row["method"], per_device_train_batch_size=2, max_seq_len=32,
                              gradient_checkpointing=True, mixed_precision="bf16", lora_r=bench.LORA_R,
                              lora_target_modules="all-linear")
        traced = trace_training_step(config_from_setup(folder, setup), 1, target_device="cuda")
        assert (row["trace_allocated_bytes"], row["trace_reserved_bytes"]) == (traced.peak_bytes, traced.reserved_bytes)
        breakdown = estimate(analysis.inventory, setup, analysis.lora(bench.LORA_R, "all-linear"))
        assert (row["formula_reserved_bytes"], row["formula_allocated_bytes"]) == (breakdown.total,
                                                                                  breakdown.tensors)
    # QLoRA's NF4 base is smaller than LoRA's bf16 one, in both predictions.
    assert rows[1]["trace_allocated_bytes"] < rows[0]["trace_allocated_bytes"]
    assert rows[1]["formula_allocated_bytes"] < rows[0]["formula_allocated_bytes"]
    table = (results / "estimate_cuda_cpu-dry-run.md").read_text()
    assert "| llama-3.2-1b | qlora | 2 x 32 | on |" in table and "| trace reserved | 0 |" in table


def test_stored_predictions_are_read_back_and_runs_add_up(tmp_path, monkeypatch):
    bench = _load_bench()
    results = ["--results-dir", str(tmp_path)]
    assert bench.main([*DRY, "--methods", "lora", "--shapes", "2x32", "--predict-only", *results]) == 0
    stored = json.loads((tmp_path / "estimate_cuda_predictions_cpu-dry-run.json").read_text())["points"]
    assert list(stored) == ["llama-3.2-1b/lora/2x32/ckpt-on"]
    assert not (tmp_path / "estimate_cuda_cpu-dry-run.json").exists()  # --predict-only measures nothing

    computed = []
    original = bench.predict

    def counting_predict(point, source):
        computed.append(point.key)
        return original(point, source)

    monkeypatch.setattr(bench, "predict", counting_predict)
    # The stored point is read back; only the new one (1x16) is computed, and added to the file.
    assert bench.main([*DRY, "--methods", "lora", "--shapes", "2x32", "1x16", *results]) == 0
    assert computed == ["llama-3.2-1b/lora/1x16/ckpt-on"]
    rows = {bench._key(r): r for r in json.loads((tmp_path / "estimate_cuda_cpu-dry-run.json").read_text())["rows"]}
    fields = [f.name for f in dataclasses.fields(bench.Prediction)]
    assert {f: rows["llama-3.2-1b/lora/2x32/ckpt-on"][f] for f in fields} == {
        f: stored["llama-3.2-1b/lora/2x32/ckpt-on"][f] for f in fields}
    stored = json.loads((tmp_path / "estimate_cuda_predictions_cpu-dry-run.json").read_text())["points"]
    assert sorted(stored) == ["llama-3.2-1b/lora/1x16/ckpt-on", "llama-3.2-1b/lora/2x32/ckpt-on"]

    # A later run of another point keeps the earlier rows (GPU stages over model subsets add up to one table).
    assert bench.main([*DRY, "--methods", "qlora", "--shapes", "1x16", *results]) == 0
    rows = json.loads((tmp_path / "estimate_cuda_cpu-dry-run.json").read_text())["rows"]
    assert sorted(bench._key(r) for r in rows) == ["llama-3.2-1b/lora/1x16/ckpt-on", "llama-3.2-1b/lora/2x32/ckpt-on",
                                                   "llama-3.2-1b/qlora/1x16/ckpt-on"]

    # Past --max-minutes no point starts: it is listed as not run, with its predictions.
    assert bench.main([*DRY, "--methods", "qlora", "--shapes", "1x16", "--max-minutes", "0", *results]) == 0
    rows = {bench._key(r): r for r in json.loads((tmp_path / "estimate_cuda_cpu-dry-run.json").read_text())["rows"]}
    assert rows["llama-3.2-1b/qlora/1x16/ckpt-on"]["status"] == "not run: --max-minutes reached"
    assert rows["llama-3.2-1b/qlora/1x16/ckpt-on"]["trace_allocated_bytes"] > 0 and len(rows) == 3


def test_measured_model_is_the_trainers_qlora_model(tmp_path):
    import bitsandbytes as bnb

    from shardtune.memory.inventory import ModelAnalysis

    bench = _load_bench()
    folder = _tiny_folder(bench, tmp_path)
    point = bench.Point("llama-3.2-1b", "qlora", 2, 32, True)
    trainee = bench.build(bench.train_config(point, folder), torch.device("cpu"))
    quantised = [m for m in trainee.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 7 * bench.TINY["num_hidden_layers"]  # every projection of every layer, not the head
    trainable = [p for p in trainee.model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trainable)  # the trainer's adapters are fp32 over a bf16 base
    assert sum(p.numel() for p in trainable) == ModelAnalysis(folder, use_cache=False).lora(bench.LORA_R,
                                                                                          "all-linear").total
