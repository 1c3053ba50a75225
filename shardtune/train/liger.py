"""``use_liger_kernel``: Liger's Triton kernels for RMSNorm, RoPE and SwiGLU on CUDA (TRL's key).

Liger patches the model instance (its norms' and MLPs' ``forward``) and the family's module-level RoPE function.
Its cross-entropy patches are left off: shardtune's own loss (train/loss.py) already runs the head one chunk of
tokens at a time and never makes the whole logits, and it is the loss every strategy and the estimator share.
On a CPU there is no Triton: the run says so once and goes on with transformers' modules.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from shardtune.errors import UsageError
from shardtune.train.applied import LigerReport
from shardtune.train.plan import unwrap

log = logging.getLogger("shardtune")

CPU_MESSAGE = "use_liger_kernel needs CUDA (Triton); on CPU shardtune's fused loss is used"
INSTALL = "pip install liger-kernel (or pip install 'shardtune[liger]')"
# Liger's own kernels, by the keyword its per-family apply functions take; its losses stay off (see above).
KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True,
           "cross_entropy": False, "fused_linear_cross_entropy": False}


def apply_liger_kernel(model: nn.Module, device: torch.device) -> LigerReport:
    """Patch ``model`` (PEFT or not, before any parallel wrapper) with Liger's kernels; the names of those applied.

    On a CPU: one warning, nothing changes (the report says why). Under fake tensors (the estimator's trace)
    nothing changes either: the trace follows transformers' modules, which keep at least what Liger's keep for
    backward.
    """
    if device.type != "cuda":
        log.warning(CPU_MESSAGE)
        return LigerReport([], fallback=CPU_MESSAGE)
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        return LigerReport([], fallback="traced on fake tensors")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise UsageError(f"use_liger_kernel=true needs the liger-kernel package ({exc}): {INSTALL}, or set "
                         "use_liger_kernel false") from None
    base = unwrap(model)
    model_type = getattr(base.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise UsageError(f"use_liger_kernel=true: liger-kernel has no kernels for model_type {model_type!r}; it "
                         f"supports {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}; set use_liger_kernel false")
    accepted = inspect.signature(apply).parameters
    kwargs = {name: on for name, on in KERNELS.items() if name in accepted}
    apply(model=base, **kwargs)
    applied = [name for name, on in kwargs.items() if on]
    log.info("Liger kernels for %s: %s (loss: shardtune's fused one)", model_type, ", ".join(applied))
    return LigerReport(applied)
