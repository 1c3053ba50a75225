"""QLoRA's 4-bit base in the trace.

Real tensors (``fake=False``, the CPU check): the trainer's own ``build_model(weights="init")`` quantises the
initialised weights (``model.quantize_linears``), since the trace loads none.

Fake tensors: ``Params4bit`` is a tensor subclass that cannot wrap a FakeTensor (``Tensor._make_subclass`` refuses
it), so each quantised linear layer is traced as :class:`PackedNF4Linear`: a frozen bf16 parameter of the NF4
weight's bytes (bitsandbytes' packed storage with ``bnb_4bit_quant_storage`` bf16, its quantisation constants
included), which FSDP shards and gathers at that size, and a matmul that dequantises it into a full weight for its
forward and again for its backward, as ``bitsandbytes.MatMul4Bit`` does. DoRA reads the dequantised weight itself
(PEFT's ``dequantize_module_weight``), so a DoRA job keeps a bf16 base and ``nf4_adjustment`` swaps the quantised
weights' bytes for NF4's afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.config import LoraConfig, TrainConfig


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with W dequantised from ``packed`` into a temporary, and again in backward: nothing saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        ctx.packed, ctx.shape = packed, (out_features, x.shape[-1])
        return x @ packed.new_empty(ctx.shape, dtype=x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.packed.new_empty(ctx.shape, dtype=grad.dtype), None, None


class PackedNF4Linear(nn.Linear):
    """A 4-bit linear layer's memory on fake tensors: its NF4 bytes as a frozen bf16 parameter; the input cast to
    the compute dtype and the output back to the input's, as ``bitsandbytes.nn.Linear4bit`` does."""

    def __init__(self, linear: nn.Linear, lora: LoraConfig) -> None:
        nn.Module.__init__(self)
        from shardtune.memory.formula import nf4_bytes
        from shardtune.train.model import DTYPES

        self.in_features, self.out_features = linear.in_features, linear.out_features
        numel = self.in_features * self.out_features
        elements = -(-round(nf4_bytes(numel, lora.use_nested_quant)) // 2)  # bf16 storage: 2 bytes each
        self.weight = nn.Parameter(linear.weight.new_empty((elements, 1), dtype=torch.bfloat16), requires_grad=False)
        self.weight.stands_for = numel  # what count_parameters counts
        self.bias = linear.bias
        self.compute_dtype = DTYPES[lora.bnb_4bit_compute_dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DequantizedMatmul.apply(x.to(self.compute_dtype), self.weight, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def packable(lora: LoraConfig) -> bool:
    """Whether the fake-tensor trace holds the job's 4-bit base as :class:`PackedNF4Linear` layers: not for DoRA,
    which reads the dequantised weight itself."""
    return not lora.use_dora


def pack_linears(model: nn.Module, lora: LoraConfig) -> None:
    """Swap the linear layers bitsandbytes would quantise (all but the output head) for :class:`PackedNF4Linear`."""
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(module, name, PackedNF4Linear(child, lora))


def nf4_adjustment(model: nn.Module, cfg: TrainConfig, plan, info) -> tuple[int, int]:
    """(bytes saved on this rank by storing the quantised weights in NF4, bytes of one dequantised weight).

    The weights bitsandbytes quantises are the base model's linear layers except the output head.
    """
    from shardtune.memory.formula import nf4_bytes
    from shardtune.train.plan import unwrap

    head = unwrap(model).get_output_embeddings()
    weights = [m.weight for name, m in model.named_modules()
               if type(m) is nn.Linear and m is not head and ".lora_" not in name]
    numel = sum(w.numel() for w in weights)
    stored = sum(w.numel() * w.element_size() for w in weights)
    shard = 1
    if plan.strategy.shards_parameters and plan.sharding != "NO_SHARD":
        shard = info.local_world_size if plan.sharding == "HYBRID_SHARD" else info.world_size
    saving = (stored - nf4_bytes(numel, cfg.lora.use_nested_quant)) / shard
    compute_bytes = 2  # bitsandbytes dequantises to its compute dtype (bf16 / fp16)
    dequant = max((w.numel() for w in weights), default=0) * compute_bytes
    return round(saving), dequant
