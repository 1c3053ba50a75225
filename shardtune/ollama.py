"""An Ollama ``Modelfile`` beside an exported GGUF: ``ollama create NAME -f Modelfile && ollama run NAME``.

Ollama writes prompts with Go templates, not the Jinja chat template the model was trained with, and Jinja cannot
be translated in general. The chat formats fine-tunes use are few, though: the template is recognised by its
markers and the matching Go template written (ChatML, Llama 3, Llama 2 / Mistral [INST], Zephyr). A template of
none of them, or none at all, gets ChatML, and the Modelfile says so in a comment. A default system prompt the
Jinja template writes (SmolLM2's, Qwen2.5's) becomes ``SYSTEM``; the format's end-of-turn markers become ``stop``.
A run that trained on plain prompts (prompt/completion or text rows, no chat template) gets ``PLAIN``: the prompt as
it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from shardtune.files import digest_holds, with_digest, write_text


@dataclass(frozen=True)
class ChatFormat:
    name: str
    markers: tuple[str, ...]  # strings only this format's Jinja templates hold (any one of them)
    go_template: str
    stops: tuple[str, ...]
    system_pattern: str  # a default system prompt the Jinja template writes as literal text


# Each template writes every message once: Ollama hands a template the system prompt twice, as .System and as the
# first of .Messages (the Modelfile's SYSTEM too, when the conversation has none), so the system turn is written from
# .Messages only. Rendered through Go's text/template the way Ollama calls it, each equals the Jinja template it
# stands for on the same conversation (tests/test_ollama_template.py).
CHATML = ChatFormat(
    "chatml", ("<|im_start|>",),
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
    ("<|im_start|>", "<|im_end|>"), r"<\|im_start\|>system\n([^{}'\"<]+?)<\|im_end\|>")
LLAMA3 = ChatFormat(
    "llama3", ("<|start_header_id|>",),
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    r"<\|start_header_id\|>system<\|end_header_id\|>\n\n([^{}'\"<]+?)<\|eot_id\|>")
# Mistral's [INST] format: a system message opens the first [INST] block and the user's turn follows inside it.
INST = ChatFormat(
    "inst", ("[INST]",),
    "{{- $previous := \"\" }}{{- range .Messages }}"
    "{{ if eq .Role \"system\" }}[INST] {{ .Content }}\n\n"
    "{{ else if eq .Role \"user\" }}{{ if ne $previous \"system\" }}[INST] {{ end }}{{ .Content }} [/INST]"
    "{{ else if eq .Role \"assistant\" }} {{ .Content }}</s>{{ end }}{{ $previous = .Role }}{{ end }}",
    ("[INST]", "[/INST]", "</s>"), r"<<SYS>>\n([^{}'\"<]+?)\n<</SYS>>")
ZEPHYR = ChatFormat(
    "zephyr", ("<|user|>", "'<|' + message['role'] + '|>"),
    "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}</s>\n{{ end }}<|assistant|>\n",
    ("<|system|>", "<|user|>", "<|assistant|>", "</s>"), r"<\|system\|>\n([^{}'\"<]+?)</s>")
FORMATS = (CHATML, LLAMA3, INST, ZEPHYR)
# Ollama hands a template that does not range over .Messages the last user message as .Prompt: a run trained on
# plain prompts is asked as it trained, the prompt's text alone, and stops at its EOS.
PLAIN = ChatFormat("plain", (), "{{ .Prompt }}", (), "")
SIGNATURE = "(written by shardtune export)"
# The mark of a Modelfile shardtune wrote: this exact first line, and a last line holding the SHA-256 of every line
# above it. --overwrite replaces only a Modelfile with both, and the digest matching: one the user edited (a SYSTEM
# or PARAMETER changed, the first line kept) is the user's, as an edited file of an HF export is (there by its size
# and modification time, recorded in the folder's export list; a GGUF's OUT may be a file in any folder, which has
# no list of shardtune's, so the Modelfile carries its own record).
FIRST_LINE = f"# Ollama: ollama create NAME -f Modelfile && ollama run NAME   {SIGNATURE}"
MAX_BYTES = 1 << 20  # far more than any Modelfile shardtune writes; a larger file is not one


def chat_format(chat_template: str | None) -> tuple[ChatFormat, bool]:
    """(the format of ``chat_template``, whether it was recognised); ChatML when it was not."""
    for fmt in FORMATS:
        if chat_template and any(marker in chat_template for marker in fmt.markers):
            return fmt, True
    return CHATML, False


def _quoted(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile_text(gguf_name: str, chat_template: str | None, eos_token: str | None, *,
                   plain_text: bool = False) -> str:
    """The Modelfile for the GGUF file ``gguf_name`` in the same folder; ``plain_text``: the model trained on plain
    prompts, not through ``chat_template``."""
    fmt, known = (PLAIN, True) if plain_text else chat_format(chat_template)
    lines = [FIRST_LINE, f"FROM ./{gguf_name}"]
    if plain_text:
        lines.append("# The run trained on plain prompts (prompt/completion or text rows), not the chat template: "
                     "TEMPLATE passes the prompt as it is; write it as the training rows' prompts were written.")
    elif not known:
        lines.append("# The model's chat template is none of ChatML, Llama 3, [INST] or Zephyr"
                     + ("" if chat_template else " (it has none)") + ": ChatML is assumed; edit TEMPLATE to match.")
    lines.append(f"TEMPLATE {_quoted(fmt.go_template)}")
    # a Jinja string literal may spell a newline as the escape \n (Qwen2.5's does): read it as the newline it writes
    if known and fmt.system_pattern and \
            (system := re.search(fmt.system_pattern, (chat_template or "").replace("\\n", "\n"))):
        lines.append(f"SYSTEM {_quoted(system.group(1).strip())}")
    stops = list(fmt.stops) + ([eos_token] if eos_token and eos_token not in fmt.stops else [])
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return with_digest("\n".join(lines) + "\n")


def modelfile_written_by_shardtune(path: str | Path) -> bool:
    """Whether ``path`` is a Modelfile shardtune wrote and nobody edited since: its first line is exactly
    ``FIRST_LINE`` and its last line the SHA-256 of the lines above it. The words 'written by shardtune' elsewhere
    in a user's Modelfile (a comment, a SYSTEM prompt) do not make it shardtune's."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return False
    if len(data) > MAX_BYTES or not data.endswith(b"\n"):
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return text.startswith(FIRST_LINE + "\n") and bool(digest_holds(data))


def write_modelfile(gguf_path: Path, chat_template: str | None, eos_token: str | None, *,
                    plain_text: bool = False) -> Path:
    """``Modelfile`` beside ``gguf_path`` (written under a temporary name, then renamed)."""
    return write_text(gguf_path.parent / "Modelfile",
                      modelfile_text(gguf_path.name, chat_template, eos_token, plain_text=plain_text))
