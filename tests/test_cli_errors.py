"""Bad input found in a user walkthrough: each gets one line naming the input, the place and the fix, exit code 2,
no traceback, and no minute of hub retries or model loading before it."""

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from shardtune.cli import main
from shardtune.errors import UsageError, closest

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # a slip to the hub fails at once, not in ~50 s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    return make_model_folder(tmp_path_factory.mktemp("tiny") / "model", tokenizer=make_tokenizer())


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def exits_2(argv: list[str]) -> None:
    """argparse subcommands end in SystemExit(2); the others return 2."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2


# 1. data sets neither local nor on the hub


def test_unreachable_hub_data_set_is_a_usage_error(monkeypatch):
    import datasets

    from shardtune.data.readers import Source, iter_split

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someorg/somedata' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UsageError, match=r"'someorg/somedata' is neither a local path nor a reachable hub data set "
                                         r"\(Couldn't reach .*\); give a local file or folder"):
        list(iter_split(Source("hub", "someorg/somedata"), "train"))


def test_unreachable_hub_data_set_from_the_command_line(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardtune", "data", "inspect", "someorg/somedata",
                           "--model_name_or_path", str(tiny)], capture_output=True, text=True, cwd=tmp_path,
                          env=os.environ | OFFLINE, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [errors[0]] and "neither a local path nor a reachable hub data set" in errors[0]


def test_name_under_an_existing_local_folder_is_a_missing_path(tmp_path, monkeypatch):
    from shardtune.data.readers import resolve

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match=r"dataset_name 'out/nodata' does not exist: check the path \('out' is a "
                                         r"local folder"):
        resolve("out/nodata", ["train"])


# 2. the --emit-config placeholder, and merge --base


def test_estimate_refuses_the_sequence_lengths_train_refuses(tiny, tmp_path, capsys):
    """estimate said "fits" at a length beyond the model's positions and --emit-config wrote a recipe train then
    refused; a catalog model is read from its shipped config, a folder or config.json from its own."""
    # Llama 3.1's max_position_embeddings is already scaled by its rope_scaling (it read as 8 x 131072).
    for model, seq_len, limit, where in (("llama-2-70b", 8192, 4096, "catalog llama-2-70b: max_position_embeddings"),
                                         ("llama-3.1-8b", 200_000, 131072,
                                          "catalog llama-3.1-8b: max_position_embeddings"),
                                         (str(tiny), 4096, 2048, f"{tiny / 'config.json'}: max_position_embeddings")):
        assert main(["estimate", model, "--seq-len", str(seq_len), "--emit-config", str(tmp_path / "r.yaml")]) == 2
        assert one_error_line(capsys) == (f"shardtune estimate: error: --seq-len {seq_len} is beyond the {limit} "
                                          f"positions {model} covers ({where}); set --seq-len {limit} or less, or "
                                          f"give the model a longer context first (rope_scaling in its config.json)")
    for short in ("1", "0"):  # max_seq_len's declared bound, as train refuses it
        assert main(["estimate", "llama-3.1-8b", "--seq-len", short]) == 2
        assert one_error_line(capsys) == (f"shardtune estimate: error: --seq-len must be a whole number >= 2 (got "
                                          f"{short}): a row needs one token to predict from and one to predict.")
    assert not (tmp_path / "r.yaml").exists()
    assert main(["estimate", "llama-2-70b", "--seq-len", "4096"]) == 0


@pytest.fixture
def emitted(tiny, tmp_path) -> Path:
    recipe = tmp_path / "recipe.yaml"
    assert main(["estimate", str(tiny), "--method", "lora", "--emit-config", str(recipe)]) == 0
    return recipe


def test_emitted_config_uses_the_placeholder_config_rejects(emitted):
    from shardtune.config import DATASET_PLACEHOLDER

    assert f"dataset_name: {DATASET_PLACEHOLDER}\n" in emitted.read_text()



@pytest.mark.parametrize("name", ["recipe.json", "recipe.txt", "recipe"])
def test_emit_config_to_a_file_train_cannot_read_is_refused_before_writing(tiny, tmp_path, name, capsys):
    """--emit-config r.json wrote YAML into a .json file, which 'shardtune train r.json' then refused as not a
    recipe; a name train reads (.yaml, .yml) is asked for before anything is estimated or written."""
    path = tmp_path / name
    assert main(["estimate", str(tiny), "--method", "lora", "--emit-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--emit-config {path}: the recipe is written in YAML" in err and f"name it {tmp_path}/recipe.yaml" in err
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert main(["estimate", str(tiny), "--method", "lora", "--emit-config", str(tmp_path / "r.yml")]) == 0
    assert (tmp_path / "r.yml").read_text().startswith("# Written by shardtune: a 'shardtune train' recipe")

def test_placeholder_data_set_is_refused_before_the_model_loads(emitted, capsys, monkeypatch):
    import shardtune.data.templates

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the placeholder was refused")

    monkeypatch.setattr(shardtune.data.templates, "load_tokenizer", no_load)
    line = [n for n, text in enumerate(emitted.read_text().splitlines(), 1) if text.startswith("dataset_name:")][0]
    for command in (["train", str(emitted)], ["data", "inspect", str(emitted)]):
        assert main(command) == 2
        error = one_error_line(capsys)
        assert f"{emitted}, line {line}: dataset_name is still the placeholder" in error
        assert error.endswith("set dataset_name to your data (a local file/folder or a hub data set)")


def test_placeholder_is_fine_where_no_data_is_read(emitted):
    from shardtune.config import load_run_config, load_train_config

    assert load_train_config([str(emitted)]).data.dataset_name  # what estimate's own tests read back
    assert load_run_config([str(emitted), "--dry_run"]).run.dry_run  # a dry run traces, it reads no rows
    data = emitted.parent / "chat.jsonl"
    data.write_text("")
    assert load_run_config([str(emitted), "--dataset_name", str(data)]).data.dataset_name == str(data)


def test_missing_local_model_or_data_is_refused_before_anything_loads(emitted, capsys, monkeypatch):
    """Paths that are not there fail at once with where they were set; hub names (ORG/NAME) are not looked up."""
    import shardtune.data.templates

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the missing path was refused")

    monkeypatch.setattr(shardtune.data.templates, "load_tokenizer", no_load)
    monkeypatch.chdir(emitted.parent)
    assert main(["train", str(emitted), "--model_name_or_path", "./models/llama", "--dataset_name", "meta/data"]) == 2
    assert one_error_line(capsys) == ("shardtune train: error: command line (--model_name_or_path): model_name_or_path "
                                      "'./models/llama' does not exist: give a local model folder or a hub name "
                                      "(ORG/NAME)")
    assert main(["train", str(emitted), "--dataset_name", "data/train.jsonl"]) == 2
    assert one_error_line(capsys) == ("shardtune train: error: command line (--dataset_name): dataset_name "
                                      "'data/train.jsonl' does not exist: check the path")
    for command in (["train", "--dataset_name", "org/data", "--output_dir", "out"], ["data", "inspect", "org/data"]):
        assert main(command) == 2  # no model at all: said so, no traceback from the path check
        assert "model_name_or_path is required" in one_error_line(capsys)


def test_merge_and_export_refuse_a_missing_base_folder_at_once(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert main(["merge", str(adapter), "--base", str(tmp_path / "nosuchbase"), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys) == (f"shardtune merge: error: --base {tmp_path / 'nosuchbase'}: no such folder; "
                                      f"give the base model folder the adapter was trained on")
    assert main(["export", str(adapter), str(tmp_path / "out"), "--base", str(tmp_path / "nosuchbase")]) == 2
    assert "no such folder" in one_error_line(capsys)


# 3. mistyped options of argparse subcommands


@pytest.mark.parametrize("argv,error", [
    (["estimate", "llama-3.1-8b", "--methd", "lora"],
     "shardtune estimate: error: unknown option --methd; did you mean --method? (see 'shardtune estimate --help')"),
    (["estimate", "llama-3.1-8b", "--num_gpus", "2"],
     "shardtune estimate: error: unknown option --num_gpus; did you mean --num-gpus?"),
    (["generate", "M", "--promt", "hi"], "shardtune generate: error: unknown option --promt; did you mean --prompt?"),
    (["chat", "M", "--temprature", "1"], "shardtune chat: error: unknown option --temprature; did you mean"),
    (["merge", "A", "--bsae", "X", "OUT"], "shardtune merge: error: unknown option --bsae; did you mean --base?"),
    (["export", "C", "OUT", "--bsae", "X"], "shardtune export: error: unknown option --bsae; did you mean --base?"),
    (["plot", "out", "--bogus"], "shardtune plot: error: unknown option --bogus (see 'shardtune plot --help')"),
    (["demo", "--skip-estimte"], "shardtune demo: error: unknown option --skip-estimte; did you mean --skip-estimate?"),
    (["bench", "strategies", "c.yaml", "--stratgies", "ddp"],
     "shardtune bench strategies: error: unknown option --stratgies; did you mean --strategies?"),
    (["launch", "--num_procesess", "2", "train"], "shardtune launch: error: unknown option --num_procesess; "
                                                  "did you mean --num_processes?"),
    (["estimate", "llama-3.1-8b", "extra"], "shardtune estimate: error: unrecognized arguments: extra"),
    # train's keys, as a recipe's user writes them: no word was said for most (--per_device_train_batch_size,
    # --use_peft_lora, --learning_rate), and TRL's --max_length was offered nothing
    (["estimate", "llama-3.1-8b", "--per_device_train_batch_size", "4"],
     "shardtune estimate: error: unknown option --per_device_train_batch_size; per_device_train_batch_size is "
     "--batch-size here"),
    (["estimate", "llama-3.1-8b", "--max_length", "512"],
     "shardtune estimate: error: unknown option --max_length; max_seq_len is --seq-len here"),
    (["estimate", "llama-3.1-8b", "--use_peft"],
     "shardtune estimate: error: unknown option --use_peft; use_peft_lora is --method lora here"),
    (["estimate", "llama-3.1-8b", "--learning_rate", "1e-4"],
     "shardtune estimate: error: unknown option --learning_rate; learning_rate is a 'shardtune train' key with no "
     "estimate option: give the job as a recipe with --config FILE"),
    # train's --deepspeed was told to give "a recipe with --config FILE": the DeepSpeed JSON itself is one
    (["estimate", "llama-3.1-8b", "--deepspeed", "ds.json"],
     "shardtune estimate: error: unknown option --deepspeed; deepspeed is --config DS_CONFIG.json (with the recipe's "
     "--config beside it) here"),
    (["estimate", "--model_name_or_path", "llama-3.1-8b", "--gpu", "rtx4090"],
     "shardtune estimate: error: unknown option --model_name_or_path; the model is the first argument, not an "
     "option: 'shardtune estimate MODEL [options]'"),
    (["estimate", "--model", "llama-3.1-8b"], "shardtune estimate: error: unknown option --model; the model is the "
                                              "first argument"),
    # Transformers' generate() settings were 'unknown option' and no more: each says what to give instead
    (["generate", "M", "--prompt", "hi", "--do_sample"],
     "shardtune generate: error: unknown option --do_sample; --temperature above 0 samples (0 decodes greedily): "
     "leave out --do_sample, and give --temperature 1.0 for Transformers' sampling default"),
    (["chat", "M", "--num-beams=4"], "shardtune chat: error: unknown option --num-beams; beam search is not offered: "
                                     "--temperature 0 decodes greedily (num_beams 1), above 0 samples"),
    (["generate", "M", "--prompt", "hi", "--max_length", "20"],
     "shardtune generate: error: unknown option --max_length; give --max_new_tokens N, the reply's length "
     "(max_length counts the prompt too)"),
    (["chat", "M", "--min_p", "0.1"],
     "shardtune chat: error: unknown option --min_p; Transformers' generate() setting min_p is not offered; "
     "shardtune chat takes --max_new_tokens, --temperature, --top_p, --top_k, --repetition_penalty and --seed"),
    (["generate", "--model_name_or_path", "M", "--prompt", "hi"],
     "shardtune generate: error: unknown option --model_name_or_path; the model is the first argument: "
     "'shardtune generate MODEL_OR_ADAPTER' (a model folder, a run's final/ or a .gguf)"),
    (["generate", "M", "--prompt", "hi", "--max_tokens", "3"],  # a near miss keeps the spelling hint
     "shardtune generate: error: unknown option --max_tokens; did you mean --max_new_tokens?"),
])
def test_unknown_option_names_the_subcommand_and_the_option_meant(argv, error, capsys):
    exits_2(argv)
    assert one_error_line(capsys).startswith(error)


# 4. launch


@pytest.mark.parametrize("option, says", [
    ("--mixed_precision", "it is a key of the job: write it after 'train' (shardtune launch ... train "
                          "--mixed_precision VALUE)"),
    ("--use_fsdp", "here the job says so after 'train': --distributed_type FSDP"),
    ("--num_procs", "did you mean --num_processes?"),
    # torchrun's own names (shardtune launch runs torchrun): --nproc_per_node was offered --gpus_per_node, a Slurm
    # option, where processes per machine is what it means
    ("--nproc_per_node", "that is torchrun's processes per machine, and here --num_processes counts those of all "
                         "machines (Accelerate's meaning): give --num_processes (per machine x machines)"),
    ("--master-port", "that is torchrun's rendezvous port: give --main_process_port"),
    # Accelerate launch's flags: --deepspeed_config_file was offered --config_file, --dynamo_backend --rdzv_backend,
    # --cpu was "ambiguous" (a prefix of --cpus_per_task), --zero_stage and --gpu_ids got no word
    ("--deepspeed_config_file", "here the job says so after 'train': --deepspeed ds_config.json (run as FSDP)"),
    ("--zero_stage", "here the job says so after 'train': --deepspeed ds_config.json (its zero_optimization.stage"),
    ("--dynamo_backend", "it is a key of the job: write it after 'train' (shardtune launch ... train "
                         "--dynamo_backend VALUE)"),
    ("--cpu", "to train on CPUs, hide the GPUs: CUDA_VISIBLE_DEVICES= shardtune launch ..."),
    ("--gpu_ids", "choose the GPUs with CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES=0,1 shardtune launch ..."),
])
def test_launch_says_where_a_jobs_key_goes(option, says, capsys):
    """Accelerate's launcher takes mixed_precision and --use_fsdp before the script; here they are the job's, after
    'train', and the error said only 'unknown option'."""
    from tests.trainutil import refused

    line = refused(capsys, ["launch", "--num_processes", "2", option, "bf16", "train", "--model_name_or_path", "M"])
    assert line.startswith(f"shardtune launch: error: unknown option {option}; {says}")


def test_launch_names_a_mistyped_command(capsys):
    assert main(["launch", "--num_processes", "2", "trian", "--model_name_or_path", "M"]) == 2
    assert one_error_line(capsys).startswith("shardtune launch: error: unknown command 'trian'; did you mean 'train'?")
    assert main(["launch", "--num_processes", "2", "estimate"]) == 2
    assert "unknown command 'estimate': launch runs 'train' after its options" in one_error_line(capsys)


def test_launch_checks_the_training_keys_once_before_spawning(monkeypatch, capsys, tmp_path):
    from shardtune.cli import launch

    spawned = []
    monkeypatch.setattr(launch, "run_torchrun", lambda args: spawned.append(args) or 0)
    job = ["launch", "--num_processes", "2", "train", "--model_name_or_path", "no/such-model", "--dataset_name",
           "no/such-data", "--output_dir", str(tmp_path / "out")]
    assert main([*job, "--distributed_type", "FSPD"]) == 2
    assert one_error_line(capsys) == ("shardtune launch: error: distributed_type='FSPD' is not accepted; use one of "
                                      "NO, DDP, FSDP, MP, PP (did you mean FSDP?)")
    assert main([*job, "--dataset_name", str(tmp_path / "nosuch.jsonl")]) == 2  # a local path: it must be there
    assert one_error_line(capsys).endswith(f"dataset_name '{tmp_path / 'nosuch.jsonl'}' does not exist: check the path")
    assert spawned == []
    assert main(job) == 0 and len(spawned) == 1  # hub names are not looked up before the job starts


# 5. GPU names


def test_a_shortened_gpu_name_suggests_the_gpu_it_starts(capsys):
    assert closest("h100", ["h100-80gb", "h200", "a100-80gb"]) == "h100-80gb"
    assert closest("a100", ["h100-80gb", "a100-80gb", "a100-40gb"]) in ("a100-80gb", "a100-40gb")
    assert closest("h20", ["h100-80gb", "h200"]) == "h200"
    for command in (["estimate", "llama-3.1-8b", "--gpu", "h100"], ["demo", "--gpu", "h100"]):
        assert main(command) == 2
        assert one_error_line(capsys).endswith("Did you mean 'h100-80gb'?")



def test_a_gpu_is_found_as_its_owner_spells_it(capsys):
    """--gpu "RTX 4090" (as nvidia-smi and shops spell it), A100-80GB or "NVIDIA GeForce RTX 3090" were unknown GPUs
    beside rtx4090, a100-80gb and rtx3090; case, spaces, dashes, underscores and NVIDIA's or GeForce's word no
    longer matter. A name that stays ambiguous (h100: SXM or PCIe) still asks."""
    from shardtune.hardware import GPUS, gpu_by_name

    for typed, key in (("RTX 4090", "rtx4090"), ("rtx-4090", "rtx4090"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
                       ("A100-80GB", "a100-80gb"), ("a100 40gb", "a100-40gb"), ("H100_80GB_PCIe", "h100-80gb-pcie"),
                       ("T4", "t4")):
        assert gpu_by_name(typed) is GPUS[key]
    assert main(["estimate", "llama-3.2-1b", "--gpu", "RTX 4090", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["name"] == "rtx4090"
    assert main(["estimate", "llama-3.2-1b", "--gpu", "h100 pcie"]) == 2
    assert one_error_line(capsys).endswith("Did you mean 'h100-80gb-pcie'?")

# 6. checkpoint folders that do not exist


@pytest.fixture
def run_dir(tmp_path) -> Path:
    # step-9 before step-10: listed and picked by their numbers, which their names sort the other way
    for step, complete in ((9, True), (10, True), (20, True), (30, False)):
        folder = tmp_path / "out" / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "manifest.json").write_text(json.dumps({"step": step, "world_size": 1, "trainable_only": False}))
            (folder / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": step / 100, "sampler": {
                "epoch": 0, "step_in_epoch": step, "num_rows": 100, "global_batch_size": 1}}))
    return tmp_path / "out"


def test_export_of_a_missing_checkpoint_lists_the_ones_there(run_dir, tmp_path, capsys):
    missing = run_dir / "checkpoints" / "step-99"
    assert main(["export", str(missing), str(tmp_path / "x")]) == 2
    assert one_error_line(capsys) == (f"shardtune export: error: {missing}: no such folder; {missing.parent} holds "
                                      f"step-9, step-10, step-20: give one of those")
    # a half-written checkpoint (a save killed, a copy cut short) was answered 'give an output_dir/checkpoints/step-N
    # folder', which it is: the complete ones beside it are named
    for half in (run_dir / "checkpoints" / "step-30", run_dir / "checkpoints" / ".tmp-step-30"):
        half.mkdir(exist_ok=True)
        assert main(["export", str(half), str(tmp_path / "x")]) == 2
        assert one_error_line(capsys) == (
            f"shardtune export: error: {half}: not a complete shardtune checkpoint (no manifest.json: a save that did "
            f"not finish, or a copy cut short); {half.parent} holds step-9, step-10, step-20: give one of those")
    (tmp_path / "notes").mkdir()
    assert main(["export", str(tmp_path / "notes"), str(tmp_path / "x")]) == 2
    assert "not a complete shardtune checkpoint (no manifest.json); give an output_dir/" in one_error_line(capsys)
    assert main(["export", str(tmp_path / "elsewhere" / "step-1"), str(tmp_path / "x")]) == 2
    assert "does not exist either); give an output_dir/checkpoints/step-N folder" in one_error_line(capsys)
    # The run's output_dir (or its checkpoints/) given for a checkpoint: its newest complete one is named
    for given in (run_dir, run_dir / "checkpoints"):
        assert main(["export", str(given), str(tmp_path / "x")]) == 2
        assert one_error_line(capsys) == (f"shardtune export: error: {given}: not a checkpoint, but it holds "
                                          f"checkpoints: give one of them, e.g. the newest, "
                                          f"{run_dir / 'checkpoints' / 'step-20'}")


def test_resume_from_a_missing_checkpoint_fails_before_the_model_loads(run_dir, capsys, monkeypatch):
    import shardtune.train.loop

    def no_training(cfg):
        raise AssertionError("the job started before its resume folder was checked")

    monkeypatch.setattr(shardtune.train.loop, "train", no_training)
    missing = run_dir / "checkpoints" / "step-25"
    assert main(["train", "--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir", str(run_dir),
                 "--resume_from_checkpoint", str(missing)]) == 2
    error = one_error_line(capsys)
    assert f"resume_from_checkpoint={missing}: no such folder; {missing.parent} holds step-9, step-10, step-20" in error
    assert error.endswith("give one of those, or true for the newest one")


@pytest.mark.parametrize("weights,how", [
    ("adapter_config.json", "merge its adapter into the base (shardtune merge {ckpt} --base BASE MERGED) and give "
                            "model_name_or_path MERGED"),
    ("model.safetensors", "give model_name_or_path {ckpt}"),
])
def test_a_transformers_trainer_checkpoint_given_to_resume_is_named_as_one(tmp_path, capsys, monkeypatch, weights,
                                                                            how):
    """A run moved from Transformers' Trainer, resumed from its output_dir/checkpoint-500, was told 'not a complete
    shardtune checkpoint (no manifest.json); give an output_dir/checkpoints/step-N folder', which it has not. It is
    told what the folder is, that it cannot resume here, and how to train on from its weights."""
    import shardtune.train.checkpoint
    import shardtune.train.loop

    monkeypatch.setattr(shardtune.train.loop, "train", lambda cfg: pytest.fail("the job started"))
    ckpt = tmp_path / "trainer-out" / "checkpoint-500"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 500, "log_history": []}))
    (ckpt / weights).write_text("{}")
    assert main(["train", "--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir",
                 str(tmp_path / "out"), "--resume_from_checkpoint", str(ckpt)]) == 2
    assert one_error_line(capsys).endswith(
        f"resume_from_checkpoint={ckpt}: a Transformers Trainer checkpoint (global_step 500), which shardtune cannot "
        f"resume: its optimizer, scheduler and data position are Trainer's. To train on from its weights, "
        f"{how.format(ckpt=ckpt)}, with resume_from_checkpoint false and a new output_dir")
    # true in that Trainer's output_dir started from scratch beside its checkpoints ('no complete checkpoint')
    older = tmp_path / "trainer-out" / "checkpoint-90"
    older.mkdir()
    (older / "trainer_state.json").write_text(json.dumps({"global_step": 90}))
    resolve_resume = shardtune.train.checkpoint.resolve_resume
    with pytest.raises(UsageError) as refused:
        resolve_resume("true", ckpt.parent)
    assert str(refused.value) == (
        f"resume_from_checkpoint=true: no shardtune checkpoint in {ckpt.parent}, only {ckpt}: a Transformers Trainer "
        f"checkpoint (global_step 500), which shardtune cannot resume: its optimizer, scheduler and data position are "
        f"Trainer's. To train on from its weights, {how.format(ckpt=ckpt)}, with resume_from_checkpoint false and a "
        f"new output_dir")
    assert resolve_resume("true", older) is None and resolve_resume("true", tmp_path / "fresh") is None


def test_resolve_resume_says_the_folder_is_missing(run_dir):
    from shardtune.train.checkpoint import resolve_resume

    with pytest.raises(UsageError, match="step-99: no such folder; .* holds step-9, step-10, step-20:"):
        resolve_resume(str(run_dir / "checkpoints" / "step-99"), run_dir)
    assert resolve_resume(str(run_dir / "checkpoints" / "step-20"), run_dir) == run_dir / "checkpoints" / "step-20"


def test_a_saved_config_with_a_rotated_resume_folder_still_loads(run_dir):
    from shardtune.config import load_train_config, save_resolved
    from shardtune.config.loading import load_saved_config

    # export reads a run's config.yaml, whose resume folder may since have been deleted (save_total_limit)
    rotated = str(run_dir / "checkpoints" / "step-5")
    cfg = load_train_config(["--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir", str(run_dir),
                             "--resume_from_checkpoint", rotated])
    assert cfg.checkpoint.resume_from_checkpoint == rotated
    saved = run_dir / "checkpoints" / "step-20" / "config.yaml"
    save_resolved(cfg, saved)
    assert load_saved_config(saved).checkpoint.resume_from_checkpoint == rotated  # as export and resume read it


# 7. library noise on stderr


NOISE = ("Failed to load CPU gemm_4bit_forward", "is_gradient_checkpointing", "torch.distributed is disabled")


def test_estimate_trace_prints_no_library_noise(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardtune", "estimate", str(tiny), "--method", "lora", "--trace"],
                          capture_output=True, text=True, cwd=tmp_path, env=os.environ | OFFLINE, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [noise for noise in NOISE if noise in proc.stderr], proc.stderr


def test_only_those_library_messages_are_silenced(tiny, tmp_path, caplog, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    # A training run in this process (the trainer's loop, the demo's evaluation) sets bitsandbytes' logger to ERROR
    # for its own duration and beyond: start from the library's default, as a fresh CLI process does.
    monkeypatch.setattr(logging.getLogger("bitsandbytes"), "level", logging.NOTSET)
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")  # every warning the CLI's filters let through is recorded
        assert main(["estimate", "--list"]) == 0  # the CLI's start-up puts its filters in front
        assert model.is_gradient_checkpointing is False
        state = {"w": torch.zeros(2)}
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        bnb.warning("another bitsandbytes warning")
        warnings.warn("another user warning", UserWarning)
        warnings.warn("another future warning", FutureWarning)
    shown = [str(w.message) for w in caught]
    assert not [m for m in shown if any(noise in m for noise in NOISE)], shown
    assert "another user warning" in shown and "another future warning" in shown
    assert [r.getMessage() for r in caplog.records if r.name == bnb.name] == ["another bitsandbytes warning"]


def test_ctrl_c_on_a_single_process_run_says_how_to_go_on(tiny, tmp_path, capsys, monkeypatch):
    from shardtune.cli import train

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    data = tmp_path / "chat.jsonl"
    data.write_text("")
    assert main(["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out")]) == 130
    assert one_error_line(capsys) == ("shardtune train: interrupted; no checkpoint was saved for it: "
                                      "resume_from_checkpoint true carries on from the newest earlier checkpoint "
                                      "under output_dir/checkpoints, where there is one (else the run starts over)")
    monkeypatch.setenv("RANK", "0")  # a rank of a launched job: the launcher says it, once
    assert main(["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == ""


def test_output_dir_that_is_a_file_or_read_only_is_one_line(tiny, tmp_path, capsys, monkeypatch, restore_logging):
    import errno
    from pathlib import Path

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    taken = tmp_path / "out"
    taken.write_text("a file")
    argv = ["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--max_steps", "1"]
    assert main([*argv, "--output_dir", str(taken)]) == 2
    assert one_error_line(capsys) == (f"shardtune train: error: output_dir {taken} is a file, not a folder: give a "
                                      f"folder (it is created if missing)")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main([*argv, "--output_dir", str(tmp_path / "new")]) == 2
    assert one_error_line(capsys) == (f"shardtune train: error: output_dir {tmp_path / 'new'} cannot be written "
                                      f"(read-only: Read-only file system): fix its permissions or give another "
                                      f"output_dir")


def test_train_without_the_launcher_refuses_several_processes(tiny, tmp_path, capsys, monkeypatch):
    """shardtune train starts no processes: num_processes 2 outside torchrun would train on one, silently (while
    its dry run and estimate describe two)."""
    from tests.trainutil import write_chat_data

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=20)
    argv = ["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
            str(tmp_path / "out"), "--num_processes", "2", "--distributed_type", "DDP"]
    exits_2(argv)
    assert one_error_line(capsys) == ("shardtune train: error: command line (--num_processes): num_processes=2: "
                                      "shardtune train runs one process; start 2 with shardtune launch "
                                      "--num_processes 2 train ..., or set num_processes 1")
    assert not (tmp_path / "out").exists()
    accelerate = tmp_path / "accelerate.yaml"  # where a user meets it: an Accelerate file for several GPUs
    accelerate.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    exits_2([*argv[:-4], "--config_file", str(accelerate)])
    assert one_error_line(capsys).startswith(f"shardtune train: error: {accelerate}, line 2: num_processes=2: ")
    # The launcher's own keys place a process in a job that train alone never joins.
    exits_2([*argv[:-4], "--machine_rank", "1", "--main_process_ip", "10.0.0.1"])
    assert one_error_line(capsys) == ("shardtune train: error: command line (--machine_rank); command line "
                                      "(--main_process_ip): machine_rank=1, main_process_ip=10.0.0.1: shardtune "
                                      "launch reads these to start a job's processes, and shardtune train alone "
                                      "starts none; run shardtune launch ... train ..., or leave them out")
    for key, value in (("main_process_port", "29555"), ("rdzv_backend", "c10d")):
        exits_2([*argv[:-4], f"--{key}", value])
        assert one_error_line(capsys) == (f"shardtune train: error: command line (--{key}): {key}={value}: shardtune "
                                          f"launch reads this to start a job's processes, and shardtune train alone "
                                          f"starts none; run shardtune launch ... train ..., or leave it out")
    assert not (tmp_path / "out").exists()


def test_find_batch_size_says_what_one_row_needs_and_suggests_only_what_is_not_on(tiny, capsys, tmp_path):
    """It suggested --gradient-checkpointing and --method lora to a job that had both, and never said what one row
    needs against the card; a card smaller than the CUDA context is said to be that."""
    import json as json_module

    argv = ["estimate", "llama-3-70b", "--method", "qlora", "--gpu-memory", "10", "--gradient-checkpointing",
            "--seq-len", "256", "--num-gpus", "2", "--strategy", "FSDP"]
    assert main([*argv, "--batch-size", "1", "--json"]) == 0
    one = json_module.loads(capsys.readouterr().out)
    total = sum(item["bytes"] for item in one["items"]) / 2**30
    assert main([*argv, "--find-batch-size"]) == 2
    assert one_error_line(capsys) == (
        f"shardtune estimate: error: --find-batch-size: not even a micro-batch of 1 fits a 10GiB with FSDP "
        f"FULL_SHARD: it needs {total:.2f} GiB and 1.00 GiB of CUDA context, against 10.00 GiB; try --offload-params "
        f"or more GPUs with --num-gpus and --strategy FSDP (each holds a shard)")
    assert main(["estimate", str(tiny), "--method", "lora", "--find-batch-size", "--gpu-memory", "0.5"]) == 2
    assert one_error_line(capsys).endswith("against 0.50 GiB; the CUDA context alone takes more than the card has")
    recipe = tmp_path / "r.yaml"  # --config: the recipe's keys, since the options are refused beside it
    recipe.write_text("model_name_or_path: llama-3-70b\ndataset_name: d.jsonl\nuse_peft_lora: true\n"
                      "gradient_checkpointing: false\n")
    assert main(["estimate", "--config", str(recipe), "--find-batch-size", "--gpu-memory", "20"]) == 2
    assert one_error_line(capsys).endswith("try gradient_checkpointing true, use_4bit_quantization true, more "
                                           "processes (num_processes) with distributed_type FSDP (each holds a "
                                           "shard) or a shorter max_seq_len")


def test_launch_on_a_port_in_use_is_one_line_naming_it(tiny, tmp_path, capsys):
    """A --main_process_port that another program holds: torchrun's agent ended in a 40-line traceback (exit 1)
    whose last words said EADDRINUSE; now one line names the option and the fix, before any worker starts."""
    import socket

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["launch", "--num_processes", "2", "--main_process_port", str(port), "train",
                     "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
                     str(tmp_path / "out")])
    assert code == 2
    assert one_error_line(capsys) == (
        f"shardtune launch: error: --main_process_port {port}: that port is already in use on this machine "
        f"(another job's rendezvous, or another program): give a free one with --main_process_port (the same on "
        f"every machine), or, on one machine, leave it out and a free port is picked")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("env, problem", [
    ({"RANK": "1"}, "the environment sets RANK=1, but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "the environment sets RANK=0, WORLD_SIZE=2, but MASTER_ADDR and MASTER_PORT "
                                       "are not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "the environment sets RANK=2, WORLD_SIZE=2, but RANK=2 is not below WORLD_SIZE=2"),
])
def test_a_half_set_torchrun_environment_is_one_line(env, problem, tiny, tmp_path, capsys, monkeypatch,
                                                      restore_logging):
    """torchrun's variables set by hand, or a RANK left exported in the shell: RANK=1 alone trained as rank 1 of 1
    until the sampler raised a ValueError, WORLD_SIZE=2 without MASTER_ADDR ended in torch's traceback, and with
    RANK=1 in the shell every refusal of train and launch exited 2 without a word (only rank 0 of a job speaks)."""
    from tests.trainutil import write_chat_data

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=20)
    argv = ["train", "--model_name_or_path", str(tiny), "--dataset_name", str(data), "--output_dir",
            str(tmp_path / "out"), "--max_steps", "1"]
    exits_2(argv)
    assert one_error_line(capsys) == (
        f"shardtune train: error: {problem}: these are torchrun's variables, which shardtune launch sets for each "
        f"process it starts (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); run "
        f"shardtune launch --num_processes N train ..., or unset {' '.join(n for n in env if 'MASTER' not in n)} "
        f"to train on one process")
    assert not (tmp_path / "out").exists()
    exits_2(["launch", "--num_processes", "2", "train", "--max_stepz", "1"])  # the launcher is no rank: it speaks
    assert "unknown key 'max_stepz'; did you mean 'max_steps'?" in one_error_line(capsys)


def test_machines_started_with_other_training_arguments_are_refused_on_each(tiny, tmp_path):
    """Two machines of one job whose 'shardtune launch ... train' lines differ (another learning rate and batch on
    machine 1) trained together, exit 0, each rank with its own values: DDP's replicas drifted apart and the
    sampler's shards overlapped. Now every rank refuses at the start, each machine's log says which keys differ,
    and nothing is written."""
    from tests.trainutil import one_rank_per_machine, write_chat_data

    data = write_chat_data(tmp_path / "chat.jsonl", rows=40)
    common = ["-m", "shardtune", "train", "--model_name_or_path", str(tiny), "--dataset_name", str(data),
              "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]
    machine_0 = ["--per_device_train_batch_size", "2"]
    machine_1 = ["--learning_rate", "0.05", "--per_device_train_batch_size", "4", "--machine_rank", "1"]
    ended = one_rank_per_machine([common + machine_0, common + machine_1], tmp_path, OFFLINE)
    said = [err for _, err in ended]
    assert [code for code, _ in ended] == [2, 2], said
    for err in said:
        lines = [line for line in err.splitlines() if line.startswith("shardtune ")]
        assert lines == [
            "shardtune train: error: the job's processes were started with different settings: learning_rate 5e-05 "
            "(rank 0) / 0.05 (rank 1); per_device_train_batch_size 2 (rank 0) / 4 (rank 1): every rank must train "
            "with the same ones; give each machine's shardtune launch the same arguments after 'train' (only "
            "--machine_rank differs)"], err[-3000:]
    assert not (tmp_path / "out").exists()


def test_launch_refuses_restarts_that_would_refuse_their_own_run(monkeypatch, capsys, tmp_path):
    """--max_restarts 1 without resume_from_checkpoint: rank 1 failed at step 3, torchrun restarted the workers, and
    they refused output_dir as holding an earlier run (the failed attempt's step-2), so the launcher ended with
    exit 2 and a message about output_dir, the real failure scrolled away. Refused before any worker starts;
    with resume_from_checkpoint true, or overwrite_output_dir true, the restarts can go on."""
    from shardtune.cli import launch

    spawned = []
    monkeypatch.setattr(launch, "run_torchrun", lambda args: spawned.append(args) or 0)
    job = ["launch", "--num_processes", "2", "--max_restarts", "1", "train", "--model_name_or_path", "no/such-model",
           "--dataset_name", "no/such-data", "--output_dir", str(tmp_path / "out")]
    assert main(job) == 2
    assert one_error_line(capsys) == (
        "shardtune launch: error: --max_restarts 1: a restarted worker finds this run's own checkpoints in output_dir "
        "and, without resume_from_checkpoint, refuses them as an earlier run: add --resume_from_checkpoint true "
        "after 'train' (a restart then carries on from the newest complete checkpoint), or leave --max_restarts out")
    assert spawned == []
    for fix in (["--resume_from_checkpoint", "true"], ["--overwrite_output_dir", "true"]):
        assert main([*job, *fix]) == 0
    assert len(spawned) == 2


def test_a_launch_dry_run_refuses_the_restarts_the_launch_refuses(capsys):
    """README: --dry_run prints the torchrun command once the training values pass their checks; it printed one
    for --max_restarts without resume_from_checkpoint, which the same launch without --dry_run refuses (exit 2)."""
    job = ["launch", "--dry_run", "--num_processes", "2", "--max_restarts", "3", "train", "--learning_rate", "1e-4"]
    assert main(job) == 2
    assert one_error_line(capsys).startswith("shardtune launch: error: --max_restarts 3: a restarted worker finds")
    assert main([*job, "--resume_from_checkpoint", "true"]) == 0
    assert "--max_restarts 3" in capsys.readouterr().out
