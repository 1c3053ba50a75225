"""QLoRA's 4-bit base in the trace.

Real tensors (``fake=False``, the CPU check): transformers' own layer swap (``replace_with_bnb_linear``, as
``from_pretrained(quantization_config=...)`` does) and bitsandbytes' own quantiser (``Params4bit(...).to(device)``),
on the initialised weights since the trace loads none.

Fake tensors: ``Params4bit`` is a tensor subclass that cannot wrap a FakeTensor (``Tensor._make_subclass`` refuses
it), so the base is traced in bf16 and ``nf4_adjustment`` swaps the quantised weights' bytes for the formula's NF4
bytes (``formula.nf4_bytes``), adding one dequantised weight for the running matmul. The trace says so in its notes.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.config import LoraConfig, TrainConfig
from shardtune.train.model import _quantization_config


def _output_head_names(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if module is head]


def quantize_linears(model: nn.Module, lora: LoraConfig) -> None:
    """Swap ``model``'s linear layers (the head excepted) for bitsandbytes 4-bit ones holding quantised weights."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    originals = {name: module.weight for name, module in model.named_modules() if type(module) is nn.Linear}
    config = _quantization_config(lora)
    replace_with_bnb_linear(model, modules_to_not_convert=_output_head_names(model), quantization_config=config)
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit) or name not in originals:
            continue
        weight = originals[name]
        meta = module.weight
        module.weight = bnb.nn.Params4bit(weight.detach(), requires_grad=False, **meta.__dict__).to(weight.device)
        if module.bias is not None and module.bias.device.type == "meta":
            module.bias = nn.Parameter(torch.zeros(module.bias.shape, dtype=weight.dtype, device=weight.device),
                                       requires_grad=False)
    model.is_loaded_in_4bit = True  # what from_pretrained sets; PEFT reads it


def nf4_adjustment(model: nn.Module, cfg: TrainConfig, plan, info) -> tuple[int, int]:
    """(bytes saved on this rank by storing the quantised weights in NF4, bytes of one dequantised weight).

    The weights bitsandbytes quantises are the base model's linear layers except the output head.
    """
    from shardtune.memory.formula import nf4_bytes
    from shardtune.train.parallelize import unwrap

    head = unwrap(model).get_output_embeddings()
    weights = [m.weight for name, m in model.named_modules()
               if type(m) is nn.Linear and m is not head and ".lora_" not in name]
    numel = sum(w.numel() for w in weights)
    stored = sum(w.numel() * w.element_size() for w in weights)
    shard = 1
    if plan.strategy == "FSDP" and plan.sharding != "NO_SHARD":
        shard = info.local_world_size if plan.sharding == "HYBRID_SHARD" else info.world_size
    saving = (stored - nf4_bytes(numel, cfg.lora.use_nested_quant)) / shard
    compute_bytes = 2  # bitsandbytes dequantises to its compute dtype (bf16 / fp16)
    dequant = max((w.numel() for w in weights), default=0) * compute_bytes
    return round(saving), dequant
