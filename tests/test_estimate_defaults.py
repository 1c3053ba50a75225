"""``shardtune estimate MODEL`` with no options describes the job ``shardtune train`` runs with no flags.

Both read their defaults from one place, the config schema: the estimator's Setup is compared with the Setup of
train's default config (``setup_from_config``, the mapping ``--config`` uses), field by field, through the CLI's
JSON; and the header says whether the estimated job is train's defaults, or what those are.
"""

from __future__ import annotations

import json

import pytest

from shardtune.cli import main as shardtune_main
from shardtune.config import load_train_config
from shardtune.config.schema import TrainConfig
from shardtune.memory.setup import Setup
from shardtune.memory.trace_setup import setup_from_config


def _train_defaults(model: str, native_bf16: bool) -> Setup:
    """The Setup of ``shardtune train`` given nothing but a model, data and a folder."""
    cfg = load_train_config(["--model_name_or_path", model, "--dataset_name", "d", "--output_dir", "o"])
    return setup_from_config(cfg, 1, native_bf16=native_bf16)


@pytest.fixture
def tiny_model(tmp_path):
    from shardtune.testing.tiny import make_model_folder

    return str(make_model_folder(tmp_path / "model"))


def test_the_estimators_setup_defaults_are_trains(tiny_model):
    assert Setup().to_dict() == _train_defaults(tiny_model, native_bf16=True).to_dict()
    assert Setup(native_bf16=False).to_dict() == _train_defaults(tiny_model, native_bf16=False).to_dict()
    assert TrainConfig().precision_on(True) == "bf16" and TrainConfig().precision_on(False) == "no"
    # Both sides above are Setups: one reading a key wrongly agrees with itself. Each is also the value train's
    # config holds under the key the trainer reads.
    cfg = load_train_config(["--model_name_or_path", tiny_model, "--dataset_name", "d", "--output_dir", "o"])
    setup = Setup().to_dict()
    assert {name: setup[name] for name in ("batch_size", "seq_len", "gradient_accumulation_steps",
                                           "gradient_checkpointing", "activation_offloading", "optimizer", "lora_r",
                                           "lora_target_modules", "attn_implementation")} == {
        "batch_size": cfg.run.per_device_train_batch_size, "seq_len": cfg.data.max_seq_len,
        "gradient_accumulation_steps": cfg.run.gradient_accumulation_steps,
        "gradient_checkpointing": cfg.run.gradient_checkpointing,
        "activation_offloading": cfg.run.activation_offloading,
        "optimizer": cfg.optim.optim, "lora_r": cfg.lora.lora_r, "lora_target_modules": cfg.lora.lora_target_modules,
        "attn_implementation": cfg.model.attn_implementation}


