"""Build the model to train: transformers' causal LM, its weights in the right dtype, LoRA or QLoRA on top.

Nothing here knows about ranks except *where* the weights come from: with ``on_meta`` the model is built on the
meta device (no memory) and its weights arrive later from rank 0 (see ``parallelize.load_from_rank0``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtune.config import LoraConfig, ModelConfig, TrainConfig
from shardtune.config.keys import Problem
from shardtune.errors import UsageError
from shardtune.moe import MOE_TARGETS, moe_dora_problem, moe_family
from shardtune.peft_names import did_you_mean, unmatched

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
    # torch_dtype bfloat16: every weight, gradient and optimizer state in bf16, no fp32 master copy (the updates
    # are stochastically rounded, train/bf16_adamw.py); compute runs in bf16 without autocast.
    pure_bf16: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.pure_bf16:
            return torch.bfloat16
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision, torch.float32)

    @property
    def trainable_dtype(self) -> torch.dtype:
        """What trained weights (and so their gradients and AdamW moments) are stored in."""
        return torch.bfloat16 if self.pure_bf16 else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype:
        """autocast's dtype; fp32 means none: pure bf16 weights already compute in bf16."""
        return torch.float32 if self.pure_bf16 else self.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """FSDP2's gradient reduce-scatter dtype: fp32 for fp32 master weights; pure bf16 reduces its bf16
        gradients as they are (as DDP does), since the sharded gradient is stored in bf16 anyway and an fp32 copy
        of each unit's gradient is the memory pure bf16 is chosen to save."""
        return torch.bfloat16 if self.pure_bf16 else torch.float32

    def describe(self) -> str:
        return "pure bf16 (no fp32 master)" if self.pure_bf16 else f"mixed precision {self.mixed_precision}"

    def frozen_dtype(self, lora: LoraConfig) -> torch.dtype:
        """The dtype the model loads in: the frozen base's (LoRA), or the trained weights' (full)."""
        if lora.use_4bit_quantization:
            return DTYPES[lora.bnb_4bit_quant_storage_dtype]
        return self.compute_dtype if lora.use_peft_lora else self.trainable_dtype

    def upcasts_residual(self, lora: LoraConfig, *, fsdp: bool) -> bool:
        """Whether the embeddings' output is cast up to fp32, so the residual stream runs in fp32: under autocast
        (one process, DDP, MP, PP) with a LoRA base stored in the compute dtype.

        autocast runs only matmuls in bf16; every other operation runs in its inputs' dtype. With bf16 embeddings
        the whole residual stream (each layer's additions, the norms, the head's input) would run in bf16: on
        SmolLM2 the first loss moved 1.4e-3 from fp32's. From fp32 embeddings' output it runs as with fp32 weights
        under autocast (TRL's default), while the base keeps half the memory: the same loss where the checkpoint
        is stored in bf16 (its values are then what fp32 weights hold), 5.7e-4 from fp32's for SmolLM2's fp32
        folder (TRL's: 1.3e-4). FSDP2 casts each decoder layer's input to its mixed-precision dtype, so there
        the upcast would buy nothing. Nor under QLoRA: its 4-bit weights round far more than a bf16 stream does,
        and bitsandbytes hands each layer's output back in its input's dtype, so an fp32 stream would hold its
        projections' outputs in fp32."""
        return (lora.use_peft_lora and not lora.use_4bit_quantization and not fsdp and not self.pure_bf16
                and self.compute_dtype != torch.float32)


