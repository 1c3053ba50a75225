"""Bad input refused in one line, exit code 2 (issue 20): a key set twice (in a YAML file, or on the command line),
a model folder without weights (before any tokenising), and a model folder that needs its own Python code when
trust_remote_code was not given. Each message names the input, the place and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.cli import main
from shardtune.errors import UsageError

# Keys and values only: a dry run opens neither the model nor the data.
DRY_RUN = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o", "--dry_run", "true"]
MARKER_CODE = "open({marker!r}, 'w').close()\n"  # what a model's own code does here: proof that it ran


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    return path


@pytest.fixture
def no_tokenising(monkeypatch):
    """Fails the test if a tokenizer is loaded: the refusals come before any data is tokenised."""
    import shardtune.data.templates

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the bad input was refused")

    monkeypatch.setattr(shardtune.data.templates, "load_tokenizer", refuse)


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse subcommands
        return int(exc.code)


# 1a. a key set twice in a YAML file


def test_a_key_set_twice_in_a_recipe_names_the_file_and_both_lines(tmp_path, capsys, no_tokenising):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: m\nseed: 1\nlearning_rate: 1e-4\nlora_r: 4\noutput_dir: out\n"
                      "fsdp_config:\n  fsdp_offload_params: true\n  fsdp_offload_params: false\nlearning_rate: 2e-4\n")
    assert main(["train", str(recipe)]) == 2
    assert error_line(capsys) == (f"shardtune train: error: {recipe}: key 'learning_rate' is set twice (lines 3 "
                                  f"and 9); keep one | {recipe}: key 'fsdp_offload_params' is set twice (lines 7 and "
                                  f"8); keep one")


def test_an_accelerate_file_is_read_with_the_same_check(tmp_path, capsys):
    """Also a key at the top and again under fsdp_config: both become the one flat key."""
    acc = tmp_path / "fsdp.yaml"
    acc.write_text("distributed_type: FSDP\nfsdp_sharding_strategy: FULL_SHARD\nfsdp_config:\n"
                   "  fsdp_sharding_strategy: SHARD_GRAD_OP\nnum_processes: 2\n")
    for argv in (["train", "--config_file", str(acc), "--model_name_or_path", "m", "--output_dir", "o"],
                 ["launch", "--config_file", str(acc), "--dry_run", "train"]):
        assert main(argv) == 2
        assert error_line(capsys).endswith(f"error: {acc}: key 'fsdp_sharding_strategy' is set twice (lines 2 and 4); "
                                           f"keep one")


def test_yaml_merges_and_overrides_from_the_command_line_stay_legal(tmp_path):
    from shardtune.cli.common import load_job_config
    from shardtune.config.loading import read_yaml_recipe

    nested = tmp_path / "nested.yaml"
    nested.write_text("defaults: &d {a: 1, b: 2}\nother:\n  <<: *d\n  b: 3\n")  # '<<' then a key: YAML's override
    assert read_yaml_recipe(nested)[0]["other"] == {"a": 1, "b": 3}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1e-4\nseed: 1\nuse_peft_lora: true\nlora_r: 4\n")
    cfg = load_job_config([str(recipe), *DRY_RUN, "learning_rate=2e-4", "--seed", "3"])
    assert (cfg.optim.learning_rate, cfg.run.seed, cfg.lora.lora_r) == (2e-4, 3, 4)  # YAML < key=value < --key


# 1b. a key given twice on the command line


@pytest.mark.parametrize("given,typed", [
    (["--learning_rate", "1e-4", "--seed", "1", "--learning_rate", "2e-4"],
     "--learning_rate 1e-4 and --learning_rate 2e-4"),
    (["learning_rate=1e-4", "--learning_rate", "2e-4"], "learning_rate=1e-4 and --learning_rate 2e-4"),
    (["--learning_rate=1e-4", "learning_rate=2e-4"], "--learning_rate=1e-4 and learning_rate=2e-4"),
    (["--lora-r", "4", "--lora_r", "8"], "--lora-r 4 and --lora_r 8"),
    # another tool's name as key=value and the key as a flag: the flag won without a word
    (["max_length=256", "--max_seq_len", "128"], "max_length=256 and --max_seq_len 128"),
    (["max_seq_len=256", "--max_length", "128"], "max_seq_len=256 and --max_length 128"),
])
def test_a_key_given_twice_on_the_command_line_names_both_as_typed(given, typed, capsys, no_tokenising):
    key = "lora_r" if "lora" in typed else "max_seq_len" if "max_" in typed else "learning_rate"
    assert main(["train", *DRY_RUN, *given]) == 2
    assert error_line(capsys) == f"shardtune train: error: command line: key '{key}' is given twice ({typed}); keep one"


def test_the_same_value_twice_loses_nothing_and_passes():
    from shardtune.cli.common import load_job_config

    cfg = load_job_config([*DRY_RUN, "--seed", "3", "--packing", "--seed", "3", "--packing"])
    assert cfg.run.seed == 3 and cfg.data.packing


def test_launch_passes_its_own_num_processes_to_train_without_a_conflict(capsys):
    """launch writes --num_processes/--num_machines (and --config_file) ahead of the user's train arguments: the
    same value after 'train' passes; another value is refused, saying where the launcher's option goes."""
    from shardtune.cli.common import load_job_config
    from shardtune.cli.launch import JOB, launcher_parser, torchrun_command

    def train_argv(launch: list[str], train: list[str]) -> list[str]:
        cmd = torchrun_command(launcher_parser().parse_args(launch), train)
        job = next(i for i in range(len(cmd)) if cmd[i:i + len(JOB)] == JOB)
        return cmd[job + len(JOB):]  # what launch checks, and every rank's 'shardtune train' reads

    same = train_argv(["--num_processes", "2"], [*DRY_RUN, "--num_processes", "2"])
    assert load_job_config(same).distributed.num_processes == 2
    with pytest.raises(UsageError) as refused:
        load_job_config(train_argv(["--num_processes", "2"], [*DRY_RUN, "--num_processes", "4"]))
    assert str(refused.value) == ("command line: key 'num_processes' is given twice (--num_processes 2 and "
                                  "--num_processes 4); keep one (under 'shardtune launch', write --num_processes "
                                  "before 'train': the launcher's value decides what starts)")
    assert main(["launch", "--num_processes", "2", "train", *DRY_RUN, "--num_processes", "4"]) == 2
    assert "key 'num_processes' is given twice" in error_line(capsys)


