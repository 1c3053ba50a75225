"""The seed recipe people run with Accelerate + TRL runs unchanged (but for a local tiny model, data and a step cap),
and the run's health checks: a hung rank times out naming itself, a NaN loss stops with advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardtune.cli import main
from tests.faults import CALLBACK as FAULTS
from tests.faults import fault_env
from tests.test_config import ACCELERATE_FSDP
from tests.trainutil import flags, losses, run_shardtune, shardtune_env, write_chat_data

RECIPE = ("--seed 100 --chat_template_format chatml --add_special_tokens False --append_concat_token False "
          "--splits train,test --max_seq_len 128 --num_train_epochs 1 --max_steps 3 --logging_steps 5 --log_level info "
          "--logging_strategy steps --eval_strategy epoch --save_strategy epoch --bf16 True --packing True "
          "--learning_rate 1e-4 --lr_scheduler_type cosine --weight_decay 1e-4 --warmup_ratio 0.0 --max_grad_norm 1.0 "
          "--output_dir out --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
          "--gradient_accumulation_steps 4 --gradient_checkpointing True --use_reentrant False "
          "--dataset_text_field content --use_flash_attn True --use_peft_lora True --lora_r 8 --lora_alpha 16 "
          "--lora_dropout 0.1 --lora_target_modules all-linear --use_4bit_quantization False").split()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("recipe")
    model = make_model_folder(root / "model")
    (root / "chat").mkdir()
    write_chat_data(root / "chat" / "train.jsonl", rows=2000)
    write_chat_data(root / "chat" / "test.jsonl", rows=40, seed=1)  # the recipe's eval_strategy epoch evaluates it
    data = root / "chat"
    (root / "fsdp_config.yaml").write_text(ACCELERATE_FSDP)
    return root, model, data


def test_seed_recipe_runs_unchanged(assets, restore_logging):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, model, data = assets
    result = run_shardtune(["launch", "--config_file", "fsdp_config.yaml", "train", *RECIPE,
                            "--model_name_or_path", str(model), "--dataset_name", str(data)], root)
    assert result.returncode == 0, result.stderr[-3000:]
    out = root / "out"
    assert "strategy: FSDP FULL_SHARD on 2 process(es), mixed precision bf16" in result.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in logged if "loss" in r]
    # logging_steps 5 > max_steps 3: the first and the last step are still logged.
    assert [r["step"] for r in records] == [1, 3]
    # The reference: the same recipe's first step on one process, the global batch of 2 x 8 x 4 rows made of
    # 8 x 8. The sampler gives both the same rows; LoRA's B starts at zero, so lora_dropout cannot change step 1.
    one = flags(*RECIPE, "--output_dir", str(root / "one_process"), "--gradient_accumulation_steps", "8",
                "--max_steps", "1", "--model_name_or_path", str(model), "--dataset_name", str(data))
    assert main(["train", *one]) == 0  # in this process: no second interpreter to start
    reference = json.loads((root / "one_process" / "metrics.jsonl").read_text().splitlines()[0])
    assert (records[0]["tokens"], records[0]["target_tokens"]) == (reference["tokens"], reference["target_tokens"])
    assert abs(records[0]["loss"] - reference["loss"]) <= 1e-5 * reference["loss"], (records[0], reference)
    # eval_strategy epoch: the run stops inside its epoch at max_steps, and evaluates there, as Transformers does.
    assert [r["step"] for r in logged if "eval_loss" in r] == [3]
    assert (out / "checkpoints" / "step-3" / "manifest.json").is_file()  # save_strategy epoch at the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["strategy"] == "FSDP"
    # The adapter folder loads with PEFT and changes nothing until trained weights differ from zero-init B.
    base = AutoModelForCausalLM.from_pretrained(model)
    tuned = PeftModel.from_pretrained(base, out / "final")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.isfinite(tuned(input_ids=ids).logits).all()
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)


def test_hung_rank_times_out_naming_itself(assets):
    """Rank 0 hangs, so the rank that times out is rank 1, and it must name itself. (With rank 1 hung the waiting
    rank was rank 0, the number a rank read from the wrong variable also says, by default.)"""
    root, model, data = assets
    env = shardtune_env(root) | fault_env(step="hang:2:0")
    result = subprocess.run([sys.executable, "-m", "shardtune", "launch", "--num_processes", "2", "train",
                             "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                             "--max_seq_len", "64", "--max_steps", "3", "--per_device_train_batch_size", "2",
                             "--save_strategy", "no", "--output_dir", str(root / "hang"), "--ddp_timeout", "10",
                             "--callbacks", FAULTS],
                            cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert "rank 1: a collective timed out after ddp_timeout=10 s" in result.stderr, result.stderr[-3000:]
    assert "rank 0: a collective timed out" not in result.stderr  # the hung rank is not the one that waited
    assert os.path.exists(root / "hang" / "metrics.jsonl")


def test_ranks_that_cannot_connect_are_not_called_a_timeout(assets, monkeypatch, capsys):
    """Gloo's refused connection (a rank gone before the others joined) came within seconds, and was reported as
    "a collective timed out after ddp_timeout=1800 s" because its text holds "timeout"."""
    from shardtune.cli import main
    from shardtune.train import loop

    root, model, data = assets

    def refused(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:144] Connection refused\n"
                           "Exception raised from ... (timeout 1800000 ms)")

    monkeypatch.setattr(loop, "train", refused)
    assert main(["train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                 "--max_seq_len", "64", "--max_steps", "1", "--output_dir", str(root / "refused")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "shardtune train: rank 0: could not connect to the other ranks (Gloo connectFullMesh failed with "
        "[gloo/transport/tcp/pair.cc:144] Connection refused). One of them ended or never started (read its "
        "messages above), or the rendezvous address is unreachable")


def test_nan_loss_stops_with_step_and_advice(assets):
    root, model, data = assets
    result = run_shardtune(["train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits",
                            "train", "--max_seq_len", "64", "--max_steps", "5", "--per_device_train_batch_size", "2",
                            "--save_strategy", "no", "--output_dir", str(root / "nan"), "--learning_rate", "1e30",
                            "--max_grad_norm", "0", "--logging_steps", "1"], root)
    assert result.returncode == 1
    line = [x for x in result.stderr.splitlines() if "stopped:" in x][0]
    logged = losses(root / "nan")  # the steps before the blow-up, each logged (logging_steps 1)
    assert logged
    # the step named is the one whose loss was not finite, the first not logged
    assert line.startswith(f"shardtune train: rank 0: stopped: step {len(logged) + 1}: loss "), line
    assert line.endswith(". Last good checkpoint: none. Likely causes: learning_rate 1e+30 too high, fp16 overflow "
                         "(use bf16), or a bad batch; resume from the checkpoint with a lower learning rate"), line


def test_fp16_trains_with_a_gradient_scaler(assets):
    """The losses alone fall without a scaler too: the step-6 checkpoint's trainer state holds the scaler, at
    torch's initial scale 2**16 with 6 overflow-free updates counted towards its growth (interval 2000)."""
    root, model, data = assets

    def run(name: str, *extra: str):
        result = run_shardtune(["train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits",
                                "train", "--max_seq_len", "64", "--packing", "True", "--per_device_train_batch_size",
                                "4", "--logging_steps", "1", "--learning_rate", "1e-2", *extra, "--output_dir",
                                str(root / name)], root)
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    result = run("fp16", "--max_steps", "6", "--fp16", "True", "--save_steps", "6")
    assert "mixed precision fp16" in result.stderr
    found = losses(root / "fp16")
    assert len(found) == 6 and found[-1] < found[0]
    state = json.loads((root / "fp16" / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    assert state["scaler"] is not None, "fp16 ran without a loss scaler"
    assert (state["scaler"]["scale"], state["scaler"]["_growth_tracker"]) == (2.0**16, 6), state["scaler"]
    # The loss is scaled before backward and the gradients unscaled before clipping and the step: the first step's
    # gradient norm is fp32's (the loss backward unscaled, then divided by the scale, read 2**16 times smaller, and
    # AdamW, blind to a gradient's scale, still lowered the loss).
    run("fp32", "--max_steps", "1", "--fp16", "False", "--bf16", "False")

    def first_grad_norm(name: str) -> float:
        records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        return next(r["grad_norm"] for r in records if r.get("step") == 1 and "loss" in r)

    assert first_grad_norm("fp16") == pytest.approx(first_grad_norm("fp32"), rel=0.01)


def test_an_fp16_step_with_overflowing_gradients_is_skipped_and_said(assets):
    """An fp16 step whose gradients hold inf is skipped: a warning names the step, the loss scale halves, the
    schedule waits (step 3 runs at step 2's rate) and training goes on. The skip was said nowhere before."""
    root, model, data = assets
    out = root / "fp16_overflow"
    result = subprocess.run([sys.executable, "-m", "shardtune", "train", "--model_name_or_path", str(model),
                             "--dataset_name", str(data), "--splits", "train", "--max_seq_len", "64",
                             "--per_device_train_batch_size", "2", "--max_steps", "3", "--logging_steps", "1",
                             "--fp16", "true", "--save_strategy", "no", "--output_dir", str(out),
                             "--callbacks", "tests.faults:Fp16Overflow"],
                            cwd=root, env=shardtune_env(root) | fault_env(), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "overflowed" in line]
    assert len(said) == 1 and "step 2: fp16 gradients overflowed (inf or NaN): no update, the loss scale lowered " \
        "to 32768" in said[0], said
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["loss_scale"] for r in steps] == [2.0**16, 2.0**15, 2.0**15]
    assert steps[2]["lr"] == steps[1]["lr"] < steps[0]["lr"] and steps[1]["grad_norm"] is None


def test_epoch_logging_and_epoch_count(assets, tmp_path):
    """logging_strategy epoch writes one record per epoch; a run that ends with its epoch counts that epoch."""
    root, model, _ = assets
    data = write_chat_data(tmp_path / "small.jsonl", rows=300)
    out = root / "epochs"
    result = run_shardtune(["train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits",
                            "train", "--max_seq_len", "64", "--packing", "True", "--num_train_epochs", "2",
                            "--per_device_train_batch_size", "8", "--logging_strategy", "epoch",
                            "--save_strategy", "no", "--output_dir", str(out)], root)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 2 and len(records) == 2
    assert records[-1]["step"] == summary["steps"] and records[0]["step"] * 2 == summary["steps"]
    assert [r["epoch"] for r in records] == [1.0, 2.0]
