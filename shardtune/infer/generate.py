"""Text generation for ``shardtune generate`` and ``chat``: loading a model or adapter folder (or a GGUF), the
prompt as training encoded it, and ``model.generate`` with its KV cache, streamed through transformers'
``TextStreamer``.

The prompt goes through the model once and fills the cache; every later step feeds only the newest token.
``use_cache=False`` recomputes the whole prefix every step; it exists to check that the cache changes nothing but
the speed, and to measure by how much.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune.data.encode import render_chat, special_prefix, with_prefix
from shardtune.data.templates import END_OF_TURN_TOKENS, reply_end_token
from shardtune.errors import UsageError
from shardtune.gguf_source import find_gguf, parsed_once
from shardtune.gguf_source import load_model as load_gguf_model
from shardtune.gguf_source import load_tokenizer as load_gguf_tokenizer
from shardtune.hub import (
    ADAPTER_ON_ANOTHER_BASE,
    adapter_base,
    adapter_folder_problem,
    adapter_left_out,
    adapter_weights_problem,
    config_context_length,
    has_tokenizer,
    is_adapter_folder,
    loading_refused,
    model_folder_problem,
    pickled_weights_refused,
    tokenizer_problem,
)
from shardtune.train.layout import newest_checkpoint_in


@dataclass
class GenerationStats:
    """What one call to :func:`generate` cost."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""  # "stop_token", "max_new_tokens" or "context_length" (the model's last position)
    stop_token_id: int | None = None
    decode_steps: int = 0  # forwards after the prefill (the first token comes out of the prefill)

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed in forwards (one token each) per second, prefill excluded."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 else float("nan")


# --------------------------------------------------------------------------------------------------------- loading


def weights_source(path: str | Path) -> Path | None:
    """The model folder or GGUF whose weights ``load_for_generation(path)`` loads: an adapter's base, else ``path``
    itself; None where the adapter's config does not tell (loading says what is wrong)."""
    folder = Path(path).expanduser()
    if not is_adapter_folder(folder):
        return folder
    try:
        return adapter_base(folder)
    except UsageError:
        return None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32  # CPU matmuls in bf16 are slow and lose the token-for-token match with training-time fp32


