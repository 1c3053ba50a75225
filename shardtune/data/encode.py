"""Examples to token ids and labels: templates rendered, targets marked, BOS added once, EOS kept as a target.

Labels follow Hugging Face: ``labels[i]`` is the target of position ``i`` (the loss shifts by one), ``-100`` where
ignored. The first token of every document is never a target, so in a packed row no position learns to predict
across a document boundary.
"""

from __future__ import annotations

from shardtune.data.readers import SKIP_HINT, BadRow
from shardtune.data.templates import END_OF_TURN_TOKENS, TEMPLATES

IGNORE = -100


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before every text by itself (usually BOS), found by encoding a probe."""
    probe = "a b"
    with_special = tokenizer(probe).input_ids
    plain = tokenizer(probe, add_special_tokens=False).input_ids
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start]
    return []


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def with_prefix(prefix: list[int], ids: list[int], labels: list[int] | None = None) -> tuple[list[int], list[int]]:
    """``ids`` (and ``labels``) behind the tokenizer's ``special_prefix``, unless they start with it already: a
    template that writes BOS itself must not get a second one. Training rows and generation prompts both use it."""
    labels = ids if labels is None else labels
    if prefix and ids[:len(prefix)] != prefix:
        ids, labels = prefix + ids, [IGNORE] * len(prefix) + labels
    return ids, labels


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_segments(tokenizer, messages: list[dict], target_from: int, end_of_turn: str | None) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_target) pieces; targets are assistant turns with their end token.

    Rendering the history with the generation prompt gives where each assistant turn starts; rendering it with the
    turn gives where it ends. Templates that rewrite earlier turns fall back to finding each reply in the text.
    """
    full = _render(tokenizer, messages)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < target_from:
            continue
        try:
            before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            after = _render(tokenizer, messages[:i + 1]).rstrip()
        except Exception:  # a template that refuses a partial conversation (e.g. one that must end with a user)
            before = after = None
        if before is not None and full.startswith(before) and full.startswith(after) and cursor <= len(before):
            start, end = len(before), len(after)
        else:
            start = full.find(m["content"], cursor)
            if start < 0:
                raise BadRow("", "the chat template does not reproduce the assistant reply; use "
                                 "chat_template_format chatml or another named template")
            end = start + len(m["content"])
            rest = full[end:]
            for eot in (end_of_turn, tokenizer.eos_token, *END_OF_TURN_TOKENS):
                if eot and rest.startswith(eot):
                    end += len(eot)
                    break
        if start > cursor:
            segments.append((full[cursor:start], False))
        segments.append((full[start:end], True))
        cursor = end
    if cursor < len(full):
        segments.append((full[cursor:], False))
    return segments


def encode_example(example: dict, tokenizer, *, prefix: list[int], train_on_prompt: bool,
                   chat_template_format: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one canonical example, before truncation."""
    eos = tokenizer.eos_token_id
    if example["kind"] == "chat":
        if not tokenizer.chat_template:
            raise BadRow(example["where"], "the tokenizer has no chat template: set chat_template_format "
                                           "(chatml, llama-3, mistral, alpaca, zephyr)")
        template = TEMPLATES.get(chat_template_format)
        try:
            segments = chat_segments(tokenizer, example["messages"], example["target_from"],
                                     template.end_of_turn if template else None)
        except BadRow as exc:
            raise BadRow(example["where"], f"{exc.problem}; {SKIP_HINT}") from None
        except Exception as exc:  # jinja raise_exception from the template, e.g. an unsupported role order
            raise BadRow(example["where"], f"the chat template rejects this conversation ({exc}); {SKIP_HINT}") \
                from None
        ids: list[int] = []
        labels: list[int] = []
        for text, is_target in segments:
            piece = _ids(tokenizer, text)
            ids += piece
            labels += piece if (is_target or train_on_prompt) else [IGNORE] * len(piece)
    else:
        prompt_ids = _ids(tokenizer, example["prompt"])
        completion_ids = _ids(tokenizer, example["completion"])
        if not completion_ids or completion_ids[-1] != eos:
            completion_ids = completion_ids + [eos]  # EOS is a target: the model learns to stop
        ids = prompt_ids + completion_ids
        labels = (prompt_ids if train_on_prompt else [IGNORE] * len(prompt_ids)) + completion_ids
    ids, labels = with_prefix(prefix, ids, labels)
    if labels:
        labels[0] = IGNORE
    return ids, labels


def encode_batch(batch: dict, *, tokenizer, max_seq_len: int, train_on_prompt: bool, chat_template_format: str) -> dict:
    """``datasets.map`` function: canonical examples to truncated ids/labels plus per-row statistics.

    A row the template rejects is recorded in ``bad`` (not raised: exceptions do not cross worker processes well).
    """
    prefix = special_prefix(tokenizer)
    out: dict[str, list] = {"input_ids": [], "labels": [], "dropped_tokens": [], "bad": []}
    keys = list(batch)
    for values in zip(*(batch[k] for k in keys)):
        example = dict(zip(keys, values))
        try:
            ids, labels = encode_example(example, tokenizer, prefix=prefix, train_on_prompt=train_on_prompt,
                                         chat_template_format=chat_template_format)
        except BadRow as exc:
            out["input_ids"].append([])
            out["labels"].append([])
            out["dropped_tokens"].append(0)
            out["bad"].append(str(exc))
            continue
        dropped = max(0, len(ids) - max_seq_len)
        out["input_ids"].append(ids[:max_seq_len])
        out["labels"].append(labels[:max_seq_len])
        out["dropped_tokens"].append(dropped)
        out["bad"].append("")
    return out
