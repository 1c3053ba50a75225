"""A transformers tokenizer as GGUF metadata: the vocabulary, token types, scores, merges, special token ids and
chat template llama.cpp tokenizes and chats with.

Two kinds, as llama.cpp's converter writes them: byte-level BPE (GPT-2, Llama-3, SmolLM2, Qwen: ``gpt2``) and
SentencePiece-style BPE with byte fallback (Llama-2, TinyLlama, Mistral: ``llama``).
"""

from __future__ import annotations

import json
import logging
import re

from shardtune.errors import UsageError

log = logging.getLogger("shardtune")


def tokenizer_kind(spec: dict) -> str:
    """``llama`` for a SentencePiece-style vocabulary (byte-fallback BPE, ``▁`` for spaces), ``gpt2`` for
    byte-level BPE; anything else (WordPiece, Unigram) cannot be written."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UsageError(f"--format gguf: a {model.get('type')} tokenizer cannot be written; shardtune writes "
                         f"byte-level BPE (gpt2) and SentencePiece BPE (llama) vocabularies")
    return "llama" if model.get("byte_fallback") else "gpt2"


def _split_patterns(node) -> list[str]:
    """The Split regexes of a pre-tokenizer (nested in Sequences)."""
    if isinstance(node, dict):
        if node.get("type") == "Split":
            pattern = node.get("pattern") or {}
            return [pattern.get("Regex") or pattern.get("String") or ""]
        return [p for child in node.get("pretokenizers") or [] for p in _split_patterns(child)]
    return []


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for how the text is split before BPE, read from the pre-tokenizer's regex with
    transformers' own table of those names (the one its GGUF reader uses the other way round). A plain
    ByteLevel pre-tokenizer is GPT-2's split."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        GGUF_PRE_TOKENIZER_SPLITS = {}
    patterns = _split_patterns(spec.get("pre_tokenizer"))
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if regex in patterns:
            return name
    pre = spec.get("pre_tokenizer") or {}
    if not patterns and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    log.warning("--format gguf: the tokenizer's pre-tokenizer is none llama.cpp names; writing 'default', so "
                "llama.cpp may split text differently from transformers")
    return "default"


def _merges(spec: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges") or []]


def token_table(tokenizer, vocab_size: int, kind: str) -> tuple[list[str], list[int]]:
    """(token strings by id, llama.cpp token types) for ``vocab_size`` ids: rows of the embedding no token uses
    are ``[PADn]`` (UNUSED), as llama.cpp's converter names them."""
    from gguf import TokenType

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise UsageError(f"--format gguf: the tokenizer has ids up to {max(by_id)} but the model only {vocab_size} "
                         f"embeddings; save the model after resizing its embeddings to the tokenizer")
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(token)
        if i == tokenizer.unk_token_id and kind == "llama":
            types.append(TokenType.UNKNOWN)
        elif i in special or (i in added and added[i].special):
            types.append(TokenType.CONTROL)
        elif i in added:
            types.append(TokenType.USER_DEFINED)
        elif kind == "llama" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _adds(tokenizer) -> tuple[bool, bool]:
    """Whether encoding text adds BOS at the start and EOS at the end (llama.cpp must do the same)."""
    ids = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return bool(ids) and bos is not None and ids[0] == bos, bool(ids) and eos is not None and ids[-1] == eos


def add_vocab(writer, tokenizer, vocab_size: int, *, pre: str | None = None, pad_token_id: int | None = None) -> None:
    """The tokenizer, its special ids and its chat template under llama.cpp's ``tokenizer.*`` keys; ``pad_token_id``
    (the source GGUF's own) wins over the tokenizer's, which training may have changed (pad must not be EOS)."""
    spec = backend_json(tokenizer)
    kind = tokenizer_kind(spec)
    tokens, types = token_table(tokenizer, vocab_size, kind)
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre or ("default" if kind == "llama" else pre_tokenizer_name(spec)))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if kind == "llama":
        # llama.cpp's SentencePiece tokenizer merges the best-scored pair first; a BPE vocabulary lists its
        # tokens in merge order, so the score falls with the id
        writer.add_token_scores([-float(i) for i in range(vocab_size)])
    if merges := _merges(spec):
        writer.add_token_merges(merges)
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.unk_token_id, writer.add_unk_token_id),
                          (tokenizer.pad_token_id if pad_token_id is None else pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    add_bos, add_eos = _adds(tokenizer)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if template := template_for_gguf(tokenizer.chat_template):
        writer.add_chat_template(template)


def template_for_gguf(chat_template) -> str | None:
    """The chat template as llama.cpp's Jinja reads it: the default one of several, without transformers'
    ``{% generation %}`` markers (they only tell transformers which tokens are the assistant's)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default") or next(iter(chat_template.values()), None)
    if not chat_template:
        return None
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", chat_template)


def backend_json(tokenizer) -> dict:
    """The fast tokenizer's own description (model type, merges, pre-tokenizer), as tokenizer.json holds it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UsageError(f"--format gguf: {type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; save the "
                         f"model with its tokenizer.json")
    return json.loads(backend.to_str())
