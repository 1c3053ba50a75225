"""Closing the loop: a training run records its traced peak beside the measured one."""

from __future__ import annotations

import json

import pytest

from tests.trainutil import flags, run_shardtune, write_chat_data


@pytest.mark.parametrize("family,nproc,extra", [
    # unpacked rows are padded to their batch's longest (~20 tokens here), far below max_seq_len: the trace must
    # run that shape, not max_seq_len rows, and project the targets the rows had (the head skips the prompts)
    ("tiny", 1, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--packing", "False",
                 "--max_seq_len", "256"]),
    ("llama3", 1, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--packing", "False",
                   "--max_seq_len", "256", "--use_peft_lora", "True"]),  # a tied head
    ("tiny", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP", "--use_peft_lora", "True",
                 "--gradient_checkpointing", "True"]),
], ids=["one_process_unpacked", "tied_head_lora_unpacked", "fsdp_lora"])
def test_predicted_peak_recorded_beside_measured(tmp_path, monkeypatch, family, nproc, extra):
    from shardtune.testing.families import make_family_folder
    from shardtune.testing.tiny import make_model_folder

    monkeypatch.setenv("SHARDTUNE_PREDICT_MEMORY", "1")
    model = make_model_folder(tmp_path / "model") if family == "tiny" else make_family_folder(tmp_path / "model",
                                                                                               family)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=600)
    args = flags("--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                 "--max_seq_len", "64", "--packing", "True", "--max_steps", "3", "--save_strategy", "no",
                 "--logging_steps", "1", "--output_dir", str(tmp_path / "out"), *extra)
    cmd = ["train", *args] if nproc == 1 else ["launch", "--num_processes", str(nproc), "train", *args]
    result = run_shardtune(cmd, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # the wait for the trace is announced before it, and its result after
    announced = result.stderr.find("predicting this job's peak memory by tracing")
    assert 0 <= announced < result.stderr.find("peak memory per process: predicted")
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    record = records[-1]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["step"] == 3 and record["measured_by"] == "memory tracker, real tensors"
    assert record["measured_peak_bytes"] > 100_000  # the tiny model's weights and optimizer alone exceed this
    # The bound for CPU runs is 5%; the trace runs the measured step's shapes and targets, and lands within
    # 0.1% here (told every token is a target it overstated these by 2-3%).
    assert abs(record["peak_error"]) <= 0.01
    assert record["peak_error"] == pytest.approx(
        (record["predicted_peak_bytes"] - record["measured_peak_bytes"]) / record["measured_peak_bytes"])
    assert summary["predicted_peak_bytes"] == record["predicted_peak_bytes"]
    packed = "--packing" not in extra
    assert record["traced_seq_len"] == 64 if packed else 8 < record["traced_seq_len"] < 64
    tracked = next(r for r in records if r.get("step") == 2 and "loss" in r)  # the step the CPU check measures
    if nproc == 1:  # each micro-batch's targets, as the step counted them
        assert sum(record["traced_target_tokens"]) == tracked["target_tokens"]
