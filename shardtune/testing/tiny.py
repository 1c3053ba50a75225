"""A tiny Llama-style model and a byte-level BPE tokenizer that shardtune makes itself, with nothing to download.

Tests, benchmarks and the demo need a real Hugging Face model folder (config.json, safetensors, tokenizer files) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load exactly as they load a hub model.
This module writes one. The tokenizer behaves like the Llama-3 one in the ways that break fine-tunes: it adds BOS
itself (so a chat template that also writes BOS would double it), it has a distinct pad token, and it carries a
ChatML chat template with ``{% generation %}`` markers.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

# ChatML, the format of Qwen and many fine-tunes; the generation markers let transformers return the assistant mask.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = ("the a an one two three four five six seven eight nine ten plus minus times is are was what how many "
          "answer question sum of and or not yes no red green blue cat dog bird fish tree house car road river "
          "small large quick slow happy sad model train data token layer shard memory batch").split()


def sample_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic English-like lines with digits and punctuation: enough for BPE merges that look real."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words.insert(rng.randint(0, len(words)), str(rng.randint(0, 999)))
        lines.append(" ".join(words).capitalize() + rng.choice((".", "?", "!", ",")))
    return lines


def make_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` (a generated one by default).

    Byte-level, so every string encodes without an unknown token, as with GPT-2, Llama-3 and Qwen.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) if corpus is not None else sample_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], chat_template=CHATML_TEMPLATE,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)


def tiny_llama_config(vocab_size: int, *, num_layers: int = 2, hidden_size: int = 64, intermediate_size: int = 128,
                      num_heads: int = 4, num_kv_heads: int = 2, max_position_embeddings: int = 2048,
                      bos_token_id: int | None = None, eos_token_id: int | None = None,
                      pad_token_id: int | None = None):
    """A ``LlamaConfig`` for a model small enough to train on a CPU core in seconds."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                       bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       rms_norm_eps=1e-5, rope_theta=10000.0)


def make_model_folder(path: str | Path, *, seed: int = 0, tokenizer=None, untrained: Sequence[str] = (),
                      **config_kwargs) -> Path:
    """Write a randomly initialised tiny Llama and its tokenizer as a Hugging Face model folder at ``path``;
    ``untrained``: tokens whose rows of the embeddings and the head are zero, as in a base model that never saw
    them (Llama 3's base models and their chat template's tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = tokenizer or make_tokenizer()
    config = tiny_llama_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for token_id in tokenizer.convert_tokens_to_ids(list(untrained)):
            model.get_input_embeddings().weight[token_id] = 0
            model.get_output_embeddings().weight[token_id] = 0
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