@parsed_once()  # a GGUF's metadata, read by the model and the tokenizer alike
def load_for_generation(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load a local model folder, or a PEFT adapter folder on top of its base, in eval mode: (model, tokenizer)."""
    folder = Path(path).expanduser()
    if gguf := find_gguf(folder):  # a .gguf file, or a folder holding one
        device = torch.device(device) if device is not None else default_device()
        model = load_gguf_model(gguf, dtype=dtype or default_dtype(device))
        return model.to(device).eval(), load_gguf_tokenizer(gguf)
    if not folder.is_dir():
        raise UsageError(f"MODEL_OR_ADAPTER '{path}' is not a folder; give a model folder (with config.json) or a "
                         f"PEFT adapter folder (with adapter_config.json).")
    is_adapter = is_adapter_folder(folder)
    if not is_adapter and not (folder / "config.json").is_file():
        if (folder / "final").is_dir():
            raise UsageError(f"'{path}' is a training run's output_dir: give its final/ ({folder / 'final'})")
        if (folder / "trainer_state.json").is_file():
            raise UsageError(f"'{path}' is a training checkpoint: export it first (shardtune export {path} OUT), "
                             f"then give OUT")
        if newest := newest_checkpoint_in(folder):  # a run still going, or stopped before its final/
            raise UsageError(f"'{path}' holds training checkpoints, not a model: export one first, e.g. the newest "
                             f"(shardtune export {newest} OUT), then give OUT; a run that finished has its model "
                             f"in OUTPUT_DIR/final")
        raise UsageError(f"'{path}' holds neither config.json nor adapter_config.json; give a Transformers model "
                         f"folder or a PEFT adapter folder (e.g. a training run's final/).")
    if is_adapter and (problem := adapter_folder_problem(folder)):
        raise UsageError(problem)
    base = adapter_base(folder) if is_adapter else folder
    name = f"{folder / 'adapter_config.json'}: base model folder '{base}'" if is_adapter else f"'{path}'"
    if problem := model_folder_problem(base, name, trust_remote_code=trust_remote_code,
                                       trust_fix="pass --trust_remote_code") or tokenizer_problem(name, folder, base) \
            or (is_adapter and adapter_weights_problem(folder)):
        raise UsageError(problem)
    device = torch.device(device) if device is not None else default_device()
    with pickled_weights_refused(folder, base), loading_refused(
            f"'{path}'", "the folder is damaged or was altered: save it again, or use a copy you trust",
            ADAPTER_ON_ANOTHER_BASE if is_adapter else ""):
        model, tokenizer = _load(folder, base, is_adapter, dtype or default_dtype(device), trust_remote_code)
    return model.to(device).eval(), tokenizer


def _load(folder: Path, base: Path, is_adapter: bool, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    """The base model (a folder or GGUF), the adapter on it, and the adapter's tokenizer or else the base's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_gguf = find_gguf(base)
    model = load_gguf_model(base_gguf, dtype=dtype) if base_gguf else AutoModelForCausalLM.from_pretrained(
        base, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code)
    # A fine-tune saves its tokenizer (and chat template) next to the adapter; prefer it to the base one.
    tokenizer_dir = folder if has_tokenizer(folder) else base
    tokenizer = load_gguf_tokenizer(base_gguf) if tokenizer_dir is base and base_gguf else \
        AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    if not is_adapter:
        return model, tokenizer
    from peft import PeftModel

    from shardtune.train.model import resize_for_tokenizer

    # The run may have added tokens (a pad, a template's specials) and saved the grown embeddings.
    resize_for_tokenizer(model, len(tokenizer), saved_rows_follow=True)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5; nothing the user can fix
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(model, folder, is_trainable=False, local_files_only=True)
    if problem := adapter_left_out(model, folder):
        raise UsageError(problem)
    return model, tokenizer


# ------------------------------------------------------------------------------------------------------ prompting


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a reply: EOS of the tokenizer, config and generation config, the token the tokenizer's
    chat template ends a reply with (training's last target of each reply, as export lists it in a model folder's
    generation_config), and known end-of-turn tokens (a model whose generation_config lists only the end-of-text
    token would otherwise talk past its own turn)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids.update(vocab[token] for token in (*END_OF_TURN_TOKENS, reply_end_token(tokenizer)) if token in vocab)
    return ids


def encode_prompt(tokenizer: Any, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                  chat_template: bool = True, system: str | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template (with the assistant turn opened) unless told not to.
    ``template_kwargs``: the template's own variables (Qwen3's enable_thinking), as training rows' chat_template_kwargs
    give them: the prompt the rows trained on is rendered with those they were rendered with.

    The template is rendered to text and tokenized without special tokens, then the tokenizer's own prefix (BOS) is
    put in front unless the template wrote it: exactly what the trainer does to a conversation (``data.encode``), so
    the model sees at inference the ids it was trained on, with one BOS, and never an EOS the tokenizer appends.
    """
    if messages is None:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("this tokenizer has no chat template; pass --no-chat-template to feed the prompt as "
                             "plain text, or use a model whose tokenizer_config.json carries one.")
        from jinja2 import TemplateError

        try:
            text = render_chat(tokenizer, list(messages), add_generation_prompt=True, template_kwargs=template_kwargs)
        except TemplateError as exc:  # raise_exception in the template: Gemma's and Mistral's refuse a system turn
            system_first = bool(messages) and messages[0].get("role") == "system"
            fix = ("leave out --system, or put its text into the message" if system_first else
                   "give a conversation of the roles it takes, or pass --no-chat-template for plain text")
            raise UsageError(f"the tokenizer's chat template refuses this conversation ({exc}): {fix}") from None
    else:
        text = "\n".join(m["content"] for m in messages)
    return with_prefix(special_prefix(tokenizer), tokenizer(text, add_special_tokens=False)["input_ids"])[0]


class _Streamer:
    """What ``model.generate`` hands its streamer: the prompt, then each new token. It times the prefill (until the
    first new token) and the decoding, keeps the stop token out of the text, and passes text on through
    transformers' ``TextStreamer``, which holds back a piece until it cannot change (an incomplete character, a
    word still growing)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None] | None, stops: Collection[int]) -> None:
        from transformers import TextStreamer

        self.stops = stops
        self.text = None
        if write is not None:
            self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
            self.text.on_finalized_text = lambda piece, stream_end=False: piece and write(piece)
        self.started = time.perf_counter()
        self.prompt_seen = False
        self.marks: list[float] = []  # when each new token arrived

    def put(self, value: torch.Tensor) -> None:
        if self.text is not None and (not self.prompt_seen or int(value.reshape(-1)[-1]) not in self.stops):
            self.text.put(value)
        if self.prompt_seen:
            self.marks.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        if self.text is not None:
            self.text.end()

    def timings(self) -> tuple[float, float]:
        """(prefill seconds, decode seconds): until the first new token, and from it to the last."""
        if not self.marks:
            return 0.0, 0.0
        return self.marks[0] - self.started, self.marks[-1] - self.marks[0]


