"""How one rank runs forward and backward: ``LocalRunner`` for one process, DDP, FSDP2 and MP.

Every rank runs the whole model (FSDP2 gathers each unit as it runs; MP moves the activations between its
devices) on its own micro-batches. The pipeline's runner (``pipeline_parallel.PipelineRunner``) has the same
methods; ``parallelize`` returns the one the plan needs, and ``step.train_step`` calls it without knowing which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shardtune.data.collate import varlen_kwargs
from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.train.applied import Applied
from shardtune.train.export import export_final
from shardtune.train.loss import TARGET_INDEX, install_fused_loss, token_loss_sum
from shardtune.train.plan import Plan, unwrap


class Runner(Protocol):
    """What ``step.train_step``, the loop and the checkpoint call on a runner, whichever strategy made it."""

    copies: int  # how many ranks read the same rows (sums over ranks divide by it)
    flat_optimizer: bool  # the checkpoint keys optimizer state by parameter name
    scaler: Any  # fp16's loss scaler, or None

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor: ...

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def grad_norm_and_clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor: ...

    def export_final(self, output_dir: str | Path, tokenizer, *, is_peft: bool) -> Path | None: ...


def uses_varlen_attention(model: nn.Module) -> bool:
    """Whether the model runs flash attention, which reads the batch's documents from ``varlen_kwargs``."""
    implementation = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None) or ""
    return implementation.startswith("flash_attention")


# What a batch holds for the loss, not the model: the labels and, where given, their ``loss.target_index``.
LOSS_KEYS = ("labels", TARGET_INDEX)


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, *, varlen: bool = False,
                 masks: Callable[[torch.Tensor], Any] | None = None) -> dict[str, Any]:
    """The batch on ``device`` without its labels; with ``varlen`` (flash attention) also the documents' bounds;
    ``masks`` (``attention_masks``) turns the collator's block-causal mask into what the model's layers read."""
    inputs: dict[str, Any] = {k: v.to(device, non_blocking=True) for k, v in batch.items()
                              if k not in LOSS_KEYS and v is not None}
    if varlen:
        inputs.update(varlen_kwargs(batch["position_ids"], device))
    if masks is not None and "attention_mask" in inputs:
        inputs["attention_mask"] = masks(inputs["attention_mask"])
    return inputs


def attention_masks(model: nn.Module) -> Callable[[torch.Tensor], Any] | None:
    """What the packed rows' 4-D mask must become for this model's attention; None where it is right as it is.

    transformers passes a 4-D mask through unchanged, so what it would add itself is added here: the sliding window
    (Mistral's on every layer; Gemma's and Qwen's only on their ``sliding_attention`` layers, which read a mask per
    layer type from a dict), and the additive form eager attention adds to its scores (a family that has no sdpa,
    as Gemma 2, runs eager whatever the collator was told). Without it a packed row attends past the window.
    """
    config = getattr(unwrap(model), "config", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # e.g. Qwen2 without use_sliding_window: every layer attends in full
    additive = getattr(config, "_attn_implementation", None) == "eager"
    if not window and not additive:
        return None

    def masks(mask: torch.Tensor) -> Any:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        full = _in_form(allowed, additive)
        if not window:
            return full
        positions = torch.arange(allowed.shape[-1], device=allowed.device)
        sliding = _in_form(allowed & (positions[:, None] - positions[None, :] < window), additive)
        return {"full_attention": full, "sliding_attention": sliding} if layer_types is not None else sliding

    return masks


def refuse_router_aux_loss(model: nn.Module) -> None:
    """Stop a mixture-of-experts model whose config asks for the router's auxiliary (load-balancing) loss, in one
    line: the trainer's loss is the head's cross-entropy alone (``loss.head_loss_sum``), so the auxiliary loss
    would be left out (with flash attention silently; with the packed rows' 4-D mask transformers' own computation
    of it fails on the mask's shape), and a pipeline stage sees only its own layers' routers."""
    config = getattr(unwrap(model), "config", None)
    if getattr(config, "output_router_logits", False):
        where = Path(getattr(config, "_name_or_path", "") or ".") / "config.json"
        raise UsageError(f"{where}: output_router_logits is true, but shardtune's loss does not add the router's "
                         f"auxiliary loss (router_aux_loss_coef); set output_router_logits to false there to "
                         f"train without it")


def _in_form(allowed: torch.Tensor, additive: bool) -> torch.Tensor:
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)


