"""``shardtune generate`` and ``shardtune chat``: talk to a model folder or a fine-tuned adapter, with the KV cache."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from shardtune.errors import UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_OR_ADAPTER",
                   help="a local Transformers model folder, or a PEFT adapter folder (e.g. OUTPUT_DIR/final)")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=256, metavar="N",
                   help="most tokens to generate per reply (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 is greedy; above 0 samples (default: 0)")
    p.add_argument("--top_p", "--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling (with --temperature above 0): keep the most likely tokens up to this "
                        "probability mass (default: 1)")
    p.add_argument("--top_k", "--top-k", type=int, default=0, metavar="K",
                   help="top-k sampling (with --temperature above 0): keep the K most likely tokens; 0 keeps all "
                        "(default: 0)")
    p.add_argument("--repetition_penalty", "--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="above 1 makes tokens already in the prompt or the reply less likely, greedy or sampled "
                        "(Transformers' repetition_penalty; default: 1, none)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the sampling generator (with --temperature above 0; default: 0)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message put before the conversation")
    p.add_argument("--chat_template_kwargs", "--chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's own variables as a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(Qwen3): give those the training rows' chat_template_kwargs gave, so the prompt is the one "
                        "the run trained on")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="recompute the whole prefix every token instead of using the KV cache (slow; for checks)")
    p.add_argument("--dtype", default="auto", help=f"{' | '.join(DTYPES)} (default: bf16 on a GPU, else float32)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                   help="run Python code shipped in the model folder (only for folders you trust)")


# Transformers' generate() settings (and a training recipe's model key) that these commands spell otherwise or do
# not offer: what to give instead. Any other GenerationConfig field gets the list of what is offered.
TRANSFORMERS_OPTIONS = {
    "do_sample": "--temperature above 0 samples (0 decodes greedily): leave out --do_sample, and give "
                 "--temperature 1.0 for Transformers' sampling default",
    "num_beams": "beam search is not offered: --temperature 0 decodes greedily (num_beams 1), above 0 samples",
    "max_length": "give --max_new_tokens N, the reply's length (max_length counts the prompt too)",
    "num_return_sequences": "one reply per call: run it again with another --seed (with --temperature above 0)",
    "use_cache": "the KV cache is on; --no-cache turns it off",
    "model_name_or_path": "the model is the first argument: 'shardtune {command} MODEL_OR_ADAPTER' (a model folder, "
                          "a run's final/ or a .gguf)",
}
OFFERED = "--max_new_tokens, --temperature, --top_p, --top_k, --repetition_penalty and --seed"


def _transformers_option(name: str, command: str) -> str | None:
    """What to give instead of Transformers' generate() setting ``name``; None for a name that is none of them."""
    key = name.replace("-", "_")
    key = "model_name_or_path" if key == "model" else key
    if key in TRANSFORMERS_OPTIONS:
        return TRANSFORMERS_OPTIONS[key].format(command=command)
    from transformers import GenerationConfig

    if key in GenerationConfig().to_dict():
        return f"Transformers' generate() setting {key} is not offered; shardtune {command} takes {OFFERED}"
    return None


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a reply to a prompt, streamed as it is decoded, or to each "
                                        "prompt of a file, batched",
                       description="Generate a reply to --prompt (streamed), or to each prompt of --prompt_file "
                                   "(batched, one JSON line a reply), with a model folder or a PEFT adapter folder, "
                                   "through the tokenizer's chat template, using the KV cache.")
    _add_common(g)
    prompts = g.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="the user's message (plain text with --no-chat-template)")
    prompts.add_argument("--prompt_file", "--prompt-file", metavar="FILE",
                         help="many prompts, batched: a text file of one prompt a line, or a .jsonl file of "
                              "{\"prompt\": TEXT or [...]} or {\"messages\": [...]} rows (a last assistant turn, the "
                              "reference reply, is left out); one JSON line a reply comes out, in the file's order")
    g.add_argument("--batch_size", "--batch-size", type=int, default=None, metavar="N",
                   help="with --prompt_file: prompts generated together, left-padded (default: 8); greedy replies "
                        "are those each prompt gets alone")
    template = g.add_mutually_exclusive_group()
    template.add_argument("--no-chat-template", dest="chat_template", action="store_false", default=None,
                          help="feed the prompt as plain text instead of through the chat template")
    template.add_argument("--chat-template", dest="chat_template", action="store_true", default=None,
                          help="feed it through the chat template (the default, except for a run's final/ "
                               "trained on plain prompts: prompt/completion or text rows)")
    g.set_defaults(func=main_generate)
    g.placed_elsewhere = lambda name: _transformers_option(name, "generate")
    c = sub.add_parser("chat", help="chat with a model in the terminal (/reset, /exit)",
                       description="An interactive conversation: type a message, the reply streams back. "
                                   "Ctrl-C stops a reply, /reset starts over, /exit or end of input (Ctrl-D) "
                                   "quits.")
    _add_common(c)
    c.set_defaults(func=main_chat)
    c.placed_elsewhere = lambda name: _transformers_option(name, "chat")


