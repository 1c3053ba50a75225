"""Every bad input answers in one line with exit code 2, no traceback (issue 27, item 3): the known cases.

A GGUF cut short, for every command that reads one; a damaged adapter under GGUF export; ``export CKPT .``; launcher
options out of range; a callback class that cannot be made; bitsandbytes that does not import; eval_strategy without
an eval split; max_seq_len beyond the model's positions. Each runs the command in this process (``cli.main``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from shardtune.cli import main
from tests.trainutil import logging_restored, refused, tiny_workspace


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny model, chat data, and a 2-step LoRA run (checkpoints/step-1, step-2, final/) trained here."""
    root = tiny_workspace(tmp_path_factory, "bad-inputs", rows=16)
    with logging_restored():
        assert main(["train", "--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                     "--output_dir", str(root / "run"), "--use_peft_lora", "true", "--max_steps", "2",
                     "--save_steps", "1", "--max_seq_len", "64", "--per_device_train_batch_size", "2"]) == 0
    return root


def train_argv(work: Path, out: Path, *extra: str, model: Path | None = None) -> list[str]:
    return ["train", "--model_name_or_path", str(model or work / "model"), "--dataset_name",
            str(work / "chat.jsonl"), "--output_dir", str(out), "--max_steps", "1", *extra]


# ------------------------------------------------------------------------------------------- GGUF files cut short


