"""``shardtune estimate --measured``: the setups that fit are ranked by the speeds ``bench strategies`` measured."""

from __future__ import annotations

import json

import pytest

from shardtune.cli import main
from shardtune.errors import UsageError
from shardtune.hardware import gpu_by_name
from shardtune.memory.inventory import ModelAnalysis
from shardtune.memory.recommend import Measured, candidates, evaluate_setup, recommend
from shardtune.memory.setup import validate
from tests.setups import checked_setup


def measured_file(tmp_path, speeds: dict[str, float], failed: tuple[str, ...] = (), processes: int = 2,
                  method: str = "lora"):
    rows = [{"strategy": k, "tokens_per_s": v, "error": "exit 1: out of memory" if k in failed else None}
            for k, v in speeds.items()]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"model": "m", "method": method, "num_processes": processes, "device": "2 x GPU",
                                "results": rows}))
    return path


def fastest_fitting(analysis, base, gpu, measured):
    """What the ranking must pick, worked out here from the estimator's own per-setup figures."""
    fitting = [s for s in candidates(base, measured, analysis) if evaluate_setup(analysis, s).fits(gpu.memory_bytes)]
    best = max(measured.speed(s) or 0.0 for s in fitting)
    return next(s for s in fitting if (measured.speed(s) or 0.0) == best)


def test_measured_speeds_overrule_the_usual_order(tmp_path):
    analysis, gpu = ModelAnalysis("llama-3.2-1b"), gpu_by_name("h100-80gb")
    base = validate(checked_setup(method="lora", distributed_type="FSDP", num_gpus=2))
    usual = recommend(analysis, base, gpu)
    assert usual.setup.strategy == "DDP"  # everything fits: DDP is the usual choice
    measured = Measured.load(measured_file(tmp_path, {"DDP": 900.0, "FSDP": 1200.0, "MP": 400.0}))
    rec = recommend(analysis, base, gpu, measured)
    assert rec.fits and rec.setup == fastest_fitting(analysis, base, gpu, measured)
    assert rec.setup.strategy == "FSDP"
    assert "fastest measured" in rec.reason and "Without measurements it would be DDP" in rec.reason
    # The file was measured with another model ("m"), on GPUs: the reason cautions about the model only.
    assert "Caution: the speeds were measured with m, not llama-3.2-1b" in rec.reason
    assert "CPU measurements" not in rec.reason and "--method" not in rec.reason  # both LoRA
    full = recommend(analysis, base, gpu, Measured.load(measured_file(tmp_path, {"DDP": 900.0}, method="full")))
    assert ("Caution: the speeds were measured with --method full, this estimate is for lora; give --method full "
            "to compare like with like.") in full.reason
    # With DDP measured fastest, the pick agrees with the usual one and says why.
    agree = recommend(analysis, base, gpu, Measured.load(measured_file(tmp_path, {"DDP": 2000.0, "FSDP": 1200.0})))
    assert agree.setup == usual.setup and "also the usual choice" in agree.reason


@pytest.mark.parametrize("fsdp_speed, picked", [(2359.0, "DDP"), (2358.0 / 0.95 - 1, "DDP"),
                                                 (2358.0 / 0.95 + 1, "FSDP")])
def test_speeds_within_the_tie_margin_leave_the_choice_to_the_usual_order(tmp_path, fsdp_speed, picked):
    # bench/results/strategies_cpu.json once measured DDP 2,358 and FSDP 2,359 tokens/s on a busy machine: noise.
    from shardtune.memory.recommend import MEASURED_TIE

    assert MEASURED_TIE == 0.05
    analysis, gpu = ModelAnalysis("llama-3.2-1b"), gpu_by_name("h100-80gb")
    base = validate(checked_setup(method="lora", distributed_type="FSDP", num_gpus=2))
    rec = recommend(analysis, base, gpu, Measured.load(measured_file(tmp_path, {"DDP": 2358.0, "FSDP": fsdp_speed})))
    assert rec.setup.strategy == picked
    assert ("a tie the usual order decides" in rec.reason) == (picked == "DDP")


