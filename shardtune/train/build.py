"""The model as a training job builds it: where its weights come from, its adapters, its parallelisation and
FSDP's gather dtype. ``shardtune estimate --trace`` calls the same ``build_model`` with ``weights="init"`` under
fake tensors, so there is one place that builds the model."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from shardtune.config import TrainConfig
from shardtune.dist import DistInfo, run_and_share
from shardtune.train.model import (DTYPES, Precision, apply_lora, count_parameters, init_base_model,
                                   keep_4bit_layout_for_training, load_base_model,
                                   resize_for_tokenizer, revive_untrained_rows, upcast_embeddings_output)
from shardtune.train.parallelize import Runner, load_from_rank0, parallelize
from shardtune.train.plan import Plan

log = logging.getLogger("shardtune")


def load_device(plan: Plan, info: DistInfo) -> torch.device:
    """Where the weights are loaded: this process's device, except where the setup places them itself (see
    ``Plan.places_weights_itself``). QLoRA quantises in CPU RAM there too: moving a quantised weight
    (``Params4bit.to``) moves its quantisation state with it, so a 4-bit model larger than one GPU (QLoRA + FSDP's
    reason to exist) can start."""
    return torch.device("cpu") if plan.places_weights_itself else info.device


def build_model(cfg: TrainConfig, plan: Plan, precision: Precision, info: DistInfo, vocab_size: int, *,
                weights: Literal["load", "init"] = "load", config=None, stands_in_for: TrainConfig | None = None,
                prepare_base: Callable[[nn.Module], None] | None = None,
                added_token_ids: Sequence[int] = (), data_specials: Mapping[int, str] | None = None,
                ) -> tuple[nn.Module, Runner, int, int]:
    """The model, parallelized, and the runner that steps it; with its (trainable, total) parameter counts.

    ``weights="load"``: the pretrained weights (from disk, or from rank 0's copy on the other ranks).
    ``weights="init"``: initialised from ``config`` on ``info.device`` (the trace, under fake tensors).
    ``stands_in_for``: the job whose precision rules apply, where ``cfg`` stands in for it (the trace's bf16
    stand-in for a QLoRA job). ``prepare_base``: run on the initialised base before the adapters (the trace packs
    a QLoRA job's 4-bit layers there). ``added_token_ids``: the tokens the run added to the tokenizer
    (``data.templates.added_token_ids``), whose rows train under LoRA even where the embeddings need not grow.
    ``data_specials``: the special tokens the data writes, by id (``data.templates.special_tokens_written``); those
    the base model never trained start at the mean of its rows and train (``revive_untrained_rows``).
    """
    lora = cfg.lora
    # QLoRA quantises while it loads, on every rank (a meta model has nothing to quantise).
    on_meta = weights == "load" and plan.loads_from_rank0 and not lora.use_4bit_quantization
    # Under fake tensors, modules made outside a device context cannot change dtype later (PEFT casts adapters).
    with torch.device(info.device) if weights == "init" else contextlib.nullcontext():
        if weights == "init":
            model = init_base_model(cfg.model, lora, precision, info.device, config)
            if prepare_base is not None:
                prepare_base(model)
        else:
            model = load_base_model(cfg.model, lora, precision, info.device, load_on=load_device(plan, info),
                                    on_meta=on_meta and not info.is_main)
            if lora.use_4bit_quantization:
                keep_4bit_layout_for_training(model)
        new_rows = resize_for_tokenizer(model, vocab_size, added=added_token_ids)
        if weights == "load" and data_specials:
            new_rows = sorted(set(new_rows) | set(_revive(model, data_specials, info, shared=on_meta,
                                                          lora=lora.use_peft_lora)))
        if lora.use_peft_lora:
            model = apply_lora(model, lora, seed=cfg.run.seed, added_token_ids=new_rows,
                               trainable_dtype=precision.trainable_dtype)
        if precision.upcasts_residual((stands_in_for or cfg).lora, fsdp=plan.strategy == "FSDP"):
            upcast_embeddings_output(model)
        if cfg.run.neftune_noise_alpha:
            add_neftune_noise(model, cfg.run.neftune_noise_alpha)
    trainable, total = count_parameters(model)
    if weights == "load":
        log.info("trainable parameters: %s of %s (%.4f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    full_state = buffers = None
    if on_meta and info.is_main:
        full_state = model.state_dict()
        buffers = {k: v.clone() for k, v in model.named_buffers()}
    model, runner = parallelize(model, plan, info)
    if on_meta:
        load_from_rank0(model, full_state, buffers, info, offload=plan.offload)
    model.train()
    return model, runner, trainable, total


def _revive(model: nn.Module, specials: Mapping[int, str], info: DistInfo, *, shared: bool, lora: bool) -> list[int]:
    """``revive_untrained_rows`` for the special tokens the data writes, said once; ``shared``: only rank 0 holds
    the weights (the others are on meta and get its rows, the revived ones included), and tells the others which
    rows train, so every rank's adapters are alike."""
    if shared:
        revived = run_and_share(lambda: revive_untrained_rows(model, list(specials)), runs=info.is_main,
                                what="reading the base model's token rows")[0] or []
    else:
        revived = revive_untrained_rows(model, list(specials))
    if revived and info.is_main:
        log.warning("model: the base model never trained the rows of %s, which the data writes (near zero, as in "
                    "Llama 3's base models): they start at the mean of its trained rows and train%s",
                    ", ".join(specials[token_id] for token_id in revived),
                    " with the adapters (PEFT's trainable_token_indices)" if lora else "")
    return revived


def add_neftune_noise(model: nn.Module, alpha: float) -> None:
    """NEFTune (Jain et al. 2023, as TRL's ``neftune_noise_alpha``): while training, the input embeddings get
    uniform noise in +-alpha / sqrt(seq_len * hidden). Drawn from torch's generator, so a resumed run draws the
    same noise; evaluation and generation (``model.eval()``) see none."""

    def noisy(module: nn.Module, _args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        bound = alpha / (output.size(-2) * output.size(-1)) ** 0.5
        return output + torch.empty_like(output).uniform_(-bound, bound)

    model.get_input_embeddings().register_forward_hook(noisy)


def fsdp_param_dtype(cfg: TrainConfig, precision: Precision) -> torch.dtype | None:
    """FSDP's gather dtype: the mixed-precision one; for QLoRA always the 4-bit weights' storage dtype.

    FSDP casts every floating-point parameter to this dtype when it gathers; the packed NF4 bytes are stored as
    bf16 "numbers", so any other dtype would convert them and silently destroy the base weights.
    """
    if cfg.lora.use_4bit_quantization:
        return DTYPES[cfg.lora.bnb_4bit_quant_storage_dtype]
    if precision.compute_dtype != torch.float32:
        return precision.compute_dtype
    return None


def plan_for(cfg: TrainConfig, info: DistInfo, precision: Precision) -> Plan:
    """The run's plan from its config and launch (before MP/PP stages are placed)."""
    from shardtune.train.plan import make_plan

    return make_plan(cfg.distributed, info, param_dtype=fsdp_param_dtype(cfg, precision),
                     compute_dtype=precision.autocast_dtype, reduce_dtype=precision.reduce_dtype,
                     gradient_checkpointing=cfg.run.gradient_checkpointing, use_reentrant=cfg.run.use_reentrant,
                     activation_offloading=cfg.run.activation_offloading, liger_kernel=cfg.run.use_liger_kernel,
                     compile_backend=cfg.run.torch_compile_backend if cfg.run.torch_compile else None,
                     compile_mode=cfg.run.torch_compile_mode)