def write_tiny_gguf(path: Path) -> Path:
    """A well-formed GGUF: a few metadata keys and one 16x8 float32 tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.arange(128, dtype=np.float32).reshape(16, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """The whole file, its first 64 bytes (the header cut), and all of it but its last 100 bytes (a tensor cut)."""
    root = tmp_path_factory.mktemp("gguf")
    whole = write_tiny_gguf(root / "whole.gguf").read_bytes()
    (root / "header.gguf").write_bytes(whole[:64])
    (root / "tensors.gguf").write_bytes(whole[:-100])
    return {"whole": root / "whole.gguf", "header": root / "header.gguf", "tensors": root / "tensors.gguf"}


def gguf_commands(work: Path, gguf: Path, out: Path) -> dict[str, list[str]]:
    """Every command that reads a GGUF, reading ``gguf``."""
    return {"train": train_argv(work, out / "run", "--max_seq_len", "32", model=gguf),
            "estimate": ["estimate", str(gguf)],
            "generate": ["generate", str(gguf), "--prompt", "hi"],
            "chat": ["chat", str(gguf)],
            "export": ["export", str(gguf), str(out / "x.gguf"), "--format", "gguf"],
            "export --base": ["export", str(work / "run"), str(out / "y.gguf"), "--format", "gguf", "--base",
                              str(gguf)],
            "merge --base": ["merge", str(work / "run" / "final"), "--base", str(gguf), str(out / "merged")],
            "data inspect": ["data", "inspect", str(work / "chat.jsonl"), "--model_name_or_path", str(gguf)]}


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_a_gguf_cut_short_is_one_line_for_every_command_that_reads_one(work, ggufs, cut, tmp_path, capsys):
    gguf = ggufs[cut]
    for name, argv in gguf_commands(work, gguf, tmp_path).items():
        line = refused(capsys, argv, str(gguf), "truncated GGUF file", "download (or export) the .gguf again")
        assert "tokenizer" not in line, (name, line)
    assert not (tmp_path / "run").exists()  # train refused it before writing anything


def test_the_whole_gguf_passes_and_the_end_is_read_from_its_header(ggufs):
    from shardtune.gguf_source import find_gguf

    assert find_gguf(ggufs["whole"]).path == ggufs["whole"].resolve()
    # The header's own account: the first 64 bytes hold the magic, version and counts, and nothing of the rest.
    size = ggufs["whole"].stat().st_size
    from shardtune.gguf_source import _bytes_promised, _bytes_promised_by_gguf

    assert _bytes_promised(str(ggufs["whole"]), size, 0) == size == _bytes_promised_by_gguf(str(ggufs["whole"]))
    assert _bytes_promised(str(ggufs["tensors"]), size - 100, 0) == size
    assert _bytes_promised(str(ggufs["header"]), 64, 0) is None


def test_the_gguf_package_reader_finds_the_same_cut(ggufs, monkeypatch, capsys):
    """transformers before its fast GGUF reader: the gguf package's reader tells the same, word for word (a cut in
    the tensors is not a cut header), and passes the whole file."""
    import shardtune.gguf_source as gguf_source

    size = ggufs["whole"].stat().st_size  # the last tensor's end: GGUFWriter writes nothing after it
    fast = {cut: refused(capsys, ["estimate", str(ggufs[cut])], "truncated GGUF file") for cut in ("header", "tensors")}
    assert "its header ends early (64 bytes)" in fast["header"]
    assert f"{size - 100:,} bytes of the {size:,} its header and tensors need" in fast["tensors"]
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.reader", None)
    gguf_source._bytes_promised.cache_clear()
    try:
        for cut in ("header", "tensors"):
            assert refused(capsys, ["estimate", str(ggufs[cut])]) == fast[cut]
        assert gguf_source.find_gguf(ggufs["whole"]).path == ggufs["whole"].resolve()
    finally:
        gguf_source._bytes_promised.cache_clear()


# -------------------------------------------------------------------------------- GGUF export of a damaged adapter


def damaged_run(work: Path, tmp_path: Path, file: str, content: bytes | None) -> Path:
    """A copy of the run whose final/``file`` holds ``content`` (None: cut to all but its last 100 bytes)."""
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    target = run / "final" / file
    target.write_bytes(target.read_bytes()[:-100] if content is None else content)
    return run


@pytest.mark.parametrize("file,content,says", [
    ("adapter_model.safetensors", None, "adapter_model.safetensors: not a safetensors file"),
    ("adapter_model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "not a safetensors file"),
    ("adapter_config.json", b'{"r": ', "adapter_config.json: not a JSON object (line 1"),
    ("adapter_config.json", b"[]", "adapter_config.json: not a JSON object (it holds a list)"),
])
def test_gguf_export_of_a_damaged_adapter_is_one_line(work, tmp_path, capsys, file, content, says):
    run = damaged_run(work, tmp_path, file, content)
    refused(capsys, ["export", str(run), str(tmp_path / "x.gguf"), "--format", "gguf"], says,
            "the folder is damaged or was altered")
    refused(capsys, ["export", str(run / "final"), str(tmp_path / "x.gguf"), "--format", "gguf"], says)
    assert not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------------------------------------ export CKPT .


def test_export_into_the_current_folder_is_one_line(work, tmp_path, monkeypatch, capsys):
    checkpoint = work / "run" / "checkpoints" / "step-1"
    for where, out, says in ((tmp_path, ".", "OUT .: is the current folder"),
                             (tmp_path, "sub/..", "OUT sub/..: is the current folder"),
                             (tmp_path / "deeper", "..", "OUT ..: holds the current folder")):
        where.mkdir(exist_ok=True)
        monkeypatch.chdir(where)
        before = {str(p): p.read_bytes() if p.is_file() else None for p in where.rglob("*")}  # all of it, not names
        refused(capsys, ["export", str(checkpoint), out, "--base", str(work / "model")], says, "a new folder")
        refused(capsys, ["merge", str(work / "run" / "final"), "--base", str(work / "model"), out], says)
        assert {str(p): p.read_bytes() if p.is_file() else None for p in where.rglob("*")} == before


# --------------------------------------------------------------------------------------------- launch options


@pytest.mark.parametrize("options,says", [
    (["--main_process_port", "70000"], "--main_process_port 70000: give a whole number from 1 to 65535"),
    (["--main_process_port", "0"], "--main_process_port 0: give a whole number from 1 to 65535"),
    (["--main_process_port", "-1"], "--main_process_port -1: give a whole number from 1 to 65535"),
    (["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "127.0.0.1"],
     "--machine_rank 2: give a whole number from 0 to 1 (--num_machines 2: 0 on the main machine, then 1)"),
    (["--num_machines", "4", "--machine_rank", "4", "--main_process_ip", "127.0.0.1"],
     "--machine_rank 4: give a whole number from 0 to 3 (--num_machines 4: 0 on the main machine, then 1 to 3)"),
    (["--num_machines", "2", "--machine_rank", "-1", "--main_process_ip", "127.0.0.1"],
     "--machine_rank -1: give a whole number from 0 to 1"),
    (["--machine_rank", "1"], "--machine_rank 1: give a whole number from 0 to 0"),
])
def test_launcher_ports_and_machine_ranks_out_of_range_are_one_line(work, tmp_path, capsys, no_torchrun, options,
                                                                     says):
    """Before, a port out of range ended in torchrun's ValueError traceback, and a machine rank past the last
    machine waited forever for machines that would never join."""
    job = train_argv(work, tmp_path / "out")
    refused(capsys, ["launch", *options, "--dry_run", *job], says)
    refused(capsys, ["launch", *options, *job], says)


def test_an_accelerate_file_port_out_of_range_names_the_file(work, tmp_path, capsys, no_torchrun):
    acc = tmp_path / "acc.yaml"
    acc.write_text("main_process_port: 99999\nnum_processes: 2\n")
    refused(capsys, ["launch", "--config_file", str(acc), *train_argv(work, tmp_path / "out")],
            f"{acc}: main_process_port 99999: give a whole number from 1 to 65535")


# ------------------------------------------------------------------------------- callbacks that cannot be made


CALLBACKS = '''
class NeedsArgs:
    def __init__(self, path):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        pass


class Raises:
    def __init__(self):
        raise RuntimeError("no connection to the dashboard")
'''


@pytest.mark.parametrize("name,says", [
    ("NeedsArgs", "missing 1 required positional argument: 'path'); a callback named in the config is made as "
                  "NeedsArgs(): give its arguments defaults"),
    ("Raises", "(RuntimeError: no connection to the dashboard); fix Raises.__init__, or leave it out of callbacks"),
])
def test_a_callback_class_that_cannot_be_made_is_named_in_one_line(work, tmp_path, capsys, monkeypatch, name, says):
    (tmp_path / "my_hooks.py").write_text(CALLBACKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    with logging_restored():
        refused(capsys, [*train_argv(work, out), "--callbacks", f"my_hooks:{name}"],
                f"callbacks: my_hooks:{name} failed as it was made, {name}()", says)
    assert not out.exists()


# ------------------------------------------------------------------------------ bitsandbytes that does not import


@pytest.fixture
def broken_bitsandbytes(tmp_path, monkeypatch):
    """A bitsandbytes whose import fails as a build for another CUDA does: a RuntimeError."""
    package = tmp_path / "site" / "bitsandbytes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('CUDA Setup failed despite GPU being available.')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)


@pytest.mark.parametrize("extra,uses,instead", [
    (["--optim", "adamw_8bit"], "optim adamw_8bit needs", "optim adamw_torch"),
    (["--use_peft_lora", "true", "--use_4bit_quantization", "true"], "use_4bit_quantization (QLoRA) needs",
     "use_4bit_quantization false (plain LoRA)"),
])
def test_bitsandbytes_that_does_not_import_says_what_to_install(work, tmp_path, capsys, monkeypatch, extra, uses,
                                                                 instead):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed: import raises ImportError
    out = tmp_path / "out"
    refused(capsys, [*train_argv(work, out), *extra], uses,
            "bitsandbytes, which does not import here (ModuleNotFoundError", "pip install -U 'bitsandbytes>=0.46'",
            instead)
    assert not out.exists()


def test_a_bitsandbytes_build_that_fails_to_load_is_named_too(work, tmp_path, capsys, broken_bitsandbytes):
    refused(capsys, [*train_argv(work, tmp_path / "out"), "--optim", "lion_8bit"],
            "optim lion_8bit needs bitsandbytes, which does not import here (RuntimeError: CUDA Setup failed")


def test_a_job_without_bitsandbytes_does_not_import_it(work, tmp_path, monkeypatch):
    """Only a job that uses it asks: the check imports nothing for plain AdamW."""
    from shardtune.config import load_run_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    load_run_config(train_argv(work, tmp_path / "out")[1:])  # no ImportError reached it


# ------------------------------------------------------------------------------ eval_strategy with no eval split


def test_eval_strategy_without_an_eval_split_is_refused(work, tmp_path, capsys):
    """Transformers' Trainer refuses an eval_strategy without an eval_dataset; so does shardtune, naming the three
    ways out, instead of a run that never evaluates."""
    with logging_restored():
        line = refused(capsys, [*train_argv(work, tmp_path / "out"), "--eval_strategy", "steps", "--eval_steps", "1"],
                       "eval_strategy steps evaluates on the eval split", f"'{work / 'chat.jsonl'}' has no eval rows "
                       "(no rows in split(s) test)", "eval_split_ratio 0.05, or set eval_strategy no")
    assert line.startswith("shardtune train: error: ")


def test_eval_on_start_without_an_eval_split_is_refused(work, tmp_path, capsys):
    """eval_on_start asks for a baseline evaluation: with no eval rows it is refused like eval_strategy, not a run
    that skips it without a word; per_device_eval_batch_size acts under it (and is refused with no evaluation)."""
    with logging_restored():
        refused(capsys, [*train_argv(work, tmp_path / "out"), "--eval_on_start", "true",
                         "--per_device_eval_batch_size", "2"],
                "eval_on_start true evaluates on the eval split", "has no eval rows (no rows in split(s) test)",
                "eval_split_ratio 0.05, or set eval_on_start false")
        refused(capsys, [*train_argv(work, tmp_path / "out"), "--per_device_eval_batch_size", "2"],
                "per_device_eval_batch_size=2 set without eval_strategy steps or epoch, or eval_on_start true")
    assert not (tmp_path / "out").exists()


def test_an_eval_split_whose_rows_have_no_targets_is_named_so(work, tmp_path, capsys):
    """An eval file whose rows hold no reply was refused as having "no rows in split(s) test", which it has."""
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(work / "chat.jsonl", data / "train.jsonl")
    (data / "test.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    argv = ["train", "--model_name_or_path", str(work / "model"), "--dataset_name", str(data), "--output_dir",
            str(tmp_path / "out"), "--max_steps", "1", "--eval_strategy", "steps", "--eval_steps", "1"]
    with logging_restored():
        refused(capsys, argv, "has no eval rows (split(s) test held 1 row(s), none with a target token: no assistant "
                              "reply or completion, or truncated away by max_seq_len")


def test_eval_split_ratio_gives_the_eval_split_it_needs(work, tmp_path):
    out = tmp_path / "out"
    with logging_restored():
        assert main([*train_argv(work, out), "--eval_strategy", "steps", "--eval_steps", "1",
                     "--eval_split_ratio", "0.25", "--max_seq_len", "64"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [1]


# ------------------------------------------------------------------------ max_seq_len beyond the model's positions


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("short") / "model", max_position_embeddings=48)


def test_max_seq_len_beyond_the_models_positions_is_refused(work, short_model, tmp_path, capsys):
    """Refused, not capped: the user asked for rows that long, and a row past 48 positions would train positions
    the model never learned."""
    argv = train_argv(work, tmp_path / "out", model=short_model)
    # 49: the first position beyond the 48 the model covers (a refusal from 50 on, or 64, would pass as well)
    refused(capsys, [*argv, "--max_seq_len", "49"], "command line (--max_seq_len): max_seq_len 49 is beyond the 48 "
            f"positions model_name_or_path '{short_model}' covers ({short_model / 'config.json'}: "
            "max_position_embeddings); set max_seq_len 48 or less")
    refused(capsys, argv, "max_seq_len 2048 (the default) is beyond the 48 positions")
    assert not (tmp_path / "out").exists()


def test_a_rope_scaling_factor_extends_what_the_model_covers(tmp_path):
    from shardtune.hub import context_length

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096,
                                                    "rope_scaling": {"type": "linear", "factor": 4.0}}))
    assert context_length(str(folder)) == (16384, f"{folder / 'config.json'}: max_position_embeddings x rope_scaling "
                                                  f"factor")
    (folder / "config.json").write_text(json.dumps({"n_positions": 1024}))  # GPT-2's name for it
    assert context_length(str(folder)) == (1024, f"{folder / 'config.json'}: n_positions")


def test_a_multimodal_configs_text_part_gives_its_positions_and_layers(tmp_path):
    """Gemma 3's and Llama 4's config.json hold the language model's shape in text_config: the positions and the
    decoder layers were read from the top level only, so max_seq_len beyond them and PP or MP over more GPUs than
    layers went unchecked until the model loaded."""
    from shardtune.hub import context_length, num_layers

    folder = tmp_path / "gemma3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {"num_hidden_layers": 27},
                                                    "text_config": {"max_position_embeddings": 131072,
                                                                    "num_hidden_layers": 34}}))
    config = folder / "config.json"
    assert context_length(str(folder)) == (131072, f"{config}: text_config.max_position_embeddings")
    assert num_layers(str(folder)) == (34, f"{config}: text_config.num_hidden_layers")


# ----------------------------------------------------------------------------------------------- attention kernel


def test_an_attention_kernel_that_cannot_run_is_refused_before_anything_is_written(work, tmp_path, capsys,
                                                                                   monkeypatch):
    """A misspelt attn_implementation, and flash attention where it cannot run (no CUDA here; and fp32), are one
    line and exit 2, the dry run's too (it builds the model), where they were transformers' tracebacks (exit 1)
    after the data was tokenised; use_flash_attn still falls back."""
    import torch

    out = tmp_path / "out"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this project's CPU machines, anywhere
    with logging_restored():
        refused(capsys, [*train_argv(work, out), "--attn_implementation", "sdpaa"],
                "attn_implementation='sdpaa' is not accepted; use one of sdpa, eager, flash_attention_2, "
                "flash_attention_3 (did you mean sdpa?)")
        for dry in ("false", "true"):
            refused(capsys, [*train_argv(work, out), "--attn_implementation", "flash_attention_2", "--dry_run", dry],
                    "attn_implementation=flash_attention_2: it runs on CUDA GPUs only and this job has none; use "
                    "attn_implementation sdpa (the default), with use_flash_attn true to take flash attention where "
                    "it can run")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: True)
        refused(capsys, [*train_argv(work, out), "--attn_implementation", "flash_attention_2", "--bf16", "false"],
                "it computes in bf16 or fp16 only, and this job computes in fp32 (set bf16 true)")
    assert not out.exists()


def test_lora_modules_that_name_no_module_and_a_zero_alpha_are_refused(work, tmp_path, capsys):
    """PEFT trains nothing for a modules_to_save name that matches no module and says nothing (the run trained the
    adapters alone and recorded the typo in adapter_config.json); lora_alpha 0 scales every update to nothing."""
    with logging_restored():
        refused(capsys, [*train_argv(work, tmp_path / "a"), "--use_peft_lora", "true", "--lora_modules_to_save",
                         "lm_head,embed_tokns"],
                "lora_modules_to_save=lm_head,embed_tokns: no module of the model is named embed_tokns (did you "
                "mean embed_tokens?)")
        refused(capsys, [*train_argv(work, tmp_path / "b"), "--use_peft_lora", "true", "--lora_alpha", "0"],
                "lora_alpha=0 must be positive")
        # The same for a typo among the target modules: PEFT refuses a list none of whose names match, and adapted
        # q_proj alone for q_proj,v_porj (2,048 parameters trained, no word).
        refused(capsys, [*train_argv(work, tmp_path / "c"), "--use_peft_lora", "true", "--lora_target_modules",
                         "q_proj,v_porj"],
                "lora_target_modules=q_proj,v_porj: no module of the model is named v_porj (did you mean v_proj?)")
    assert not (tmp_path / "b").exists()


def test_q_proj_v_proj_on_phi3_points_once_at_its_fused_qkv_proj():
    """Phi-3 fuses q, k and v into qkv_proj: a recipe's q_proj,v_proj was refused with 'did you mean qkv_proj,
    qkv_proj?', one guess per missing name; the fused module is named once."""
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import LoraConfig
    from shardtune.errors import UsageError
    from shardtune.testing.families import FAMILIES
    from shardtune.train.model import apply_lora

    model = AutoModelForCausalLM.from_config(FAMILIES["phi3"](vocab_size=64, pad_token_id=0))
    with pytest.raises(UsageError) as refusal:
        apply_lora(model, LoraConfig(use_peft_lora=True, lora_target_modules="q_proj,v_proj"), seed=0)
    assert ("lora_target_modules=q_proj,v_proj: no module of the model is named q_proj, v_proj (did you mean "
            "qkv_proj?);") in str(refusal.value)