@pytest.mark.parametrize("train, refused", [
    (["--learning_rate", "1e-4", "--learning_rate", "2e-4"],
     "key 'learning_rate' is given twice (--learning_rate 1e-4 and --learning_rate 2e-4); keep one"),
    (["--num_processes", "4"], "key 'num_processes' is given twice (--num_processes 2 and --num_processes 4); keep "
                               "one (under 'shardtune launch', write --num_processes before 'train'"),
])
def test_launch_dry_run_refuses_a_key_given_twice_as_the_launch_does(train, refused, capsys):
    """launch --dry_run shows the command a launch would run: it must not print one the launch then refuses."""
    assert main(["launch", "--num_processes", "2", "--dry_run", "train", *train]) == 2
    assert refused in error_line(capsys)
    once = ["--learning_rate", "1e-4"] if "learning_rate" in refused else ["--num_processes", "2"]
    assert main(["launch", "--num_processes", "2", "--dry_run", "train", *once]) == 0  # printed
    assert "torch.distributed.run" in capsys.readouterr().out


# 2. a model folder with config.json but no weights


@pytest.fixture
def no_weights(tiny, tmp_path) -> Path:
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny, folder)
    (folder / "model.safetensors").unlink()
    return folder


def no_weights_message(name: str) -> str:
    return (f"{name} holds config.json but no weights (no *.safetensors, pytorch_model*.bin or *.index.json file; it "
            f"holds chat_template.jinja, config.json, generation_config.json, tokenizer.json, tokenizer_config.json): "
            f"copy the weight files into it, or give the folder that has them")


def test_train_refuses_a_model_folder_without_weights_before_tokenising(no_weights, data, tmp_path, capsys,
                                                                         no_tokenising):
    out = tmp_path / "out"
    assert main(["train", "--model_name_or_path", str(no_weights), "--dataset_name", str(data), "--output_dir",
                 str(out)]) == 2
    assert error_line(capsys) == ("shardtune train: error: command line (--model_name_or_path): "
                                  + no_weights_message(f"model_name_or_path '{no_weights}'"))
    assert not out.exists()


