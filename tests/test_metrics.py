"""Run metrics that depend on the GPU: its bf16 peak for MFU, matched on the CUDA device name."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12), ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", 165e12),
    ("Some Future GPU", None),
])
def test_a_variant_is_not_taken_for_the_gpu_whose_name_it_contains(monkeypatch, name, peak):
    from shardtune.train.metrics import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops(torch.device("cpu")) is None
