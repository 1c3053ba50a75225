"""What Ollama users get from ``shardtune export --format gguf``: the Modelfile's Go template, rendered the way
Ollama renders it (tests/ollama_render.go: Go's own text/template, the Modelfile's SYSTEM put in front of a
conversation without one, system messages handed to the template both as .System and in .Messages), equals the
Jinja chat template the model was trained with on the same conversation: every message written once, the system
prompt included.

Needs the Go toolchain (``make test`` installs Debian's golang-go where it can, as it does shellcheck)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from jinja2 import Template

from shardtune.cli import main
from shardtune.data.templates import TEMPLATES
from shardtune.ollama import chat_format

RENDER = Path(__file__).with_name("ollama_render.go")
needs_go = pytest.mark.skipif(shutil.which("go") is None, reason="the Go toolchain is not installed (apt-get install "
                                                                 "golang-go): Ollama's templates are Go templates")

SYSTEM = {"role": "system", "content": "You answer in one word."}
TURNS = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
         {"role": "user", "content": "And of Italy?"}]


def ollama_prompt(template: str, messages: list[dict], system: str = "") -> str:
    request = {"template": template, "system": system, "messages": messages}
    proc = subprocess.run(["go", "run", str(RENDER)], input=json.dumps(request), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def jinja_prompt(jinja: str, messages: list[dict]) -> str:
    text = Template(jinja).render(messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    return text.removeprefix("<s>")  # llama.cpp adds BOS itself (tokenizer.ggml.add_bos_token)


@needs_go
@pytest.mark.parametrize("name", ["chatml", "llama-3", "mistral", "zephyr"])
def test_the_modelfile_template_renders_each_message_once_as_the_jinja_template_does(name):
    jinja = TEMPLATES[name].jinja
    fmt, known = chat_format(jinja)
    assert known
    expected = jinja_prompt(jinja, [SYSTEM, *TURNS])
    assert expected.count(SYSTEM["content"]) == 1
    # the system prompt in the request, or as the Modelfile's SYSTEM (ollama run): the same prompt either way
    assert ollama_prompt(fmt.go_template, [SYSTEM, *TURNS]) == expected
    assert ollama_prompt(fmt.go_template, TURNS, system=SYSTEM["content"]) == expected
    assert ollama_prompt(fmt.go_template, TURNS) == jinja_prompt(jinja, TURNS)


def test_a_fine_tune_of_a_gguf_keeps_what_the_gguf_says_of_itself(tmp_path):
    """License, organization and languages stay, the source's name becomes the base model's, and the padding id is
    the source's own, though training replaced an EOS pad in the tokenizer (pad must not be EOS for training)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.gguf_export import write_gguf
    from shardtune.gguf_source import Described
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import run_shardtune, write_chat_data

    folder = make_model_folder(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    own = Described((("general.license", "apache-2.0", (string,)), ("general.organization", "TinyOrg", (string,)),
                     ("general.languages", ["en", "fr"], (array, string))), pad_token_id=tokenizer.eos_token_id)
    base = write_gguf(AutoModelForCausalLM.from_pretrained(folder), tokenizer, tmp_path / "base.gguf", "f16",
                      name="Tiny Base", source=own)
    write_chat_data(tmp_path / "chat.jsonl", rows=20)
    trained = run_shardtune(["train", "--model_name_or_path", str(base), "--dataset_name", "chat.jsonl",
                             "--max_seq_len", "64", "--max_steps", "1", "--use_peft_lora", "true", "--output_dir",
                             "run", "--predict_memory", "false"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert saved.pad_token_id != tokenizer.eos_token_id  # what training did to the tokenizer
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "gguf", "--quantize", "f16"]) == 0
    fields = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf").fields
    value = {key: fields[key].contents() for key in fields if key.startswith("general.") or "padding" in key}
    assert value["general.name"] == "run"
    assert value["general.license"] == "apache-2.0" and value["general.organization"] == "TinyOrg"
    assert value["general.languages"] == ["en", "fr"]
    assert value["general.base_model.count"] == 1 and value["general.base_model.0.name"] == "Tiny Base"
    assert value["general.base_model.0.organization"] == "TinyOrg"
    assert value["tokenizer.ggml.padding_token_id"] == tokenizer.eos_token_id


def test_a_run_trained_on_plain_prompts_gets_a_modelfile_that_passes_the_prompt_as_it_is(tmp_path, caplog):
    """A prompt/completion run trains on plain prompts, but its GGUF's Modelfile wrapped every prompt in the
    tokenizer's ChatML, a format the run never saw. Its final/ and its checkpoints now get ``{{ .Prompt }}``, the
    prompt's text alone, and a note; a model that says nothing of how it trained keeps the chat template's."""
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import logging_restored

    make_model_folder(tmp_path / "model")
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} plus 1? ",
                                                              "completion": f"{i + 1}."}) + "\n" for i in range(16)))
    with logging_restored():
        assert main(["train", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                     str(tmp_path / "plain.jsonl"), "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
                     "--save_steps", "1", "--use_peft_lora", "true", "--max_seq_len", "64",
                     "--predict_memory", "false"]) == 0
    templates = {}
    for name, source in (("run", tmp_path / "run"), ("checkpoint", tmp_path / "run" / "checkpoints" / "step-1"),
                         ("model", tmp_path / "model")):
        caplog.clear()
        out = tmp_path / f"{name}-gguf"
        assert main(["export", str(source), str(out), "--format", "gguf", "--quantize", "f16"]) == 0
        modelfile = (out / "Modelfile").read_text()
        templates[name] = re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S)[1]
        assert ("trained on plain prompts" in modelfile) == (name != "model")
        assert ("trained on plain prompts" in caplog.text) == (name != "model"), caplog.text
    assert templates == {"run": "{{ .Prompt }}", "checkpoint": "{{ .Prompt }}", "model": chat_format("<|im_start|>")[0]
                         .go_template}
    if shutil.which("go"):
        assert ollama_prompt(templates["run"], [{"role": "user", "content": "What is 3 plus 1? "}]) == \
            "What is 3 plus 1? "
