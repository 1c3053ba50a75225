"""Named chat templates and the tokenizer they are applied to.

Each template is written so that rendering the first ``i`` messages with ``add_generation_prompt=True`` gives a prefix
of the whole conversation: that is how the encoder finds each assistant turn without ``{% generation %}`` markers.
Templates that need the BOS token write ``bos_token``; the encoder never adds a second one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import UsageError
from shardtune.hub import tokenizer_problem


# Tokens that end a turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3, GPT-style, Llama 2/Mistral),
# and Llama 3's (and Granite's) end of text and end of message, which llama.cpp also stops on: a run whose template
# made <|eot_id|> its EOS keeps only that in a GGUF's metadata, where the base's <|end_of_text|> still ends a reply.
# The encoder keeps the one after a reply as a target, generation stops on any of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>",
                      "<|end_of_text|>", "<|eom_id|>")


@dataclass(frozen=True)
class ChatTemplate:
    jinja: str
    special_tokens: tuple[str, ...]  # added to the tokenizer with add_special_tokens
    end_of_turn: str | None  # the token that ends an assistant turn; None: the tokenizer's EOS


CHATML = ChatTemplate(
    jinja=("{% for message in messages %}"
           "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    special_tokens=("<|im_start|>", "<|im_end|>"), end_of_turn="<|im_end|>")

LLAMA3 = ChatTemplate(
    jinja=("{{ bos_token }}{% for message in messages %}"
           "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), end_of_turn="<|eot_id|>")

# Mistral v0.1 style: a system message goes inside the first [INST] block.
MISTRAL = ChatTemplate(
    jinja=("{{ bos_token }}{% for message in messages %}"
           "{% if message['role'] == 'system' %}{{ '[INST] ' + message['content'] + '\n\n' }}"
           "{% elif message['role'] == 'user' %}"
           "{% if loop.first or messages[loop.index0 - 1]['role'] != 'system' %}{{ '[INST] ' }}{% endif %}"
           "{{ message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
           "{% else %}{{ raise_exception('mistral template: unsupported role ' + message['role']) }}{% endif %}"
           "{% endfor %}"),
    special_tokens=("[INST]", "[/INST]"), end_of_turn=None)

ALPACA = ChatTemplate(
    jinja=("{% for message in messages %}"
           "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
           "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
           "{% elif message['role'] == 'assistant' %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}"
           "{% else %}{{ raise_exception('alpaca template: unsupported role ' + message['role']) }}{% endif %}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"),
    special_tokens=(), end_of_turn=None)

ZEPHYR = ChatTemplate(
    jinja=("{% for message in messages %}"
           "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"),
    special_tokens=("<|system|>", "<|user|>", "<|assistant|>"), end_of_turn=None)

TEMPLATES: dict[str, ChatTemplate] = {"chatml": CHATML, "llama-3": LLAMA3, "mistral": MISTRAL, "alpaca": ALPACA,
                                      "zephyr": ZEPHYR}

# The prompt that turns an Alpaca row (instruction, input, output) into prompt/completion text.
ALPACA_PREAMBLE = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                   "completes the request.")
ALPACA_PROMPT = "{preamble}\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def alpaca_prompt(instruction: str, input_text: str, system: str = "") -> str:
    """The Alpaca prompt for one row; the row's output follows it as the completion. A row's ``system`` text (the
    column of LLaMA-Factory's Alpaca files) stands where the Alpaca preamble, the format's own system prompt, is."""
    with_input = ", paired with an input that provides further context" if input_text else ""
    return ALPACA_PROMPT.format(preamble=system or ALPACA_PREAMBLE.format(with_input=with_input),
                                instruction=instruction,
                                input_block=f"### Input:\n{input_text}\n\n" if input_text else "")


def load_tokenizer(model_name_or_path: str, cfg, *, trust_remote_code: bool = False):
    """The model's tokenizer with ``cfg``'s chat template, its special tokens if asked, and a pad token != EOS.

    A token added here makes ``len(tokenizer)`` exceed the model's vocabulary: the trainer resizes the embeddings.
    """
    from transformers import AutoTokenizer

    from shardtune.gguf_source import find_gguf, load_tokenizer as load_gguf_tokenizer

    if gguf := find_gguf(model_name_or_path):  # vocabulary, merges and chat template from the file's metadata
        return configure_tokenizer(load_gguf_tokenizer(gguf), cfg)
    if Path(model_name_or_path).expanduser().is_dir() and (
            problem := tokenizer_problem(f"model_name_or_path '{model_name_or_path}'", model_name_or_path)):
        raise UsageError(problem)  # a local folder: what is missing, not transformers' guess at a hub id
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from model_name_or_path '{model_name_or_path}': "
                         f"{str(exc).splitlines()[0]} (give a local model folder or a hub id).") from exc
    return configure_tokenizer(tokenizer, cfg)


def end_of_turn_problem(tokenizer, cfg) -> str | None:
    """A named template whose end-of-turn token the tokenizer lacks, for data about to be tokenised (a run
    trained so still exports): the token would train as text spelled out in pieces, and generation would not
    stop there. (Markers spelled in pieces are how Zephyr and Mistral train; a turn must still end in one token.)"""
    template = TEMPLATES.get(cfg.chat_template_format)
    end = template.end_of_turn if template is not None else None
    if end is None or cfg.add_special_tokens or end in tokenizer.get_vocab():
        return None
    return (f"chat_template_format {cfg.chat_template_format}: the tokenizer has no token {end}, the template's end "
            f"of a turn: it would train as text spelled out in pieces, and generation would not stop there; set "
            f"add_special_tokens true (adds the template's tokens and resizes the embeddings), or "
            f"chat_template_format none to keep the tokenizer's own template")


def configure_tokenizer(tokenizer, cfg):
    """Apply ``cfg.chat_template_format`` / ``add_special_tokens`` and a distinct pad token to ``tokenizer``; the
    ids of the tokens added are ``added_token_ids(tokenizer)``."""
    before = len(tokenizer)
    _configure(tokenizer, cfg)
    setattr(tokenizer, _ADDED_IDS, list(range(before, len(tokenizer))))  # add_tokens appends its ids
    return tokenizer


# Where configure_tokenizer leaves the ids it added on the tokenizer object (never saved with it).
_ADDED_IDS = "_shardtune_added_token_ids"


def added_token_ids(tokenizer) -> list[int]:
    """The ids of the tokens ``configure_tokenizer`` added (a template's specials, a pad token). A model whose
    vocabulary has spare rows past its tokenizer (Phi-3's 32064 for 32011 tokens, Qwen2.5's, Gemma 3's) gives them
    rows it holds already, so the embeddings do not grow, yet those rows are new to the model and must train."""
    return list(getattr(tokenizer, _ADDED_IDS, []))


def _configure(tokenizer, cfg) -> None:
    name = cfg.chat_template_format
    if name != "none":
        if name not in TEMPLATES:
            raise UsageError(f"chat_template_format '{name}' is unknown: choose none or one of "
                             f"{', '.join(TEMPLATES)}.")
        template = TEMPLATES[name]
        tokenizer.chat_template = template.jinja
        if cfg.add_special_tokens and template.special_tokens:
            # add_tokens(special_tokens=True) keeps the tokens already registered (add_special_tokens may replace them)
            tokenizer.add_tokens(list(template.special_tokens), special_tokens=True)
            if template.end_of_turn is not None:
                # as in the PEFT chat examples: generation stops at the end of the assistant turn
                tokenizer.eos_token = template.end_of_turn
    if path := cfg.chat_template_path:  # TRL's: a Jinja file's template
        try:
            tokenizer.chat_template = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"chat_template_path '{path}': cannot read it ({exc}); give a UTF-8 Jinja file.") from None
    if (eos := cfg.eos_token) is not None:  # after the template's end of turn, which it overrides
        if eos not in tokenizer.get_vocab():
            raise UsageError(f"eos_token '{eos}' is not a token of the tokenizer (it would be spelled out in pieces, "
                             f"and generation would never stop at it): give one of its tokens, e.g. "
                             f"{tokenizer.eos_token}, its own EOS, or leave eos_token out.")
        tokenizer.eos_token = eos
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no EOS token: the model could never learn to stop. Use a tokenizer "
                         "with an eos_token.")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # pad == EOS makes collators that mask pad tokens also mask EOS, so the model never learns to stop
        unk = tokenizer.unk_token_id
        if unk is not None and unk not in (tokenizer.eos_token_id, tokenizer.bos_token_id):
            tokenizer.pad_token = tokenizer.unk_token
        elif "<|pad|>" not in tokenizer.get_vocab() and (spare := spare_special_token(tokenizer)):
            tokenizer.pad_token = spare
        else:
            if "<|pad|>" not in tokenizer.get_vocab():
                tokenizer.add_tokens(["<|pad|>"], special_tokens=True)
            tokenizer.pad_token = "<|pad|>"


def reply_end_token(tokenizer) -> str | None:
    """The special token the tokenizer's chat template writes right after an assistant reply (Gemma's
    <end_of_turn>, Qwen's <|im_end|>, Phi-3's <|end|>, Llama 3's <|eot_id|>), found by rendering a probe
    conversation; None when the template writes none there, or refuses the probe. Trained replies end with it, so
    a model folder must stop at it, whether or not it is the tokenizer's EOS."""
    reply = "shardtune reply probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "probe"},
                                              {"role": "assistant", "content": reply}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe (no user role, tools required...)
        return None
    if not isinstance(text, str) or (at := text.find(reply)) < 0:
        return None
    rest = text[at + len(reply):]
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    return max((token for token in specials if token and rest.startswith(token)), key=len, default=None)


def spare_special_token(tokenizer) -> str | None:
    """A special token of the vocabulary that no text or template writes, to pad with: one named for padding
    (Llama 3.1's <|finetune_right_pad_id|>), else a reserved one (Llama 3's <|reserved_special_token_0|>). Padding
    with it grows no embeddings, so a LoRA adapter still loads onto the base as it is (PeftModel.from_pretrained);
    a token added instead is a row the base lacks."""
    used = {tokenizer.bos_token, tokenizer.eos_token, *END_OF_TURN_TOKENS,
            *(token for template in TEMPLATES.values() for token in template.special_tokens)}
    spare = [token.content for _, token in sorted(tokenizer.added_tokens_decoder.items())
             if token.special and token.content not in used]
    return next((token for word in ("pad", "reserved") for token in spare if word in token.lower()), None)


def special_tokens_written(dataset, tokenizer) -> dict[int, str]:
    """The tokenizer's special tokens (a chat template's, BOS, EOS; not the pad, which the collator adds and no
    loss or attention reads) that the tokenised ``dataset`` (a ``datasets.Dataset``) holds, by id; read from its
    Arrow column, so a large data set costs no Python loop."""
    import pyarrow.compute as pc

    specials = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()
                if token.special and token_id != tokenizer.pad_token_id}
    if not specials or dataset is None or not len(dataset):
        return {}
    present: set[int] = set()
    for chunk in dataset.data.column("input_ids").chunks:
        present.update(pc.unique(pc.list_flatten(chunk)).to_pylist())
    return {token_id: specials[token_id] for token_id in sorted(present & specials.keys())}
