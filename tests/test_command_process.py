"""What the ``shardtune`` command does because it owns its process: a ``train``, ``generate`` or ``merge`` process
leaves bitsandbytes out when its work does not use it (shardtune/bitsandbytes_use.py) and keeps it for all work
that does; every command leaves its objects to the OS at exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from shardtune.bitsandbytes_use import model_needs_bitsandbytes, needs_bitsandbytes
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
    assert needs_bitsandbytes(config(str(_saved_quantised(plain, tmp_path / "quantised")), use_peft_lora=True))


def _saved_quantised(plain, folder):
    """A model folder whose config says it was saved quantised with bitsandbytes (its config only)."""
    folder.mkdir()
    settings = json.loads((plain / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(settings))
    return folder


def test_a_hub_model_whose_config_is_not_cached_keeps_it(work, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert needs_bitsandbytes(config("some-org/not-cached-model", use_peft_lora=True))


def _imported(result: subprocess.CompletedProcess) -> list[str]:
    """The modules a ``PYTHONPROFILEIMPORTTIME=1`` process imported, as Python itself listed them."""
    assert result.returncode == 0, result.stderr[-3000:]
    imported = re.findall(r"^import time:.*\| +([\w.]+)$", result.stderr, flags=re.M)
    assert "peft" in imported and "torch" in imported  # the listing is there and holds PEFT
    return imported


def test_a_lora_run_and_generate_and_merge_of_its_adapter_never_import_it(work):
    """The processes as torchrun and a user start them (``python -m shardtune ...``)."""
    env = shardtune_env(work) | {"PYTHONPROFILEIMPORTTIME": "1", "SHARDTUNE_PREDICT_MEMORY": "0"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)

    trained = run("train", "--model_name_or_path", "model", "--dataset_name", "chat.jsonl", "--max_seq_len", "64",
                  "--max_steps", "2", "--use_peft_lora", "true", "--bf16", "false", "--logging_steps", "1",
                  "--output_dir", "lora")
    assert not [name for name in _imported(trained) if name.startswith("bitsandbytes.")]
    assert len((work / "lora" / "metrics.jsonl").read_text().splitlines()) >= 2
    assert os.path.isfile(work / "lora" / "final" / "adapter_model.safetensors")
    generated = run("generate", "lora/final", "--prompt", "Hello", "--max_new_tokens", "4")
    assert not [name for name in _imported(generated) if name.startswith("bitsandbytes.")]
    assert generated.stdout.strip()  # the reply, decoded
    merged = run("merge", "lora/final", "--base", "model", "merged")
    assert not [name for name in _imported(merged) if name.startswith("bitsandbytes.")]
    assert (work / "merged" / "model.safetensors").is_file()


def test_generate_and_merge_keep_it_for_a_base_saved_quantised_or_an_unreadable_adapter(work, tmp_path):
    from shardtune.infer.generate import weights_source

    plain = work / "model"
    assert weights_source(plain) == plain and not model_needs_bitsandbytes(weights_source(plain))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for base, needed in ((plain, False), (_saved_quantised(plain, tmp_path / "quantised"), True)):
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        assert weights_source(adapter) == base  # the base it is loaded on
        assert model_needs_bitsandbytes(weights_source(adapter)) is needed
    (adapter / "adapter_config.json").write_text("{broken")
    assert weights_source(adapter) is None  # loading it reports the broken file; bitsandbytes is kept till then
    assert model_needs_bitsandbytes(None)


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

