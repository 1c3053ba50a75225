"""What people read: the side-by-side table at 80 columns, and the --plot picture against the estimator's numbers."""

import io
import json
import re

import pytest
from rich.console import Console

from shardtune.cli import main
from shardtune.memory.report import estimate_report
from shardtune.hardware import GIB, gpu_by_name
from shardtune.memory.plot import bar_totals, breakdown_figure
from shardtune.memory.report import render
from shardtune.memory.setup import validate
from tests.setups import checked_setup

CASES = {
    "70b lora 8 gpus": ("llama-2-70b", checked_setup(method="lora", distributed_type="FSDP", num_gpus=8,
                                             per_device_train_batch_size=8), "h100-80gb"),
    "8b full 2 nodes": ("llama-3.1-8b", checked_setup(distributed_type="FSDP", num_gpus=8, num_nodes=2), "a100-80gb"),
    "8b qlora 4090": ("llama-3.1-8b", checked_setup(method="qlora", per_device_train_batch_size=2), "rtx4090"),
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


def test_plot_option_writes_a_png(tmp_path, capsys, monkeypatch):
    """The PNG is the figure drawn (its pixel size), whose bars are the --json setups' totals."""
    from tests.pictures import drawn_size, keep_saved_figures, png_size

    saved = keep_saved_figures(monkeypatch)
    path = tmp_path / "memory.png"
    assert main(["estimate", "llama-3.2-1b", "--num-gpus", "4", "--json", "--plot", str(path)]) == 0
    captured = capsys.readouterr()
    fig, dpi = saved["memory.png"]
    assert png_size(path) == drawn_size(fig, dpi)
    setups = json.loads(captured.out)["strategies"]
    assert bar_totals(fig) == pytest.approx([s["per_gpu"]["total"] / GIB for s in setups], rel=1e-9)
    assert list(tmp_path.iterdir()) == [path]  # the temporary file was renamed, not left behind
    assert f"wrote {path}" in captured.err


def test_plot_to_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    """Exit 2 and one line naming the option, the folder that is missing and the fix; nothing made on disk."""
    path = tmp_path / "no" / "such.png"
    assert main(["estimate", "llama-3.2-1b", "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--plot {path}: the folder {path.parent} does not exist; create it or pick another" in err
    assert out == ""  # refused before the estimate: no report printed above the error
    assert list(tmp_path.iterdir()) == []


def test_plot_not_a_png_is_refused_before_any_json(tmp_path, capsys):
    """A --plot name that is no PNG is refused up front: with --json no object reaches stdout before exit 2 (a
    script would otherwise read a whole answer from a command that failed)."""
    path = tmp_path / "memory.jpg"
    assert main(["estimate", "llama-3.2-1b", "--json", "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out[:200], err)
    assert f"--plot {path}: the picture is a PNG; give a file name ending in .png." in err
    assert list(tmp_path.iterdir()) == []


def test_estimate_config_reads_the_files_a_job_runs_with(tmp_path, capsys):
    """--config: a recipe, an Accelerate file and a DeepSpeed JSON give the estimate of exactly that job, the same
    as the options that describe it; setup options beside --config are refused. Each file sets what is not the
    default (ZeRO-3, not Accelerate's ZeRO-2 for DEEPSPEED; no checkpointing; fp32), so each one is read."""
    from shardtune.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: llama-3.1-8b\nuse_peft_lora: true\nlora_r: 16\nlora_target_modules: "
                      "all-linear\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nmax_seq_len: 4096\n"
                      "gradient_checkpointing: false\nbf16: false\ndataset_name: d\n")
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
                   "num_machines: 1\nmixed_precision: 'no'\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    argv = ["estimate", "--gpu", "h100-80gb", "--json"]
    assert main([*argv, "--config", str(recipe), "--config", str(acc), "--config", str(ds)]) == 0
    from_files = json.loads(capsys.readouterr().out)
    assert main([*argv, "llama-3.1-8b", "--method", "lora", "--lora-r", "16", "--num-gpus", "8", "--strategy", "fsdp",
                 "--sharding-strategy", "FULL_SHARD", "--batch-size", "2", "--gradient-accumulation-steps", "4",
                 "--seq-len", "4096", "--no-gradient-checkpointing", "--mixed-precision", "no"]) == 0
    from_options = json.loads(capsys.readouterr().out)
    assert from_files["per_gpu"] == from_options["per_gpu"] and from_files["per_gpu"]["total"] > 0
    assert from_files["trainable_parameters"] == from_options["trainable_parameters"]
    assert main([*argv, "--config", str(recipe), "--config", str(acc)]) == 0  # without the JSON: ZeRO-2
    assert json.loads(capsys.readouterr().out)["per_gpu"] != from_files["per_gpu"]
    assert main(["estimate", "--config", str(recipe), "--method", "full", "--num-gpus", "2"]) == 2
    assert "--method: with --config the files describe the setup" in capsys.readouterr().err
    # The process count a launch gives (`shardtune launch --num_processes 8 train ...`) where the files hold none
    counted = tmp_path / "accelerate_no_count.yaml"
    counted.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: 'no'\n")
    assert main([*argv, "--config", str(recipe), "--config", str(counted), "--config", str(ds), "--num-gpus", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["per_gpu"] == from_files["per_gpu"]
    assert main([*argv, "--config", str(recipe), "--config", str(acc), "--num-gpus", "4"]) == 2
    assert (f"--num-gpus: the files set num_processes 8 ({acc}, line 3), num_machines 1 ({acc}, line 4), which "
            f"decide with --config; change it there, or leave --num-gpus out") in capsys.readouterr().err



def test_estimate_config_of_distributed_type_no_on_several_processes_says_it_is_ddp(tmp_path, capsys):
    """A recipe with distributed_type NO and num_processes 2 trains as DDP (train says so at start); the estimate of
    the same files showed a DDP table without saying why, so a user who wrote NO read it as the wrong job."""
    from shardtune.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\ndistributed_type: 'NO'\nnum_processes: 2\nuse_peft_lora: "
                      "true\n")
    assert main(["estimate", "--gpu", "h100-80gb", "--config", str(recipe), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["setup"]["strategy"] == "DDP"
    assert ("note: distributed_type NO on 2 processes: estimated as DDP, each process a slice of every batch (NO "
            "alone would have each train the whole model on its own)") in captured.err
    recipe.write_text(recipe.read_text().replace("num_processes: 2", "num_processes: 1"))
    assert main(["estimate", "--gpu", "h100-80gb", "--config", str(recipe), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["setup"]["strategy"] == "NO" and "DDP" not in captured.err

def test_estimate_config_of_a_launcher_file_alone_needs_no_data(tmp_path, capsys):
    """An Accelerate config or a DeepSpeed JSON is a whole setup without a recipe: the estimate of MODEL under it
    needs no dataset_name (nothing is read), and is that of the options describing the same job."""
    from shardtune.cli import main

    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}))
    argv = ["estimate", "llama-3.2-1b", "--json"]
    for files, options in (([acc], ["--num-gpus", "4", "--strategy", "FSDP", "--sharding-strategy", "FULL_SHARD"]),
                           ([ds], ["--strategy", "zero2", "--batch-size", "2"])):
        assert main([*argv, *(x for f in files for x in ("--config", str(f)))]) == 0, capsys.readouterr().err
        from_files = json.loads(capsys.readouterr().out)
        assert main([*argv, *options]) == 0
        assert from_files["per_gpu"] == json.loads(capsys.readouterr().out)["per_gpu"]


def test_estimate_config_of_a_deepspeed_file_says_what_it_became_as_train_does(tmp_path, capsys):
    """A DeepSpeed JSON offloading the optimizer alone (ZeRO-2) is estimated as FSDP offloading parameters,
    gradients and optimizer together: train prints that mapping at start, estimate --config printed nothing, so its
    '+ CPU offload' and 120 GiB of host RAM came without a word of where they came from."""
    from shardtune.cli import main
    from shardtune.config.loading import deepspeed_mappings

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert main(["estimate", "llama-3.2-1b", "--num-gpus", "4", "--config", str(ds), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["setup"]["offload_params"] is True
    ((source, lines),) = deepspeed_mappings(["--deepspeed", str(ds)])
    said = [f"DeepSpeed config {source}, as shardtune runs it:", *(f"  {line}" for line in lines)]
    assert captured.err.splitlines() == said
    assert "zero_optimization.offload_optimizer.device cpu -> fsdp_offload_params true" in captured.err


@pytest.mark.parametrize("options", [["--offload-params"], ["--sharding-strategy", "SHARD_GRAD_OP"],
                                     ["--sharding-strategy", "HYBRID_SHARD", "--num-gpus", "8", "--num-nodes", "2"]])
def test_an_fsdp_option_estimates_fsdp_without_strategy(options, capsys):
    """--offload-params or --sharding-strategy with the strategy left to shardtune ask for FSDP: the estimate is of
    that job (it was of the setup the recommender preferred, the option dropped without a word)."""
    from shardtune.cli import main

    argv = ["estimate", "llama-3.2-1b", "--method", "lora", "--json", *options]
    assert main(argv) == 0
    left = json.loads(capsys.readouterr().out)
    assert main([*argv, "--strategy", "FSDP"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert left["setup"] == named["setup"] and left["setup"]["strategy"] == "FSDP"
    assert left["per_gpu"] == named["per_gpu"]
    # ... with the option itself: not plain FSDP, whose FULL_SHARD and no offload it replaces.
    given = ({"offload_params": True} if "--offload-params" in options
             else {"sharding_strategy": options[options.index("--sharding-strategy") + 1]})
    assert {key: left["setup"][key] for key in given} == given
    gpus = options[2:] if "--num-gpus" in options else []
    assert main(["estimate", "llama-3.2-1b", "--method", "lora", "--json", *gpus, "--strategy", "FSDP"]) == 0
    assert left["per_gpu"] != json.loads(capsys.readouterr().out)["per_gpu"]


def test_the_estimate_compares_and_recommends_only_jobs_train_runs(tmp_path, capsys):
    """Adafactor cannot run under FSDP (its factored state needs whole rows), and pure bf16 only with AdamW: the
    estimate recommended FSDP SHARD_GRAD_OP for adafactor on 2 GPUs, whose recipe train then refused. Now FSDP is
    not compared there (model parallel, the one that fits, is recommended and its recipe loads), and a job named
    outright that train refuses is refused with train's words."""
    from shardtune.cli import main
    from shardtune.config import load_train_config

    recipe = tmp_path / "r.yaml"
    argv = ["estimate", "llama-3.1-8b", "--optimizer", "adafactor", "--num-gpus", "2"]
    assert main([*argv, "--json", "--emit-config", str(recipe)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["strategy"] for row in data["strategies"]] == ["DDP", "MP"]
    assert data["recommendation"]["strategy"] == "MP" and data["recommendation"]["fits"]
    cfg = load_train_config([str(recipe), "--dataset_name", "d.jsonl"])
    assert (cfg.distributed.distributed_type, cfg.optim.optim) == ("MP", "adafactor")
    assert main([*argv, "--strategy", "FSDP"]) == 2
    assert "--optimizer adafactor with --strategy FSDP: Adafactor's factored state" in capsys.readouterr().err
    assert main(["estimate", "llama-3.1-8b", "--pure-bf16", "--optimizer", "adamw_8bit"]) == 2
    assert "--pure-bf16 with --optimizer adamw_8bit" in capsys.readouterr().err
    # Every refusal at once, as train gives them (the first alone was said)
    assert main([*argv, "--strategy", "FSDP", "--pure-bf16"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer adafactor with --strategy FSDP" in err and " | --pure-bf16 with --optimizer adafactor" in err


def test_model_parallel_stays_on_one_machine(capsys):
    """MP is one process driving its machine's GPUs: across nodes it was compared (and recommended when it alone
    fit) though train cannot run it; named outright it is refused."""
    from shardtune.cli import main

    assert main(["estimate", "llama-3.1-8b", "--method", "full", "--num-gpus", "1", "--num-nodes", "2",
                 "--json"]) == 0
    assert "MP" not in [row["strategy"] for row in json.loads(capsys.readouterr().out)["strategies"]]
    assert main(["estimate", "llama-3.1-8b", "--strategy", "MP", "--num-gpus", "8", "--num-nodes", "2"]) == 2
    assert "--strategy MP: one process drives the GPUs of its own machine" in capsys.readouterr().err


def test_pipeline_micro_batches_are_the_jobs_in_the_time_and_the_recipe(tmp_path, capsys):
    """PP's micro-batches per batch are part of the job: the time was of train's default 2 while the recipe
    --emit-config wrote one row each (8), and a count that does not divide the batch was accepted."""
    from shardtune.cli import main
    from shardtune.config import load_train_config

    argv = ["estimate", "llama-3.1-8b", "--method", "lora", "--num-gpus", "4", "--gpu", "a100-40gb", "--batch-size",
            "8", "--strategy", "PP", "--time", "--json"]
    steps = {}
    for given, expected in ((None, 8), (4, 4)):
        recipe = tmp_path / f"pp{given}.yaml"
        assert main([*argv, *(["--pipeline-microbatches", str(given)] if given else []), "--emit-config",
                     str(recipe)]) == 0
        pp = [row for row in json.loads(capsys.readouterr().out)["timing"]["setups"]
              if row["setup"] == "pipeline parallel"]
        steps[expected] = pp[0]["step_s"]
        assert load_train_config([str(recipe), "--dataset_name", "d.jsonl"]).distributed.pipeline_microbatches == \
            expected
    assert steps[8] < steps[4]  # more micro-batches, less of the pipeline idle
    assert main([*argv, "--pipeline-microbatches", "3"]) == 2
    assert "--batch-size 8 must be a multiple of --pipeline-microbatches 3" in capsys.readouterr().err
    assert main([*argv, "--pipeline-microbatches", "2"]) == 2  # train's 1F1B needs one per stage, as train says
    assert "1F1B needs at least one micro-batch per stage: --pipeline-microbatches 2 for 4 stages" in \
        capsys.readouterr().err


def test_pp_and_mp_with_more_gpus_than_decoder_layers_are_refused_as_train_refuses_them(config_dir, tmp_path,
                                                                                       capsys):
    """PP with 4 GPUs (MP with 3) on a model of 2 decoder layers: train refuses the job (a stage would hold no layer),
    while estimate gave it a table; it now refuses it in one line too, a recipe's in train's own words."""
    from shardtune.config.loading import run_config_problems
    from shardtune.testing.tiny import tiny_llama_config

    model = config_dir(tiny_llama_config(256, num_layers=2).to_dict())
    where = f"{model}/config.json: num_hidden_layers"
    for strategy, gpus, each in (("PP", 4, "pipeline stage per"), ("MP", 3, "model-parallel stage per")):
        devices = ["--mp_devices", ",".join(f"cuda:{i}" for i in range(gpus))] if strategy == "MP" else []
        _, _, by_train = run_config_problems(["--model_name_or_path", model, "--dataset_name", "d.jsonl",
                                              "--output_dir", str(tmp_path / "out"), "--distributed_type", strategy,
                                              "--num_processes", str(gpus if strategy == "PP" else 1),
                                              "--pipeline_microbatches", "4", "--dry_run", "true", *devices])
        assert any(f"{gpus} stages for the 2 decoder layers of model_name_or_path '{model}'" in p
                   for p in by_train), by_train
        assert main(["estimate", model, "--num-gpus", str(gpus), "--strategy", strategy, "--batch-size", "4",
                     *(["--pipeline-microbatches", "4"] if strategy == "PP" else [])]) == 2
        assert capsys.readouterr().err == (
            f"shardtune estimate: error: --strategy {strategy} runs one {each} GPU: {gpus} stages for the 2 decoder "
            f"layers of {model} ({where}); use 2 GPUs or fewer (--num-gpus), or FSDP or DDP\n")
    recipe = tmp_path / "pp.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndistributed_type: PP\nnum_processes: 4\n"
                      f"pipeline_microbatches: 4\nper_device_train_batch_size: 4\n")
    assert main(["estimate", "--config", str(recipe)]) == 2
    assert capsys.readouterr().err == (
        f"shardtune estimate: error: {recipe}, line 3: distributed_type=PP runs one pipeline stage per process: 4 "
        f"stages for the 2 decoder layers of model_name_or_path '{model}' ({where}); launch 2 processes or fewer "
        f"(--num_processes 2)\n")
    # As many GPUs as layers is a job train runs.
    assert main(["estimate", model, "--num-gpus", "2", "--strategy", "PP", "--batch-size", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["num_gpus"] == 2


def test_pipeline_parallel_asked_for_is_compared_and_named_by_the_recommendation(capsys):
    """--strategy PP at a batch only it holds: the setups table left PP out, and the recommendation said "at
    micro-batch 64 no setup holds it" above a breakdown of the asked PP that fits. PP now sits in the table, with
    the totals and the largest micro-batch its own estimate gives, and the recommendation names it."""
    asked = ["estimate", "llama-3.1-8b", "--num-gpus", "4", "--gpu", "h100-80gb", "--batch-size", "64", "--json"]
    assert main([*asked, "--strategy", "PP"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["strategy"] == "PP" and data["fits"]
    pp = [row for row in data["strategies"] if row["strategy"] == "PP"]
    assert len(pp) == 1 and pp[0]["fits"] and pp[0]["per_gpu"] == data["per_gpu"]
    others = [row for row in data["strategies"] if row["strategy"] != "PP"]
    assert not any(row["fits"] for row in others)  # the case in question: PP alone holds 64 rows
    reason = data["recommendation"]["reason"]
    assert "no setup holds it" not in reason and "at micro-batch 64 only pipeline parallel holds it" in reason
    assert main(asked) == 0  # PP is compared where asked for (or measured), as before otherwise
    assert "PP" not in [row["strategy"] for row in json.loads(capsys.readouterr().out)["strategies"]]


def test_the_batch_plan_line_agrees_with_its_json(capsys):
    """--find-batch-size printed 'x 1 accumulation steps' where the plan keeps one: the line now says each figure of
    --json's batch_plan in words that read."""
    asked = ["estimate", "llama-3.1-8b", "--method", "lora", "--num-gpus", "4", "--find-batch-size"]
    assert main([*asked, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["batch_plan"]
    assert plan["gradient_accumulation_steps"] == 1
    assert main(asked) == 0
    text = " ".join(capsys.readouterr().out.split())
    line = (f"batch: micro-batch {plan['micro_batch_size']} per GPU x 1 accumulation step = global batch "
            f"{plan['global_batch_size']} (asked {plan['requested_global_batch_size']}; at most "
            f"{plan['largest_fitting_micro_batch']} fits per GPU, {plan['roomy_micro_batch']} with more to spare")
    assert line in text


def test_a_largest_micro_batch_at_the_search_limit_reads_as_no_limit(capsys):
    """Pipeline parallel keeps one row per stage in flight, so any micro-batch fits and the search stops at its
    limit: the table said "max b 4096" and --find-batch-size "at most 4096 fits per GPU", a limit that is none.
    They now say 4096+ and "4096 or more"; the JSON keeps the number searched to."""
    from shardtune.memory.recommend import MAX_BATCH

    asked = ["estimate", "llama-3.1-8b", "--num-gpus", "4", "--gpu", "h100-80gb", "--strategy", "PP", "--batch-size",
             "64", "--find-batch-size"]
    assert main([*asked, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pp = next(row for row in data["strategies"] if row["strategy"] == "PP")
    assert pp["max_batch_size"] == data["batch_plan"]["largest_fitting_micro_batch"] == MAX_BATCH
    others = [row["max_batch_size"] for row in data["strategies"] if row["strategy"] != "PP"]
    assert others and max(others) < MAX_BATCH  # the other rows keep their numbers
    assert main(asked) == 0
    text = " ".join(capsys.readouterr().out.split())
    cells = " ".join(f"{pp['per_gpu'][k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations",
                                                                  "overhead", "total"))
    assert f" pipeline parallel {cells} yes {MAX_BATCH}+ " in text
    assert f"max b: the largest micro-batch that fits (searched up to {MAX_BATCH})" in text
    assert f"{MAX_BATCH} or more fit per GPU: the search stops there)" in text and f"at most {MAX_BATCH}" not in text
    for batch in others:
        assert f" no {batch} " in text


def test_pipeline_stages_count_nccls_buffers_as_the_other_multi_process_setups_do(capsys):
    """PP's breakdown said "CUDA context and NCCL ... 0.75" GiB under a table whose note counted 1.00 for the same
    GPUs: its stages are processes that talk over NCCL, like DDP's and FSDP's ranks, where MP's one process does
    not. The context is 768 MiB, plus 256 MiB of NCCL buffers for every setup of several processes."""
    from shardtune.memory.formula import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES

    contexts = {}
    for strategy, gpus in (("PP", 2), ("MP", 2), ("DDP", 2), ("NO", 1)):
        assert main(["estimate", "llama-3.1-8b", "--method", "lora", "--num-gpus", str(gpus), "--strategy", strategy,
                     "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        contexts[strategy] = report["cuda_context"]
        assert report["nvidia_smi_bytes"] == report["per_gpu"]["total"] + report["cuda_context"]
    assert contexts == {"PP": CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES, "MP": CUDA_CONTEXT_BYTES,
                        "DDP": CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES, "NO": CUDA_CONTEXT_BYTES}
    assert CUDA_CONTEXT_BYTES == 768 * 2**20 and NCCL_BUFFER_BYTES == 256 * 2**20  # what docs/choosing-a-setup.md says


def test_the_setups_side_by_side_leave_out_only_mp_and_pp_with_more_gpus_than_layers(config_dir, capsys):
    """The comparison listed model parallel on 4 GPUs for a model of 2 decoder layers (and llama-3.1-405b's 126
    layers on 1024 GPUs), a job train refuses; it is left out there, every other setup kept, and kept where each GPU
    holds a layer (pipeline parallel too, where measured)."""
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.recommend import Measured, candidates
    from shardtune.testing.tiny import tiny_llama_config

    model = config_dir(tiny_llama_config(256, num_layers=2).to_dict())
    others = ["DDP", "FSDP SHARD_GRAD_OP", "FSDP FULL_SHARD", "FSDP FULL_SHARD + CPU offload"]
    for name, layers in ((model, 2), ("llama-3.1-405b", 126)):
        for gpus, mp in ((layers, ["model parallel"]), (layers + 1, []), (layers * 2, [])):
            assert main(["estimate", name, "--num-gpus", str(gpus), "--json"]) == 0
            setups = [row["setup"] for row in json.loads(capsys.readouterr().out)["strategies"]]
            assert setups == others + mp, (name, gpus)
    measured = Measured("res.json", {"DDP": 3000.0, "MP": 1000.0, "PP": 2000.0})
    analysis = analysis_for(model, checked_setup().config)
    for gpus, split in ((2, ["model parallel", "pipeline parallel"]), (4, [])):  # 4 rows: one per stage under 1F1B
        base = checked_setup(num_gpus=gpus, per_device_train_batch_size=4)
        labels = [s.label() for s in candidates(base, measured, analysis)]
        assert labels == others + split, gpus


def test_a_recipe_emitted_from_a_recipe_keeps_its_data_and_output_dir(tmp_path, capsys):
    """--config recipe --emit-config: the written recipe trained into ./output (the recipe's output_dir dropped)
    and the command said to set a dataset_name the recipe had."""
    from shardtune.cli import main
    from shardtune.config import load_train_config

    recipe, emitted = tmp_path / "r.yaml", tmp_path / "out.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\ndataset_name: mine.jsonl\noutput_dir: runs/mine\n"
                      "use_peft_lora: true\n")
    assert main(["estimate", "--config", str(recipe), "--find-batch-size", "--emit-config", str(emitted)]) == 0
    assert f"wrote {emitted} (shardtune train {emitted})" in capsys.readouterr().out
    cfg = load_train_config([str(emitted)])
    assert (cfg.data.dataset_name, cfg.run.output_dir) == ("mine.jsonl", "runs/mine")


def test_estimate_of_a_recipe_reads_fsdp_reshard_after_forward(tmp_path, capsys):
    """FSDP2 without resharding after forward is SHARD_GRAD_OP (train/plan.py): the estimate of a recipe that says
    so counts what that job holds, not FULL_SHARD's."""
    # LoRA: the peak is in the decoder layers' backward, where the layers kept gathered are (full fine-tuning of this
    # model peaks at the end of backward, after each layer was resharded: the same bytes either way).
    base = ("model_name_or_path: llama-3.2-1b\ndataset_name: d\ndistributed_type: FSDP\nnum_processes: 2\n"
            "per_device_train_batch_size: 2\nmax_seq_len: 1024\nuse_peft_lora: true\n")
    totals = {}
    for name, extra in (("full", ""), ("no_reshard", "fsdp_reshard_after_forward: false\n"),
                        ("grad_op", "fsdp_sharding_strategy: SHARD_GRAD_OP\n"),
                        ("grad_op_reshard", "fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                                            "fsdp_reshard_after_forward: true\n")):
        (tmp_path / f"{name}.yaml").write_text(base + extra)
        assert main(["estimate", "--config", str(tmp_path / f"{name}.yaml"), "--json"]) == 0
        totals[name] = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert totals["no_reshard"] == totals["grad_op"] != totals["full"] == totals["grad_op_reshard"]
    # HYBRID_SHARD without resharding keeps its layers gathered inside the node as SHARD_GRAD_OP does: the same
    # bytes more than HYBRID_SHARD, on 2 nodes of 2 GPUs (each shard over 2, as the pair above).
    hybrid = base.replace("num_processes: 2", "num_processes: 4\nnum_machines: 2")
    hybrid += "fsdp_sharding_strategy: HYBRID_SHARD\n"
    for name, extra in (("hybrid", ""), ("hybrid_keep", "fsdp_reshard_after_forward: false\n")):
        (tmp_path / f"{name}.yaml").write_text(hybrid + extra)
        assert main(["estimate", "--config", str(tmp_path / f"{name}.yaml"), "--json"]) == 0
        totals[name] = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert totals["hybrid_keep"] - totals["hybrid"] == totals["grad_op"] - totals["full"] > 0


@pytest.mark.parametrize("policy", ["NO_WRAP", "SIZE_BASED_WRAP"])
def test_estimate_of_a_recipe_with_other_fsdp_units_asks_for_the_trace(tmp_path, capsys, policy):
    """The formula counts a unit per decoder layer: a recipe that wraps otherwise (the whole model as one unit holds
    every weight gathered at once) is refused without --trace rather than estimated as if per layer."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\ndataset_name: d\ndistributed_type: FSDP\nnum_processes: 2\n"
                      f"fsdp_auto_wrap_policy: {policy}\n")
    assert main(["estimate", "--config", str(recipe)]) == 2
    assert (f"fsdp_auto_wrap_policy {policy}: the estimate's formula counts one FSDP unit per decoder layer "
            f"(TRANSFORMER_BASED_WRAP); add --trace") in capsys.readouterr().err
    recipe.write_text(recipe.read_text().replace(policy, "TRANSFORMER_BASED_WRAP"))
    assert main(["estimate", "--config", str(recipe), "--json"]) == 0


def test_an_emitted_recipe_for_several_gpus_names_the_launch_command(tmp_path, capsys):
    """shardtune train runs one process: the recipe of a 2-GPU setup is run by shardtune launch, as printed."""
    for gpus, command in (("2", "shardtune launch --num_processes 2 train"), ("1", "shardtune train")):
        out = tmp_path / f"e{gpus}.yaml"
        assert main(["estimate", "llama-3.2-1b", "--num-gpus", gpus, "--emit-config", str(out)]) == 0
        assert f"then: {command} {out})" in capsys.readouterr().out


def test_the_launch_command_of_a_multi_machine_recipe_starts_it(tmp_path, capsys):
    """The command printed for a recipe of several machines is one 'shardtune launch' takes, with the rank and the
    main machine's address filled in (it printed no --machine_rank and no --main_process_ip, so the command as shown
    was refused: 'multi-machine launch needs --main_process_ip')."""
    from shardtune.cli.launch import launcher_parser, torchrun_command

    out = tmp_path / "multi.yaml"
    assert main(["estimate", "llama-3.1-8b", "--num-gpus", "4", "--num-nodes", "3", "--strategy", "FSDP",
                 "--emit-config", str(out)]) == 0
    shown = " ".join(capsys.readouterr().out.split(f"wrote {out} (")[1].rsplit(")", 1)[0].split())
    words = shown.split(": ", 2)[-1].split(", RANK")[0].split()
    assert words[:2] == ["shardtune", "launch"] and words[-2:] == ["train", str(out)]
    for rank in range(3):
        filled = [{"RANK": str(rank), "ADDRESS": "10.0.0.1"}.get(w, w) for w in words[2:-2]]
        cmd = torchrun_command(launcher_parser().parse_args(filled), [str(out)])
        assert cmd[cmd.index("--nnodes") + 1] == "3" and cmd[cmd.index("--nproc_per_node") + 1] == "4"
        assert cmd[cmd.index("--node_rank") + 1] == str(rank) and cmd[cmd.index("--master_addr") + 1] == "10.0.0.1"
    assert "RANK 0 on the main machine and 1 to 2 on the others, ADDRESS the main machine's" in shown


def test_a_recipe_is_written_only_of_a_job_that_fits_and_trains_its_loss(tmp_path, capsys):
    """--emit-config wrote the recipe of a setup that needed 98 GiB of an 80 GiB card ("Nothing fits" printed
    above it), and with --loss full a recipe whose job (shardtune's loss) the estimate had not described. Both are
    refused, nothing written; the job named outright that fits is written."""
    from shardtune.cli import main

    out = tmp_path / "x.yaml"
    asked = ["estimate", "llama-3.1-8b", "--method", "lora", "--strategy", "NO", "--no-gradient-checkpointing",
             "--batch-size", "8"]
    assert main([*asked, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"]
    assert main([*asked, "--emit-config", str(out)]) == 2
    err = capsys.readouterr().err
    need = (report["per_gpu"]["total"] + report["cuda_context"]) / 2**30
    assert f"single GPU at micro-batch 8 needs {need:.1f} GiB per GPU, more than the 79.6 GiB" in err
    assert "so no recipe is written" in err and not out.exists()
    assert main(["estimate", "llama-3.1-8b", "--method", "lora", "--loss", "full", "--emit-config", str(out)]) == 2
    assert "trains with shardtune's own loss, not --loss full" in capsys.readouterr().err and not out.exists()
    assert main([*asked, "--batch-size", "1", "--emit-config", str(out)]) == 0 and out.is_file()


@pytest.mark.parametrize("options, says", [
    (["--gpu", "t4", "--mixed-precision", "bf16"], "--mixed-precision bf16: the NVIDIA T4 16GB does not compute bf16"),
    (["--gpu", "t4", "--mixed-precision", "fp16", "--attn-implementation", "flash_attention_2"],
     "FlashAttention-2 runs on Ampere and newer GPUs, not on the NVIDIA T4 16GB"),
    (["--gpu", "a100-80gb", "--mixed-precision", "no", "--attn-implementation", "flash_attention_2"],
     "flash attention computes in bf16 or fp16 only, and this job computes in fp32 on the NVIDIA A100 80GB"),
])
def test_what_the_card_cannot_run_is_refused_without_time(options, says, capsys):
    """bf16 on a T4 was refused only with --time (and the emitted recipe said bf16 true); flash attention on a T4
    or in fp32 was estimated as flash, where the trainer falls back to sdpa, which holds more."""
    from shardtune.cli import main

    assert main(["estimate", "llama-3.2-1b", "--method", "lora", *options]) == 2
    assert says in capsys.readouterr().err


def test_a_recipes_job_is_estimated_as_train_runs_it_on_the_card(tmp_path, capsys):
    """Under --config the card checks named options --config refuses, and refused jobs train runs: a recipe's
    use_flash_attn falls back to sdpa where flash cannot run (estimated so, and said), its bf16 runs emulated; an
    attn_implementation flash_attention_2 it cannot run is refused by its key."""
    from shardtune.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\nuse_peft_lora: true\nuse_flash_attn: true\nbf16: true\n")
    assert main(["estimate", "--config", str(recipe), "--gpu", "t4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: use_flash_attn: FlashAttention-2 runs on Ampere and newer GPUs" in captured.err
    sdpa = tmp_path / "sdpa.yaml"
    sdpa.write_text("model_name_or_path: llama-3.2-1b\nuse_peft_lora: true\nbf16: true\n")
    assert main(["estimate", "--config", str(sdpa), "--gpu", "t4", "--json"]) == 0
    assert json.loads(captured.out)["per_gpu"] == json.loads(capsys.readouterr().out)["per_gpu"]
    # Emulated bf16 has no speed to time it by: the refusal names the recipe's key, not an option --config refuses.
    assert main(["estimate", "--config", str(sdpa), "--gpu", "t4", "--time"]) == 2
    err = capsys.readouterr().err
    assert f"set bf16 false (and fp16 true for fp16) at {sdpa}, line 3" in err and "--mixed-precision" not in err
    sdpa.write_text("model_name_or_path: llama-3.2-1b\nmixed_precision: bf16\n")
    assert main(["estimate", "--config", str(sdpa), "--gpu", "t4", "--time"]) == 2
    assert f"set mixed_precision fp16 (or no) at {sdpa}, line 2" in capsys.readouterr().err
    recipe.write_text("model_name_or_path: llama-3.2-1b\nattn_implementation: flash_attention_2\nbf16: false\n")
    assert main(["estimate", "--config", str(recipe), "--gpu", "a100-80gb"]) == 2
    assert "attn_implementation flash_attention_2: flash attention computes in bf16 or fp16 only" in \
        capsys.readouterr().err


def test_pure_bf16_is_estimated_wherever_train_runs_it(tmp_path, capsys):
    """Train runs torch_dtype bfloat16 with bf16 false, and on a card that only emulates bf16 (with a warning): the
    estimate takes both too (a check this session added refused them, and was taken back)."""
    from shardtune.cli import main

    assert main(["estimate", "llama-3.2-1b", "--pure-bf16", "--gpu", "t4"]) == 0
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\ntorch_dtype: bfloat16\nbf16: false\n")
    assert main(["estimate", "--config", str(recipe)]) == 0
    assert "pure bf16" in capsys.readouterr().out


@pytest.mark.parametrize("options, says", [
    (["--num-gpus", "2", "--strategy", "MP", "--sharding-strategy", "SHARD_GRAD_OP"],
     "--sharding-strategy sets up FSDP, and --strategy MP is not FSDP"),
    (["--num-gpus", "2", "--strategy", "DDP", "--offload-params"], "--offload-params sets up FSDP"),
    (["--pipeline-microbatches", "4"], "--pipeline-microbatches splits the batch of pipeline parallel only"),
    (["--time", "--inter-node", "ethernet-25g"], "--inter-node ethernet-25g: the job runs on one node"),
    (["--time", "--interconnect", "pcie4"], "--interconnect pcie4: the job runs on one GPU per node"),
    (["--time", "--gpu", "rtx4090", "--num-gpus", "2", "--interconnect", "nvlink4"],
     "--interconnect nvlink4: the NVIDIA GeForce RTX 4090 24GB has no NVLink"),
])
def test_an_option_that_would_change_nothing_is_refused(options, says, capsys):
    """Each of these was accepted and dropped without a word (a sharding for model parallel, micro-batches for no
    pipeline, a link no collective crosses) or, for NVLink named on a card without it, used as if it were there."""
    from shardtune.cli import main

    assert main(["estimate", "llama-3.2-1b", *options]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_an_architecture_transformers_does_not_ship_is_one_short_line(tmp_path, capsys):
    """transformers' own message lists every model type it knows: 9,000 characters in the "one line"."""
    from shardtune.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "foo", "hidden_size": 64}')
    assert main(["estimate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type 'foo' is not in transformers " in err and len(err) < 300


def test_the_side_by_side_table_fits_80_columns_with_a_405b_models_totals(capsys, monkeypatch):
    """A total of thousands of GiB was cut to '7826…' (and the header to 'max…') at the docs' 80 columns: such
    figures are whole GiB with a thousands separator, and nothing in the table is cut."""
    from shardtune.cli import main
    from shardtune.memory.report import GIB

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["estimate", "llama-3.1-405b", "--num-gpus", "8", "--num-nodes", "2", "--json"]) == 0
    ddp = next(row for row in json.loads(capsys.readouterr().out)["strategies"] if row["setup"] == "DDP")
    assert main(["estimate", "llama-3.1-405b", "--num-gpus", "8", "--num-nodes", "2"]) == 0
    table = capsys.readouterr().out.split("Setups side by side")[1].split("fits: total")[0]
    assert "…" not in table and "max b" in table
    assert f"{ddp['per_gpu']['total'] / GIB:,.0f}" in table


def test_tight_margin_is_the_calibrated_error():
    """"fits, tight" means less to spare than the formula's mean error on measured peaks: the constant is the one
    bench/calibration.py reports, so a recalibration that moves it fails here until the constant follows."""
    from pathlib import Path

    from shardtune.memory.formula import MEASURED_ERROR

    calibration = json.loads((Path(__file__).parent.parent / "bench/results/calibration.json").read_text())
    assert MEASURED_ERROR == round(calibration["memory_summary"]["mean_abs_error"], 3)


def test_a_setup_that_fits_within_the_estimates_error_is_tight_and_a_roomier_micro_batch_is_named(capsys):
    """LoRA of Llama-3.1-8B on one RTX 4090 at 2 x 4096 tokens fits by 0.23 GiB where the estimate's error is about
    2 GiB (and its trace leaves 0.03): it said "fits" as if that were certain. It is now "fits, tight", and the
    recommendation names micro-batch 1 x 8 (the same 8 rows per optimizer step), with what that leaves."""
    from shardtune.memory.formula import MEASURED_ERROR

    asked = ["estimate", "llama-3.1-8b", "--method", "lora", "--gpu", "rtx4090", "--seq-len", "4096"]
    assert main([*asked, "--batch-size", "2", "--gradient-accumulation-steps", "4", "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    gpu, total, context = tight["gpu"]["memory_bytes"], tight["per_gpu"]["total"], tight["cuda_context"]
    assert tight["fits"] and tight["spare_bytes"] == gpu - total - context
    assert 0 <= tight["spare_bytes"] < MEASURED_ERROR * total and tight["tight"] and tight["recommendation"]["tight"]
    assert main([*asked, "--batch-size", "1", "--gradient-accumulation-steps", "8", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["spare_bytes"] >= MEASURED_ERROR * roomy["per_gpu"]["total"] and not roomy["tight"]
    assert not roomy["recommendation"]["tight"] and "Tight" not in roomy["recommendation"]["reason"]
    reason = " ".join(tight["recommendation"]["reason"].split())
    assert (f"Tight: {tight['spare_bytes'] / GIB:.2f} GiB to spare is less than the estimate's mean error on measured "
            f"peaks ({MEASURED_ERROR:.1%}, {MEASURED_ERROR * total / GIB:.2f} GiB here): micro-batch 1 x 8 "
            f"accumulation steps leaves {roomy['spare_bytes'] / GIB:.2f} GiB.") in reason
    assert main([*asked, "--batch-size", "2", "--gradient-accumulation-steps", "4"]) == 0
    assert "fits, tight" in capsys.readouterr().out


def test_the_estimate_says_how_to_write_its_setup_as_a_recipe_and_that_recipe_estimates_the_same(tmp_path, capsys):
    """The estimate ended at its recommendation with no word of how to train it; the recipe is one option away. The
    last line now names --emit-config and the setup it writes, and the recipe written estimates to the same figures
    (the smaller micro-batch and its accumulation included)."""
    from shardtune.cli import main

    job = ["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--num-gpus", "2", "--no-gradient-checkpointing",
           "--batch-size", "16"]
    assert main(job) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at 80 columns
    assert out.endswith("(slow: every step crosses PCIe). It keeps 120 GiB per node in host RAM: check that each "
                        "node has that much free. to train it: add --emit-config FILE.yaml, which writes FSDP "
                        "FULL_SHARD + CPU offload at micro-batch 1 x 16 accumulation steps as a 'shardtune train' "
                        "recipe")
    recipe = tmp_path / "r.yaml"
    assert main([*job, "--json", "--emit-config", str(recipe)]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--config", str(recipe), "--gpu", "rtx4090", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["setup"] == estimated["setup"] and again["per_gpu"] == estimated["per_gpu"]
    assert (again["setup"]["batch_size"], again["setup"]["gradient_accumulation_steps"]) == (1, 16)
    assert main([*job, "--emit-config", str(tmp_path / "s.yaml")]) == 0  # written: the hint is not repeated
    assert "to train it" not in capsys.readouterr().out
    main(["estimate", "llama-3.1-70b", "--gpu", "rtx4090", "--no-gradient-checkpointing"])
    out = capsys.readouterr().out
    assert "Nothing fits" in out and "to train it" not in out  # no recipe to write