def generation_config(tokenizer: Any, *, max_new_tokens: int, temperature: float, top_p: float,
                      stops: Collection[int], use_cache: bool, top_k: int = 0, repetition_penalty: float = 1.0):
    """Exactly what ``generate`` asks for, nothing the model's own generation_config.json adds (a default
    temperature, top_k or repetition penalty would change what ``--temperature 0`` means; ``_own_defaults_only``)."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k or None} \
        if temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    stop_list = sorted(stops)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_list or [0])[0]
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=stop_list or None,
                            pad_token_id=pad, use_cache=use_cache, repetition_penalty=repetition_penalty, **sampling)


@contextmanager
def _own_defaults_only(model: Any) -> Iterator[None]:
    """transformers fills what a passed GenerationConfig leaves at its default from the model's own
    generation_config.json (a repetition penalty of 1.0 is taken as unset): for the call, the model's is plain."""
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int = 0,
                   repetition_penalty: float = 1.0) -> None:
    """The sampling settings, refused in one line when no generation could use them (NaN included)."""
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be at least 1 (got {max_new_tokens}).")
    if not temperature >= 0 or math.isinf(temperature):
        raise UsageError(f"temperature must be a number >= 0 (got {temperature:g}); use 0 for greedy decoding.")
    if not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1] (got {top_p:g}); 1 keeps every token.")
    if top_k < 0:
        raise UsageError(f"top_k must be 0 or more (got {top_k}); 0 keeps every token.")
    if not 0 < repetition_penalty < math.inf:
        raise UsageError(f"repetition_penalty must be a number above 0 (got {repetition_penalty:g}); 1 changes "
                         f"nothing, above 1 makes tokens already in the text less likely.")
    # greedy decoding takes the likeliest token: a nucleus or a top-k cut would change nothing
    for name, value, neutral in (("top_p", top_p, 1), ("top_k", top_k, 0)):
        if temperature == 0 and value != neutral:
            raise UsageError(f"{name} {value:g} acts only when sampling, and temperature 0 decodes greedily: set "
                             f"temperature above 0 (e.g. 0.7) to sample, or leave {name} at {neutral}.")


