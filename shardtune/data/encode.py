"""Examples to token ids and labels: templates rendered, targets marked, BOS added once, EOS kept as a target.

Labels follow Hugging Face: ``labels[i]`` is the target of position ``i`` (the loss shifts by one), ``-100`` where
ignored. The first token of every document is never a target, so in a packed row no position learns to predict
across a document boundary.
"""

from __future__ import annotations

import functools
import json

from shardtune.data.formats import template_message
from shardtune.data.readers import SKIP_HINT, BadRow
from shardtune.data.templates import END_OF_TURN_TOKENS, TEMPLATES

IGNORE = -100
# Tokens past the kept ones that a text cut before tokenising must still give: the cut changes the last few tokens
# (a word or a merge cut in two), never tokens this far before it.
CUT_MARGIN = 64


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


def _spans(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s ids and each one's characters (start, end), from a fast tokenizer."""
    if not text:
        return [], []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded.input_ids, [tuple(span) for span in encoded.offset_mapping]


def max_token_chars(tokenizer) -> int:
    """The longest entry of the vocabulary, in characters: no token covers more of a text (a byte-level token's
    entry has a character per byte, so it is at least as long as the text it covers)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def ids_upto(tokenizer, text: str, limit: int | None, token_chars: int, *, spans: bool = False
             ) -> tuple[list[int], int, list[tuple[int, int]]]:
    """``text``'s ids as tokenising it whole gives them, how many it has, and (with ``spans``, from a fast
    tokenizer) each one's characters: all of them, or, for a text far longer than ``limit`` tokens can cover, only
    the first ``limit`` and an estimate of the count. ``limit`` None: the whole text.

    Truncation keeps only the first tokens, so a 20 MB row need not be tokenised whole (a minute and gigabytes).
    A prefix of ``(limit + CUT_MARGIN) * token_chars`` characters is tokenised instead; it is trusted only when it
    gives ``CUT_MARGIN`` tokens more than are kept, and grows until it does or is the whole text.
    """
    def tokenize(part: str) -> tuple[list[int], list[tuple[int, int]]]:
        return _spans(tokenizer, part) if spans else (_ids(tokenizer, part), [])

    chars = max((limit or 0) + CUT_MARGIN, 1) * max(token_chars, 1)
    while limit is not None and chars < len(text):
        ids, found = tokenize(text[:chars])
        if len(ids) >= limit + CUT_MARGIN:
            return ids[:limit], max(round(len(ids) * len(text) / chars), len(ids)), found[:limit]
        chars *= 4
    ids, found = tokenize(text)
    return ids, len(ids), found


def with_prefix(prefix: list[int], ids: list[int], labels: list[int] | None = None) -> tuple[list[int], list[int]]:
    """``ids`` (and ``labels``) behind the tokenizer's ``special_prefix``, unless they start with it already: a
    template that writes BOS itself must not get a second one. Training rows and generation prompts both use it."""
    labels = ids if labels is None else labels
    if prefix and ids[:len(prefix)] != prefix:
        ids, labels = prefix + ids, [IGNORE] * len(prefix) + labels
    return ids, labels


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """A conversation as the tokenizer's chat template writes it, with the template's own variables
    (``template_kwargs``: a row's chat_template_kwargs); training and generation render through this one call."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))


def _without_calls(message: dict) -> dict:
    return {key: value for key, value in message.items() if key != "tool_calls"}


def chat_segments(tokenizer, messages: list[dict], target_from: int, end_of_turn: str | None,
                  tools: list[dict] | None = None, untrained: frozenset[int] = frozenset(),
                  template_kwargs: dict | None = None) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_target) pieces; targets are assistant turns with their end token.
    ``tools``: the function definitions the template writes into the prompt (never a target). ``untrained``: the
    indices of assistant turns that are no targets (OpenAI's weight 0). ``template_kwargs``: the template's
    variables for this conversation (TRL's chat_template_kwargs column), given to every rendering.

    Rendering the history with the generation prompt gives where each assistant turn starts; rendering it with the
    turn gives where it ends. Templates that rewrite earlier turns fall back to finding each reply in the text, after
    the turns before it (``_past_history``), so a reply is never taken from inside the prompt that asks for it.
    """
    render = functools.partial(render_chat, tokenizer, tools=tools or None, template_kwargs=template_kwargs)
    full = render(messages)
    if tools and render_chat(tokenizer, messages, template_kwargs=template_kwargs) == full:
        raise BadRow("", "the chat template does not write the row's tools, so the model would learn its tool calls "
                         "without their definitions; use a chat template that renders tools (the model's own, where "
                         "it has one), or leave them out")
    for i, m in enumerate(messages):
        if m.get("tool_calls") and render([*messages[:i], _without_calls(m), *messages[i + 1:]]) == full:
            raise BadRow("", f"message {i}: the chat template does not write its tool_calls, so the turn would train "
                             f"as an empty reply; use a chat template that renders tool calls (the model's own, where "
                             f"it has one), or leave them out")
    segments: list[tuple[str, bool]] = []
    cursor = walked = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < target_from or i in untrained:
            continue
        try:
            before = render(messages[:i], add_generation_prompt=True)  # i == 0: the header alone
            after = render(messages[:i + 1]).rstrip()
        except Exception:  # noqa: BLE001 - a template that refuses a partial conversation (must end with a user)
            before = after = None
        if before is not None and full.startswith(before) and full.startswith(after) and cursor <= len(before):
            start, end = len(before), len(after)
        else:
            start = full.find(m["content"], _past_history(full, messages[walked:i], cursor))
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
        cursor, walked = end, i + 1
    if cursor < len(full):
        segments.append((full[cursor:], False))
    return segments


def _past_history(full: str, history: list[dict], cursor: int) -> int:
    """Where the turns ``history`` end in the rendered ``full``, looking from ``cursor``: each turn's text found in
    order. System turns are passed over (templates move them: Mistral's writes the system prompt into the last user
    turn), and so is a turn the template leaves out. A short reply ("OK", "4") is often in its question too."""
    for message in history:
        content = message.get("content")
        if message["role"] != "system" and isinstance(content, str) and content:
            if (at := full.find(content, cursor)) >= 0:
                cursor = at + len(content)
    return cursor


def encode_example(example: dict, tokenizer, *, prefix: list[int], train_on_prompt: bool,
                   chat_template_format: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one canonical example, before truncation."""
    ids, labels, _, _ = _encode(example, tokenizer, prefix=prefix, train_on_prompt=train_on_prompt,
                                chat_template_format=chat_template_format, keep=None, token_chars=0)
    return ids, labels


def _segments(example: dict, tokenizer, chat_template_format: str) -> list[tuple[str, bool]]:
    """The example's text in (text, is_target) pieces: a chat rendered by its template, or prompt and completion."""
    if example["kind"] != "chat":
        return [(example["prompt"], False), (example["completion"], True)]
    if not tokenizer.chat_template:
        raise BadRow(example["where"], "the tokenizer has no chat template: set chat_template_format "
                                       "(chatml, llama-3, mistral, alpaca, zephyr)")
    template = TEMPLATES.get(chat_template_format)
    try:
        return chat_segments(tokenizer, [template_message(m) for m in example["messages"]], example["target_from"],
                             template.end_of_turn if template else None,
                             json.loads(example["tools"]) if example.get("tools") else None,
                             frozenset(i for i, m in enumerate(example["messages"]) if m.get("weight") == 0),
                             json.loads(example["template_kwargs"]) if example.get("template_kwargs") else None)
    except BadRow as exc:
        raise BadRow(example["where"], f"{exc.problem}; {SKIP_HINT}") from None
    except Exception as exc:  # noqa: BLE001 - jinja raise_exception, e.g. an unsupported role order
        raise BadRow(example["where"], f"the chat template rejects this conversation ({exc}); {SKIP_HINT}") from None


def marked_ids(tokenizer, segments: list[tuple[str, bool]], keep: int | None, token_chars: int
               ) -> tuple[list[int], list[bool], int, bool]:
    """(ids, is_target, length, estimated) of the segments' text tokenised whole, as TRL and generation tokenise
    it: a token is a target where its characters overlap a target segment (TRL's assistant and completion masks).
    Tokenising the pieces apart would differ where a tokenizer marks a text's start: SentencePiece's Llama-2 and
    Mistral give every piece a leading space, so each reply would be trained as " reply". A tokenizer without
    character offsets (a slow one) tokenises them apart. ``keep``, ``length``, ``estimated``: as ``ids_upto``."""
    if not getattr(tokenizer, "is_fast", False):
        ids: list[int] = []
        marks: list[bool] = []
        length = 0
        for text, is_target in segments:
            budget = None if keep is None else max(0, keep - length)
            piece, count, _ = ids_upto(tokenizer, text, budget, token_chars)
            ids, marks, length = ids + piece, marks + [is_target] * len(piece), length + count
        return ids, marks, length, length > len(ids)
    ids, length, found = ids_upto(tokenizer, "".join(text for text, _ in segments), keep, token_chars, spans=True)
    targets, at = [], 0
    for text, is_target in segments:
        if is_target:
            targets.append((at, at + len(text)))
        at += len(text)
    marks, t = [], 0  # one sweep: tokens and targets both run left to right
    for a, b in found:
        while t < len(targets) and targets[t][1] <= a:
            t += 1
        s, e = targets[t] if t < len(targets) else (0, 0)
        marks.append(t < len(targets) and (max(a, s) < min(b, e) or (a == b and s <= a < e)))
    return ids, marks, length, length > len(ids)


def _encode(example: dict, tokenizer, *, prefix: list[int], train_on_prompt: bool, chat_template_format: str,
            keep: int | None, token_chars: int) -> tuple[list[int], list[int], int, bool]:
    """(input_ids, labels, length, estimated): the ids and labels are exact for the first ``keep`` tokens (all
    when None); a text far longer than that is cut before tokenising, and then ``length`` is an estimate."""
    if train_on_prompt and (held := next((i for i, m in enumerate(example["messages"]) if m.get("weight") == 0),
                                         None)) is not None:
        raise BadRow(example["where"], f"message {held} (assistant) has weight 0, but train_on_prompt true trains "
                                       f"every token: set train_on_prompt false, or drop the weight; {SKIP_HINT}")
    ids, marks, length, estimated = marked_ids(tokenizer, _segments(example, tokenizer, chat_template_format),
                                               keep, token_chars)
    eos = tokenizer.eos_token_id
    # EOS ends a prompt-completion row as a target, so the model learns to stop (a cut row's lies past the kept
    # tokens either way); a chat's end-of-turn token is the template's.
    if example["kind"] != "chat" and (not ids or ids[-1] != eos or estimated):
        ids, marks, length = ids + [eos], marks + [True], length + 1
    labels = [token if (is_target or train_on_prompt) else IGNORE for token, is_target in zip(ids, marks)]
    unprefixed = len(ids)
    ids, labels = with_prefix(prefix, ids, labels)
    if labels:
        labels[0] = IGNORE
    return ids, labels, length + len(ids) - unprefixed, estimated


def encode_batch(batch: dict, *, tokenizer, max_seq_len: int, train_on_prompt: bool, chat_template_format: str,
                 token_chars: int | None = None) -> dict:
    """``datasets.map`` function: canonical examples to truncated ids/labels plus per-row statistics.

    A row the template rejects is recorded in ``bad`` (not raised: exceptions do not cross worker processes well).
    ``dropped_estimated`` marks rows whose ``dropped_tokens`` is estimated: a text cut before tokenising (see
    ``ids_upto``; ``token_chars`` is ``max_token_chars(tokenizer)``, found here when not given).
    """
    prefix = special_prefix(tokenizer)
    token_chars = token_chars or max_token_chars(tokenizer)
    out: dict[str, list] = {"input_ids": [], "labels": [], "dropped_tokens": [], "dropped_estimated": [], "bad": []}
    keys = list(batch)
    for values in zip(*(batch[k] for k in keys)):
        example = dict(zip(keys, values))
        try:
            ids, labels, length, estimated = _encode(
                example, tokenizer, prefix=prefix, train_on_prompt=train_on_prompt,
                chat_template_format=chat_template_format, keep=max_seq_len, token_chars=token_chars)
        except BadRow as exc:
            ids, labels, length, estimated = [], [], 0, False
            out["bad"].append(str(exc))
        else:
            out["bad"].append("")
        out["input_ids"].append(ids[:max_seq_len])
        out["labels"].append(labels[:max_seq_len])
        out["dropped_tokens"].append(max(0, length - max_seq_len))
        out["dropped_estimated"].append(estimated)
    return out