def test_a_gguf_repository_folder_is_refused_naming_its_gguf_file(no_weights, data, tmp_path, capsys, no_tokenising):
    """A GGUF repository (llama.cpp quantizations beside the original config.json) is a folder with config.json and
    no Transformers weights: train refuses it, and names the GGUF file to give instead."""
    (no_weights / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert main(["train", "--model_name_or_path", str(no_weights), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out")]) == 2
    assert error_line(capsys).endswith(f"or give the folder that has them, or give one of its GGUF files "
                                       f"({no_weights / 'model.Q4_K_M.gguf'}), which holds the weights")


def test_generate_chat_and_merge_refuse_a_model_folder_without_weights(no_weights, tmp_path, capsys):
    for command in ("generate", "chat"):
        argv = [command, str(no_weights), *(["--prompt", "hi"] if command == "generate" else [])]
        assert exit_code(argv) == 2
        assert error_line(capsys) == f"shardtune {command}: error: " + no_weights_message(f"'{no_weights}'")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(no_weights)}))
    assert exit_code(["generate", str(adapter), "--prompt", "hi"]) == 2
    assert error_line(capsys) == ("shardtune generate: error: " + no_weights_message(
        f"{adapter / 'adapter_config.json'}: base model folder '{no_weights}'"))
    assert exit_code(["merge", str(adapter), "--base", str(no_weights), str(tmp_path / "merged")]) == 2
    assert error_line(capsys) == "shardtune merge: error: " + no_weights_message(f"--base {no_weights}")