def decide_precision(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """``cfg`` with its precision written down for ``device``: where the config leaves it to the hardware, bf16
    true (native bf16) or false, and QLoRA's 4-bit dtypes, so config.yaml and every checkpoint record the choice;
    the choice and why are logged. bf16 asked of hardware that only emulates it runs as asked (as before this
    default existed), with a warning that fp32 is faster there."""
    from shardtune.hardware import native_bf16

    native, why = native_bf16(device.type)
    if cfg.precision_left_to_hardware and cfg.model.pure_bf16:  # torch_dtype bfloat16 decides: bf16 throughout
        log.info("precision: pure bf16, as torch_dtype bfloat16 asks (weights and optimizer states in bf16, no fp32 "
                 "master; %s)", why if native else f"{why}: bf16 is emulated there, slower than fp32")
        return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, bf16=native)).with_4bit_dtypes()
    if cfg.precision_left_to_hardware:
        log.info("precision: %s by default (%s; %s)", "bf16 mixed precision" if native else "fp32", why,
                 "--bf16 false trains in fp32" if native else "bf16 would be emulated, slower than fp32")
        return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, bf16=native)).with_4bit_dtypes()
    if not native and (cfg.mixed_precision == "bf16" or cfg.model.pure_bf16):
        # A GPU before Ampere (T4, V100) computes fp16 natively, at many times its fp32 rate: say so there
        faster = ("fp32 (--bf16 false); fp16 mixed precision (--bf16 false --fp16 true, with a loss scaler) runs "
                  "natively there" if device.type == "cuda" else "fp32 (--bf16 false)")
        log.warning("bf16 asked for, but %s: bf16 is emulated there and slower than %s", why, faster)
    return cfg.with_4bit_dtypes()


def attn_implementation(model_cfg: ModelConfig, device: torch.device, compute_dtype: torch.dtype) -> str:
    """flash_attention_2 when asked, installed, on CUDA and computing in bf16/fp16 (flash-attn has no fp32
    kernels); otherwise the configured one (sdpa by default), with a warning saying why."""
    if not model_cfg.use_flash_attn:
        return model_cfg.attn_implementation
    from shardtune.config.validation import flash_unavailable

    why = flash_unavailable("flash_attention_2", device.type == "cuda", compute_dtype == torch.float32)
    if why is None:
        return "flash_attention_2"
    _warn_once(f"use_flash_attn: {why}, using {model_cfg.attn_implementation} attention instead")
    return model_cfg.attn_implementation


def family_attention(config, attn: str) -> str:
    """``attn``, or eager where it is sdpa and the family has no sdpa attention (Gemma 2: sdpa cannot soft-cap
    the scores), with a warning; transformers would refuse to build the model instead."""
    if attn != "sdpa":
        return attn
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # a family of its own code (trust_remote_code): transformers decides
        return attn
    if getattr(model_class, "_supports_sdpa", True):
        return attn
    _warn_once(f"attn_implementation sdpa: {model_class.__name__} has no sdpa attention, using eager instead")
    return "eager"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    # The attention choice is asked for by the model loader and the collator: one warning is enough.
    log.warning(message)


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

    from shardtune.gguf_source import find_gguf
    from shardtune.hub import model_folder_problem, pickled_weights_refused

    path = model_cfg.model_name_or_path
    dtype = precision.frozen_dtype(lora)
    attn = attn_implementation(model_cfg, device, precision.compute_dtype)
    device = load_on or device
    if gguf := find_gguf(path):
        return _load_gguf_model(gguf, lora, dtype, attn, device, on_meta=on_meta)
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
    attn = family_attention(config, attn)
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


def _load_gguf_model(gguf, lora: LoraConfig, dtype: torch.dtype, attn: str, device: torch.device, *,
                     on_meta: bool) -> nn.Module:
    """The causal LM of a GGUF file, its weights dequantized to ``dtype``; on meta its config comes from the
    file's metadata (a GGUF has no config.json), so every rank builds the same model."""
    from transformers import AutoModelForCausalLM

    from shardtune.gguf_source import load_config, load_model

    if lora.use_4bit_quantization:
        raise UsageError(f"use_4bit_quantization=true with model_name_or_path={str(gguf.path)!r}: QLoRA of a GGUF "
                         f"base is not supported; train LoRA (use_4bit_quantization false) on it")
    if on_meta:
        config = load_config(gguf)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        model.name_or_path = config._name_or_path  # what PEFT records as the adapter's base on every rank
        return model
    return load_model(gguf, dtype=dtype, attn_implementation=attn).to(device)


def init_base_model(model_cfg: ModelConfig, lora: LoraConfig, precision: Precision, device: torch.device,
                    config) -> nn.Module:
    """The causal LM of ``config`` with initialised weights instead of loaded ones (their values do not change
    memory; under fake tensors they cost nothing), quantised as QLoRA's would be: what the trace builds."""
    from transformers import AutoModelForCausalLM

    attn = family_attention(config, attn_implementation(model_cfg, device, precision.compute_dtype))
    # Under fake mode, modules built outside a device context cannot later change dtype (PEFT casts its adapters).
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=precision.frozen_dtype(lora),
                                                 attn_implementation=attn)
        if lora.use_4bit_quantization:
            quantize_linears(model, lora)
    return model


