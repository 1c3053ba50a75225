"""Build the model to train: transformers' causal LM, its weights in the right dtype, LoRA or QLoRA on top.

Nothing here knows about ranks except *where* the weights come from: with ``on_meta`` the model is built on the
meta device (no memory) and its weights arrive later from rank 0 (see ``parallelize.load_from_rank0``).
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtune.config import LoraConfig, ModelConfig
from shardtune.errors import UsageError

log = logging.getLogger("shardtune")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """How weights are stored and how compute runs.

    ``mixed_precision`` bf16/fp16 keeps trainable weights (the master copy the optimizer updates) in fp32 and runs
    compute in the low precision: FSDP2's MixedPrecisionPolicy or autocast. A frozen base (LoRA) has no optimizer
    state and needs no master copy, so it is stored in the compute dtype, halving its memory.
    """

    mixed_precision: str  # no | bf16 | fp16

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision, torch.float32)

    def frozen_dtype(self, lora: LoraConfig) -> torch.dtype:
        if lora.use_4bit_quantization:
            return DTYPES[lora.bnb_4bit_quant_storage_dtype]
        return self.compute_dtype if lora.use_peft_lora else torch.float32


def attn_implementation(model_cfg: ModelConfig, device: torch.device, compute_dtype: torch.dtype) -> str:
    """flash_attention_2 when asked, installed, on CUDA and computing in bf16/fp16 (flash-attn has no fp32
    kernels); otherwise the configured one (sdpa by default), with a warning saying why."""
    if not model_cfg.use_flash_attn:
        return model_cfg.attn_implementation
    import importlib.util

    fp32 = compute_dtype == torch.float32
    if device.type == "cuda" and not fp32 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    why = ("no CUDA device" if device.type != "cuda" else
           "flash-attn computes in bf16/fp16 only and mixed precision is off" if fp32 else
           "the flash_attn package is not installed")
    _warn_once(f"use_flash_attn: {why}, using {model_cfg.attn_implementation} attention instead")
    return model_cfg.attn_implementation


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    # The attention choice is asked for by the model loader and the collator: one warning is enough.
    warnings.warn(message, stacklevel=3)


def _quantization_config(lora: LoraConfig):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=lora.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=lora.use_nested_quant,
                              bnb_4bit_compute_dtype=DTYPES[lora.bnb_4bit_compute_dtype],
                              bnb_4bit_quant_storage=DTYPES[lora.bnb_4bit_quant_storage_dtype])


def load_base_model(model_cfg: ModelConfig, lora: LoraConfig, precision: Precision, device: torch.device, *,
                    load_on: torch.device | None = None, on_meta: bool = False) -> nn.Module:
    """The pretrained causal LM for training on ``device``, its weights loaded onto ``load_on`` (default
    ``device``; the CPU where the setup places them itself), or on meta, to be filled from rank 0.

    The attention implementation follows ``device``, where the model will run, not where it is loaded: the
    collator builds its masks for that same choice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.hub import model_folder_problem, pickled_weights_refused

    path = model_cfg.model_name_or_path
    dtype = precision.frozen_dtype(lora)
    attn = attn_implementation(model_cfg, device, precision.compute_dtype)
    device = load_on or device
    # A folder without weights, with a damaged file or with code not allowed to run is one line here, not
    # transformers' traceback. Only where weights are read: a rank built on meta needs config.json alone.
    folder = Path(path).expanduser()
    if not on_meta and folder.is_dir() and (problem := model_folder_problem(
            folder, f"model_name_or_path={path!r}", trust_remote_code=model_cfg.trust_remote_code,
            trust_fix="set trust_remote_code true")):
        raise UsageError(problem)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"model_name_or_path={path!r}: cannot load its config ({str(exc).splitlines()[0]}); "
                         f"give a local model folder with config.json or a hub name you can reach") from None
    if on_meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                    trust_remote_code=model_cfg.trust_remote_code)
    kwargs = dict(dtype=dtype, attn_implementation=attn, trust_remote_code=model_cfg.trust_remote_code)
    if lora.use_4bit_quantization:
        kwargs.update(quantization_config=_quantization_config(lora),
                      device_map={"": device.index if device.type == "cuda" else "cpu"})
    with pickled_weights_refused(folder):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    return model if lora.use_4bit_quantization else model.to(device)


def init_base_model(model_cfg: ModelConfig, lora: LoraConfig, precision: Precision, device: torch.device,
                    config) -> nn.Module:
    """The causal LM of ``config`` with initialised weights instead of loaded ones (their values do not change
    memory; under fake tensors they cost nothing), quantised as QLoRA's would be: what the trace builds."""
    from transformers import AutoModelForCausalLM

    # Under fake mode, modules built outside a device context cannot later change dtype (PEFT casts its adapters).
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=precision.frozen_dtype(lora),
                                                 attn_implementation=attn_implementation(model_cfg, device,
                                                                                         precision.compute_dtype))
        if lora.use_4bit_quantization:
            quantize_linears(model, lora)
    return model


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



def resize_for_tokenizer(model: nn.Module, vocab_size: int) -> None:
    """Grow the embeddings when the tokenizer gained tokens (chat template specials, a pad token)."""
    if vocab_size > model.get_input_embeddings().num_embeddings:
        log.info("resizing token embeddings to %d for the added tokens", vocab_size)
        model.resize_token_embeddings(vocab_size, mean_resizing=True)


def target_modules(spec: str) -> str | list[str]:
    """PEFT's ``target_modules``: 'all-linear' as it is, otherwise a comma-separated list of module names."""
    spec = spec.strip()
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (fp32 weights); the base is frozen.

    The seed is set just before injection so every rank and every setup starts from the same adapters.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                                 target_modules=target_modules(lora.lora_target_modules), bias="none",
                                 task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    try:
        model = get_peft_model(model, peft_config)
    except ValueError as exc:
        raise UsageError(f"lora_target_modules={lora.lora_target_modules!r}: {str(exc).splitlines()[0]}; use "
                         f"all-linear or names of the model's linear layers (e.g. q_proj,v_proj)") from None
    # Adapters train in fp32 whatever the base dtype: their updates are tiny and would vanish in bf16.
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a 4-bit weight counts as the parameters it stands for."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            n = getattr(param, "quant_state").shape.numel() if getattr(param, "quant_state", None) else n * 2
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total