def test_a_lora_target_the_model_lacks_is_refused_where_it_was_written(work, tmp_path, capsys):
    """Found only once the model is built, a recipe's lora_target_modules typo was refused without the file and
    line that set it, and estimate --config named an option the user never typed (--lora-target-modules)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {work / 'model'}\ndataset_name: {work / 'chat.jsonl'}\n"
                      f"use_peft_lora: true\nlora_target_modules: q_projj\n")
    with logging_restored():
        refused(capsys, ["train", str(recipe), "--output_dir", str(tmp_path / "run"), "--max_steps", "1"],
                f"{recipe}, line 4: lora_target_modules=q_projj: no module of the model is named q_projj")
    refused(capsys, ["estimate", "--config", str(recipe)],
            f"{recipe}, line 4: lora_target_modules q_projj matches no linear layer of model")
    # A typo beside a good name: train refused it, estimate counted q_proj alone (2,048 trainable)
    refused(capsys, ["estimate", str(work / "model"), "--method", "lora", "--lora-target-modules", "q_proj,v_porj"],
            "--lora-target-modules q_proj,v_porj: no linear layer of model is named v_porj (did you mean v_proj?)")
    # Given by estimate's options, the refusal names them
    refused(capsys, ["estimate", str(work / "model"), "--method", "lora", "--lora-target-modules", "q_proj",
                     "--lora-modules-to-save", "q_proj"],
            "--lora-target-modules q_proj: every module it names is also in --lora-modules-to-save (q_proj)")
    assert not (tmp_path / "run").exists()


def test_estimate_config_given_a_folder_says_it_is_a_folder(tmp_path, capsys):
    """``estimate --config runs/`` was told 'no such file' of a folder that is there."""
    refused(capsys, ["estimate", "--config", str(tmp_path)],
            f"--config {tmp_path}: a folder, not a file; give a training recipe, an Accelerate config file or a "
            f"DeepSpeed JSON")


def test_estimate_given_a_recipe_as_model_points_at_config(tmp_path, capsys):
    """``estimate recipe.yaml`` was read as a config.json: 'invalid JSON at line 1, column 1'."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: m\n")
    refused(capsys, ["estimate", str(recipe)], f"MODEL {recipe}: a YAML file, not a model; to estimate the job a "
                                               f"training recipe describes, give it as --config {recipe}")