def upcast_embeddings_output(model: nn.Module) -> None:
    """Cast the input embeddings' output to fp32 under autocast, so the residual stream runs in fp32 there
    (``Precision.upcasts_residual``). A forward outside autocast (a callback's, say) keeps the base's dtype: the
    fp32 stream would meet the bf16 weights in a plain matmul."""
    def upcast(_module: nn.Module, _args, output: torch.Tensor) -> torch.Tensor:
        return output.float() if torch.is_autocast_enabled(output.device.type) else output

    model.get_input_embeddings().register_forward_hook(upcast)


def keep_lora_input_dtype(model: nn.Module) -> None:
    """Make PEFT's LoRA layers feed their adapters the layer's input as it is, as its bitsandbytes 4-bit layers do
    under autocast (the trace's bf16 stand-in for a QLoRA job). PEFT's plain ``Linear`` first casts the input to
    the adapter's dtype (fp32), and autocast casts that back to a bf16 copy which the adapter's matmul keeps for
    backward: one copy per adapted linear, where the 4-bit layers of q/k/v (and gate/up) share one input."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False


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


def keep_4bit_layout_for_training(model: nn.Module) -> None:
    """Stop bitsandbytes repacking a 4-bit layer's weight for its CPU inference kernel the first time the layer
    runs in eval mode (an evaluation) on a CPU with AVX512-BF16: that kernel has no backward, so every later training
    step lost the gradient through the 4-bit layers (the adapters below them stopped learning), and under FSDP the
    gathered weight was rewritten in place, giving a wrong eval_loss and a broken model from there on."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def resize_for_tokenizer(model: nn.Module, vocab_size: int, *, saved_rows_follow: bool = False,
                         added: Sequence[int] = ()) -> list[int]:
    """Grow the embeddings when the tokenizer gained tokens (chat template specials, a pad token); the ids of the
    rows added (their values are drawn at random around the mean of the others), with those of ``added`` (the
    tokens the run added, ``data.templates.added_token_ids``) that fell on spare rows the model held already,
    which are as new to it and train as well. ``saved_rows_follow``: the
    trained rows of an adapter or checkpoint are loaded over them next, so no mean and covariance of the others
    is taken (a minute and more on a 128k vocabulary, with transformers' warning that the rows are drawn at
    random)."""
    old_size = model.get_input_embeddings().num_embeddings
    spare = sorted(token_id for token_id in set(added) if token_id < old_size)
    if vocab_size <= old_size:
        return spare
    log.info("resizing token embeddings to %d for the added tokens", vocab_size)
    # A model built on meta (FSDP ranks filled from rank 0 later) or of fake tensors (the memory trace) has no
    # values to take a mean of.
    from torch._subclasses.fake_tensor import is_fake

    weight = model.get_input_embeddings().weight
    model.resize_token_embeddings(vocab_size, mean_resizing=not (saved_rows_follow or weight.is_meta
                                                                 or is_fake(weight)))
    return spare + list(range(old_size, vocab_size))


# A row of the embeddings or the head whose norm is below this share of the matrix's median row norm was never
# trained: pretraining never saw its token, and weight decay took it to (near) zero. Trained rows, rare tokens'
# included, sit within a factor of a few of the median.
UNTRAINED_ROW_NORM = 1e-3
_ROWS_AT_ONCE = 8192  # rows measured at a time: a 128k x 4096 matrix is never copied to fp32 whole


def _vocabulary_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The input embeddings' weight, and the head's where it is a matrix of its own (not tied, not 4-bit)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    matrices = [embed.weight]
    if head is not None and head.weight is not embed.weight and type(head.weight) in (torch.Tensor, nn.Parameter) \
            and tuple(head.weight.shape) == tuple(embed.weight.shape):
        matrices.append(head.weight)
    return matrices


