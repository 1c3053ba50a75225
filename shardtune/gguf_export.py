"""A trained causal LM as one GGUF file that llama.cpp, Ollama and LM Studio run: ``shardtune export --format gguf``.

What llama.cpp's own converter (``convert_hf_to_gguf.py``) would write for the same model, built with the
``gguf`` package: its tensor names (``gguf.get_tensor_name_map``), its quantizers (``gguf.quants``) and its
``GGUFWriter``. The model is a plain transformers model (LoRA already merged); this module reads its config, its
state dict and its tokenizer and knows nothing of runs, checkpoints or ranks.

Llama-family models only (Llama, Mistral, SmolLM2, TinyLlama, and Qwen2): llama.cpp runs other families through
other graphs with other tensors, which this writer does not produce; they are refused in one line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UsageError, writing
from shardtune.files import WRITTEN_BY, replacing
from shardtune.gguf_source import ROPE_FREQS, llama3_frequency_factors
from shardtune.gguf_vocab import add_vocab

if TYPE_CHECKING:
    from shardtune.gguf_source import Described

log = logging.getLogger("shardtune")

# --quantize values: what each 2-D weight is stored as. 1-D tensors (norms, biases) stay float32, as llama.cpp's.
QUANTIZE = ("f16", "bf16", "q8_0")
# The metadata key that marks a GGUF as shardtune's own: --overwrite replaces only a file that carries it.
MARK_KEY = "shardtune.written_by"


@dataclass(frozen=True)
class Family:
    """How one transformers family is written: llama.cpp's architecture name, and whether its Q/K weights are
    permuted (llama.cpp computes Llama's RoPE on interleaved pairs, transformers on split halves)."""

    arch: str
    permute_qk: bool


FAMILIES = {"llama": Family("llama", True), "mistral": Family("llama", True), "qwen2": Family("qwen2", False)}


CONVERT = "convert a Transformers model folder of it with llama.cpp's convert_hf_to_gguf.py"


def family_of(config, fix: str = CONVERT) -> Family:
    """The family of ``config``, or one UsageError naming the architecture or the RoPE scaling that cannot be
    written, ending in ``fix`` (the steps from the user's source to a GGUF made elsewhere): all of it read from the
    config alone, so that an export asks before it loads the weights or makes a folder."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UsageError(f"--format gguf: architecture {model_type!r} ({', '.join(config.architectures or [])}) "
                         f"cannot be written; shardtune writes GGUF for {', '.join(FAMILIES)} models: {fix}")
    family = FAMILIES[model_type]
    rope_type = _rope_type(_rope_parameters(config))
    written = ("default", "linear", None, *(("llama3",) if family.arch == "llama" else ()))
    if rope_type not in written:
        raise UsageError(f"--format gguf: rope_type {rope_type!r} of this {model_type} model is not written yet "
                         f"({', '.join(t for t in written if t)} are); {fix}")
    return family


def _rope_type(rope: dict) -> str | None:
    return rope.get("rope_type", rope.get("type", "default"))


def permute_for_rope(weight, num_heads: int):
    """The rows of a Q or K projection reordered from transformers' rotate-half RoPE layout (each head's first
    half then its second half) to llama.cpp's interleaved pairs; llama.cpp's loader and transformers' GGUF reader
    undo exactly this."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rope_parameters(config) -> dict:
    # transformers 5 keeps RoPE in rope_parameters; 4.x in rope_theta and rope_scaling
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    return {**scaling, **params}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def general_name(name: str) -> str:
    """``name`` as general.name: the same, but "mistral" becomes "Mistral". transformers' GGUF reader takes a
    llama-architecture file whose general.name is exactly "mistral" for a Mistral one, and gguf has no tensor map
    for that architecture, so the file would not load; to llama.cpp the name is only a label."""
    return "Mistral" if name == "mistral" else name


def add_hparams(writer, config, family: Family, name: str) -> None:
    """The model's shape, RoPE and norm under llama.cpp's metadata keys."""
    import gguf

    rope = _rope_parameters(config)
    writer.add_name(general_name(name))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    head_dim = _head_dim(config)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    if _rope_type(rope) == "linear":  # llama3's is the ROPE_FREQS tensor; any other is refused by family_of
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _storage(array, quantize: str):
    """(bytes or array to write, its GGML type): 1-D tensors in float32, weights as ``quantize`` asks; a Q8_0
    weight whose rows are not whole 32-value blocks falls back to f16, as llama.cpp's converter does."""
    import gguf
    import numpy as np

    types = gguf.GGMLQuantizationType
    if array.ndim == 1:
        return array.astype(np.float32), types.F32
    if quantize == "f16" or (quantize == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0]):
        return array.astype(np.float16), types.F16
    qtype = types.BF16 if quantize == "bf16" else types.Q8_0
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def add_tensors(writer, model, family: Family, quantize: str) -> int:
    """Every weight under llama.cpp's name, Q/K permuted where the family needs it; a tied head is stored once
    (llama.cpp reuses token_embd when output.weight is absent). Returns the number of parameters written."""
    import gguf
    import torch

    config = model.config
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    written = 0
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        if "rotary_emb" in hf_name:
            continue  # a buffer computed from the config, not a weight
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UsageError(f"--format gguf: no llama.cpp tensor for {hf_name!r} of this {config.model_type} model; "
                             f"{CONVERT}")
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if family.permute_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            array = permute_for_rope(array, config.num_attention_heads)
        elif family.permute_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            array = permute_for_rope(array, kv_heads)
        data, qtype = _storage(array, quantize)
        writer.add_tensor(name, data, raw_dtype=qtype)
        written += array.size
    if _rope_type(_rope_parameters(config)) == "llama3":  # not a parameter: not counted
        factors, _ = _storage(llama3_frequency_factors(config).numpy(), quantize)
        writer.add_tensor(ROPE_FREQS, factors, raw_dtype=gguf.GGMLQuantizationType.F32)
    return written


def check_quantize(quantize: str) -> None:
    """Refuse (exit 2) a ``--quantize`` value shardtune cannot write, before anything is loaded or trained."""
    if quantize not in QUANTIZE:
        raise UsageError(f"--quantize {quantize or repr(quantize)}: not a GGUF type shardtune writes; use one of "
                         f"{', '.join(QUANTIZE)}")


def write_gguf(model, tokenizer, path: str | Path, quantize: str, *, name: str,
               tokenizer_pre: str | None = None, source: Described | None = None) -> Path:
    """Write ``model`` (a transformers causal LM, adapters merged) and ``tokenizer`` as the GGUF file ``path``,
    its weights as ``quantize`` says; under a temporary name, renamed when complete. ``source``: what the GGUF the
    model was made from says of itself (license, organization, its name as the base model, its padding id),
    kept rather than dropped."""
    import gguf

    check_quantize(quantize)
    family = family_of(model.config)
    path = Path(path)
    with writing(path), replacing(path) as tmp:  # a full disk named by the file it stopped
        writer = gguf.GGUFWriter(str(tmp), family.arch)
        try:
            # First, so that an --overwrite later knows this file as shardtune's own
            # (export_gguf.gguf_written_by_shardtune).
            writer.add_string(MARK_KEY, f"{WRITTEN_BY} export")
            add_hparams(writer, model.config, family, name)
            for key, value, types in (source.general if source else ()):
                writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
            writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES[quantize]]))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            add_vocab(writer, tokenizer, model.config.vocab_size, pre=tokenizer_pre,
                      pad_token_id=source.pad_token_id if source else None)
            count = add_tensors(writer, model, family, quantize)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    log.info("wrote %s: %s parameters, %s", path, f"{count:,}", quantize)
    return path
