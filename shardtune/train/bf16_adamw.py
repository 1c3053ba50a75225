"""AdamW for pure bf16 training (``torch_dtype: bfloat16``): bf16 weights, gradients and moments, no fp32 master.

A bf16 weight has 8 significant bits, so an update smaller than half its spacing (|w| / 256) rounds back to the
same weight: with a small learning rate plain bf16 AdamW stops moving the weights altogether. Each step here is
computed in fp32 and rounded to bf16 *stochastically*: up with probability equal to the fraction of the spacing
left over, so the expected stored weight is the fp32 result and small steps accumulate over many steps instead of
vanishing (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting BFloat16 Training").

Why our own and not torchao's: torchao 0.18 has made its bf16 AdamW private (``torchao.optim._AdamW``) and runs
it through ``torch.compile`` per parameter shape (15 s for one 64x64 weight on a CPU); Kahan summation would keep
a third bf16 tensor per weight, where stochastic rounding keeps exactly half of fp32 AdamW's state, which is what
the estimator's ``--pure-bf16`` counts.

The random bits are a hash of each fp32 result's bits and the step count, not draws from a generator: the same
weight rounds the same way on one process and in any FSDP shard, nothing extra has to be checkpointed for an exact
resume, and the checkpoint loader's zero step (DCP fills empty optimizer state by stepping once with lr 0, which
leaves every weight exactly as it is) cannot disturb torch's random streams.
"""

from __future__ import annotations

import math

import torch

# Elements per slice of a tensor processed at once: bounds the fp32/int64 temporaries of one step (49 bytes per
# element; config/optimizers.py holds both numbers, which the estimator counts) to ~100 MB whatever the size of the
# largest weight (a large vocabulary's embedding).
from shardtune.config.optimizers import PURE_BF16_SLICE_ELEMENTS as CHUNK_ELEMENTS

_LOW16 = 0xFFFF
_MIX = 0x45D9F3B  # an odd multiplier of a well-known 32-bit integer hash (two multiply-xorshift rounds)
_STEP_SALT = 0x9E3779B1  # 2^32 / golden ratio: spreads consecutive step counts over the 32-bit range


def _hash16(bits: torch.Tensor, step: int) -> torch.Tensor:
    """16 pseudo-random bits per element from an int64 tensor of 32-bit patterns and the step count."""
    x = (bits ^ ((step * _STEP_SALT) & 0xFFFFFFFF)) & 0xFFFFFFFF
    for _ in range(2):  # int64 products of a 32-bit value and a 27-bit constant cannot overflow
        x = ((x >> 16) ^ x) * _MIX & 0xFFFFFFFF
    return ((x >> 16) ^ x) & _LOW16


def round_to_bf16(values: torch.Tensor, step: int) -> torch.Tensor:
    """``values`` (fp32) rounded stochastically to bf16: away from zero with probability (dropped bits) / 2^16.

    Adding a uniform 16-bit number to the low half of the fp32 pattern and truncating does exactly that (the
    carry reaches the kept bits with that probability); the sign bit is untouched, so it works for negatives too.
    """
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + _hash16(bits, step)) & 0xFFFF0000
    # Back to a signed 32-bit pattern; infinities and NaNs keep their class (their low bits carry nowhere new).
    rounded = torch.where(rounded >= 1 << 31, rounded - (1 << 32), rounded).to(torch.int32)
    return rounded.view(torch.float32).to(torch.bfloat16)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (the update is elementwise), a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formulas) on bf16 weights, with stochastically rounded updates.

    The moments are bf16 like the weights (2 x 2 bytes per weight) plus torch's 0-d fp32 ``step``; each step
    reads them into fp32, updates in fp32 and writes them back rounded to nearest (a moment is an average, not an
    accumulator, so its rounding does not build up); only the weight, which accumulates, is rounded stochastically.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        if param.dtype != torch.bfloat16:
            raise TypeError(f"BF16AdamW steps bf16 weights; got one in {param.dtype}")
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
        step_size = lr / (1 - beta1 ** step)
        sqrt_bc2 = math.sqrt(1 - beta2 ** step)
        flat = [_local(t).view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
        for start in range(0, flat[0].numel(), CHUNK_ELEMENTS):
            weight, grad, exp_avg, exp_avg_sq = (t[start:start + CHUNK_ELEMENTS] for t in flat)
            grad32 = grad.float()
            avg32 = exp_avg.float().lerp_(grad32, 1 - beta1)
            sq32 = exp_avg_sq.float().mul_(beta2).addcmul_(grad32, grad32, value=1 - beta2)
            exp_avg.copy_(avg32)
            exp_avg_sq.copy_(sq32)
            weight32 = weight.float().mul_(1 - lr * decay)
            weight32.addcdiv_(avg32, sq32.sqrt_().div_(sqrt_bc2).add_(eps), value=-step_size)
            weight.copy_(round_to_bf16(weight32, step))
