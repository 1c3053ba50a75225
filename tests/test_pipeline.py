"""Pipeline parallel on 2 gloo processes gives the losses, gradient norms, eval losses and weights of one process,
and a killed pipeline run resumes exactly.

The one-process references run in this process (``train(cfg)``); the pipeline runs as ``shardtune launch`` runs
them, both in one pair of gloo processes (tests/trainutil.py ``train_jobs``), the killed one through ``shardtune
launch`` itself. fp32, no dropout: the only differences are summation order.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.faults import CALLBACK as FAULTS
from tests.faults import fault_env
from tests.trainutil import flags, run_shardtune, train_jobs, write_chat_data

TOL = 1e-4
STEPS = 3
# Evaluate after every step: eval batches of 8 rows (training: 4) and each switch between the schedule's training
# and evaluation modes are exercised, and a resumed run evaluates again.
EVAL = ["--eval_strategy", "steps", "--eval_steps", "1", "--eval_split_ratio", "0.05"]
ONE_F_ONE_B = ["--pipeline_schedule", "1F1B", "--pipeline_microbatches", "2"]
LORA = ["--use_peft_lora", "True", "--gradient_accumulation_steps", "2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("pipeline")
    model = make_model_folder(root / "model", num_layers=4)
    data = write_chat_data(root / "chat.jsonl")
    return root, model, data


def args(assets, out: str, extra: list[str]) -> list[str]:
    """The job, in fp32 (not this machine's bf16 default): the pipeline must do one process's arithmetic, checked at
    1e-4, and bf16 rounds the two layouts differently."""
    root, model, data = assets
    return flags("--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                 "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS), "--logging_steps", "1",
                 "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--output_dir", str(root / out),
                 "--per_device_train_batch_size", "4", "--bf16", "false", *extra)


def one_process(assets, out: str, extra: list[str]) -> list[dict]:
    from shardtune.train.loop import train

    train(load_train_config(args(assets, out, extra)))
    return records(assets[0] / out)


PIPELINES = {"pp_1f1b": [*EVAL, *ONE_F_ONE_B],
             "pp_gpipe_lora": [*LORA, "--pipeline_schedule", "GPipe", "--pipeline_microbatches", "4"]}


@pytest.fixture(scope="module")
def pipelines(assets) -> dict[str, str]:
    """Both pipeline runs of PIPELINES, as ``shardtune launch --num_processes 2 train`` runs them, in one pair of
    processes (train_jobs): each run's error, or ""."""
    return train_jobs(assets[0], {out: (2, [*args(assets, out, extra), "--distributed_type", "PP", "--callbacks",
                                            "tests.setup_probe:SetupProbe"]) for out, extra in PIPELINES.items()})


def pipeline(assets, pipelines, out: str) -> list[dict]:
    assert not pipelines[out], pipelines[out]
    return records(assets[0] / out)


def launched(assets, out: str, extra: list[str]) -> list[dict]:
    """A pipeline run through ``shardtune launch`` itself."""
    result = run_shardtune(["launch", "--num_processes", "2", "train", *args(assets, out, extra),
                            "--distributed_type", "PP"], assets[0])
    assert result.returncode == 0, result.stderr[-3000:]
    return records(assets[0] / out)


def records(out, key: str = "loss") -> list[dict]:
    """The training records (``key`` loss) or the eval records (``eval_loss``): one per step."""
    found = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in found if key in r]
    assert [r["step"] for r in found] == list(range(1, STEPS + 1)) and all(math.isfinite(r[key]) for r in found)
    return found


def assert_same(reference: list[dict], other: list[dict]) -> None:
    for ref, got in zip(reference, other):
        for key in ("loss", "grad_norm"):
            assert abs(ref[key] - got[key]) <= TOL * abs(ref[key]), \
                f"step {ref['step']} {key}: {ref[key]} vs {got[key]}"
        assert ref["tokens"] == got["tokens"] and ref["target_tokens"] == got["target_tokens"]


def assert_same_eval(reference_out, other_out) -> None:
    for ref, got in zip(records(reference_out, "eval_loss"), records(other_out, "eval_loss")):
        assert abs(ref["eval_loss"] - got["eval_loss"]) <= TOL * ref["eval_loss"], f"step {ref['step']}: {ref} vs {got}"
        assert ref["eval_tokens"] == got["eval_tokens"] > 0


@pytest.fixture(scope="module")
def full_runs(assets, pipelines) -> tuple[list[dict], list[dict]]:
    """The one-process full fine-tune and its 1F1B pipeline twin, both evaluating after every step."""
    return one_process(assets, "ref_full", EVAL), pipeline(assets, pipelines, "pp_1f1b")


def test_pp_1f1b_full_finetune_matches_one_process(assets, full_runs):
    from tests.setup_probe import probe

    reference, piped = full_runs
    assert_same(reference, piped)
    # 1F1B, 2 micro-batches of the 4 rows: the last stage runs each one's backward right after its forward (step 1
    # also begins with one forward and backward of a micro-batch before the pattern)
    schedule = probe(assets[0] / "pp_1f1b", rank=1)["schedule"]
    assert schedule[-4:] == ["F2", "B", "F2", "B"] and set(schedule) == {"F2", "B"}
    assert_same_eval(assets[0] / "ref_full", assets[0] / "pp_1f1b")
    # The exported model is the whole unsplit model with the weights one process trained.
    from safetensors.torch import load_file

    ref = load_file(str(assets[0] / "ref_full" / "final" / "model.safetensors"))
    got = load_file(str(assets[0] / "pp_1f1b" / "final" / "model.safetensors"))
    start = load_file(str(assets[1] / "model.safetensors"))
    assert ref.keys() == got.keys()
    # AdamW moves a weight by about the learning rate whatever its gradient's size, so fp32 summation-order noise in
    # a near-zero gradient shows as a step-sized difference: the two runs' weights agree to 1e-3 of how far
    # training moved them (1.5e-5 of 2.0e-2 on this machine's kernels; an absolute 1e-5 held on some CPUs only).
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # it trained
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-3 * moved


