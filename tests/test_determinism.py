"""Transformers' full_determinism and tf32 keys act in the run: they were refused as unknown keys."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch._prims_common import alert_not_deterministic

from shardtune.cli import main
from shardtune.config import load_train_config
from shardtune.errors import TrainingStopped
from tests.trainutil import logging_restored, tiny_workspace


class Probe:
    """Records PyTorch's settings at each step; at step 2 asks for an operation with no deterministic kernel, as
    PyTorch's own CUDA kernels do (a no-op unless deterministic algorithms are on)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                          torch.backends.cudnn.deterministic, torch.get_float32_matmul_precision()))
        if state.step == 2:
            alert_not_deterministic("scatter_add_cuda_kernel")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "determinism", rows=40)


def run(work, name: str, *extra: str, probe: Probe) -> dict:
    from shardtune.train.loop import train

    argv = ["--model_name_or_path", str(work / "model"), "--dataset_name", str(work / "chat.jsonl"), "--output_dir",
            str(work / name), "--max_steps", "3", "--logging_steps", "1", "--save_strategy", "no", "--predict_memory",
            "false", "--per_device_train_batch_size", "4", *extra]
    with logging_restored():
        return train(load_train_config(argv), [probe])


def test_full_determinism_holds_for_the_run_and_names_an_operation_without_a_deterministic_kernel(work):
    assert not torch.are_deterministic_algorithms_enabled()
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    off = Probe()
    run(work, "off", probe=off)
    assert off.seen == [(False, None, False, "highest")] * 3  # the alert did nothing: the run went on
    on = Probe()
    with pytest.raises(TrainingStopped) as stopped:
        run(work, "on", "--full_determinism", "true", "--tf32", "false", probe=on)
    assert on.seen == [(True, ":16:8", True, "highest")] * 2
    # (the operation ran in the probe, so the line names the callback it ran in too)
    assert str(stopped.value) == ("full_determinism true: callback tests.test_determinism:Probe.on_step_end raised "
                                  "RuntimeError: scatter_add_cuda_kernel does not have a deterministic "
                                  "implementation; leave full_determinism out, or avoid that operation")
    # and the process is as it was before the run
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    # the losses of the steps taken are the run's without it (on the CPU runs repeat exactly anyway)
    logged = {name: [json.loads(line)["loss"] for line in (work / name / "metrics.jsonl").read_text().splitlines()
                     if '"loss"' in line] for name in ("off", "on")}
    assert logged["on"] == logged["off"][:1]  # step 2 stopped before its record


def test_tf32_true_without_an_ampere_gpu_is_refused(work, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this project's CI
    assert main(["train", "--model_name_or_path", str(work / "model"), "--dataset_name", str(work / "chat.jsonl"),
                 "--output_dir", str(work / "tf32"), "--tf32", "true"]) == 2
    assert ("tf32 true needs an NVIDIA GPU of the Ampere generation or newer (compute capability 8.0+), and this "
            "job has no CUDA GPU; leave tf32 out") in capsys.readouterr().err