def test_a_folder_without_config_json_is_refused_by_train(tmp_path, data, capsys, no_tokenising):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["train", "--model_name_or_path", str(folder), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (f"shardtune train: error: command line (--model_name_or_path): model_name_or_path "
                                  f"'{folder}' holds no config.json (it holds model.safetensors): give a Transformers "
                                  f"model folder, the one save_pretrained wrote")


# 3. a model folder that needs its own Python code


@pytest.fixture
def custom_code(tiny, tmp_path) -> tuple[Path, Path]:
    """The tiny model as a model type transformers does not have, its classes in the folder's own files, which
    create a marker file when they are imported."""
    folder, marker = tmp_path / "custom", tmp_path / "code-ran"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tinyfoo", architectures=["FooForCausalLM"],
                  auto_map={"AutoConfig": "configuration_foo.FooConfig",
                            "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_foo.py").write_text(MARKER_CODE.format(marker=str(marker)) + (
        "from transformers import LlamaConfig\n\n\nclass FooConfig(LlamaConfig):\n    model_type = 'tinyfoo'\n"))
    (folder / "modeling_foo.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_foo import FooConfig\n\n\n"
        "class FooForCausalLM(LlamaForCausalLM):\n    config_class = FooConfig\n")
    return folder, marker


def custom_code_message(name: str) -> str:
    return (f"{name} needs its own Python code to load (config.json: model_type 'tinyfoo', auto_map AutoConfig -> "
            f"configuration_foo.FooConfig, AutoModelForCausalLM -> modeling_foo.FooForCausalLM), and shardtune does "
            f"not run code from a model folder unless asked: if you trust that code, ")


def test_generate_and_chat_refuse_custom_code_unless_trust_remote_code(custom_code, capsys):
    folder, marker = custom_code
    for command in ("generate", "chat"):
        argv = [command, str(folder), *(["--prompt", "hi"] if command == "generate" else [])]
        assert exit_code(argv) == 2
        assert error_line(capsys) == (f"shardtune {command}: error: " + custom_code_message(f"'{folder}'")
                                      + "pass --trust_remote_code")
        assert not marker.exists()
    from shardtune.hub import model_folder_problem

    # Asked for, the code is left to transformers to run (not here: it would import it from ~/.cache).
    assert model_folder_problem(folder, "m", trust_remote_code=True, trust_fix="") is None


def test_train_refuses_custom_code_unless_trust_remote_code(custom_code, data, tmp_path, capsys, no_tokenising):
    folder, marker = custom_code
    assert main(["train", "--model_name_or_path", str(folder), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out")]) == 2
    assert error_line(capsys) == ("shardtune train: error: command line (--model_name_or_path): "
                                  + custom_code_message(f"model_name_or_path '{folder}'")
                                  + "set trust_remote_code true")
    assert not marker.exists()


def test_an_auto_map_for_a_model_type_transformers_has_is_not_refused(tiny, tmp_path):
    """Models that shipped code before transformers adopted them (auto_map beside a known model_type) load with
    transformers' own classes, as transformers does without trust_remote_code: nothing to refuse."""
    from shardtune.hub import model_folder_problem

    folder = tmp_path / "adopted"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_llama_old.LlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    assert model_folder_problem(folder, "m", trust_remote_code=False, trust_fix="") is None


def test_launch_refuses_processes_a_file_after_train_asks_for_and_it_would_not_start(tmp_path, capsys):
    """A recipe of num_processes 2 (as estimate --emit-config writes one) or an Accelerate file given after 'train'
    ran one process: the launcher's own values, written ahead of the user's arguments, won without a word. Refused,
    naming the file, line and where the value goes; the same value given to the launcher starts it."""
    recipe, accelerate = tmp_path / "r2.yaml", tmp_path / "acc.yaml"
    recipe.write_text("model_name_or_path: M\ndataset_name: d.jsonl\nnum_processes: 2\n")
    accelerate.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    for train in ([str(recipe)], ["--config_file", str(accelerate)]):
        assert main(["launch", "--dry_run", "train", *train]) == 2
        where = f"{recipe}, line 3" if train == [str(recipe)] else f"{accelerate}, line 2"
        assert error_line(capsys) == (f"shardtune launch: error: {where}: num_processes=2, but the launcher starts 1; "
                                      f"give it to the launcher (shardtune launch --num_processes 2 train ...), which "
                                      f"decides what starts, or to start 1 take num_processes out of the file (a "
                                      f"run's saved config.yaml records the num_processes it ran on)")
        assert main(["launch", "--num_processes", "2", "--dry_run", "train", *train]) == 0
        assert "--nproc_per_node 2" in capsys.readouterr().out


def test_a_launcher_option_whose_value_is_train_is_read_as_its_value(capsys):
    """--partition train (a common Slurm partition) was taken for the command: 'expected one argument'."""
    job = ["--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir", "o"]
    assert main(["launch", "--slurm", "--partition", "train", "--gpus_per_node", "2", "--dry_run", "train", *job]) == 0
    assert "#SBATCH --partition=train" in capsys.readouterr().out
    assert main(["launch", "--slurm", "--job_name", "train", "--gpus_per_node", "2", "--dry_run", "train", *job]) == 0
    assert "#SBATCH --job-name=train" in capsys.readouterr().out


def test_model_parallel_on_several_processes_is_refused_before_anything_starts(capsys):
    """MP runs in one process over several devices: launched on 2 processes (or written into a cluster job), it
    was refused only by every worker once started, on a cluster after the job's wait in the queue."""
    job = ["--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir", "o", "--distributed_type", "MP"]
    for launcher in (["--num_processes", "2", "--dry_run"], ["--slurm", "--gpus_per_node", "2", "--dry_run"]):
        assert main(["launch", *launcher, "train", *job]) == 2
        assert "distributed_type=MP runs in one process over several devices (mp_devices), not on 2 processes" in \
            error_line(capsys)
    assert main(["launch", "--num_processes", "1", "--dry_run", "train", *job]) == 0


def test_pipeline_parallel_on_one_process_is_refused_before_the_data_is_tokenised(tiny, data, tmp_path, capsys,
                                                                                  monkeypatch):
    """PP needs one process per stage: 'shardtune train --distributed_type PP' (no launch) tokenised the whole data
    set (minutes for a large one) before it was refused."""
    import shardtune.data

    def refuse(*args, **kwargs):
        raise AssertionError("the data was tokenised before the bad input was refused")

    monkeypatch.setattr(shardtune.data, "prepare_datasets", refuse)
    assert main(["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out"), "--distributed_type", "PP"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "shardtune train: error: distributed_type=PP needs one process per pipeline stage: start it with 'shardtune "
        "launch --num_processes N train ...'")


@pytest.mark.parametrize("given,typed", [
    (["d.jsonl", "--max_seq_len", "32", "--max_seq_len", "128"], "--max_seq_len 32 and --max_seq_len 128"),
    (["d.jsonl", "--dataset_name", "e.jsonl"], "--dataset_name d.jsonl and --dataset_name e.jsonl"),
])
def test_data_inspect_refuses_a_key_given_twice_as_train_does(given, typed, capsys, no_tokenising):
    """'data inspect' reads train's arguments so that a recipe is inspected as it will be trained: it took the last
    of two values without a word, where train refuses the same command line."""
    key = typed.split()[0][2:]
    assert main(["data", "inspect", *given, "--model_name_or_path", "m"]) == 2
    assert error_line(capsys) == (f"shardtune data inspect: error: command line: key '{key}' is given twice "
                                  f"({typed}); keep one")