def _check_options(prompt_ids: Sequence[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                   repetition_penalty: float) -> None:
    check_sampling(max_new_tokens, temperature, top_p, top_k, repetition_penalty)
    if not prompt_ids:
        raise UsageError("the prompt is empty after tokenization; give some text.")


def check_device(name: str | None) -> torch.device:
    """``--device`` as a torch device this machine has (default: CUDA where there is one), or a UsageError."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device; give cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu: each says if it has a device
    count = backend.device_count() if backend and hasattr(backend, "device_count") and backend.is_available() else 0
    if (device.index or 0) >= count:
        kind = device.type.upper() if device.type == "cuda" else device.type
        raise UsageError(f"--device {name}: this machine has {count or 'no'} {kind} device{'' if count == 1 else 's'} "
                         f"torch can use; give cpu{f', or {device.type}:0' if count else ''}")
    return device


MAX_NEW_TOKENS = 128  # generate()'s default, which a chat's room for a reply follows too


@torch.inference_mode()
def generate(model: Any, tokenizer: Any, prompt_ids: Sequence[int], *, max_new_tokens: int = MAX_NEW_TOKENS,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
             seed: int | None = None, use_cache: bool = True,
             stream: Callable[[str], None] | None = None, stop_ids: Collection[int] | None = None,
             stats: GenerationStats | None = None) -> list[int]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with ``model.generate``; returns the new ids, without
    the stop token.

    Greedy when ``temperature`` is 0, else temperature plus top-p (and top-k, when above 0) sampling, drawn from
    torch's generator seeded with ``seed`` (the caller's random state is left as it was); ``repetition_penalty``
    (Transformers' CTRL-style penalty: a token already in the text has its logit divided by it where positive,
    multiplied where negative) applies to both. ``stream`` receives the text as it is decoded.
    ``stop_ids`` defaults to :func:`stop_token_ids`; pass an empty set to always run to ``max_new_tokens``.
    ``use_cache=False`` recomputes the whole prefix at every step (the cache must change nothing but the speed).
    ``stats``, if given, is filled with timings.
    """
    _check_options(prompt_ids, max_new_tokens, temperature, top_p, top_k, repetition_penalty)
    room = _room(model, prompt_ids, max_new_tokens, "the prompt")
    stops = stop_token_ids(model, tokenizer) if stop_ids is None else set(stop_ids)
    config = generation_config(tokenizer, max_new_tokens=room, temperature=temperature, top_p=top_p,
                               stops=stops, use_cache=use_cache, top_k=top_k, repetition_penalty=repetition_penalty)
    streamer = _Streamer(tokenizer, stream, stops)
    [produced] = _decode(model, [prompt_ids], config, seed=seed, streamer=streamer)
    stats = _ended(produced, stops, len(prompt_ids), room < max_new_tokens, stats)
    stats.prefill_s, stats.decode_s = streamer.timings()
    return produced[:stats.new_tokens]


@torch.inference_mode()
def generate_batch(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, batch_size: int = 8,
                   max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, repetition_penalty: float = 1.0, seed: int | None = None, use_cache: bool = True,
                   stop_ids: Collection[int] | None = None,
                   names: Sequence[str] | None = None) -> list[tuple[list[int], GenerationStats]]:
    """:func:`generate` for many prompts, ``batch_size`` at a time, left-padded (the pads masked out, positions
    counted from each row's first token): each prompt's new ids and stats, in the order given. Greedy, each reply
    is the one :func:`generate` gives its prompt alone (in float32; in bf16 a padded batch rounds slightly
    otherwise, and a near tie may go the other way). Sampling draws each batch from ``seed``, so with
    ``batch_size`` 1 each reply is the one :func:`generate` samples alone; in a larger batch the rows share the draws.
    Prompts are batched longest first (the least padding); one too close to the model's last position for
    ``max_new_tokens`` goes alone, so that it stops there as it would alone. ``names``: what a refusal calls each
    prompt (default: prompt 1, prompt 2 ...)."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1 (got {batch_size}).")
    if not prompts:
        raise UsageError("no prompts to generate for; give at least one.")
    for prompt_ids in prompts:
        _check_options(prompt_ids, max_new_tokens, temperature, top_p, top_k, repetition_penalty)
    names = names or [f"prompt {number}" for number in range(1, len(prompts) + 1)]
    rooms = [_room(model, ids, max_new_tokens, name) for name, ids in zip(names, prompts)]
    stops = stop_token_ids(model, tokenizer) if stop_ids is None else set(stop_ids)
    longest_first = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    full_room = [i for i in longest_first if rooms[i] == max_new_tokens]
    batches = [[i] for i in longest_first if rooms[i] < max_new_tokens] + \
        [full_room[at:at + batch_size] for at in range(0, len(full_room), batch_size)]
    results: dict[int, tuple[list[int], GenerationStats]] = {}
    for batch in batches:
        config = generation_config(tokenizer, max_new_tokens=rooms[batch[0]], temperature=temperature, top_p=top_p,
                                   stops=stops, use_cache=use_cache, top_k=top_k,
                                   repetition_penalty=repetition_penalty)
        for i, produced in zip(batch, _decode(model, [prompts[i] for i in batch], config, seed=seed)):
            stats = _ended(produced, stops, len(prompts[i]), rooms[i] < max_new_tokens)
            results[i] = produced[:stats.new_tokens], stats
    return [results[i] for i in range(len(prompts))]


def _room(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, what: str) -> int:
    """How many tokens may follow ``prompt_ids``: ``max_new_tokens``, or fewer where the model's positions end
    (beyond them its output is garbage); a prompt that leaves none is refused."""
    if covered := model_context(model):
        _refuse_beyond(len(prompt_ids), covered, what)
        return min(max_new_tokens, covered[0] - len(prompt_ids))
    return max_new_tokens


def _decode(model: Any, rows: Sequence[Sequence[int]], config: Any, *, seed: int | None,
            streamer: Any = None) -> list[list[int]]:
    """``model.generate`` on ``rows`` left-padded to one width, each row's pads masked out (transformers counts its
    positions from its first token): the ids each row produced, a finished row's padding included. Sampling
    draws from torch's generator seeded with ``seed``, the caller's random state left as it was."""
    device = _model_device(model)
    width = max(len(row) for row in rows)
    pads = [width - len(row) for row in rows]
    input_ids = torch.tensor([[config.pad_token_id] * pad + list(row) for pad, row in zip(pads, rows)], device=device)
    mask = torch.tensor([[0] * pad + [1] * len(row) for pad, row in zip(pads, rows)], device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=config.do_sample), _own_defaults_only(model):
        if config.do_sample:
            torch.manual_seed(seed if seed is not None else int(torch.seed()))
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=streamer)
    return out[:, width:].tolist()


def _ended(produced: list[int], stops: Collection[int], prompt_tokens: int, at_context_end: bool,
           stats: GenerationStats | None = None) -> GenerationStats:
    """``stats`` filled for a reply that produced ``produced``: it ends at its first stop token (a batch pads a
    finished row after it), else ran to its room (``at_context_end``: the model's last position)."""
    stats = stats if stats is not None else GenerationStats()
    end = next((at for at, token_id in enumerate(produced) if token_id in stops), None)
    stats.prompt_tokens, stats.new_tokens = prompt_tokens, len(produced) if end is None else end
    stats.stop_reason = "stop_token" if end is not None else "context_length" if at_context_end else \
        "max_new_tokens"
    stats.stop_token_id = produced[end] if end is not None else None
    forwards = len(produced) if end is None else end + 1
    stats.decode_steps = max(forwards - 1, 0)  # the first token comes out of the prefill
    return stats


def _refuse_beyond(prompt_tokens: int, covered: tuple[int, str], what: str = "the prompt") -> None:
    """A prompt that leaves the model no position to generate at, refused in one line."""
    length, where = covered
    if prompt_tokens >= length:
        raise UsageError(f"{what} is {prompt_tokens} tokens, and the model covers {length} positions ({where}): "
                         f"shorten it")


def model_context(model: Any) -> tuple[int, str] | None:
    """(the positions a loaded model covers, where that was read), or None where its config says none."""
    config = getattr(model, "config", None)
    return config_context_length(config.to_dict(), "its config") if hasattr(config, "to_dict") else None


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


@dataclass
class ChatSession:
    """A conversation kept across turns; each turn re-encodes it through the chat template."""

    model: Any
    tokenizer: Any
    system: str | None = None
    options: dict = field(default_factory=dict)  # generate() keywords: max_new_tokens, temperature, top_p, seed ...
    template_kwargs: dict | None = None  # the chat template's own variables (chat_template_kwargs)
    messages: list[dict] = field(default_factory=list)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def __post_init__(self) -> None:
        self.reset()

    def reply(self, user_text: str, stream: Callable[[str], None] | None = None,
              note: Callable[[str], None] | None = None) -> str:
        """Add the user's message, generate the assistant's answer, keep both, and return the answer. Where the
        conversation no longer fits the model's positions (with room for a reply), its earliest turns are dropped,
        the system message kept, and ``note`` told; a message that cannot fit alone is refused and not kept."""
        messages = [*self.messages, {"role": "user", "content": user_text}]
        prompt_ids = encode_prompt(self.tokenizer, messages=messages, template_kwargs=self.template_kwargs)
        covered, dropped = model_context(self.model), 0
        if covered:
            length, first = covered[0], 1 if self.system else 0
            room = min(self.options.get("max_new_tokens", MAX_NEW_TOKENS), length // 4)
            while len(prompt_ids) > length - room and len(messages) - first > 1:
                del messages[first:first + 2]  # the earliest user turn and its reply
                dropped += 2
                prompt_ids = encode_prompt(self.tokenizer, messages=messages, template_kwargs=self.template_kwargs)
            _refuse_beyond(len(prompt_ids), covered)  # the message alone: nothing is dropped, nothing kept
        if dropped and note:
            note(f"the conversation went beyond the model's {covered[0]} positions: its earliest {dropped} turns "
                 f"are left out from here")
        new_ids = generate(self.model, self.tokenizer, prompt_ids, stream=stream, **self.options)
        self.messages = messages
        answer = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": answer})
        return answer
