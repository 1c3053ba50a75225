"""The optimizers ``optim`` names, in Transformers' words, and the bytes of state each keeps: one table.

The trainer builds them from this table (train/optim.py) and the estimator counts their state from it
(memory/formula.py), so ``shardtune estimate --optimizer NAME`` models the optimizer ``optim: NAME`` runs.
Torch-free: the estimator and the config checks read it without importing torch.

State bytes per trainable weight (the moments; what FSDP shards and the checkpoint holds):
- torch AdamW: exp_avg and exp_avg_sq in the weight's dtype (2 x 4 bytes for fp32 master weights), plus a 0-d
  fp32 ``step`` per tensor;
- bitsandbytes 8-bit (AdamW: two moments, Lion: one): each moment 1 byte per value, plus one fp32 absmax per
  block of 256 values (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"); a tensor with
  fewer than 4096 values keeps fp32 moments (bitsandbytes' ``min_8bit_size``, which Transformers leaves at its
  default); the two 256-entry fp32 quantisation maps are shared by every tensor;
- bitsandbytes 32-bit (paged AdamW, Lion): fp32 moments whatever the weight's dtype;
- Adafactor (Transformers', Shazeer & Stern 2018): no first moment (beta1 None, Transformers' default); the
  second moment of a matrix factored into a row and a column vector (fp32), of a vector kept whole; a 0-d fp32
  running RMS per tensor;
- SGD (Transformers passes no momentum): no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUANT_BLOCK = 256  # values per fp32 absmax in bitsandbytes' blockwise 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 state for tensors smaller than this (its default)
QMAP_BYTES = 256 * 4  # one 8-bit quantisation map: 256 fp32 values
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
# The estimator's earlier spellings, kept working.
ESTIMATE_ALIASES = {"adamw": "adamw_torch", "adamw-8bit": "adamw_8bit"}


def canonical(name: str) -> str:
    """The table's name for ``name`` (an estimator alias or a table name, any case); unknown names unchanged."""
    name = name.lower()
    return ESTIMATE_ALIASES.get(name, name)


def non_cuda_alternative(name: str) -> str:
    """What to use where a paged optimizer cannot run: the same optimizer without paging."""
    return name.removeprefix("paged_").replace("adamw_32bit", "adamw_torch")


def _moment_bytes(spec: OptimizerSpec, numel: int, weight_bytes: int) -> float:
    """One moment of a ``numel``-value tensor (8-bit: codes plus absmax per block)."""
    if spec.state_bits == 8 and numel >= MIN_8BIT_SIZE:
        return numel + 4 * math.ceil(numel / QUANT_BLOCK)
    return numel * (weight_bytes if spec.state_bits == 0 else 4)


def tensor_state_bytes(name: str, shape: tuple[int, ...], weight_bytes: int) -> int:
    """Bytes of optimizer state one trainable tensor of ``shape`` gets (without the maps all tensors share)."""
    spec = OPTIMIZERS[canonical(name)]
    numel = math.prod(shape)
    if spec.kind == "adafactor":
        factored = shape[-2] + shape[-1] if len(shape) >= 2 else numel
        return 4 * factored + 4  # + the running RMS
    step = 4 if spec.library == "torch" and spec.moments else 0  # torch keeps a 0-d fp32 step per tensor
    return int(spec.moments * _moment_bytes(spec, numel, weight_bytes)) + step


def shared_state_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """The 8-bit quantisation maps, one per moment, shared by every 8-bit tensor (none when no tensor is)."""
    spec = OPTIMIZERS[canonical(name)]
    eight_bit = spec.state_bits == 8 and any(math.prod(s) >= MIN_8BIT_SIZE for s in shapes)
    # bitsandbytes' AdamW maps its signed first and unsigned second moment; Lion's one moment uses the signed map.
    return spec.moments * QMAP_BYTES if eight_bit else 0


def state_bytes(name: str, shapes: list[tuple[int, ...]], weight_bytes: int) -> int:
    """All optimizer state of trainable tensors of ``shapes``: what the trainer's optimizer holds after a step."""
    return sum(tensor_state_bytes(name, s, weight_bytes) for s in shapes) + shared_state_bytes(name, shapes)


def bytes_per_param(name: str, weight_bytes: int, matrix: tuple[int, int]) -> float:
    """State bytes per trainable weight in a large model: the estimator's rate.

    ``matrix`` is a representative trainable matrix (rows, cols); only Adafactor's factored state depends on it
    (4 (rows + cols) bytes per rows x cols weights). Per-tensor constants (torch's step, the shared maps) and
    bitsandbytes' fp32 state for tensors under 4096 values are left out: in an LLM they are well under 0.1%.
    """
    spec = OPTIMIZERS[canonical(name)]
    if spec.kind == "adafactor":
        rows, cols = matrix
        return 4 * (rows + cols) / (rows * cols)
    if spec.state_bits == 8:
        return spec.moments * (1 + 4 / QUANT_BLOCK)
    return spec.moments * (weight_bytes if spec.state_bits == 0 else 4)
