"""The optimizers ``optim`` names, in Transformers' words, and the state each keeps: one table.

The trainer builds them from this table (train/optim.py) and the estimator counts their state from it
(memory/optimizer_state.py), so ``shardtune estimate --optimizer NAME`` models the optimizer ``optim: NAME`` runs.
Torch-free: the estimator and the config checks read it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_epsilon")


@dataclass(frozen=True)
class OptimizerSpec:
    """What one ``optim`` name runs, what it reads from the config, and what state it keeps."""

    library: str  # torch | bitsandbytes | transformers: where the optimizer class comes from
    kind: str  # adamw | lion | adafactor | sgd
    moments: int  # state tensors shaped like the weight
    state_bits: int  # 0: the weight's own dtype (torch); 32: fp32; 8: blockwise 8-bit (bitsandbytes)
    paged: bool = False  # bitsandbytes' paged state (CUDA unified memory): needs CUDA
    # OptimConfig keys it reads besides learning_rate and weight_decay (Transformers passes the same ones).
    reads: tuple[str, ...] = ()

    @property
    def needs_cuda(self) -> bool:
        return self.paged


_ADAMW_TORCH = OptimizerSpec("torch", "adamw", 2, 0, reads=ADAM_KEYS)
_ADAMW_8BIT = OptimizerSpec("bitsandbytes", "adamw", 2, 8, reads=ADAM_KEYS)
_LION_KEYS = ("adam_beta1", "adam_beta2")  # Transformers passes Lion the Adam betas, and no epsilon
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw_torch": _ADAMW_TORCH,
    "adamw_torch_fused": _ADAMW_TORCH,  # the fused kernel wherever it runs (CUDA), as adamw_torch
    "adamw_8bit": _ADAMW_8BIT,
    "adamw_bnb_8bit": _ADAMW_8BIT,
    "paged_adamw_8bit": OptimizerSpec("bitsandbytes", "adamw", 2, 8, paged=True, reads=ADAM_KEYS),
    "paged_adamw_32bit": OptimizerSpec("bitsandbytes", "adamw", 2, 32, paged=True, reads=ADAM_KEYS),
    "lion_8bit": OptimizerSpec("bitsandbytes", "lion", 1, 8, reads=_LION_KEYS),
    "lion_32bit": OptimizerSpec("bitsandbytes", "lion", 1, 32, reads=_LION_KEYS),
    "paged_lion_8bit": OptimizerSpec("bitsandbytes", "lion", 1, 8, paged=True, reads=_LION_KEYS),
    "paged_lion_32bit": OptimizerSpec("bitsandbytes", "lion", 1, 32, paged=True, reads=_LION_KEYS),
    "adafactor": OptimizerSpec("transformers", "adafactor", 1, 32),
    "sgd": OptimizerSpec("torch", "sgd", 0, 0),
}
# What pure bf16 (torch_dtype bfloat16) runs: AdamW with stochastically rounded bf16 updates (train/bf16_adamw.py).
# The others would round every small update of a bf16 weight away (bitsandbytes', Adafactor and SGD write their
# result back to nearest), so they are refused with it.
PURE_BF16_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# Its step works on one slice of a weight at a time, in fp32 and int64: the elements per slice, and the bytes per
# element its temporaries peak at (the fp32 gradient, moments and weight, 16, and the stochastic rounding's int64
# bit patterns, hash and result, 33, at its torch.where).
PURE_BF16_SLICE_ELEMENTS = 1 << 21
PURE_BF16_SLICE_BYTES_PER_ELEMENT = 49
# Transformers' names that are not run here, and what to use: the closest spelling, adamw_torch, would keep 4 (8)
# times the state these were chosen to save. train's optim and estimate's --optimizer refuse them with this.
NOT_RUN = {"adamw_torch_8bit": "torchao's 8-bit AdamW is not run here; use adamw_8bit, bitsandbytes' 8-bit AdamW, "
                               "with the same state bytes (adamw_torch keeps 4 times as many)",
           "adamw_torch_4bit": "torchao's 4-bit AdamW is not run here; use adamw_8bit, bitsandbytes' 8-bit AdamW, "
                               "the least AdamW state here (about twice the 4-bit one; adamw_torch keeps 8 times as "
                               "much)"}
# The estimator's earlier spellings, kept working.
ESTIMATE_ALIASES = {"adamw": "adamw_torch", "adamw-8bit": "adamw_8bit"}


def canonical(name: str) -> str:
    """The table's name for ``name`` (an estimator alias or a table name, any case); unknown names unchanged."""
    name = name.lower()
    return ESTIMATE_ALIASES.get(name, name)


def non_cuda_alternative(name: str) -> str:
    """What to use where a paged optimizer cannot run: the same optimizer without paging."""
    return name.removeprefix("paged_").replace("adamw_32bit", "adamw_torch")
