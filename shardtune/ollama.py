"""An Ollama ``Modelfile`` beside an exported GGUF: ``ollama create NAME -f Modelfile && ollama run NAME``.

Ollama writes prompts with Go templates, not the Jinja chat template the model was trained with, and Jinja cannot
be translated in general. The chat formats fine-tunes use are few, though: the template is recognised by its
markers and the matching Go template written (ChatML, Llama 3, Llama 2 / Mistral [INST], Zephyr). A template of
none of them, or none at all, gets ChatML, and the Modelfile says so in a comment. A default system prompt the
Jinja template writes (SmolLM2's) becomes ``SYSTEM``; the format's end-of-turn markers become ``stop``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatFormat:
    name: str
    marker: str  # a string only this format's Jinja template holds
    go_template: str
    stops: tuple[str, ...]
    system_pattern: str  # a default system prompt the Jinja template writes as literal text


CHATML = ChatFormat(
    "chatml", "<|im_start|>",
    "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
    ("<|im_start|>", "<|im_end|>"), r"<\|im_start\|>system\n([^{}'\"<]+?)<\|im_end\|>")
LLAMA3 = ChatFormat(
    "llama3", "<|start_header_id|>",
    "{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    r"<\|start_header_id\|>system<\|end_header_id\|>\n\n([^{}'\"<]+?)<\|eot_id\|>")
INST = ChatFormat(
    "inst", "[INST]",
    "{{- range $i, $m := .Messages }}{{- if eq $m.Role \"user\" }}[INST] {{ if and (eq $i 0) $.System }}"
    "{{ $.System }}\n\n{{ end }}{{ $m.Content }} [/INST]{{- else if eq $m.Role \"assistant\" }} {{ $m.Content }}"
    "</s>{{- end }}{{- end }}",
    ("[INST]", "[/INST]", "</s>"), r"<<SYS>>\n([^{}'\"<]+?)\n<</SYS>>")
ZEPHYR = ChatFormat(
    "zephyr", "<|user|>",
    "{{- if .System }}<|system|>\n{{ .System }}</s>\n{{ end }}"
    "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}</s>\n{{ end }}<|assistant|>\n",
    ("<|system|>", "<|user|>", "<|assistant|>", "</s>"), r"<\|system\|>\n([^{}'\"<]+?)</s>")
FORMATS = (CHATML, LLAMA3, INST, ZEPHYR)


def chat_format(chat_template: str | None) -> tuple[ChatFormat, bool]:
    """(the format of ``chat_template``, whether it was recognised); ChatML when it was not."""
    for fmt in FORMATS:
        if chat_template and fmt.marker in chat_template:
            return fmt, True
    return CHATML, False


def _quoted(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile_text(gguf_name: str, chat_template: str | None, eos_token: str | None) -> str:
    """The Modelfile for the GGUF file ``gguf_name`` in the same folder."""
    fmt, known = chat_format(chat_template)
    lines = [f"# Ollama: ollama create NAME -f Modelfile && ollama run NAME   (written by shardtune export)",
             f"FROM ./{gguf_name}"]
    if not known:
        lines.append("# The model's chat template is none of ChatML, Llama 3, [INST] or Zephyr"
                     + ("" if chat_template else " (it has none)") + ": ChatML is assumed; edit TEMPLATE to match.")
    lines.append(f"TEMPLATE {_quoted(fmt.go_template)}")
    if known and (system := re.search(fmt.system_pattern, chat_template or "")):
        lines.append(f"SYSTEM {_quoted(system.group(1).strip())}")
    stops = list(fmt.stops) + ([eos_token] if eos_token and eos_token not in fmt.stops else [])
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: Path, chat_template: str | None, eos_token: str | None) -> Path:
    """``Modelfile`` beside ``gguf_path`` (written under a temporary name, then renamed)."""
    target = gguf_path.parent / "Modelfile"
    tmp = target.with_name(".tmp-Modelfile")
    tmp.write_text(modelfile_text(gguf_path.name, chat_template, eos_token))
    tmp.replace(target)
    return target