def revive_untrained_rows(model: nn.Module, token_ids: Sequence[int]) -> list[int]:
    """Of ``token_ids`` (the special tokens the run's data writes), those whose row of the input embeddings or of
    the head the base model never trained (``UNTRAINED_ROW_NORM``): Llama 3's base models have (near) zero rows for
    <|start_header_id|>, <|end_header_id|> and <|eot_id|>, the tokens of their own chat template. Each such row is
    set to the mean of the matrix's trained rows, as transformers starts rows it adds; the ids are returned, so
    that they train under LoRA too (``added_token_targets``). Left at zero, a frozen head row keeps the reply's end
    token at logit zero, so the fine-tuned model never stops, and an input row of zeros tells the model nothing."""
    ids = sorted(set(token_ids))
    revived: set[int] = set()
    with torch.no_grad():
        for weight in _vocabulary_matrices(model) if ids else []:
            norms = torch.cat([rows.float().norm(dim=1) for rows in weight.detach().split(_ROWS_AT_ONCE)])
            trained = norms > UNTRAINED_ROW_NORM * norms.median()
            dead = [token_id for token_id in ids if token_id < len(norms) and not trained[token_id]]
            if not dead or not trained.any():
                continue
            total = sum(rows[keep].float().sum(dim=0) for rows, keep in
                        zip(weight.detach().split(_ROWS_AT_ONCE), trained.split(_ROWS_AT_ONCE)))
            weight[dead] = (total / trained.sum()).to(weight.dtype)
            revived.update(dead)
    return sorted(revived)


def trainable_token_ids(model: nn.Module) -> list[int]:
    """The token rows ``model``'s adapters train (PEFT's ``trainable_token_indices``, on any of its modules)."""
    ids: set[int] = set()
    for module in model.modules():
        if type(module).__name__ == "TrainableTokensLayer":
            ids.update(token_id for indices in module.token_indices.values() for token_id in indices)
    return sorted(ids)