def _load(args: argparse.Namespace):
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per run is noise before a chat

    from shardtune.bitsandbytes_use import model_needs_bitsandbytes
    from shardtune.cli.common import leave_out_bitsandbytes_unless, say_base_unquantised
    from shardtune.errors import check_choice
    from shardtune.infer.generate import check_device, check_sampling, load_for_generation, weights_source

    # before the model loads, and before a chat
    check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty)
    if args.seed is not None and args.temperature == 0:  # greedy decoding draws nothing to seed
        raise UsageError(f"--seed {args.seed} acts only when sampling, and temperature 0 decodes greedily: set "
                         f"--temperature above 0 (e.g. 0.7) to sample, or leave --seed out.")
    device = check_device(args.device)
    leave_out_bitsandbytes_unless(lambda: model_needs_bitsandbytes(weights_source(args.model)))
    dtype_name = check_choice(args.dtype, DTYPES, "--dtype")
    dtype = None if dtype_name == "auto" else getattr(torch, dtype_name)
    loaded = load_for_generation(args.model, dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    say_base_unquantised(args.model, f"{args.command} runs it on its base model unquantised")
    return loaded


def template_kwargs(text: str | None, what: str) -> dict | None:
    """A JSON object of the chat template's variables (``text``, or an object already), refused in one line naming
    ``what`` where it is no object or names an argument of apply_chat_template itself."""
    import json

    from shardtune.data.formats import TEMPLATE_OWN

    if text is None:
        return None
    try:
        kwargs = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not JSON ({exc.msg}); give an object, e.g. '{{\"enable_thinking\": false}}'") \
            from None
    if not isinstance(kwargs, dict):
        raise UsageError(f"{what} is not a JSON object; give the template's variables as one, e.g. "
                         f"'{{\"enable_thinking\": false}}'")
    if own := [key for key in kwargs if key in TEMPLATE_OWN]:
        raise UsageError(f"{what} names {', '.join(own)}, which the template call sets itself; give only the "
                         f"template's own variables")
    return kwargs


def _options(args: argparse.Namespace) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "repetition_penalty": args.repetition_penalty,
            "seed": 0 if args.seed is None else args.seed, "use_cache": args.use_cache}


def _write(out: TextIO, first: str = ""):
    """A stream of text pieces to ``out``, flushed as they come; ``first`` written ahead of the first piece."""
    ahead = [first]

    def stream(piece: str) -> None:
        out.write(ahead.pop() + piece if ahead else piece)
        out.flush()

    return stream