def test_estimate_with_no_options_estimates_train_with_no_flags(tiny_model, capsys):
    assert shardtune_main(["estimate", tiny_model, "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)["setup"]
    expected = _train_defaults(tiny_model, native_bf16=True).to_dict()
    assert {k: estimated[k] for k in expected} == expected
    # what train does with no flags, stated: micro-batch, length, precision, checkpointing, optimizer
    assert (estimated["batch_size"], estimated["seq_len"], estimated["mixed_precision"],
            estimated["gradient_checkpointing"], estimated["optimizer"]) == (8, 2048, "bf16", True, "adamw_torch")


def test_the_header_states_trains_defaults(tiny_model, capsys):
    assert shardtune_main(["estimate", tiny_model]) == 0
    assert "(what shardtune train runs with no flags)" in capsys.readouterr().out
    assert shardtune_main(["estimate", tiny_model, "--seq-len", "512", "--no-gradient-checkpointing"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert ("micro-batch 8 x 512 tokens, bf16 mixed (fp32 master), adamw_torch, gradient checkpointing off" in out
            and "(shardtune train with no flags runs: micro-batch 8 x 2048 tokens, bf16 mixed (fp32 master), "
                "adamw_torch, gradient checkpointing on, sdpa attention)" in out)


@pytest.mark.parametrize("loss, words", [
    ("full", "transformers' loss, whole fp32 logits"),
    ("full-shifted", "transformers <= 4.44's loss, fp32 logits and a shifted copy"),
    ("chunked", "torchtune's chunked loss")])
def test_another_loss_than_trains_is_not_called_trains_defaults(loss, words, capsys):
    """--loss full counts transformers' whole fp32 logits (Llama-3.1-8B LoRA: 52.9 GiB, where train's fused loss
    needs 28.3), and the header still said 'what shardtune train runs with no flags': it now names the loss."""
    assert shardtune_main(["estimate", "llama-3.1-8b", "--method", "lora", "--loss", loss, "--json"]) == 0
    other = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert shardtune_main(["estimate", "llama-3.1-8b", "--method", "lora", "--json"]) == 0
    assert other >= json.loads(capsys.readouterr().out)["per_gpu"]["total"] * (1.5 if loss == "full" else 1)
    assert shardtune_main(["estimate", "llama-3.1-8b", "--method", "lora", "--loss", loss]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"sdpa attention, {words} (--loss {loss}) (shardtune train with no flags runs: " in out
    assert "(what shardtune train runs with no flags)" not in out


def test_a_recipe_that_compiles_or_runs_liger_is_not_called_trains_defaults(tiny_model, tmp_path, capsys):
    # torch_compile and use_liger_kernel change what train runs: the header names them (and no longer says "what
    # shardtune train runs with no flags"), the JSON carries them, and the header says how memory counts them.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model}\ndataset_name: d\ntorch_compile: true\n"
                      "use_liger_kernel: true\n")
    assert shardtune_main(["estimate", "--config", str(recipe)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sdpa attention, torch_compile (inductor), Liger kernels" in out
    assert "(what shardtune train runs with no flags)" not in out and "memory counted as transformers' eager" in out
    assert shardtune_main(["estimate", "--config", str(recipe), "--json"]) == 0
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert (setup["torch_compile"], setup["use_liger_kernel"]) == ("inductor", True)
    assert shardtune_main(["estimate", tiny_model, "--json"]) == 0
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert (setup["torch_compile"], setup["use_liger_kernel"]) == (None, False)


def test_a_recipe_without_precision_is_estimated_as_the_gpu_would_train_it(tiny_model, tmp_path, capsys,
                                                                          monkeypatch):
    # This machine without bf16: the estimate still follows the GPU it is for.
    monkeypatch.setattr("shardtune.hardware.local_native_bf16", lambda: (False, "no bf16 here"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model}\ndataset_name: d\n")
    assert shardtune_main(["estimate", "--config", str(recipe), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["mixed_precision"] == "bf16"  # the H100 computes bf16
    # And the other way: on this machine with bf16, a V100 (no bf16) is estimated in fp32, as train runs there.
    monkeypatch.setattr("shardtune.hardware.local_native_bf16", lambda: (True, ""))
    assert shardtune_main(["estimate", "--config", str(recipe), "--gpu", "v100-32gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["mixed_precision"] == "no"


def test_on_a_card_without_bf16_the_estimate_is_fp32_as_train_would_run(tiny_model, capsys):
    assert shardtune_main(["estimate", tiny_model, "--gpu", "v100-32gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["mixed_precision"] == "no"
    assert shardtune_main(["estimate", tiny_model, "--gpu", "v100-32gb", "--mixed-precision", "fp16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["mixed_precision"] == "fp16"


@pytest.mark.parametrize("gpu,options,dtype", [("t4", ["--mixed-precision", "fp16"], "float16"),
                                               ("t4", [], "float32"), ("h100-80gb", [], "bfloat16")])
def test_a_qlora_recipe_computes_its_4bit_weights_in_the_cards_precision(tiny_model, tmp_path, capsys, gpu, options,
                                                                         dtype):
    """A T4 has no bf16: its QLoRA recipe said fp16 true beside bnb_4bit_compute_dtype bfloat16 (and bf16
    storage, the dtype the model loads in), an emulated dtype there, which CPU autocast even refuses beside fp16."""
    recipe = tmp_path / "recipe.yaml"
    assert shardtune_main(["estimate", tiny_model, "--gpu", gpu, "--method", "qlora", *options,
                           "--emit-config", str(recipe)]) == 0
    capsys.readouterr()
    cfg = load_train_config([str(recipe)])
    assert (cfg.lora.bnb_4bit_compute_dtype, cfg.lora.bnb_4bit_quant_storage_dtype) == (dtype, dtype)
