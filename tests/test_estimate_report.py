"""What people read: the side-by-side table at 80 columns, and the --plot picture against the estimator's numbers."""

import io
import re

import pytest
from rich.console import Console

from shardtune.cli import main
from shardtune.memory.report import estimate_report
from shardtune.hardware import GIB, gpu_by_name
from shardtune.memory.plot import bar_totals, breakdown_figure
from shardtune.memory.report import render
from shardtune.memory.setup import Setup, validate

CASES = {
    "70b lora 8 gpus": ("llama-2-70b", Setup(method="lora", strategy="fsdp", num_gpus=8, batch_size=8), "h100-80gb"),
    "8b full 2 nodes": ("llama-3.1-8b", Setup(strategy="fsdp", num_gpus=8, num_nodes=2), "a100-80gb"),
    "8b qlora 4090": ("llama-3.1-8b", Setup(method="qlora", batch_size=2), "rtx4090"),
}


def _report(case: str):
    model, setup, gpu = CASES[case]
    return estimate_report(model, validate(setup), gpu_by_name(gpu), auto=True)


@pytest.mark.parametrize("case", CASES)
def test_side_by_side_table_reads_at_80_columns(case):
    report = _report(case)
    out = io.StringIO()
    render(report, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    table_start = next(i for i, line in enumerate(lines) if line.startswith("Setups side by side"))
    rows = [line for line in lines[table_start:] if re.match(r"^ ?(DDP|FSDP|single|model)", line)]
    assert len(rows) == len(report.table)
    for row, (breakdown, batch) in zip(rows, report.table):
        assert "…" not in row  # nothing cut short
        numbers = row.split()[-8:]  # params grads optim activ ovhd total fits max-b
        expected = [f"{breakdown.per_gpu()[k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations",
                                                                     "overhead", "total")]
        assert numbers[:6] == expected
        assert numbers[6] == ("yes" if breakdown.fits(report.gpu.memory_bytes) else "no")
        assert numbers[7] == str(batch)


@pytest.mark.parametrize("case", CASES)
def test_plot_bars_are_the_estimated_totals(case):
    report = _report(case)
    fig = breakdown_figure(report)
    drawn = bar_totals(fig)
    assert drawn == pytest.approx([b.total / GIB for b, _ in report.table], rel=1e-9)
    capacity_lines = [line.get_ydata()[0] for line in fig.axes[0].get_lines()]
    assert capacity_lines[0] == pytest.approx(report.gpu.memory_bytes / GIB)
    framed = [p for p in fig.axes[0].patches if p.get_gid() == "recommended"]
    if report.recommendation.fits:  # the recommended setup's bar, and only it, is framed
        index = [b.setup for b, _ in report.table].index(report.recommendation.setup)
        assert len(framed) == 1 and framed[0].get_x() + framed[0].get_width() / 2 == pytest.approx(index)
        assert framed[0].get_height() == pytest.approx(drawn[index])


def test_plot_option_writes_a_png(tmp_path, capsys):
    path = tmp_path / "memory.png"
    assert main(["estimate", "llama-3.2-1b", "--num-gpus", "4", "--json", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed, not left behind
    assert "wrote" in capsys.readouterr().err


def test_plot_to_a_missing_folder_is_a_usage_error(tmp_path):
    assert main(["estimate", "llama-3.2-1b", "--plot", str(tmp_path / "no" / "such.png")]) == 2


def test_estimate_config_reads_the_files_a_job_runs_with(tmp_path, capsys):
    """--config: a recipe, an Accelerate file and a DeepSpeed JSON give the estimate of exactly that job, the same
    as the options that describe it; setup options beside --config are refused."""
    import json

    from shardtune.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: llama-3.1-8b\nuse_peft_lora: true\nlora_r: 16\nlora_target_modules: "
                      "all-linear\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nmax_seq_len: 4096\n"
                      "gradient_checkpointing: true\nbf16: true\ndataset_name: d\n")
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
                   "num_machines: 1\nmixed_precision: bf16\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    argv = ["estimate", "--gpu", "h100-80gb", "--json"]
    assert main([*argv, "--config", str(recipe), "--config", str(acc), "--config", str(ds)]) == 0
    from_files = json.loads(capsys.readouterr().out)
    assert main([*argv, "llama-3.1-8b", "--method", "lora", "--lora-r", "16", "--num-gpus", "8", "--strategy", "fsdp",
                 "--sharding-strategy", "FULL_SHARD", "--batch-size", "2", "--gradient-accumulation-steps", "4",
                 "--seq-len", "4096", "--gradient-checkpointing"]) == 0
    from_options = json.loads(capsys.readouterr().out)
    assert from_files["per_gpu"] == from_options["per_gpu"] and from_files["per_gpu"]["total"] > 0
    assert from_files["trainable_parameters"] == from_options["trainable_parameters"]
    assert main(["estimate", "--config", str(recipe), "--method", "full", "--num-gpus", "2"]) == 2
    assert "--method, --num-gpus: with --config the files describe the setup" in capsys.readouterr().err
