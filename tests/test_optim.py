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


def test_an_overflowed_fp16_step_leaves_the_learning_rate_schedule_where_it_was():
    """The loss scaler skips an update whose gradients overflowed; the schedule must not advance for it."""
    from transformers import AutoModelForCausalLM

    from shardtune.dist import DistInfo
    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.optim import build_scheduler
    from shardtune.train.plan import Plan
    from shardtune.train.runner import LocalRunner
    from shardtune.train.step import StepContext, train_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(64, num_layers=1))
    cfg = OptimConfig(learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="linear")
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    ids = torch.randint(1, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(12).expand(2, 12)}

    def step(init_scale: float) -> None:
        runner = LocalRunner(model, Plan(strategy="NO"), info)
        runner.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        ctx = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, runner=runner, info=info,
                          max_grad_norm=0.0, pad_token_id=0)
        train_step(ctx, [batch])

    before = [p.detach().clone() for p in model.parameters()]
    step(init_scale=3e38)  # the scaled gradients overflow: no update
    assert scheduler.last_epoch == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step(init_scale=1.0)
    assert scheduler.last_epoch == 1 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