def main_generate(args: argparse.Namespace) -> int:
    from shardtune.infer.generate import GenerationStats, encode_prompt, generate, model_context
    from shardtune.train.layout import trained_prompt_style

    if args.batch_size is not None and args.prompt_file is None:
        raise UsageError(f"--batch_size {args.batch_size} acts only with --prompt_file: leave it out, or give the "
                         f"prompts as a file")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch_size must be at least 1 (got {args.batch_size}); 1 generates one prompt at a time")
    kwargs = template_kwargs(args.chat_template_kwargs, f"--chat_template_kwargs {args.chat_template_kwargs}")
    rows = read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    model, tokenizer = _load(args)
    chat_template = args.chat_template
    if chat_template is None:  # as the run fed its prompts, where MODEL is a run's final/ that says
        chat_template = trained_prompt_style(args.model) != "plain text"
        if not chat_template:
            print("[the run trained on plain prompts (prompt/completion or text rows): the prompt goes in as plain "
                  "text; --chat-template puts it through the chat template]", file=sys.stderr)
    if kwargs and not chat_template:
        raise UsageError(f"--chat_template_kwargs {args.chat_template_kwargs} acts only through the chat template, "
                         f"and the prompt goes in as plain text: leave it out, or pass --chat-template")
    if rows is not None:
        return _generate_file(args, model, tokenizer, rows, chat_template, kwargs)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat_template=chat_template, system=args.system,
                               template_kwargs=kwargs)
    stats = GenerationStats()
    generate(model, tokenizer, prompt_ids, stream=_write(sys.stdout), stats=stats, **_options(args))
    sys.stdout.write("\n")
    speed = f" at {stats.tokens_per_s:.1f} tokens/s" if stats.decode_steps else ""  # none decoded: no speed
    # which stop token: the template's end of turn (<|im_end|>) and EOS (<|end_of_text|>) tell different stories
    stopped = f"at {tokenizer.convert_ids_to_tokens(stats.stop_token_id)}" if stats.stop_token_id is not None \
        else f"by {stats.stop_reason}"
    if stats.stop_reason == "context_length" and (covered := model_context(model)):
        stopped = f"at the model's last position ({covered[0]} positions, {covered[1]})"
    new = f"{stats.new_tokens} new token{'' if stats.new_tokens == 1 else 's'}"
    print(f"[{stats.prompt_tokens} prompt tokens, prefill {stats.prefill_s * 1e3:.0f} ms; {new}{speed}; stopped "
          f"{stopped}; KV cache {'on' if args.use_cache else 'off'}]", file=sys.stderr)
    return 0


Prompt = tuple[int, str | list[dict], dict | None]  # a line's number, its prompt, its chat_template_kwargs


def read_prompt_file(path: str) -> list[Prompt]:
    """``--prompt_file``'s prompts with their line numbers: a line's text, or a .jsonl row's ``prompt`` text or
    ``messages`` (without a last assistant turn) and its ``chat_template_kwargs``; blank lines are skipped, and a
    bad line is refused naming it."""
    import json
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"--prompt_file {path}: {'a folder' if file.is_dir() else 'no such file'}; give a text file "
                         f"of one prompt a line, or a .jsonl file of prompt or messages rows")
    try:
        lines = file.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompt_file {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"--prompt_file {path}: holds no prompt; give one a line")
    if file.suffix.lower() != ".jsonl":
        return [(number, line, None) for number, line in numbered]
    prompts: list[Prompt] = []
    fix = ("give each line as {\"prompt\": TEXT} or {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} (a "
           "conversation as 'prompt' too, as TRL's prompt-only rows)")
    for number, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--prompt_file {path}:{number}: not JSON ({exc.msg}); {fix}") from None
        if not isinstance(row, dict):
            raise UsageError(f"--prompt_file {path}:{number}: not a JSON object; {fix}")
        kwargs = template_kwargs(row.get("chat_template_kwargs"), f"--prompt_file {path}:{number}: its "
                                 f"chat_template_kwargs")
        # a chat's messages, or TRL's prompt: a text, or a conversation (its prompt-only and conversational rows)
        prompt = row["messages"] if "messages" in row else row.get("prompt")
        if isinstance(prompt, str) and "messages" not in row:
            prompts.append((number, prompt, kwargs))
            continue
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                       and isinstance(m.get("content"), str) for m in prompt):
            prompt = prompt[:-1] if prompt[-1]["role"] == "assistant" else prompt
            if prompt:
                prompts.append((number, [{"role": m["role"], "content": m["content"]} for m in prompt], kwargs))
                continue
        raise UsageError(f"--prompt_file {path}:{number}: neither a 'prompt' text nor 'messages' (or a 'prompt') "
                         f"of role and content texts ending in a turn to answer; {fix}")
    return prompts