def test_pp_gpipe_lora_with_accumulation_matches_one_process(assets, pipelines):
    reference = one_process(assets, "ref_lora", LORA)
    from tests.setup_probe import probe

    piped = pipeline(assets, pipelines, "pp_gpipe_lora")
    assert_same(reference, piped)
    # GPipe, 4 micro-batches of each accumulated batch's 4 rows: all forwards, then all backwards, twice (step 1
    # also begins with one forward and backward of a micro-batch before the pattern)
    schedule = probe(assets[0] / "pp_gpipe_lora", rank=1)["schedule"]
    assert schedule[-16:] == (["F1"] * 4 + ["B"] * 4) * 2 and set(schedule) == {"F1", "B"}
    from safetensors.torch import load_file

    ref = load_file(str(assets[0] / "ref_lora" / "final" / "adapter_model.safetensors"))
    got = load_file(str(assets[0] / "pp_gpipe_lora" / "final" / "adapter_model.safetensors"))
    assert ref.keys() == got.keys() and len(ref) > 0
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-5


def test_keep_stage_keeps_original_names(assets):
    from transformers import AutoModelForCausalLM

    from shardtune.train.pipeline_parallel import keep_stage

    full = AutoModelForCausalLM.from_pretrained(str(assets[1]))
    names = set(full.state_dict())
    first = keep_stage(AutoModelForCausalLM.from_pretrained(str(assets[1])), (0, 1), first=True, last=False)
    last = keep_stage(AutoModelForCausalLM.from_pretrained(str(assets[1])), (1, 4), first=False, last=True)
    first_names, last_names = set(first.state_dict()), set(last.state_dict())
    assert first_names | last_names == names and not first_names & last_names
    assert "model.layers.3.self_attn.q_proj.weight" in last_names and "lm_head.weight" in last_names
    assert "model.embed_tokens.weight" in first_names and "model.layers.1.mlp.up_proj.weight" not in first_names


def test_pp_resume_reproduces_the_uninterrupted_run(assets, full_runs, monkeypatch):
    """Killed after its step-2 checkpoint, resumed on 2 stages: the uninterrupted run's losses, bitwise on CPU.

    The same checkpoint resumed on one process (other stage bounds, the optimizer state resharded) also goes on
    as one process would.
    """
    root = assets[0]
    extra = [*EVAL, *ONE_F_ONE_B, "--save_strategy", "steps", "--save_steps", "2"]
    for key, value in fault_env(save="after_save:2").items():
        monkeypatch.setenv(key, value)
    killed = run_shardtune(["launch", "--num_processes", "2", "train", *args(assets, "pp_killed", extra),
                            "--distributed_type", "PP", "--callbacks", FAULTS], root)
    monkeypatch.delenv("FAULT_SAVE")
    assert killed.returncode != 0 and (root / "pp_killed" / "checkpoints" / "step-2").is_dir()
    shutil.copytree(root / "pp_killed", root / "one_resumed")
    resume = [*extra, "--resume_from_checkpoint", "true"]
    resumed = launched(assets, "pp_killed", resume)
    want = {r["step"]: r["loss"] for r in full_runs[1]}
    assert {r["step"]: r["loss"] for r in resumed} == want
    assert records(root / "pp_killed", "eval_loss") == records(root / "pp_1f1b", "eval_loss")
    assert_same(full_runs[0], one_process(assets, "one_resumed", resume))
    assert_same_eval(root / "ref_full", root / "one_resumed")


@pytest.mark.parametrize("extra, message", [
    (["--pipeline_microbatches", "3"], "multiple of pipeline_microbatches=3"),
    (["--pipeline_schedule", "zigzag"], "pipeline_schedule='zigzag'"),
    (["--eval_strategy", "steps", "--per_device_eval_batch_size", "3"], "per_device_eval_batch_size=3 must be"),
    (["--eval_on_start", "true", "--per_device_eval_batch_size", "3"], "per_device_eval_batch_size=3 must be"),
    (["--fp16", "true"], "fp16 with distributed_type=PP: the pipeline's stages do not scale the loss"),
])
def test_pipeline_config_errors(assets, extra, message):
    with pytest.raises(UsageError, match=message):
        load_train_config(args(assets, "bad", ["--distributed_type", "PP", *extra]))


def test_pp_config_is_accepted(assets):
    """A PP recipe with every PP key off its default, lower-case spellings included, keeps each as given."""
    cfg = load_train_config(args(assets, "ok", ["--distributed_type", "pp", "--pipeline_schedule", "gpipe",
                                                "--pipeline_microbatches", "4", *EVAL,
                                                "--resume_from_checkpoint", "true"]))
    d = cfg.distributed
    assert (d.distributed_type, d.pipeline_schedule, d.pipeline_microbatches) == ("PP", "GPipe", 4)
    assert cfg.run.eval_strategy == "steps" and cfg.checkpoint.resume_from_checkpoint == "true"
