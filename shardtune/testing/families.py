"""Tiny models of each supported family, built from transformers' own config classes, with nothing to download.

Each family keeps the quirk that sets it apart from Llama, at a size where the quirk changes the numbers: Llama 3's
``llama3`` RoPE scaling and tied head, Mistral's sliding window (shorter than a packed row), Qwen2's attention
biases, Qwen3's per-head q/k norms, Gemma 2's soft caps, embedding scale and ``query_pre_attn_scalar`` (not
``head_dim``), Gemma 3's local/global layers with their own RoPE bases, Phi-3's fused ``qkv_proj`` and
``gate_up_proj``, Mixtral's experts. Every model has 2 layers and hidden size 64, so a training step takes
milliseconds on a CPU; the folders are real Hugging Face ones (``make_family_folder``) that every shardtune command
loads as it loads a hub model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardtune.testing.tiny import make_tokenizer

# Shapes shared by every family: 4 query heads of 16 over 2 key/value heads.
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
SLIDING_WINDOW = 16  # shorter than the tests' 64-token packed rows, so the window masks something


def _llama2(**ids: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES, **ids, tie_word_embeddings=False, rms_norm_eps=1e-5)


def _llama3(**ids: Any):
    from transformers import LlamaConfig

    # Llama 3.1's frequency-dependent RoPE rescaling and Llama 3.2's tied head; a factor this small still moves
    # the low frequencies (wavelengths over original_max_position_embeddings / low_freq_factor).
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaConfig(**SIZES, **ids, tie_word_embeddings=True, rope_parameters=rope)


def _mistral(**ids: Any):
    from transformers import MistralConfig

    return MistralConfig(**SIZES, **ids, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)


def _qwen2(**ids: Any):
    from transformers import Qwen2Config

    # Qwen2 and Qwen2.5 share this architecture: biases on q, k and v (and none elsewhere).
    return Qwen2Config(**SIZES, **ids, tie_word_embeddings=True)


def _qwen3(**ids: Any):
    from transformers import Qwen3Config

    return Qwen3Config(**SIZES, **ids, head_dim=16, tie_word_embeddings=True)


def _gemma2(**ids: Any):
    from transformers import Gemma2Config

    return Gemma2Config(**SIZES, **ids, head_dim=16, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW,
                        attn_logit_softcapping=2.0, final_logit_softcapping=1.5)


def _gemma3(**ids: Any):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**SIZES, **ids, head_dim=16, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW,
                            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=1.5)


def _phi3(**ids: Any):
    from transformers import Phi3Config

    return Phi3Config(**SIZES, **ids, tie_word_embeddings=False, sliding_window=None)


def _mixtral(**ids: Any):
    from transformers import MixtralConfig

    return MixtralConfig(**(SIZES | {"intermediate_size": 64}), **ids, num_local_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=False)


FAMILIES: dict[str, Callable[..., Any]] = {
    "llama2": _llama2, "llama3": _llama3, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "mixtral": _mixtral,
}


def family_config(family: str, tokenizer):
    """The tiny config of ``family`` (a key of ``FAMILIES``) sized for ``tokenizer``."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: not one of {', '.join(FAMILIES)}")
    config = FAMILIES[family](bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    config.vocab_size = len(tokenizer)
    return config


def make_family_folder(path: str | Path, family: str, *, seed: int = 0, tokenizer=None) -> Path:
    """Write a randomly initialised tiny ``family`` model and its tokenizer as a Hugging Face model folder."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _as_family_loads_it(path, family, tokenizer or make_tokenizer())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, tokenizer))
    _spread_zero_initialised(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _as_family_loads_it(path: Path, family: str, tokenizer):
    """``tokenizer`` saved in ``path`` and loaded back as ``AutoTokenizer`` loads it beside this family's config:
    the family's tokenizer class may add its own special tokens (Qwen2's adds ``<|endoftext|>``, which real Qwen
    vocabularies hold), and the model's vocabulary is sized for what loads, as a hub model's is."""
    from transformers import AutoTokenizer

    family_config(family, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    loaded.save_pretrained(path)
    return loaded


def _spread_zero_initialised(model, seed: int) -> None:
    """Give biases and norm weights that transformers initialises to constants small random values, so a test
    notices when one of them is dropped or mixed up on the way (an export that loses Qwen2's biases, a Gemma norm
    loaded as ``weight`` rather than ``1 + weight``)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