def _generate_file(args: argparse.Namespace, model, tokenizer, rows: list[Prompt], chat_template: bool,
                   kwargs: dict | None) -> int:
    """``--prompt_file``: each prompt's reply as one JSON line on stdout, in the file's order."""
    import json
    import time

    from shardtune.infer.generate import encode_prompt, generate_batch

    def encoded(row: str | list[dict], own: dict | None) -> list[int]:
        variables = {**(kwargs or {}), **(own or {})} or None  # a row's own, over --chat_template_kwargs
        if isinstance(row, str):
            return encode_prompt(tokenizer, row, chat_template=chat_template, system=args.system,
                                 template_kwargs=variables)
        system = [{"role": "system", "content": args.system}] if args.system and row[0]["role"] != "system" else []
        return encode_prompt(tokenizer, messages=system + row, chat_template=chat_template, template_kwargs=variables)

    prompts = [encoded(row, own) for _, row, own in rows]
    started = time.perf_counter()
    replies = generate_batch(model, tokenizer, prompts, batch_size=args.batch_size or 8,
                             names=[f"--prompt_file {args.prompt_file}:{number}: its prompt" for number, *_ in rows],
                             **_options(args))
    for (_, row, _), (new_ids, stats) in zip(rows, replies):
        stopped = tokenizer.convert_ids_to_tokens(stats.stop_token_id) if stats.stop_token_id is not None \
            else stats.stop_reason
        print(json.dumps({"prompt": row, "reply": tokenizer.decode(new_ids, skip_special_tokens=True),
                          "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens, "stopped": stopped},
                         ensure_ascii=False), flush=True)
    new = sum(stats.new_tokens for _, stats in replies)
    print(f"[{len(rows)} prompt{'' if len(rows) == 1 else 's'} in batches of up to {args.batch_size or 8}; {new} new "
          f"tokens in {time.perf_counter() - started:.1f} s; KV cache {'on' if args.use_cache else 'off'}]",
          file=sys.stderr)
    return 0


def run_chat(session, lines: TextIO, out: TextIO, prompt: str = "you> ") -> None:
    """Read user turns from ``lines`` until /exit or end of input, streaming each reply to ``out``."""
    interactive = lines.isatty()
    while True:
        if interactive:
            try:
                line = input(prompt) + "\n"  # input() gives line editing and history where readline exists
            except EOFError:  # Ctrl-D
                out.write("\n")
                return
        else:
            line = lines.readline()  # a script piped in: no prompts echoed between its lines
            if not line:
                return
        text = line.strip()
        if text == "/exit":
            return
        if text == "/reset":
            session.reset()
            out.write("[conversation reset]\n")
            continue
        if not text:
            continue
        if text.startswith("/"):
            out.write(f"[unknown command {text.split()[0]}: use /reset or /exit]\n")
            continue
        stream = _write(out, first="assistant> ")  # written with the reply's first piece, after any note
        try:
            session.reply(text, stream=stream, note=lambda note: out.write(f"[{note}]\n"))
        except UsageError as exc:  # a message the model cannot take: said, and the chat goes on without it
            out.write(f"[{exc}]\n")
            continue
        except KeyboardInterrupt:  # Ctrl-C stops a reply, not the conversation (Ctrl-C at the prompt quits)
            out.write("\n[reply stopped; the message and its reply are left out of the conversation]\n")
            continue
        stream("")
        out.write("\n")


def main_chat(args: argparse.Namespace) -> int:
    from shardtune.infer.generate import ChatSession, encode_prompt
    from shardtune.train.layout import trained_prompt_style

    kwargs = template_kwargs(args.chat_template_kwargs, f"--chat_template_kwargs {args.chat_template_kwargs}")
    model, tokenizer = _load(args)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer of '{args.model}' has no chat template, so chat cannot tell the turns apart; "
                         f"use 'shardtune generate --no-chat-template' for plain-text continuation.")
    if args.system:  # a template that takes no system turn refuses it here, not at every message
        encode_prompt(tokenizer, "", system=args.system, template_kwargs=kwargs)
    if trained_prompt_style(args.model) == "plain text":
        print("[the run trained on plain prompts (prompt/completion or text rows), and chat puts every turn through "
              "the chat template, a format it did not train on; 'shardtune generate' feeds a prompt as plain text]",
              file=sys.stderr)
    session = ChatSession(model, tokenizer, system=args.system, options=_options(args), template_kwargs=kwargs)
    print("Chat with the model: Ctrl-C stops a reply, /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    run_chat(session, sys.stdin, sys.stdout)
    return 0