def test_estimate_config_without_a_model_asks_for_model(tmp_path, capsys):
    """'estimate --config ds.json' (no model anywhere) was told to give --model_name_or_path, which estimate refuses
    as an unknown option."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    line = refused(capsys, ["estimate", "--config", str(ds)],
                   f"--config {ds}: no model_name_or_path in it; give MODEL ('shardtune estimate MODEL --config ...')")
    assert "--model_name_or_path" not in line


def test_rows_left_out_of_each_epoch_are_said(work, tmp_path, capsys):
    """Every step is a whole global batch, so the rows of an incomplete last one are not trained that epoch; that
    was written only in a docstring (Transformers' Trainer trains a smaller last batch)."""
    import re

    with logging_restored():
        assert main([*train_argv(work, tmp_path / "out"), "--per_device_train_batch_size", "3", "--splits",
                     "train"]) == 0
    said = re.findall(r"batch: global batch of (\d+) rows per optimizer step .*; (\d+) of the (\d+) training rows "
                      r"are left out of each epoch: the last global batch would be incomplete", capsys.readouterr().err)
    (batch, left, rows), = [tuple(map(int, found)) for found in said]
    assert (batch, rows) == (3, 16) and left == rows % batch == 1


# ------------------------------------------------------------------------------------ bitsandbytes' dtypes


@pytest.mark.parametrize("key,value,says", [
    ("bnb_4bit_compute_dtype", "float64", "bnb_4bit_compute_dtype='float64' is not accepted; use one of bfloat16, "
                                          "float16, float32"),
    ("bnb_4bit_quant_storage_dtype", "foo", "bnb_4bit_quant_storage_dtype='foo' is not accepted"),
    ("bnb_4bit_quant_storage_dtype", "uint8", "bitsandbytes' uint8 storage would load the whole model in uint8"),
])
def test_a_4bit_dtype_shardtune_cannot_run_is_refused_before_anything_is_written(work, tmp_path, capsys, key, value,
                                                                                 says):
    """These values ended in a KeyError traceback (exit 1) after output_dir was made; uint8 is bitsandbytes' own
    default storage, which the trainer cannot load a model in."""
    out = tmp_path / "out"
    refused(capsys, train_argv(work, out, "--use_peft_lora", "true", "--use_4bit_quantization", "true", f"--{key}",
                               value), says)
    assert not out.exists()


@pytest.mark.parametrize("precision,storage,fix", [
    ("bf16", "float16", "set bnb_4bit_quant_storage_dtype bfloat16"),
    ("fp16", "bfloat16", "set bnb_4bit_quant_storage_dtype float16"),
])
def test_a_4bit_storage_dtype_autocast_cannot_mix_is_refused_before_the_first_step(work, tmp_path, capsys, precision,
                                                                                   storage, fix):
    """The model loads in its 4-bit storage dtype: float16 storage under bf16 mixed precision (or bfloat16 under
    fp16) trained to the first forward and ended there in a traceback, exit 1 ("Unexpected floating ScalarType in
    at::autocast::prioritize"). float32 storage mixes with either, and the matching half dtype trains."""
    out = tmp_path / "out"
    qlora = ("--use_peft_lora", "true", "--use_4bit_quantization", "true", f"--{precision}", "true")
    refused(capsys, train_argv(work, out, *qlora, "--bnb_4bit_quant_storage", storage),
            f"bnb_4bit_quant_storage_dtype={storage} with {precision} mixed precision", fix)
    assert not out.exists()
    with logging_restored():
        assert main(train_argv(work, out, *qlora, "--bnb_4bit_quant_storage", "float32")) == 0


def test_peft_refusing_a_target_module_is_one_readable_line():
    """PEFT's refusal of a module it cannot adapt prints the module over several lines; the first line alone was
    "Target module MixtralExperts(", which says nothing. Its whole message is kept, on one line."""
    import transformers

    from shardtune.config.schema import LoraConfig
    from shardtune.errors import UsageError
    from shardtune.testing.families import family_config
    from shardtune.testing.tiny import make_tokenizer
    from shardtune.train.model import apply_lora

    model = transformers.AutoModelForCausalLM.from_config(family_config("mixtral", make_tokenizer()))
    with pytest.raises(UsageError) as refused:
        apply_lora(model, LoraConfig(lora_target_modules="experts"), seed=0)
    said = str(refused.value)
    assert "\n" not in said and "Target module MixtralExperts( (act_fn): SiLUActivation() ) is not supported" in said
    assert said.endswith("use all-linear, names of the model's linear layers (e.g. q_proj,v_proj) or re:<regex>")


def test_mixtral_transformers_4_expert_names_train_and_dora_on_them_is_refused_as_estimate_refuses_it(tmp_path):
    """A Mixtral recipe's q_proj,v_proj,w1,w2,w3 (the transformers-4 names PEFT maps onto the fused expert
    tensors, as estimate counts them) was refused by train ("no module of the model is named w1, w2, w3"); it now
    adapts what PEFT adapts, the count estimate gives. DoRA on those tensors, which PEFT cannot do, was counted by
    estimate and refused by train with PEFT's words and a fix to "use all-linear": both now refuse it alike."""
    import transformers
    from peft import get_peft_model
    from peft import LoraConfig as PeftLoraConfig

    from shardtune.config.schema import LoraConfig
    from shardtune.errors import UsageError
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.testing.families import family_config
    from shardtune.testing.tiny import make_tokenizer
    from shardtune.train.model import apply_lora

    config = family_config("mixtral", make_tokenizer())
    targets = ["q_proj", "v_proj", "w1", "w2", "w3"]
    fresh = transformers.AutoModelForCausalLM.from_config
    adapted = apply_lora(fresh(config), LoraConfig(lora_target_modules=",".join(targets), lora_r=4), seed=0)
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    peft_model = get_peft_model(fresh(config), PeftLoraConfig(r=4, target_modules=targets))
    assert trained == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    config.save_pretrained(tmp_path)
    estimate = ModelAnalysis(str(tmp_path))
    assert estimate.lora(4, targets).total == trained
    for given in ("all-linear", "q_proj,w2"):
        with pytest.raises(UsageError) as by_train:
            apply_lora(fresh(config), LoraConfig(lora_target_modules=given, use_dora=True), seed=0)
        with pytest.raises(UsageError) as by_estimate:
            estimate.lora(8, given, dora=True)
        assert str(by_train.value) == str(by_estimate.value)
        assert str(by_train.value).startswith(f"use_dora with lora_target_modules {given}: PEFT's DoRA cannot adapt "
                                              f"mixtral's mixture-of-experts weights")
    with pytest.raises(ValueError, match="ParamWrapper does not work with use_dora"):  # PEFT's own refusal
        get_peft_model(fresh(config), PeftLoraConfig(r=4, target_modules=["w2"], use_dora=True))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_qwen_moe_targets_are_counted_and_trained_as_peft_adapts_them(model_type, tmp_path):
    """PEFT maps the transformers-4 expert names onto qwen3_moe's (and olmoe's, glm4_moe's, ...) fused expert tensors,
    not qwen2_moe's (transformers' conversion map gives qwen2_moe itself no pattern). estimate applied the mapping by
    the model type: qwen3_moe's all-linear was counted without its experts (3,584 where PEFT trains 15,392) and its
    gate_proj,up_proj,down_proj refused, as train refused them; qwen2_moe's experts were counted where PEFT adapts
    none (18,984 for 7,176)."""
    import transformers
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from shardtune.config.schema import LoraConfig
    from shardtune.errors import UsageError
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.train.model import apply_lora

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    config = (transformers.Qwen3MoeConfig(**shape, head_dim=16) if model_type == "qwen3_moe" else
              transformers.Qwen2MoeConfig(**shape, shared_expert_intermediate_size=64))
    config.save_pretrained(tmp_path)
    fresh = transformers.AutoModelForCausalLM.from_config
    if model_type == "qwen2_moe":  # its router 'gate' is no linear layer: PEFT refuses it, and so do train and estimate
        with pytest.raises(UsageError, match="no linear layer of .* is named gate"):
            ModelAnalysis(str(tmp_path), use_cache=False).lora(4, "q_proj,gate")
        with pytest.raises(UsageError, match="Qwen2MoeTopKRouter"):
            apply_lora(fresh(config), LoraConfig(lora_target_modules="q_proj,gate", lora_r=4), seed=0)
    for targets in ("all-linear", "gate_proj,up_proj,down_proj"):
        peft_targets = targets if targets == "all-linear" else targets.split(",")
        peft_model = get_peft_model(fresh(config), PeftLoraConfig(r=4, target_modules=peft_targets))
        by_peft = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert ModelAnalysis(str(tmp_path), use_cache=False).lora(4, targets).total == by_peft, targets
        adapted = apply_lora(fresh(config), LoraConfig(lora_target_modules=targets, lora_r=4), seed=0)
        assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == by_peft, targets
