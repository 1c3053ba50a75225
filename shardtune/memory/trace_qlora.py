"""QLoRA's 4-bit base in the trace.

Real tensors (``fake=False``, the CPU check): the trainer's own ``build_model(weights="init")`` quantises the
initialised weights (``model.quantize_linears``), since the trace loads none.

Fake tensors: ``Params4bit`` is a tensor subclass that cannot wrap a FakeTensor (``Tensor._make_subclass`` refuses
it), so the base is traced in bf16 and ``nf4_adjustment`` swaps the quantised weights' bytes for the formula's NF4
bytes (``formula.nf4_bytes``), adding one dequantised weight for the running matmul. The trace says so in its notes.
"""

from __future__ import annotations

from torch import nn

from shardtune.config import TrainConfig


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