def added_token_targets(model: nn.Module, token_ids: list[int], lora: LoraConfig) -> dict[str, list[int]]:
    """PEFT's ``trainable_token_indices`` for rows the tokenizer added: the input embeddings, and an untied head
    (a tied one follows its embeddings in PEFT), except a module trained whole (``lora_modules_to_save``). Without
    them LoRA would leave the new rows frozen at their random values and outside the adapter, and every load of
    the adapter would draw different ones."""
    if not token_ids:
        return {}
    names = {module: name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    modules = [embed] + ([head] if head is not None and head.weight is not embed.weight else [])
    short = [names[module].rsplit(".", 1)[-1] for module in modules]
    return {name: list(token_ids) for name in short if name not in lora.lora_modules_to_save}


REGEX_PREFIX = "re:"  # lora_target_modules "re:<pattern>": PEFT's regex form, matched against full module names
# init_lora_weights values that rewrite the base weights from an SVD/QR of them (the adapter starts non-zero).
MUTATING_INITS = ("pissa", "olora")


def target_modules(spec: str) -> str | list[str]:
    """PEFT's ``target_modules``: 'all-linear' as it is; ``re:<pattern>`` as the regex string PEFT full-matches
    against each module's name; otherwise a comma-separated list of module names (each matches as a name suffix)."""
    spec = spec.strip()
    if spec.startswith(REGEX_PREFIX):
        return spec[len(REGEX_PREFIX):]
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


def peft_init(value: str) -> bool | str:
    """``init_lora_weights`` as PEFT takes it: the booleans as booleans, the named methods as names."""
    lowered = value.strip().lower()
    return {"true": True, "false": False}.get(lowered, lowered)


def mutates_base(lora: LoraConfig) -> bool:
    """PiSSA and OLoRA move part of each base weight into the adapter, so the trained adapter only fits the
    modified base until it is converted back (``initial_adapter``)."""
    return str(peft_init(lora.init_lora_weights)).startswith(MUTATING_INITS)


def peft_lora_config(lora: LoraConfig, added_tokens: dict[str, list[int]] | None = None):
    """PEFT's LoraConfig of ``lora``; ``added_tokens`` (``added_token_targets``) train and are saved in the
    adapter, so loading it restores them instead of drawing new random rows."""
    from peft import LoraConfig as PeftLoraConfig

    bias = "none" if lora.lora_bias.lower() == "false" else lora.lora_bias.lower()
    return PeftLoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                          target_modules=target_modules(lora.lora_target_modules), bias=bias,
                          use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                          modules_to_save=list(lora.lora_modules_to_save) or None,
                          init_lora_weights=peft_init(lora.init_lora_weights),
                          trainable_token_indices=added_tokens or None, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int, added_token_ids: list[int] | None = None,
               trainable_dtype: torch.dtype = torch.float32, training: bool = True) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (``trainable_dtype`` weights: fp32, bf16 in pure bf16); the base is
    frozen.

    The seed is set just before injection so every rank and every setup starts from the same adapters. With
    PiSSA/OLoRA the adapters' initial values are kept (``initial_adapter``): export converts the trained adapter
    into a plain one for the unmodified base with them.
    """
    from peft import get_peft_model

    if training:
        # PEFT trains a copy of each module whose name ends with one of lora_modules_to_save, and adapts each one
        # named in a list of target modules; it says nothing of a name that matches none (a typo among the
        # targets): the run would train less than asked.
        targets = target_modules(lora.lora_target_modules)
        for key, names, fix in (("lora_modules_to_save", list(lora.lora_modules_to_save),
                                 "give the names of modules to train whole, e.g. lm_head,embed_tokens"),
                                ("lora_target_modules", targets if isinstance(targets, list) else [],
                                 "give the names of the model's linear layers (e.g. q_proj,v_proj), all-linear or "
                                 "re:<regex>")):
            _refuse_unmatched(model, key, names, fix)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if lora.use_dora and (problem := moe_dora_problem(model_type, moe_family(model_type), targets)):
            raise UsageError(Problem(("use_dora", "lora_target_modules"), problem))
    peft_config = peft_lora_config(lora, added_token_targets(model, added_token_ids or [], lora))
    if mutates_base(lora) and next(model.parameters()).is_meta:
        # A rank built on meta gets all of rank 0's weights, its decomposed base included: nothing to take apart
        # here (PEFT's SVD/QR cannot run on meta tensors).
        peft_config.init_lora_weights = True
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            # PEFT warns that a PiSSA/OLoRA adapter needs converting before it is shared: export does that.
            warnings.filterwarnings("ignore", message=".*(pissa|olora|PiSSA|OLoRA).*")
            model = get_peft_model(model, peft_config)
    except ValueError as exc:
        said = " ".join(str(exc).split())  # PEFT's message may print a whole module over many lines
        raise UsageError(f"lora_target_modules={lora.lora_target_modules!r}, lora_modules_to_save="
                         f"{','.join(lora.lora_modules_to_save) or None}: "
                         f"{said if len(said) <= 300 else said[:297] + '...'}; use all-linear, names of the model's "
                         f"linear layers (e.g. q_proj,v_proj) or re:<regex>") from None
    # Adapters train in fp32 whatever the base dtype: their updates are tiny and would vanish in bf16, unless pure
    # bf16 was asked for, whose optimizer rounds them stochastically instead.
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(trainable_dtype)
    if mutates_base(lora):
        model.initial_adapter = {name: param.detach().cpu().clone() for name, param in model.named_parameters()
                                 if param.requires_grad and ".lora_" in name and not param.is_meta}
    return model


def _refuse_unmatched(model: nn.Module, key: str, names: list[str], fix: str) -> None:
    """``key``'s ``names`` that no module of ``model`` is named after, as PEFT matches them (modules_to_save: the
    end of a module's name; target modules: the whole name or its last dotted parts), refused in one line with the
    nearest module names."""
    modules = [module for module, _ in model.named_modules() if module]
    if key != "lora_modules_to_save":
        # A transformers-4 name of a mixture-of-experts weight that transformers 5 fused into a 3-D tensor (Mixtral's
        # w1, w2, w3): PEFT adapts the tensor it became (shardtune.moe).
        fused = MOE_TARGETS.get(moe_family(getattr(getattr(model, "config", None), "model_type", None)), {})
        modules += [f"{name[:-len(new)]}{old}" for name, _ in model.named_parameters()
                    for old, new in fused.items() if name.endswith("." + new)]
    missing = unmatched(names, modules, saved=key == "lora_modules_to_save")
    if missing:
        guess = did_you_mean(missing, sorted({module.rsplit(".", 1)[-1] for module in modules}))
        raise UsageError(Problem(key, f"{key}={','.join(names)}: no module of the model is named "
                                      f"{', '.join(missing)}{guess}; {fix}"))


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a 4-bit weight (or the trace's stand-in for one) counts as the parameters it
    stands for."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "stands_for", param.numel())
        if param.__class__.__name__ == "Params4bit":
            n = getattr(param, "quant_state").shape.numel() if getattr(param, "quant_state", None) else n * 2
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total
