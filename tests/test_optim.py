"""The optimizer the trainer builds works with the loss scaler it pairs it with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.config import OptimConfig
from shardtune.train.optim import build_optimizer


def _scaled_step(optimizer: torch.optim.Optimizer, model: nn.Module, scaler) -> None:
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_fp16_gets_an_optimizer_its_sharded_scaler_can_step(one_process_group):
    """On CUDA AdamW is fused, but FSDP's ShardedGradScaler passes a [1]-shaped found_inf that fused AdamW cannot
    take: with sharded_scaler the trainer builds the multi-tensor AdamW. (Fused AdamW also runs on CPU tensors,
    so the CUDA choice is exercised here with CPU parameters.)"""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    on_cuda = build_optimizer(model, OptimConfig(), torch.device("cuda"))
    assert on_cuda.defaults["fused"]
    with pytest.raises(RuntimeError, match="shape"):
        _scaled_step(on_cuda, model, ShardedGradScaler("cpu"))  # why the choice exists
    model.zero_grad()
    paired = build_optimizer(model, OptimConfig(), torch.device("cuda"), sharded_scaler=True)
    assert not paired.defaults["fused"]
    before = model.weight.detach().clone()
    _scaled_step(paired, model, ShardedGradScaler("cpu"))
    assert not torch.equal(before, model.weight)  # the step was taken
