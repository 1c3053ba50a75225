"""What ``scripts/fuzz_inputs.py`` found (issue 27, item 3): each input ended in a traceback, the wrong exit code,
two lines, or was silently accepted. Now each is one line with exit code 2, checked here in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.cli import main
from tests.trainutil import logging_restored, make_lora_adapter, refused, write_chat_data


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny model, chat data, a LoRA adapter made for the model (not trained), and a file where folders go."""
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("fuzz-findings")
    make_model_folder(root / "model")
    write_chat_data(root / "chat.jsonl", rows=8)
    make_lora_adapter(root / "model", root / "adapter")
    (root / "a_file").write_text("not a folder\n")
    return root


def copy_of(work: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(work / name, tmp_path / name)
    return tmp_path / name


TRAIN = ["--dataset_name", "chat.jsonl", "--output_dir", "out", "--max_steps", "1"]


# ---------------------------------------------------------------------------------------- training keys and values


@pytest.mark.parametrize("extra,says", [
    (["--seed", "4294967296"], "seed=4294967296 must be from 0 to 4294967295"),  # numpy: "Seed must be between"
    (["--seed", "-1"], "seed=-1 must be from 0 to 4294967295"),
    (["--num_train_epochs", "-1"], "num_train_epochs=-1.0 must be positive"),  # accepted beside max_steps before
])
def test_training_values_no_generator_or_schedule_can_use(work, capsys, monkeypatch, extra, says):
    monkeypatch.chdir(work)
    refused(capsys, ["train", "--model_name_or_path", "model", *TRAIN, *extra], says)
    assert not (work / "out").exists()


def test_a_model_path_that_is_a_file_is_named_not_looked_up_on_the_hub(work, capsys, monkeypatch):
    """Before: a minute of hub retries for 'model/config.json', then a tokenizer error, and config.yaml left."""
    monkeypatch.chdir(work)
    refused(capsys, ["train", "--model_name_or_path", "model/config.json", *TRAIN],
            "model_name_or_path 'model/config.json' is a file, not a model folder")
    refused(capsys, ["train", "--model_name_or_path", "gone.gguf", *TRAIN],
            "model_name_or_path 'gone.gguf' does not exist")
    assert not (work / "out").exists()


# ------------------------------------------------------------------------------------ launcher options and files


@pytest.mark.parametrize("options,says", [
    (["--max_restarts", "-1"], "--max_restarts -1: give 0 (no restart) or more"),  # torchrun's AssertionError
    (["--monitor_interval", "nan"], "--monitor_interval nan: give a number of seconds above 0"),
    (["--monitor_interval", "-1"], "--monitor_interval -1.0: give a number of seconds above 0"),
    (["--rdzv_backend", "etcd"], "unknown --rdzv_backend 'etcd': choose one of static, c10d"),
    (["--main_process_ip", "not an ip!", "--main_process_port", "29400"],
     "--main_process_ip not an ip!: not a host name or IP address"),
])
def test_launcher_options_torchrun_would_stop_on(work, capsys, monkeypatch, no_torchrun, options, says):
    monkeypatch.chdir(work)
    job = ["train", "--model_name_or_path", "model", *TRAIN]
    refused(capsys, ["launch", *options, *job], says)
    refused(capsys, ["launch", *options, "--dry_run", *job], says)


@pytest.mark.parametrize("content,says", [
    ("num_processes: two\n", "acc.yaml: num_processes two: give a whole number 1 or more"),  # int() traceback
    ("distributed_type: FSDP\nfsdp_config: 5\n", "acc.yaml, line 2: fsdp_config must be a mapping of keys"),
    ("deepspeed_config: [1]\n", "acc.yaml, line 1: deepspeed_config must be a mapping of keys"),
    ("distributed_type: BOGUS\n", "distributed_type='BOGUS' is not accepted"),  # a dry run printed the command
])
def test_a_bad_accelerate_file_is_refused_by_launch_even_in_a_dry_run(work, tmp_path, capsys, no_torchrun, content,
                                                                      says):
    acc = tmp_path / "acc.yaml"
    acc.write_text(content)
    refused(capsys, ["launch", "--config_file", str(acc), "--dry_run", "train", "--seed", "1"], says)


def test_a_dry_run_of_launch_checks_the_training_values_it_is_given(work, tmp_path, capsys):
    """Values only: a dry run may leave out the model, the data and output_dir, and still prints the command."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: fast\n")
    refused(capsys, ["launch", "--dry_run", "train", str(recipe)], f"{recipe}, line 1: learning_rate='fast': "
                                                                  f"expected a number")
    assert main(["launch", "--dry_run", "train", "--seed", "1"]) == 0
    assert "torch.distributed.run" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- estimate


@pytest.mark.parametrize("extra,says", [
    (["--gpu-memory", "nan"], "--gpu-memory must be a positive number of GiB (got nan)"),  # ValueError traceback
    (["--gpu-memory", "inf"], "--gpu-memory must be a positive number of GiB (got inf)"),  # OverflowError
    (["--pipeline-microbatches", "0"], "--pipeline-microbatches must be a whole number >= 1"),  # accepted
    (["--emit-config", "a_file/x.yaml"], "--emit-config a_file/x.yaml: a_file is a file, not a folder"),  # exit 1
    (["--plot", "a_file/x.png"], "--plot a_file/x.png: a_file is a file, not a folder"),
])
def test_estimate_options(work, capsys, monkeypatch, extra, says):
    monkeypatch.chdir(work)
    refused(capsys, ["estimate", "llama-3-8b", *extra], says)


@pytest.mark.parametrize("content,says", [
    (b"[]", "holds a JSON list, not the object of a model's config"),  # AttributeError: 'list' ... 'get'
    (bytes(range(256)), "not UTF-8 text (byte 128)"),
])
def test_estimate_of_a_config_that_is_no_object(tmp_path, capsys, content, says):
    (tmp_path / "config.json").write_bytes(content)
    refused(capsys, ["estimate", str(tmp_path)], says)


# ----------------------------------------------------------------------------- model folders: generate, merge, export


def damaged_model(work: Path, tmp_path: Path, change: str) -> Path:
    model = copy_of(work, "model", tmp_path)
    if change == "list_config":
        (model / "config.json").write_text("[]")
    elif change == "unknown_type":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
    elif change == "no_tokenizer":
        for path in model.glob("tokenizer*"):
            path.unlink()
    elif change == "cut_weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    return model


@pytest.mark.parametrize("change,says", [
    ("list_config", "config.json: not a JSON object (it holds a list)"),  # ValueError: Unrecognized model
    ("unknown_type", "config.json: model_type 'nonesuch' is not one transformers"),  # ValueError traceback
    ("no_tokenizer", "holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, "
                     "tekken.json, tokenizer.tiktoken)"),
    ("cut_weights", "model.safetensors: not a safetensors file"),
])
def test_a_damaged_model_folder_is_one_line_for_generate_merge_and_gguf_export(work, tmp_path, capsys, change, says):
    model = damaged_model(work, tmp_path, change)
    refused(capsys, ["generate", str(model), "--prompt", "hi"], says)
    refused(capsys, ["export", str(model), str(tmp_path / "m.gguf"), "--format", "gguf"], says)
    refused(capsys, ["merge", str(work / "adapter"), "--base", str(model), str(tmp_path / "merged")], says)


@pytest.mark.parametrize("change,says", [
    ("list_config", "config.json: holds a JSON list, not the object of a model's config"),  # TypeError traceback
    ("unknown_type", "model_type 'nonesuch' is not in transformers"),  # transformers' warning above the error
    ("broken_tokenizer", "tokenizer.json: not a JSON object (line 1: Expecting property name enclosed in double "
                         "quotes)"),  # "cannot load a tokenizer ... (give a local model folder or a hub id)"
])
def test_estimate_reads_a_model_folders_settings_before_its_tokenizer(work, tmp_path, capsys, monkeypatch, change,
                                                                      says):
    """The estimate reads a folder's tokenizer (train grows the embeddings to its length): a damaged config.json
    or tokenizer file is one line naming it, as for generate, found before transformers' tokenizer loader reads
    the folder (it stopped with a traceback, or printed its warning above the error); damaged weights do not
    matter to the estimate."""
    import shardtune.data

    def no_loading(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded from a damaged folder")

    model = copy_of(work, "model", tmp_path) if change == "broken_tokenizer" else damaged_model(work, tmp_path, change)
    if change == "broken_tokenizer":
        (model / "tokenizer.json").write_text("{")
    with monkeypatch.context() as patched:
        patched.setattr(shardtune.data, "load_tokenizer", no_loading)
        refused(capsys, ["estimate", str(model)], says)
    assert main(["estimate", str(damaged_model(work, tmp_path / "cut", "cut_weights"))]) == 0


def test_a_model_folder_without_a_tokenizer_says_so_for_train_and_data_inspect(work, tmp_path, capsys):
    """train and data inspect said "cannot load a tokenizer ... (give a local model folder or a hub id)" of a local
    model folder, with transformers' words; now what generate says: the files missing and how to add them."""
    model = damaged_model(work, tmp_path, "no_tokenizer")
    says = f"model_name_or_path '{model}' holds no tokenizer (no tokenizer.json, tokenizer_config.json"
    refused(capsys, ["train", "--model_name_or_path", str(model), "--dataset_name", str(work / "chat.jsonl"),
                     "--output_dir", str(tmp_path / "out"), "--max_steps", "1"], says, "copy the base model's")
    refused(capsys, ["data", "inspect", str(work / "chat.jsonl"), "--model_name_or_path", str(model)], says)
    assert not (tmp_path / "out").exists()
    from shardtune.hub import has_tokenizer

    (model / "vocab.json").write_text("{}")  # a GPT-2 style tokenizer's files count (AutoTokenizer reads them)
    assert has_tokenizer(model)


def test_merge_takes_the_adapters_own_tokenizer_where_the_base_has_none(work, tmp_path):
    """A run's final/ keeps its tokenizer: merge reads that one, and no longer asks the base for its own (it
    refused such a base as damaged)."""
    from transformers import AutoTokenizer

    from shardtune.cli import main

    base = damaged_model(work, tmp_path, "no_tokenizer")
    adapter = copy_of(work, "adapter", tmp_path)
    AutoTokenizer.from_pretrained(str(work / "model")).save_pretrained(str(adapter))
    assert main(["merge", str(adapter), "--base", str(base), str(tmp_path / "merged")]) == 0
    merged = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    assert merged("7 + 8 =")["input_ids"] == AutoTokenizer.from_pretrained(str(adapter))("7 + 8 =")["input_ids"]


# -------------------------------------------------------------------------------------------------- adapters


def damaged_adapter(work: Path, tmp_path: Path, change: str) -> Path:
    adapter = copy_of(work, "adapter", tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(work / "model")
    if change == "list":
        config = []
    elif change == "types":
        config["r"] = "x"
    elif change == "peft_type":
        config["peft_type"] = "NOPE"
    elif change == "no_weights":
        (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


@pytest.mark.parametrize("change,says", [
    ("list", "adapter_config.json: not a JSON object (it holds a list)"),  # AttributeError / TypeError tracebacks
    ("types", "cannot be loaded (TypeError: '<=' not supported between instances of 'str' and 'int')"),
    ("peft_type", "cannot be loaded (KeyError: no 'NOPE')"),  # KeyError traceback
    ("no_weights", "holds adapter_config.json but no adapter weights (adapter_model.safetensors or"),  # exit 1
])
def test_a_damaged_adapter_is_one_line_for_generate_merge_and_gguf_export(work, tmp_path, capsys, change, says):
    adapter = damaged_adapter(work, tmp_path, change)
    refused(capsys, ["generate", str(adapter), "--prompt", "hi"], says)
    refused(capsys, ["merge", str(adapter), "--base", str(work / "model"), str(tmp_path / "merged")], says)
    refused(capsys, ["export", str(adapter), str(tmp_path / "a.gguf"), "--format", "gguf"], says)


def test_an_error_in_shardtunes_own_code_keeps_its_traceback(work):
    """Only the libraries' errors about a folder's contents become one line: a bug stays a bug."""
    from shardtune.errors import UsageError
    from shardtune.hub import loading_refused

    with pytest.raises(TypeError), loading_refused("x", "y"):
        len(5)  # raised here, in a test (shardtune) frame
    with pytest.raises(UsageError, match="x: cannot be loaded .ValueError: Unrecognized model"):
        with loading_refused("x", "y"):
            from transformers import AutoConfig

            AutoConfig.for_model("nonesuch")


# ---------------------------------------------------------------------------------------------- checkpoints


def test_a_manifest_that_is_no_object_is_one_line_for_export_and_resume(work, tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text(f"model_name_or_path: {work / 'model'}\ndataset_name: "
                                            f"{work / 'chat.jsonl'}\noutput_dir: {tmp_path / 'run'}\n")
    (checkpoint / "manifest.json").write_text("[]")
    says = f"{checkpoint / 'manifest.json'}: not the JSON shardtune writes (a JSON list, not an object)"
    refused(capsys, ["export", str(checkpoint), str(tmp_path / "x")], says)  # AttributeError: 'list' ... 'get'
    monkeypatch.chdir(work)
    with logging_restored():  # the resume is read once train has set up its logging
        refused(capsys, ["train", "--model_name_or_path", "model", *TRAIN[:2], "--output_dir", str(tmp_path / "run"),
                         "--resume_from_checkpoint", str(checkpoint)], says)


# ------------------------------------------------------------------------------- output paths that cannot be made


@pytest.mark.parametrize("argv,says", [
    (["export", "{adapter}", "a_file/x.gguf", "--format", "gguf"], "OUT a_file/x.gguf: a_file is a file, not a "
                                                                   "folder"),  # exit 1 ("File exists")
    (["merge", "{adapter}", "--base", "model", "a_file/sub"], "OUT a_file/sub: a_file is a file, not a folder"),
    (["merge", "{adapter}", "--base", "model", "nowhere_link"], "OUT nowhere_link: a symlink that leads nowhere"),
    (["merge", "{adapter}", "--base", "model", "loop_link"], "OUT loop_link: a symlink that leads nowhere (or a "
                                                            "loop of symlinks)"),
    (["plot", "run", "--out", "a_file"], "--out a_file: a file is there, where the folder goes"),
    (["demo", "--output-dir", "a_file", "--skip-estimate"], "--output-dir a_file: a file is there"),
    (["bench", "strategies", "recipe.yaml", "--out", "a_file/x.json"], "--out a_file/x.json: a_file is a file"),
    (["bench", "strategies", "recipe.yaml", "--timeout", "-1"], "--timeout -1: give the seconds allowed per setup"),
])
def test_an_output_path_that_cannot_be_made_is_refused_before_any_work(work, tmp_path, capsys, monkeypatch, argv,
                                                                       says):
    """Before any work: the work each command does first (load a model, train the demo, run the bench's setups,
    draw the plots) raises here, so an OUT checked only when it is written (merge's after loading and merging both
    models) fails the test though its message is the same."""
    import transformers

    import shardtune.bench.strategies
    import shardtune.demo.run
    import shardtune.train.plot

    def work_began(*args, **kwargs):
        raise AssertionError("the command began its work before refusing OUT")

    for owner, name in ((transformers.AutoModelForCausalLM, "from_pretrained"), (shardtune.demo.run, "run_demo"),
                        (shardtune.bench.strategies, "bench_strategies"), (shardtune.train.plot, "write_plots")):
        monkeypatch.setattr(owner, name, work_began)
    monkeypatch.chdir(tmp_path)
    for name in ("model", "adapter", "a_file"):
        (tmp_path / name).symlink_to(work / name)
    (tmp_path / "nowhere_link").symlink_to(tmp_path / "gone")
    (tmp_path / "loop_link").symlink_to(tmp_path / "loop_link")
    (tmp_path / "recipe.yaml").write_text("model_name_or_path: model\ndataset_name: chat.jsonl\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    refused(capsys, [a.replace("{adapter}", "adapter") for a in argv], says)


def test_plot_of_metrics_that_are_no_text_names_the_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n\x00\xff\n')  # UnicodeDecodeError
    refused(capsys, ["plot", str(tmp_path)], f"{tmp_path / 'metrics.jsonl'}: line 2 is not UTF-8 text (byte 1)")


# ------------------------------------------------------------------------------------- generate and chat options


@pytest.mark.parametrize("extra,says", [
    (["--device", "tpu"], "--device tpu: not a device; give cpu, cuda or cuda:N"),  # RuntimeError traceback
    (["--device", "cuda:7"], "--device cuda:7: this machine has"),  # AssertionError (no CUDA) traceback
    (["--temperature", "nan"], "temperature must be a number >= 0 (got nan)"),  # accepted
])
def test_generate_options_are_checked_before_the_model_loads(work, capsys, monkeypatch, extra, says):
    import torch

    if extra[1] == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before its options were checked")

    monkeypatch.setattr("shardtune.infer.generate.load_for_generation", loaded)
    refused(capsys, ["generate", str(work / "model"), "--prompt", "hi", *extra], says)


def test_chat_refuses_its_options_before_greeting(work, capsys, monkeypatch):
    """Before: the greeting, then the refusal at the first turn: two lines."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    refused(capsys, ["chat", str(work / "model"), "--temperature", "-1"], "temperature must be a number >= 0")
