"""Callbacks: the loop calls them in order with the documented arguments, and they steer it (stop, save)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from shardtune.train.callbacks import load_callback
from tests.trainutil import losses, shardtune_env, write_chat_data

DOC = Path(__file__).resolve().parents[1] / "docs" / "callbacks.md"


@pytest.fixture(autouse=True)
def _restore(restore_logging):
    """These tests run ``train`` in this process."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("callbacks")
    return root, make_model_folder(root / "model"), write_chat_data(root / "chat.jsonl", rows=300)


def config(assets, out: str, *extra: str):
    root, model, data = assets
    return load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                              "--max_seq_len", "64", "--packing", "True", "--max_steps", "6", "--logging_steps", "1",
                              "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
                              "--output_dir", str(root / out), *extra])


class Recorder:
    """Records every event; stops the run after step 3 and asks for an extra checkpoint at step 1."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.logged: list[float] = []
        self.saved: list[str] = []

    def on_train_begin(self, args, state, control, *, model, optimizer, plan, info, **kwargs):
        self.events.append(("train_begin", state.step))
        assert plan.strategy == "NO" and info.world_size == 1 and optimizer.param_groups

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs):
        self.events.append(("step_begin", state.global_step))
        assert len(micro_batches) == 1 and micro_batches[0]["input_ids"].shape[0] == 2  # batch 2, no accumulation

    def on_step_end(self, args, state, control, *, stats, **kwargs):
        self.events.append(("step_end", state.step))
        control.should_save = state.step == 1
        control.should_training_stop = state.step == 3

    def on_log(self, args, state, control, *, logs, **kwargs):
        self.logged.append(logs["loss"])

    def on_save(self, args, state, control, *, checkpoint, **kwargs):
        self.saved.append(Path(checkpoint).name)

    def on_train_end(self, args, state, control, *, summary, log, **kwargs):
        self.events.append(("train_end", state.step))
        summary["recorded_steps"] = state.step
        log({"step": state.step, "note": "from a callback"})


def test_events_arrive_in_order_and_control_steers_the_loop(assets):
    from shardtune.train.loop import train

    recorder = Recorder()
    summary = train(config(assets, "steered"), callbacks=[recorder])
    steps = [("step_begin", 0), ("step_end", 1), ("step_begin", 1), ("step_end", 2), ("step_begin", 2),
             ("step_end", 3)]
    assert recorder.events == [("train_begin", 0), *steps, ("train_end", 3)]
    out = assets[0] / "steered"
    assert summary["steps"] == 3 and summary["recorded_steps"] == 3  # stopped by the callback, not max_steps=6
    assert recorder.saved == ["step-1", "step-2"]  # step 1 asked for by the callback, step 2 by save_steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert recorder.logged == losses(out)  # on_log sees exactly what metrics.jsonl holds
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 3, "note": "from a callback"}
    assert (out / "final" / "config.json").is_file()  # a stopped run still writes final/


def test_the_documented_example_stops_a_run(assets, tmp_path, monkeypatch):
    # The callback class in docs/callbacks.md, named in the config as users name theirs.
    code = re.search(r"```python\n(class StopOnPlateau.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "plateau_hooks.py").write_text(code.replace("patience: int = 20", "patience: int = 1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from shardtune.train.loop import train

    # A learning rate of 0 leaves the loss flat after step 1: the callback stops the run at step 2.
    summary = train(config(assets, "plateau", "--learning_rate", "0", "--callbacks", "plateau_hooks:StopOnPlateau"))
    assert summary["steps"] == 2


@pytest.mark.parametrize("spec, message", [("nocolon", "is not 'package.module:Class'"),
                                           ("no_such_module_xyz:Cls", "cannot import 'no_such_module_xyz'"),
                                           ("json:NoSuchClass", "json has no class 'NoSuchClass'")])
def test_a_bad_callback_name_is_refused_naming_it(spec, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_callback(spec)


def test_a_bad_callback_stops_the_command_before_anything_is_written(assets):
    root, model, data = assets
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", "--model_name_or_path", str(model),
                           "--dataset_name", str(data), "--output_dir", str(root / "bad"), "--callbacks",
                           "no_such_module_xyz:Cls"], cwd=root, env=shardtune_env(root), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "callbacks: cannot import 'no_such_module_xyz'" in proc.stderr
    assert not (root / "bad").exists()
