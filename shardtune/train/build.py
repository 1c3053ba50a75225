"""The model as a training job builds it: where its weights load, its adapters, its parallelisation and FSDP's
gather dtype. ``shardtune estimate --trace`` follows the same steps under fake tensors (``memory.trace``)."""

from __future__ import annotations

import logging

import torch

from shardtune.config import TrainConfig
from shardtune.train.dist import DistInfo
from shardtune.train.model import Precision, apply_lora, count_parameters, load_base_model, resize_for_tokenizer
from shardtune.train.parallelize import Plan, load_from_rank0, parallelize

log = logging.getLogger("shardtune")


def load_device(plan: Plan, info: DistInfo) -> torch.device:
    """Where the weights are loaded: this process's device, except where the setup places them itself.

    FSDP2 moves each unit's weights to the GPU as it shards them, MP puts each stage on its device and PP keeps one
    stage per process: loading the whole model onto one GPU first would need the very memory these setups exist
    to avoid (a model larger than one GPU could not start). Those load into CPU RAM. QLoRA too: bitsandbytes
    quantises on the CPU, and moving a quantised weight (``Params4bit.to``) moves its quantisation state with it,
    so a 4-bit model larger than one GPU (QLoRA + FSDP's reason to exist) can start.
    """
    if plan.strategy in ("FSDP", "MP", "PP"):
        return torch.device("cpu")
    return info.device


def build_model(cfg: TrainConfig, plan: Plan, precision: Precision, info: DistInfo, vocab_size: int):
    """The model, parallelized, with its weights (from disk, or from rank 0's copy on the other ranks)."""
    lora = cfg.lora
    on_meta = (plan.strategy == "FSDP" and info.distributed and cfg.distributed.fsdp_cpu_ram_efficient_loading
               and cfg.distributed.fsdp_sync_module_states and not lora.use_4bit_quantization)
    model = load_base_model(cfg.model, lora, precision, info.device, load_on=load_device(plan, info),
                            on_meta=on_meta and not info.is_main)
    resize_for_tokenizer(model, vocab_size)
    if lora.use_peft_lora:
        model = apply_lora(model, lora, seed=cfg.run.seed)
    trainable, total = count_parameters(model)
    log.info("trainable parameters: %s of %s (%.4f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    full_state = buffers = None
    if on_meta and info.is_main:
        full_state = model.state_dict()
        buffers = {k: v.clone() for k, v in model.named_buffers()}
    model = parallelize(model, plan, info)
    if on_meta:
        load_from_rank0(model, full_state, buffers, info, offload=plan.offload)
    model.train()
    return model, trainable, total


def fsdp_param_dtype(cfg: TrainConfig, precision: Precision) -> torch.dtype | None:
    """FSDP's gather dtype: the mixed-precision one; for QLoRA always the 4-bit weights' storage dtype.

    FSDP casts every floating-point parameter to this dtype when it gathers; the packed NF4 bytes are stored as
    bf16 "numbers", so any other dtype would convert them and silently destroy the base weights.
    """
    if cfg.lora.use_4bit_quantization:
        from shardtune.train.model import DTYPES

        return DTYPES[cfg.lora.bnb_4bit_quant_storage_dtype]
    if precision.compute_dtype != torch.float32:
        return precision.compute_dtype
    return None
