"""Run metrics that depend on the GPU: its bf16 peak for MFU, matched on the CUDA device name."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362.05e12), ("NVIDIA L40", 181.05e12),
    ("NVIDIA L4", 121e12), ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("Some Future GPU", None),
])
def test_a_variant_is_not_taken_for_the_gpu_whose_name_it_contains(monkeypatch, name, peak):
    from shardtune.train.metrics import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops(torch.device("cpu")) is None


def test_a_full_disk_leaves_metrics_whole_and_the_run_going(tmp_path, monkeypatch, caplog):
    """A write cut short by a full disk is taken back: the file holds whole records only, and one warning says so."""
    import errno
    import json
    import os

    from shardtune.dist import DistInfo
    from shardtune.train import metrics

    log = metrics.MetricsLog(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")))
    log.write({"step": 1, "loss": 2.5})
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with caplog.at_level("WARNING", logger="shardtune"):
        log.write({"step": 2, "loss": 2.4})
        log.write({"step": 3, "loss": 2.3})
    monkeypatch.setattr(metrics.os, "write", real_write)
    log.write({"step": 4, "loss": 2.2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 4]
    warned = [r.getMessage() for r in caplog.records if r.name == "shardtune"]
    assert len(warned) == 1 and "the record of step 2 was not written (No space left on device)" in warned[0]


def test_a_non_finite_number_is_written_as_null_so_the_file_stays_json(tmp_path):
    """An fp16 step the loss scaler skips has grad_norm NaN: Python's json wrote a bare NaN, which strict readers
    (jq, browsers, most languages) refuse, so one such step made the whole file unreadable to them."""
    import json

    from shardtune.dist import DistInfo
    from shardtune.train import metrics

    log = metrics.MetricsLog(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")))
    log.write({"step": 1, "loss": 2.5, "grad_norm": float("nan"), "tokens_per_s": float("inf"),
               "per_task": {"a": float("nan"), "b": [1.0, float("-inf")]}})  # a callback's record, nested
    line = (tmp_path / "metrics.jsonl").read_text()

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(line, parse_constant=strict) == {"step": 1, "loss": 2.5, "grad_norm": None,
                                                       "tokens_per_s": None, "per_task": {"a": None, "b": [1.0, None]}}


def _flops_case(kind: str):
    """A model on the meta device and what a token's matmuls multiply by, counted from its config by hand."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from shardtune.testing.tiny import tiny_llama_config

    if kind == "mixtral":
        config = MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    else:
        config = tiny_llama_config(300, hidden_size=32, intermediate_size=48)
        config.tie_word_embeddings = kind == "tied"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    lookup = 0 if kind == "tied" else 300 * 32
    idle = 2 * (4 - 2) * 3 * 32 * 48 if kind == "mixtral" else 0  # layers x idle experts x gate, up, down
    return config, model, parameters, parameters - lookup - idle


@pytest.mark.parametrize("kind", ["untied", "tied", "mixtral"])
def test_mfu_counts_the_weights_a_token_multiplies_by(tmp_path, kind):
    """MFU's FLOPs leave out an untied input embedding (a lookup) and the experts a router does not pick, in the
    trainer and the estimator alike; a tied embedding is the LM head's matmul and counts."""
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.timing import model_flops_per_token
    from shardtune.train.metrics import flops_per_token

    config, model, parameters, used = _flops_case(kind)
    attention = 12 * 2 * 32 * 64
    adapters = 1000
    assert flops_per_token(model, parameters, parameters, 64, frozen_base=False) == 6 * used + attention
    model.requires_grad_(False)  # LoRA's base
    assert flops_per_token(model, parameters + adapters, adapters, 64, frozen_base=True) == \
        6 * adapters + 4 * used + attention
    config.save_pretrained(tmp_path)
    inv = ModelAnalysis(str(tmp_path), use_cache=False).inventory
    assert inv.parameters == parameters
    assert model_flops_per_token(inv, parameters, 64, frozen_base=False) == 6 * used + attention
    assert model_flops_per_token(inv, adapters, 64, frozen_base=True) == 6 * adapters + 4 * used + attention