def grad_scaler(plan: Plan, device: torch.device):
    """fp16's loss scaler (FSDP's sharded one under FSDP); None for bf16 and fp32, which need none."""
    if plan.compute_dtype != torch.float16:
        return None
    if plan.sharded_grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm (correct for sharded DTensor gradients), clipped to ``max_norm`` when > 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        # Each rank holds the norm of its shards: full_tensor() reduces the partial squares across ranks.
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class LocalRunner:
    """Runs the whole model on this rank's micro-batches; DDP and FSDP average gradients over the ranks."""

    copies = 1  # each rank reads its own rows, so sums over ranks count every row once
    flat_optimizer = False

    def __init__(self, model: nn.Module, plan: Plan, info: DistInfo, *, applied: Applied | None = None) -> None:
        self.model, self.plan, self.info = model, plan, info
        self.applied = applied or Applied()  # torch_compile's, Liger's and offloading's records, for summary.json
        self.scaler = grad_scaler(plan, info.device)
        self.varlen = uses_varlen_attention(model)
        self.masks = attention_masks(model)
        refuse_router_aux_loss(model)
        # The model's own forward returns the loss, the head fused into it one chunk of tokens at a time (loss.py).
        self.fused_loss = install_fused_loss(model)

    def _autocast(self):
        """autocast for one process, DDP and MP; FSDP2 casts parameters itself (MixedPrecisionPolicy)."""
        if self.plan.compute_dtype == torch.float32 or not self.plan.strategy.autocasts:
            return contextlib.nullcontext()
        return torch.autocast(self.info.device.type, dtype=self.plan.compute_dtype)

    def _sync(self, is_last: bool):
        """Hold back the gradient reduction on all but the last micro-batch, where that costs no memory: DDP's
        ``no_sync``, FSDP2's ``set_requires_gradient_sync``."""
        if not self.plan.defers_gradient_sync or not torch.distributed.is_initialized():
            return contextlib.nullcontext()
        if self.plan.strategy.replicates:
            return contextlib.nullcontext() if is_last else self.model.no_sync()
        self.model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        """Backward of ``scale`` x each micro-batch's token-loss sum; returns this rank's summed loss (fp64).

        DDP and FSDP average gradients over ranks: the world size in the backward loss turns that average back
        into the sum the global normalisation needs.
        """
        device = self.info.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro_batches):
            with self._sync(i == len(micro_batches) - 1), self._autocast():
                micro_sum = self._loss_sum(batch)
            loss = micro_sum * (self.info.world_size * scale)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += micro_sum.detach().double()
        return loss_sum

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed token loss of one eval batch (call under ``torch.no_grad``)."""
        with self._autocast():
            return self._loss_sum(batch).double()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch's summed token loss, on this rank's device (MP's head may sit on another one)."""
        device = self.info.device
        inputs = model_inputs(batch, device, varlen=self.varlen, masks=self.masks)
        labels = batch["labels"].to(device, non_blocking=True)
        if self.fused_loss:
            return self.model(**inputs, use_cache=False, loss_labels=labels,
                              loss_index=batch.get(TARGET_INDEX)).loss.to(device)
        # No name holds the logits: the loss's graph frees them once its chunks' backward has run, instead of
        # their living through the whole backward of the layers (a vocabulary-sized tensor per token).
        return token_loss_sum(self.model(**inputs, use_cache=False).logits, labels)

    def grad_norm_and_clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return grad_norm_and_clip(params, max_norm)

    def export_final(self, output_dir: str | Path, tokenizer, *, is_peft: bool) -> Path | None:
        return export_final(output_dir, self.model, tokenizer, is_peft=is_peft, info=self.info)
