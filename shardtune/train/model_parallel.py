"""Naive model parallel (``distributed_type: MP``): one process, the decoder layers split across its devices.

The split comes from the memory estimator (``shardtune train`` asks it and passes the bounds in):
``shardtune estimate --strategy mp`` chooses contiguous stages that minimise the fullest device (the first stage also
holds the embeddings, the last the head and the loss), so the stages are balanced by memory, not by layer count. Each
module then runs on its stage's device, and a forward pre-hook moves whatever tensors it receives (hidden states,
rotary tables, the attention mask) there; the logits come back to the first device, where the loss is computed like
on one device. Only one device works at a time: that is what makes it "naive" (pipeline parallel, ``PP``, keeps the
stages busy with micro-batches). The model's own forward runs, with the masks ``runner.LocalRunner`` gives every
strategy (``runner.attention_masks``), so a family's sliding windows, per-layer-type masks and RoPE, soft caps and
routing are those of one device; the hooks only move tensors.

It also runs with several ``cpu`` entries in ``mp_devices``, which exercises the mechanics without GPUs.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.utils._pytree import tree_map

from shardtune.config import TrainConfig
from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.strategies import resolve
from shardtune.train.plan import Plan, unwrap

log = logging.getLogger("shardtune")


def mp_devices(spec: str | None) -> tuple[str, ...]:
    """The devices of the stages: ``mp_devices`` as given, else every visible GPU, else one CPU."""
    if spec:
        names = tuple(d.strip() for d in spec.split(",") if d.strip())
        for name in names:
            try:
                device = torch.device(name)
            except RuntimeError:
                raise UsageError(f"mp_devices: {name!r} is not a device; write e.g. cuda:0,cuda:1 or cpu,cpu") from None
            if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
                raise UsageError(f"mp_devices: {name} does not exist ({torch.cuda.device_count()} GPU(s) visible); "
                                 f"check CUDA_VISIBLE_DEVICES")
        return names
    count = torch.cuda.device_count()
    return tuple(f"cuda:{i}" for i in range(count)) if count else ("cpu",)


def equal_bounds(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous stages of (nearly) equal layer counts, the earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


def check_processes(strategy, info: DistInfo) -> None:
    """MP runs in one process, PP in one process per stage: anything else is refused here, which ``make_job`` asks
    before it tokenises the data (minutes for a large set), not after."""
    if strategy.splits_layers and strategy.drives_several_devices and info.distributed:
        raise UsageError(f"distributed_type={strategy} runs in one process over several devices; start it "
                         f"with 'shardtune train' (not launch), or use PP to split the layers across processes")
    if strategy.splits_layers and not strategy.drives_several_devices and not info.distributed:
        raise UsageError(f"distributed_type={strategy} needs one process per pipeline stage: start it with "
                         f"'shardtune launch --num_processes N train ...'")


def place_stages(plan: Plan, cfg: TrainConfig, info: DistInfo,
                 bounds: tuple[tuple[int, int], ...] | None = None) -> tuple[Plan, DistInfo]:
    """Fill ``plan.stage_bounds`` (and, for MP, ``plan.devices``) for MP and PP; other plans pass through.

    ``bounds``: the stages the caller chose (``shardtune train`` asks the memory estimator for stages balanced
    by memory); without them, or when they do not match the stage count, equal numbers of layers. MP returns
    ``info`` on its first stage's device (see ``step_info``).
    """
    if not plan.strategy.splits_layers:
        return plan, info
    check_processes(plan.strategy, info)
    if plan.strategy.drives_several_devices:
        devices = mp_devices(cfg.distributed.mp_devices)
        stages = len(devices)
    else:
        devices, stages = (), info.world_size
    if bounds is None or len(bounds) != stages:
        from transformers import AutoConfig

        num_layers = AutoConfig.from_pretrained(cfg.model.model_name_or_path).num_hidden_layers
        if plan.strategy.leaves_a_stage_empty(stages, num_layers):
            raise UsageError(f"distributed_type={plan.strategy}: {stages} stages for a model of {num_layers} "
                             f"layers; use at most {num_layers} {'devices' if devices else 'processes'}")
        bounds = equal_bounds(num_layers, stages)
    log.info("%s stages (decoder layers per stage): %s", plan.strategy,
             ", ".join(f"{a}-{b - 1}" for a, b in bounds))
    plan = dataclasses.replace(plan, stage_bounds=bounds, devices=devices[:len(bounds)])
    return plan, step_info(info, plan) if plan.strategy.drives_several_devices else info


def stage_count(cfg: TrainConfig, world_size: int) -> int:
    """How many stages MP (its devices) or PP (its processes) splits the layers into; 1 for the other setups."""
    strategy = resolve(cfg.distributed.distributed_type, world_size > 1)
    if strategy.drives_several_devices:
        return len(mp_devices(cfg.distributed.mp_devices))
    return world_size if strategy.splits_layers else 1


def _move_to(device: torch.device):
    def move(value):
        return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value

    def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ARG001
        return tree_map(move, args), tree_map(move, kwargs)

    return hook


def step_info(info: DistInfo, plan: Plan) -> DistInfo:
    """``info`` with the first stage's device: where the step puts the batch (the embeddings are there), where the
    logits come back and the loss is summed. torchrun's LOCAL_RANK device is another GPU when ``mp_devices``
    does not start at cuda:0 (e.g. cuda:2,cuda:3)."""
    first = torch.device(plan.devices[0]) if plan.devices else info.device
    if first.type == "cuda":
        torch.cuda.set_device(first)
    return dataclasses.replace(info, device=first)


def split_across_devices(model: nn.Module, plan: Plan, info: DistInfo | None = None) -> nn.Module:  # noqa: ARG001
    """``parallelize`` for MP: each stage's layers on its device, inputs moved in, logits back to the first (the
    devices are the plan's: ``info``, one process, adds nothing)."""
    devices = [torch.device(d) for d in plan.devices] or [torch.device("cpu")]
    bounds = plan.stage_bounds or ((0, len(unwrap(model).model.layers)),)
    causal_lm = unwrap(model)
    inner = causal_lm.model
    first, last = devices[0], devices[len(bounds) - 1]
    inner.embed_tokens.to(first)
    inner.rotary_emb.to(first)
    for (start, end), device in zip(bounds, devices):
        for i in range(start, end):
            layer = inner.layers[i].to(device)
            layer.register_forward_pre_hook(_move_to(device), with_kwargs=True)
    # A head tied to the embeddings is one tensor: it stays on the first device and the hidden states go back.
    head_device = first if causal_lm.config.tie_word_embeddings else last
    for module in (inner.norm, causal_lm.lm_head):
        module.to(head_device)
        module.register_forward_pre_hook(_move_to(head_device), with_kwargs=True)

    # The model was loaded into CPU RAM; anything an architecture holds besides the parts placed above (extra
    # buffers, a positional table) goes to the first device, where the forward starts.
    if first.type != "cpu":
        for module in model.modules():
            if any(t.device.type == "cpu" for t in [*module.parameters(False), *module.buffers(False)]):
                module._apply(lambda t: t.to(first), recurse=False)

    def logits_to_first(module: nn.Module, args, kwargs, output):  # noqa: ARG001
        output.logits = output.logits.to(first)
        return output

    model.register_forward_hook(logits_to_first, with_kwargs=True)
    return model
