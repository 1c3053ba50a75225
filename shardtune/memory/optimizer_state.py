"""The bytes of optimizer state, counted from the optimizer table the trainer builds from (config/optimizers.py).

State bytes per trainable weight (the moments; what FSDP shards and the checkpoint holds):
- torch AdamW: exp_avg and exp_avg_sq in the weight's dtype (2 x 4 bytes for fp32 master weights), plus a 0-d
  fp32 ``step`` per tensor;
- bitsandbytes 8-bit (AdamW: two moments, Lion: one): each moment 1 byte per value, plus one fp32 absmax per
  block of 256 values (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"); a tensor with
  fewer than 4096 values keeps fp32 moments (bitsandbytes' ``min_8bit_size``, which Transformers leaves at its
  default); the two 256-entry fp32 quantisation maps are shared by every tensor; the embeddings keep fp32
  moments (as Transformers' Trainer overrides them for its 8-bit optimizers);
- bitsandbytes 32-bit (paged AdamW, Lion): fp32 moments whatever the weight's dtype;
- Adafactor (Transformers', Shazeer & Stern 2018): no first moment (beta1 None, Transformers' default); the
  second moment of a matrix factored into a row and a column vector (fp32), of a vector kept whole; a 0-d fp32
  running RMS per tensor;
- SGD (Transformers passes no momentum): no state.
"""

from __future__ import annotations

import math

from shardtune.config.optimizers import OPTIMIZERS, OptimizerSpec, canonical

QUANT_BLOCK = 256  # values per fp32 absmax in bitsandbytes' blockwise 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 state for tensors smaller than this (its default)
QMAP_BYTES = 256 * 4  # one 8-bit quantisation map: 256 fp32 values


def _moment_bytes(spec: OptimizerSpec, numel: int, weight_bytes: int, embedding: bool = False) -> float:
    """One moment of a ``numel``-value tensor (8-bit: codes plus absmax per block, but for an embedding's)."""
    if spec.state_bits == 8 and numel >= MIN_8BIT_SIZE and not embedding:
        return numel + 4 * math.ceil(numel / QUANT_BLOCK)
    return numel * (weight_bytes if spec.state_bits == 0 else 4)


def tensor_state_bytes(name: str, shape: tuple[int, ...], weight_bytes: int, embedding: bool = False) -> int:
    """Bytes of optimizer state one trainable tensor of ``shape`` gets (without the maps all tensors share);
    ``embedding``: an ``nn.Embedding``'s weight."""
    spec = OPTIMIZERS[canonical(name)]
    numel = math.prod(shape)
    if spec.kind == "adafactor":
        factored = shape[-2] + shape[-1] if len(shape) >= 2 else numel
        return 4 * factored + 4  # + the running RMS
    step = 4 if spec.library == "torch" and spec.moments else 0  # torch keeps a 0-d fp32 step per tensor
    return int(spec.moments * _moment_bytes(spec, numel, weight_bytes, embedding)) + step


def shared_state_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """The 8-bit quantisation maps, one per moment, shared by every 8-bit tensor (none when no tensor is)."""
    spec = OPTIMIZERS[canonical(name)]
    eight_bit = spec.state_bits == 8 and any(math.prod(s) >= MIN_8BIT_SIZE for s in shapes)
    # bitsandbytes' AdamW maps its signed first and unsigned second moment; Lion's one moment uses the signed map.
    return spec.moments * QMAP_BYTES if eight_bit else 0


def state_bytes(name: str, shapes: list[tuple[int, ...]], weight_bytes: int,
                embedding_shapes: list[tuple[int, ...]] = ()) -> int:
    """All optimizer state of trainable tensors of ``shapes`` and trainable embeddings of ``embedding_shapes``:
    what the trainer's optimizer holds after a step."""
    return (sum(tensor_state_bytes(name, s, weight_bytes) for s in shapes) + shared_state_bytes(name, shapes)
            + sum(tensor_state_bytes(name, s, weight_bytes, embedding=True) for s in embedding_shapes))


def bytes_per_param(name: str, weight_bytes: int, matrix: tuple[int, int], embedding: bool = False) -> float:
    """State bytes per trainable weight in a large model: the estimator's rate (``embedding``: an embedding's).

    ``matrix`` is a representative trainable matrix (rows, cols); only Adafactor's factored state depends on it
    (4 (rows + cols) bytes per rows x cols weights). Per-tensor constants (torch's step, the shared maps) and
    bitsandbytes' fp32 state for tensors under 4096 values are left out: in an LLM they are well under 0.1%.
    """
    spec = OPTIMIZERS[canonical(name)]
    if spec.kind == "adafactor":
        rows, cols = matrix
        return 4 * (rows + cols) / (rows * cols)
    if spec.state_bits == 8 and not embedding:
        return spec.moments * (1 + 4 / QUANT_BLOCK)
    return spec.moments * (weight_bytes if spec.state_bits == 0 else 4)
