"""What the ``shardtune`` command does because it owns its process: a ``train`` process leaves bitsandbytes out when
its job does not use it (shardtune/bitsandbytes_use.py) and keeps it for every job that does; every command leaves
its objects to the OS at exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from shardtune.bitsandbytes_use import needs_bitsandbytes
from shardtune.config import TrainConfig
from tests.trainutil import shardtune_env, tiny_workspace


def config(model: str, **keys) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.model_name_or_path = model
    for key, value in keys.items():
        section = next(s for s in ("lora", "optim") if hasattr(getattr(cfg, s), key))
        setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "bnb", rows=40)


@pytest.mark.parametrize("keys", [dict(use_peft_lora=True, use_4bit_quantization=True), dict(optim="adamw_8bit"),
                                  dict(optim="paged_lion_8bit"), dict(optim="adamw_bnb_8bit")])
def test_qlora_and_bitsandbytes_optimizers_keep_it(work, keys):
    assert needs_bitsandbytes(config(str(work / "model"), **keys))


def test_a_model_saved_quantised_keeps_it_and_a_plain_one_does_not(work, tmp_path):
    plain = work / "model"
    assert not needs_bitsandbytes(config(str(plain), use_peft_lora=True))
    assert not needs_bitsandbytes(config(str(plain), optim="adafactor"))
    quantised = tmp_path / "quantised"
    quantised.mkdir()
    settings = json.loads((plain / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(settings))
    assert needs_bitsandbytes(config(str(quantised), use_peft_lora=True))


def test_a_hub_model_whose_config_is_not_cached_keeps_it(work, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert needs_bitsandbytes(config("some-org/not-cached-model", use_peft_lora=True))


def test_a_lora_run_never_imports_it_and_trains(work):
    """The process as torchrun starts it (``python -m shardtune train``), its imports listed by Python itself."""
    env = shardtune_env(work) | {"PYTHONPROFILEIMPORTTIME": "1", "SHARDTUNE_PREDICT_MEMORY": "0"}
    result = subprocess.run([sys.executable, "-m", "shardtune", "train", "--model_name_or_path", "model",
                             "--dataset_name", "chat.jsonl", "--max_seq_len", "64", "--max_steps", "2",
                             "--use_peft_lora", "true", "--bf16", "false", "--logging_steps", "1",
                             "--output_dir", "lora"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = re.findall(r"^import time:.*\| +([\w.]+)$", result.stderr, flags=re.M)
    assert "peft" in imported and "torch" in imported  # the listing is there and holds PEFT
    assert not [name for name in imported if name.startswith("bitsandbytes.")]
    assert len((work / "lora" / "metrics.jsonl").read_text().splitlines()) >= 2
    assert os.path.isfile(work / "lora" / "final" / "adapter_model.safetensors")


def test_the_command_freezes_its_objects_before_the_interpreter_exits(work, monkeypatch, capsys):
    """``command`` (the executable, ``python -m shardtune``) freezes the garbage collector's objects once the
    subcommand has returned; ``main``, called by another program, leaves that program's collector alone."""
    import gc

    from shardtune.cli import command, main
    from shardtune.cli.common import PROCESS

    monkeypatch.setitem(PROCESS, "owned", False)
    args = ["estimate", str(work / "model"), "--json"]
    gc.unfreeze()
    try:
        assert main(args) == 0 and gc.get_freeze_count() == 0
        by_main = json.loads(capsys.readouterr().out)
        monkeypatch.setattr(sys, "argv", ["shardtune", *args])
        assert command() == 0
        assert gc.get_freeze_count() > 0 and PROCESS["owned"]
        assert json.loads(capsys.readouterr().out) == by_main  # the command's own work is the same
    finally:
        gc.unfreeze()

