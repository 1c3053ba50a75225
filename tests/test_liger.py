"""use_liger_kernel (train/liger.py) where no GPU is needed: what it asks of CUDA and of the package, in one line.

The CPU run itself (a warning, losses equal to the run without the key) is in tests/test_activation_offloading.py;
Liger's kernels on CUDA are measured by ``bash bench/gpu_session.sh liger``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardtune.errors import UsageError


def _model(model_type: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config)


def test_on_a_cpu_the_model_is_left_as_it_is_with_one_warning(caplog):
    from shardtune.train.liger import CPU_MESSAGE, apply_liger_kernel

    model = _model()
    forwards = {name: type(m).forward for name, m in model.named_modules()}
    with caplog.at_level("WARNING", logger="shardtune"):
        assert apply_liger_kernel(model, torch.device("cpu")).summary() == {"kernels": [], "fallback": CPU_MESSAGE}
    assert [r.getMessage() for r in caplog.records] == [CPU_MESSAGE]
    assert all("forward" not in m.__dict__ for m in model.modules())  # no instance patched
    assert forwards == {name: type(m).forward for name, m in model.named_modules()}


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_on_cuda_without_the_package_the_run_stops_with_the_pip_command():
    from shardtune.train.liger import apply_liger_kernel

    with pytest.raises(UsageError, match=r"use_liger_kernel=true needs the liger-kernel package .*: "
                                         r"pip install liger-kernel .*or set use_liger_kernel false"):
        apply_liger_kernel(_model(), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="needs CUDA and liger-kernel")
def test_on_cuda_liger_patches_norms_and_mlps_and_keeps_the_numbers():
    """fp32 on a GPU: the patched model's loss equals transformers' within fp32 kernel differences."""
    from shardtune.train.liger import apply_liger_kernel

    torch.manual_seed(0)
    reference = _model().cuda()
    patched = _model().cuda()
    patched.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    expected = reference(ids, labels=ids).loss  # before the patch: Liger's RoPE replaces the family's function
    assert apply_liger_kernel(patched, torch.device("cuda")).kernels == ["rope", "rms_norm", "swiglu"]
    assert "forward" in patched.model.norm.__dict__ and "forward" in patched.model.layers[0].mlp.__dict__
    found = patched(ids, labels=ids).loss
    assert abs(found.item() - expected.item()) <= 1e-4 * abs(expected.item())