def test_measurements_of_the_same_model_on_cpu_say_what_they_show(tmp_path):
    path = measured_file(tmp_path, {"DDP": 900.0, "FSDP": 1200.0})
    data = json.loads(path.read_text()) | {"model": "llama-3.2-1b (llama, 16 layers x 2048 hidden)",
                                           "device": "cpu (2 cores)"}
    path.write_text(json.dumps(data))
    base = validate(checked_setup(method="lora", distributed_type="FSDP", num_gpus=2))
    rec = recommend(ModelAnalysis("llama-3.2-1b"), base, gpu_by_name("h100-80gb"), Measured.load(path))
    assert "Caution" not in rec.reason
    assert "CPU measurements show how the setups schedule their work, not how fast GPUs run them." in rec.reason


def test_a_faster_setup_that_does_not_fit_is_passed_over(tmp_path):
    # Full fine-tuning of a 7B model on two 80 GiB GPUs: no replica fits, so DDP cannot be used however fast (one
    # checkpointed row per GPU: activations small enough that sharding fits). The next fastest, MP, comes last in
    # the usual order, so a pick that ignored the speeds (FSDP, first of the fitting candidates) is told apart.
    analysis, gpu = ModelAnalysis("llama-2-7b"), gpu_by_name("a100-80gb")
    base = validate(checked_setup(method="full", distributed_type="FSDP", num_gpus=2))
    measured = Measured.load(measured_file(tmp_path, {"DDP": 5000.0, "FSDP": 300.0, "MP": 800.0, "PP": 700.0}))
    assert not evaluate_setup(analysis, base.with_(distributed_type="DDP")).fits(gpu.memory_bytes)
    rec = recommend(analysis, base, gpu, measured)
    expected = fastest_fitting(analysis, base, gpu, measured)
    assert rec.fits and rec.setup == expected and rec.setup.strategy == "MP"
    assert recommend(analysis, base, gpu).setup.strategy == "FSDP"  # without the measurements


def test_pipeline_parallel_joins_only_when_measured(tmp_path):
    # 4 rows: one pipeline micro-batch per stage, as train's 1F1B needs (at 1 row PP is not a job train runs)
    base = validate(checked_setup(method="lora", distributed_type="FSDP", num_gpus=4, per_device_train_batch_size=4))
    with_pp = Measured.load(measured_file(tmp_path, {"PP": 3000.0, "DDP": 1000.0}))
    assert "PP" not in [s.strategy for s in candidates(base.with_(per_device_train_batch_size=1), with_pp,
                                                       ModelAnalysis("llama-2-7b"))]
    untied, tied = ModelAnalysis("llama-2-7b"), ModelAnalysis("llama-3.2-1b")
    assert "PP" not in [s.strategy for s in candidates(base, None, untied)]
    assert "PP" in [s.strategy for s in candidates(base, with_pp, untied)]
    assert "PP" in [s.strategy for s in candidates(base, with_pp, tied)]  # a tied head: planned as an untied one
    gpu = gpu_by_name("h100-80gb")
    assert recommend(untied, base, gpu, with_pp).setup.strategy == "PP"
    assert recommend(tied, base, gpu, with_pp).setup.strategy == "PP"


def test_files_from_before_the_strategies_were_spelled_one_way_still_load(tmp_path):
    measured = Measured.load(measured_file(tmp_path, {"ddp": 900.0, "fsdp": 1200.0, "mp": 400.0}))
    assert measured.tokens_per_s == {"DDP": 900.0, "FSDP": 1200.0, "MP": 400.0}


def test_failed_rows_are_not_measurements(tmp_path):
    measured = Measured.load(measured_file(tmp_path, {"DDP": 5000.0, "FSDP": 800.0}, failed=("DDP",)))
    assert measured.tokens_per_s == {"FSDP": 800.0}
    with pytest.raises(UsageError, match="no setup that ran"):
        Measured.load(measured_file(tmp_path, {"DDP": 5000.0}, failed=("DDP",)))


