"""The one place that turns a plain model into a distributed one: checkpointing, then the strategy's own wrapping.

The order follows torchtitan's ``parallelize_llama``: activation checkpointing wraps the decoder layers first,
``torch_compile`` compiles each of them (``compile.py``), then the strategy wraps or splits what those produced:
the function its entry in ``shardtune/strategies.py`` names (``fsdp.py:apply_fsdp``, ``ddp.py:apply_ddp``,
``model_parallel.py:split_across_devices``, ``pipeline_parallel.py:split_for_stage``), and its runner steps it.
A pipeline stage is split first, as torchtitan splits a pipeline before it parallelises each stage.
"""

from __future__ import annotations

import logging

from torch import nn

from shardtune.dist import DistInfo
from shardtune.train.applied import Applied
from shardtune.train.compile import apply_compile
from shardtune.train.fsdp import load_from_rank0
from shardtune.train.liger import apply_liger_kernel
from shardtune.train.offload import ActivationOffloader, offload_checkpointed_inputs
from shardtune.train.plan import Plan, unwrap
from shardtune.train.runner import Runner

__all__ = ["Runner", "apply_checkpointing", "load_from_rank0", "parallelize"]

log = logging.getLogger("shardtune")


def apply_checkpointing(model: nn.Module, plan: Plan) -> ActivationOffloader | None:
    """Recompute each decoder layer in backward (transformers' own per-layer checkpointing); the offloader that
    moves the layers' saved inputs to host memory where activation_offloading asks for it."""
    base = unwrap(model)
    kwargs = {"use_reentrant": plan.use_reentrant}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if plan.use_reentrant:
        # Reentrant checkpointing only backpropagates through inputs that require grad; with a frozen
        # embedding (LoRA) nothing would, and the adapters would get no gradient.
        base.enable_input_require_grads()
    # The config's use_cache stays as the base has it: final/ saves this config, and the runners already pass
    # use_cache=False to every training forward.
    if not plan.activation_offloading:
        return None
    # The inputs each checkpointed layer keeps wait in (pinned) host memory until backward recomputes it.
    return offload_checkpointed_inputs(base)


def parallelize(model: nn.Module, plan: Plan, info: DistInfo) -> tuple[nn.Module, Runner]:
    """PP's stage first, then checkpointing, compiled decoder layers (torch_compile), then the strategy's wrapping
    (DDP, FSDP2, MP's split) as the plan says; and the strategy's runner (which keeps the compile report for the end of
    the run).

    A single process gets checkpointing only. PP's runner drives the pipeline schedule; the others run the whole
    (wrapped) model on each rank's own micro-batches. The runner keeps what was applied (``applied.Applied``) for
    summary.json.
    """
    applied = Applied()
    split = plan.strategy.load("parallelize") if plan.strategy.parallelize is not None else None
    if plan.strategy.pipelined:
        # A stage first drops the other stages' layers (torchtitan splits a pipeline before it applies the rest),
        # so checkpointing, offloading and compile act on, and report, the layers this process runs.
        model, split = split(model, plan, info), None
    if plan.liger_kernel:  # Liger patches the layers' modules, so before anything wraps or checkpoints them
        applied.liger = apply_liger_kernel(model, info.device)
    if plan.gradient_checkpointing:
        applied.offloader = apply_checkpointing(model, plan)
    applied.compiled = apply_compile(model, plan)  # each decoder layer, before FSDP2 wraps it (torchtitan's order)
    if split is not None:
        model = split(model, plan, info)
    return model, plan.strategy.load("runner")(model, plan, info, applied=applied)