def test_cli_measured_json_and_bad_files(tmp_path, capsys):
    path = measured_file(tmp_path, {"DDP": 900.0, "FSDP": 1200.0}, processes=8)
    assert main(["estimate", "llama-3.2-1b", "--method", "lora", "--num-gpus", "2", "--json",
                 "--measured", str(path)]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["strategy"] == "FSDP" and "used 8 processes, this estimate 2 GPUs" in rec["reason"]
    assert main(["estimate", "llama-3.2-1b", "--num-gpus", "2", "--measured", str(tmp_path / "none.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["estimate", "llama-3.2-1b", "--num-gpus", "2", "--measured", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "not a JSON file" in err


@pytest.mark.parametrize("strategy,kind,processes,microbatches", [("pp", "PP", 2, 4), ("mp", "MP", 1, None)])
def test_emit_config_for_layer_splitting_setups_loads_as_a_training_recipe(tmp_path, strategy, kind, processes,
                                                                             microbatches, capsys):
    from shardtune.config import load_train_config

    path = tmp_path / f"{strategy}.yaml"
    assert main(["estimate", "llama-2-7b", "--method", "lora", "--num-gpus", "2", "--strategy", strategy,
                 "--batch-size", "4", "--emit-config", str(path)]) == 0
    cfg = load_train_config([str(path), "--dataset_name", "chat.jsonl"])
    assert cfg.distributed.distributed_type == kind and cfg.distributed.num_processes == processes
    assert cfg.run.per_device_train_batch_size == 4
    if microbatches:  # one row per micro-batch: the batch splits evenly, as PP requires
        assert cfg.distributed.pipeline_microbatches == microbatches
    else:  # MP's one process names its two GPUs: the recipe estimates (and a dry run traces) as the 2 GPUs did
        assert cfg.distributed.mp_devices == "cuda:0,cuda:1"
    capsys.readouterr()
    argv = ["estimate", "llama-2-7b", "--method", "lora", "--num-gpus", "2", "--strategy", strategy, "--batch-size",
            "4", "--json"]
    assert main(argv) == 0
    emitted = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["per_gpu"], again["setup"]["world_size"]) == (emitted["per_gpu"], 2)


def test_a_model_parallel_recipe_without_its_devices_is_refused_by_the_estimate(tmp_path, capsys):
    """MP without mp_devices runs on every visible GPU: a count the recipe does not hold, so the estimate asks for
    it rather than estimating one GPU (it said 22.5 GiB on "1 GPU" for a 2-GPU job of 14.9)."""
    path = tmp_path / "mp.yaml"
    path.write_text("model_name_or_path: llama-2-7b\ndistributed_type: MP\nuse_peft_lora: true\n")
    assert main(["estimate", "--config", str(path)]) == 2
    assert "set mp_devices (e.g. cuda:0,cuda:1 for two GPUs)" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["5", '{"results": [{"strategy": "fsdp", "tokens_per_s": 9}, '
                                          '{"strategy": "ddp", "tokens_per_s": "n/a"}]}',
                                     '{"num_processes": "two", "results": [{"strategy": "ddp", "tokens_per_s": 9}]}'])
def test_malformed_measurement_files_are_one_line_errors(tmp_path, content):
    """A malformed row is refused, not skipped (a good row beside it would hide that), with the message that says
    so: the other errors of ``Measured.load`` (no such file, no setup that ran) name ``bench strategies`` too."""
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(UsageError, match="not what 'shardtune bench strategies --out' writes"):
        Measured.load(path)


def test_measurements_do_not_apply_to_one_gpu(tmp_path):
    measured = Measured.load(measured_file(tmp_path, {"DDP": 900.0, "FSDP": 1200.0}))
    base = validate(checked_setup(method="lora", distributed_type="NO", num_gpus=1))
    rec = recommend(ModelAnalysis("llama-3.2-1b"), base, gpu_by_name("h100-80gb"), measured)
    assert rec.setup.strategy == "NO" and "do not apply to one" in rec.reason
