"""``shardtune bench strategies``: the per-setup figures are computed from what the probe measured."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from shardtune.bench.probe import STAGE_MARK, STEP_MARK, Probe, StageMarks, split_step_time
from shardtune.bench.strategies import (Result, explain, format_table, model_label, strategy_figure, summarise,
                                        write_plot)
from shardtune.cli import main as shardtune_main
from shardtune.errors import UsageError
from shardtune.memory.recommend import MEASURED_TIE
from tests.trainutil import run_shardtune, write_chat_data


def write_probe(folder, rank, **fields):
    record = {"rank": rank, "strategy": "DDP", "wall_s": [], "tokens": [], "compute_s": [], "comm_s": [],
              "stage_compute_s": [], "gpu_util": []} | fields
    (folder / f"probe-rank-{rank}.json").write_text(json.dumps(record))


def test_summarise_skips_warmup_and_takes_the_slowest_rank(tmp_path):
    write_probe(tmp_path, 0, wall_s=[9.0, 1.0, 2.0], compute_s=[9.0, 0.5, 1.0], comm_s=[0.0, 0.25, 0.5],
                tokens=[100, 100, 300])
    write_probe(tmp_path, 1, wall_s=[9.0, 1.5, 1.0], compute_s=[1.0, 0.75, 0.25], comm_s=[0.0, 0.5, 0.5])
    res = summarise("DDP", tmp_path, warmup_steps=1)
    # Steps 2 and 3: the slower rank sets each step's wall time (1.5 s and 2.0 s).
    assert res.wall_per_step_s == pytest.approx((1.5 + 2.0) / 2)
    assert res.tokens_per_s == pytest.approx(400 / 3.5)
    assert res.busy == pytest.approx([1.5 / 3.0, 1.0 / 2.5])
    assert res.in_collectives == pytest.approx([0.75 / 3.0, 1.0 / 2.5])


def test_summarise_mp_reports_each_stage(tmp_path):
    write_probe(tmp_path, 0, strategy="MP", wall_s=[5.0, 2.0, 2.0], compute_s=[5.0, 2.0, 2.0], tokens=[1, 10, 10],
                stage_compute_s=[[1.0, 1.0], [0.6, 0.8], [0.4, 0.6]])
    res = summarise("MP", tmp_path, warmup_steps=1)
    assert res.stages_or_ranks == 2
    assert res.busy == pytest.approx([1.0 / 4.0, 1.4 / 4.0])
    assert "one stage busy at a time" in explain(res, 2)


def event(name, start, end, thread=1, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           cpu_parent=parent)


def test_split_step_time_counts_compute_and_uncovered_communication():
    """Times in microseconds, as the profiler gives them; two steps on thread 1, gloo's work on thread 2."""
    gather = event("c10d::_allgather_base_", 450, 470)  # under the all-reduce below: no time of its own
    events = [
        event(STEP_MARK, 0, 1000), event(STEP_MARK, 1000, 2000),
        event("aten::mm", 100, 300), event("aten::add", 200, 400),  # overlapping: 300 us of compute
        event("aten::copy_", 455, 465, parent=gather),  # inside a collective, outside other compute: not compute
        event("aten::mm", 600, 700, thread=2),  # not the training thread
        event("gloo:all_reduce", 350, 800, thread=2),  # 50 us under compute, 400 us waiting
        event("aten::mm", 1100, 1600), event("gloo:all_gather", 1500, 2500, thread=2),  # cut at the step's end
        gather,
    ]
    split = split_step_time(events)
    assert split["compute_s"] == pytest.approx([300e-6, 500e-6])
    assert split["comm_s"] == pytest.approx([400e-6, 400e-6])
    assert split["stage_compute_s"] == []


def test_stage_marks_split_a_real_step_between_stages(tmp_path):
    """Counted, not timed: the matmuls the profiler records inside each stage's marks are exactly its layers'
    (one per nn.Linear in forward, two in backward), the head's in the last stage; none is outside a stage."""
    from shardtune.testing.tiny import make_model_folder
    from torch.autograd.profiler import record_function
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(make_model_folder(tmp_path / "m", num_layers=6)))
    bounds, steps = ((0, 1), (1, 6)), 2
    marks = StageMarks(model, bounds)
    ids = torch.randint(0, 100, (4, 64))
    model(input_ids=ids, labels=ids).loss.backward()  # first calls initialise kernels: not what is measured
    marks.switch(None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                model(input_ids=ids, labels=ids).loss.backward()
            assert marks.running is None  # the backward pass ended with no stage running
    events = prof.events()
    matmuls = [e.time_range.start for e in events if e.name == "aten::mm"]
    for stage, (start, end) in enumerate(bounds):
        marked = [(e.time_range.start, e.time_range.end) for e in events if e.name == f"{STAGE_MARK}{stage}"]
        layers = model.model.layers[start:end]
        linears = sum(isinstance(m, torch.nn.Linear) for layer in layers for m in layer.modules())
        linears += stage == len(bounds) - 1  # the head
        inside = sum(any(lo <= t < hi for lo, hi in marked) for t in matmuls)
        assert inside == steps * 3 * linears, (stage, inside, linears)
    assert len(matmuls) == steps * 3 * sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    split = split_step_time(events, num_stages=2)
    assert split["comm_s"] == [0.0] * steps
    for (first, rest), compute in zip(split["stage_compute_s"], split["compute_s"]):
        assert first > 0 and rest > 0 and first + rest < compute  # the embeddings and the loss's start are nobody's


def test_probe_callback_records_each_step_as_the_bench_reads_it(tmp_path):
    """The loop's events driven by hand around real MP steps on CPU: one record per rank, in the bench's format."""
    from shardtune.config import TrainConfig
    from shardtune.dist import DistInfo
    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.plan import Plan
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(make_model_folder(tmp_path / "m", num_layers=4)))
    args = TrainConfig()
    args.run.output_dir = str(tmp_path / "out")
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    probe, control, ids = Probe(), None, torch.randint(0, 100, (2, 32))
    probe.on_train_begin(args, None, control, model=model, optimizer=None, info=info,
                         plan=Plan(strategy="MP", stage_bounds=((0, 2), (2, 4)), devices=("cpu", "cpu")))
    for step in range(3):
        probe.on_step_begin(args, None, control, micro_batches=[], model=model, optimizer=None)
        model(input_ids=ids, labels=ids).loss.backward()
        probe.on_step_end(args, None, control, stats=SimpleNamespace(tokens=64 + step))
    probe.on_train_end(args, None, control, model=model, summary={}, log=print)
    record = json.loads((tmp_path / "out" / "probe" / "probe-rank-0.json").read_text())
    assert sorted(record) == ["comm_s", "compute_s", "gpu_util", "rank", "stage_compute_s", "strategy", "tokens",
                              "wall_s"]
    assert (record["rank"], record["strategy"], record["tokens"]) == (0, "MP", [64, 65, 66])
    assert len(record["wall_s"]) == len(record["compute_s"]) == len(record["stage_compute_s"]) == 3
    assert all(0 < c < w for c, w in zip(record["compute_s"], record["wall_s"]))  # compute inside the step's time
    assert all(len(stages) == 2 and min(stages) > 0 for stages in record["stage_compute_s"])
    res = summarise("MP", tmp_path / "out" / "probe", warmup_steps=1)
    assert res.tokens_per_s == pytest.approx((65 + 66) / sum(record["wall_s"][1:]))
    assert res.stages_or_ranks == 2 and 0 < sum(res.busy) <= 1


def test_table_has_a_row_and_a_line_per_setup():
    rows = [Result("MP", 1, 2, 0.5, 1000.0, busy=[0.4, 0.45], busy_source="x", peak_memory_bytes=2**30,
                   estimate_bytes=2**29),
            Result("DDP", 2, 2, error="exit 1: boom")]
    rows[0].explanation = explain(rows[0], 2)
    rows[1].explanation = explain(rows[1], 2)
    table = format_table(rows, "CAVEAT")
    assert "| MP | 1 | 0.500 | 1000 | 40% / 45% | - | 1.00 | 0.50 |" in table
    assert "- DDP: did not run: exit 1: boom" in table and table.endswith("CAVEAT")


def test_plot_stacks_busy_and_waiting_per_setup(tmp_path):
    rows = [Result("MP", 1, 2, 0.5, 1000.0, busy=[0.4, 0.5]),
            Result("DDP", 2, 2, 0.4, 3000.0, busy=[0.9, 0.7], in_collectives=[0.05, 0.15]),
            Result("FSDP", 2, 2, error="exit 1: boom")]
    tokens, shares = strategy_figure(rows).axes
    assert [b.get_height() for b in tokens.patches] == [1000.0, 3000.0]  # the failed setup has no bar
    busy, waiting = shares.containers
    assert [b.get_height() for b in busy] == pytest.approx([0.45, 0.8])
    assert [b.get_height() for b in waiting] == pytest.approx([0.0, 0.1])
    assert [b.get_y() for b in waiting] == pytest.approx([0.45, 0.8])  # stacked on the busy share
    assert write_plot(rows, tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def size_of(folder: Path) -> str:
    """"L layers x H hidden, N parameters" read off the model transformers loads from ``folder``: its config, and
    the numel of its parameters (a tied head once), written as people say it (3.2 M, 139.6 k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    count = f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"
    return f"{model.config.num_hidden_layers} layers x {model.config.hidden_size} hidden, {count} parameters"


def test_results_name_the_model_not_the_folder_it_was_read_from(tmp_path):
    # bench/strategies_cpu.py builds its model in a temporary folder; the estimate quotes what the file says.
    from shardtune.memory.recommend import Measured
    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(tmp_path / "bench-strategies-x1y2" / "tiny-llama", num_layers=4, hidden_size=256,
                              intermediate_size=704, num_heads=8, num_kv_heads=4)
    label = model_label(str(model))
    assert label == f"tiny-llama ({size_of(model)})"
    other = make_model_folder(tmp_path / "model", num_layers=2)
    assert model_label(str(other) + "/") == f"model (llama, {size_of(other)})"
    assert model_label("meta-llama/Not-Downloaded-7B") == "Not-Downloaded-7B"  # no config to read: its name
    measured = Measured("res.json", {"DDP": 3000.0, "MP": 1000.0}, label, 2, "cpu (2 cores)")
    assert measured.describe() == (f"DDP 3,000, MP 1,000 tokens/s measured with tiny-llama ({size_of(model)}) on "
                                   f"cpu (2 cores), 2 processes (res.json)")


def test_bad_strategy_is_a_usage_error():
    from shardtune.cli.bench import parse_strategies

    assert parse_strategies("MP, fsdp") == ["MP", "FSDP"]  # any case in, the registry's names out
    assert parse_strategies(None) == ["DDP", "FSDP", "MP", "PP"]  # every strategy that spreads a job
    # a name the registry lacks, one it has that spreads nothing over processes (NO), and an empty list
    for text, bad in (("mp,zero", "zero"), ("fsdp,no", "no"), (" , ", "empty list")):
        with pytest.raises(UsageError) as err:
            parse_strategies(text)
        assert str(err.value) == (f"--strategies {text!r}: unknown {bad}; use a comma-separated list of "
                                  f"{', '.join(parse_strategies(None))}")


def test_bench_command_end_to_end_mp_and_ddp(tmp_path, capsys):
    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(tmp_path / "model", num_layers=4)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=400)
    recipe = tmp_path / "recipe.yaml"
    # As a run's saved config.yaml holds them (README: bench a run's config.yaml): the processes it ran on and the
    # checkpoint it resumed from, gone since. Each setup runs on the bench's processes and starts afresh.
    recipe.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\nsplits: train\nmax_seq_len: 64\n"
                      f"packing: true\nper_device_train_batch_size: 4\nnum_processes: 1\nnum_machines: 1\n"
                      f"resume_from_checkpoint: {tmp_path / 'earlier' / 'checkpoints' / 'step-20'}\n")
    result = run_shardtune(["bench", "strategies", str(recipe), "--strategies", "mp,ddp", "--steps", "3",
                            "--out", str(tmp_path / "res.json"), "--work_dir", str(tmp_path / "work")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "res.json").read_text())
    assert saved["model"] == f"model (llama, {size_of(model)})"  # not the folder's path
    assert saved["num_processes"] == 2 and saved["batch_size"] == 4
    assert saved["method"] == "full"  # the recipe sets no use_peft_lora: every weight trains
    mp, ddp = saved["results"]
    work = tmp_path / "work"
    probe = json.loads((work / "MP" / "probe" / "probe-rank-0.json").read_text())
    walls = probe["wall_s"][1:]
    assert mp["tokens_per_s"] == pytest.approx(sum(probe["tokens"][1:]) / sum(walls))
    # One process drives both stages: each stage's share is its compute over the step time.
    assert mp["busy"] == pytest.approx([sum(step[s] for step in probe["stage_compute_s"][1:]) / sum(walls)
                                        for s in (0, 1)])
    records = [json.loads(line) for line in (work / "MP" / "metrics.jsonl").read_text().splitlines()]
    assert mp["losses"] == [r["loss"] for r in records] and len(records) == 3
    assert mp["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in records)
    # DDP: each rank computes part of the step and waits in the gradient all-reduce for part of it.
    ranks = [json.loads((work / "DDP" / "probe" / f"probe-rank-{r}.json").read_text()) for r in (0, 1)]
    assert ddp["busy"] == pytest.approx([sum(r["compute_s"][1:]) / sum(r["wall_s"][1:]) for r in ranks])
    assert ddp["in_collectives"] == pytest.approx([sum(r["comm_s"][1:]) / sum(r["wall_s"][1:]) for r in ranks])
    # The memory column: what `shardtune estimate` says of the same setup, in the precision the run chose.
    for row in (mp, ddp):
        ran = yaml.safe_load((work / row["strategy"] / "config.yaml").read_text())
        checkpointing = "--gradient-checkpointing" if ran["gradient_checkpointing"] else "--no-gradient-checkpointing"
        assert shardtune_main(["estimate", str(model), "--strategy", row["strategy"], "--num-gpus", "2",
                               "--batch-size", "4", "--seq-len", "64", "--method", "full", checkpointing,
                               "--mixed-precision", "bf16" if ran["bf16"] else "no", "--json"]) == 0
        assert row["estimate_bytes"] == json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    table = (tmp_path / "res.md").read_text()
    assert "| MP |" in table and "| DDP |" in table and "waiting in communication" in table
    # The estimator ranks the setups that fit by these speeds: the faster of the two here.
    out = run_shardtune(["estimate", str(model), "--num-gpus", "2", "--gpu-memory", "8", "--json",
                         "--measured", str(tmp_path / "res.json")], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    slower, faster = sorted((mp, ddp), key=lambda row: row["tokens_per_s"])
    # Within the tie margin the usual order decides, and it puts DDP before MP.
    clear = slower["tokens_per_s"] < faster["tokens_per_s"] * (1 - MEASURED_TIE)
    recommendation = json.loads(out.stdout)["recommendation"]
    assert recommendation["strategy"] == (faster["strategy"] if clear else "DDP")
    assert f"tokens/s measured with {saved['model']} on cpu" in recommendation["reason"]


# What torchrun printed when both DDP ranks of a bench setup stopped on bad data (torch 2.x, abridged paths), from
# when the bench started torchrun itself; a rank's error may still come with such a report around it.
TORCHRUN_FAILED = """\
shardtune bench: rank 0: cannot tell the data format from the columns ['foo']: give rows with 'messages'.
shardtune bench: rank 1: cannot tell the data format from the columns ['foo']: give rows with 'messages'.
E1122 22:55:04.068000 28039 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
shardtune.bench_probe FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 28043)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

# What a bench setup prints now, through 'shardtune launch' (which cuts torchrun's report to its last line).
LAUNCH_FAILED = """\
shardtune train: error: bad.jsonl:1: cannot tell the data format from the columns ['foo']: give rows with 'messages'.
W1123 21:44:57.977000 5177 torch/distributed/elastic/.../api.py:1028] Sending process 5199 closing signal SIGTERM
E1123 21:44:58.010000 5177 torch/distributed/elastic/.../api.py:1002] failed (exitcode: 2) local_rank: 0
shardtune launch: rank 0 exited with code 2 (see its messages above)
"""


def test_a_failed_setup_reports_the_ranks_error_not_torchruns_banner():
    from shardtune.bench.strategies import failure_line

    assert failure_line(LAUNCH_FAILED) == ("shardtune train: error: bad.jsonl:1: cannot tell the data format from "
                                           "the columns ['foo']: give rows with 'messages'.")
    assert failure_line(TORCHRUN_FAILED) == ("shardtune bench: rank 0: cannot tell the data format from the columns "
                                             "['foo']: give rows with 'messages'.")
    # A rank that raised: its exception (torch prefixes the rank's lines), not torchrun's ChildFailedError.
    raised = TORCHRUN_FAILED.split("\n", 2)[2].replace(
        "E1122", "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"step.py\", line 9\n"
                 "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:29500\nE1122", 1)
    assert failure_line(raised) == "RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    # A rank killed (out of memory): no error of its own; torchrun's line above its report gives the exit code.
    killed = TORCHRUN_FAILED.split("\n", 2)[2].replace("exitcode: 2", "exitcode: -9")
    assert failure_line(killed).endswith("failed (exitcode: -9) local_rank: 0")
    assert failure_line("loading...\nKilled\n") == "Killed"


def tiny_recipe(tmp_path):
    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(tmp_path / "model", num_layers=2)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=50)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\nsplits: train\nmax_seq_len: 64\n")
    return recipe


def test_bench_checks_the_recipe_before_starting_any_setup(tmp_path, monkeypatch, capsys):
    """The recipe --emit-config writes (a hub model, the dataset placeholder) is refused at once, exit 2."""
    from shardtune.bench import strategies
    from shardtune.cli import main

    def no_setup(*args, **kwargs):
        raise AssertionError("a setup was started")

    monkeypatch.setattr(strategies, "run_setup", no_setup)
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "llama-3.1-8b", "--method", "lora", "--emit-config", "recipe.yaml"]) == 0
    capsys.readouterr()
    out = ["--out", "res.json", "--plot", "res.png"]
    assert main(["bench", "strategies", "recipe.yaml", *out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    line = next(i for i, text in enumerate((tmp_path / "recipe.yaml").read_text().splitlines(), 1)
                if text.startswith("dataset_name:"))
    assert f"recipe.yaml, line {line}: dataset_name is still the placeholder REPLACE_WITH_YOUR_DATASET" in err
    assert "set dataset_name to your data" in err
    # A local model folder that is not there (a hub name like the recipe's own is fine), named where it was set.
    assert main(["bench", "strategies", "recipe.yaml", "--set", "model_name_or_path=./no-such-model",
                 "--set", "dataset_name=data/chat.jsonl", *out]) == 2
    err = capsys.readouterr().err
    assert ("command line (--model_name_or_path): model_name_or_path './no-such-model' does not exist: give a "
            "local model folder or a hub name (ORG/NAME)") in err
    assert "command line (--dataset_name): dataset_name 'data/chat.jsonl' does not exist: check the path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_when_no_setup_runs_nothing_is_saved(tmp_path, monkeypatch, capsys):
    """Every setup failed: each one's real error, one line saying none ran, exit 1, and no result files."""
    from shardtune.bench import strategies
    from shardtune.cli import main

    recipe = tiny_recipe(tmp_path)
    monkeypatch.setattr(strategies, "run_setup", lambda *args, **kwargs: (1, TORCHRUN_FAILED))
    code = main(["bench", "strategies", str(recipe), "--strategies", "ddp,fsdp", "--out", str(tmp_path / "r.json"),
                 "--plot", str(tmp_path / "r.png")])
    captured = capsys.readouterr()
    assert code == 1
    assert "- DDP: did not run: exit 1: shardtune bench: rank 0: cannot tell the data format" in captured.err
    assert "- FSDP: did not run: exit 1: shardtune bench: rank 0: cannot tell the data format" in captured.err
    assert "=====" not in captured.err + captured.out and "Busy fraction" not in captured.out
    assert f"none of the setups ran (DDP, FSDP: errors above); nothing was written to {tmp_path / 'r.json'}" \
        in captured.err
    assert "saved" not in captured.out and "rank setups by these speeds" not in captured.out
    assert not list(tmp_path.glob("r.*"))


def test_setups_run_without_the_memory_check():
    # On CPU it traces step 2 of DDP and FSDP only, several times slower: it would count against those two.
    from shardtune.bench.strategies import job_args

    args = job_args("r.yaml", "DDP", Path("out"), num_processes=2, steps=4, extra=[])
    assert args[args.index("--predict_memory") + 1] == "false"


def test_setups_run_the_recipes_callbacks_and_the_probe():
    from shardtune.bench.strategies import job_args

    args = job_args("r.yaml", "DDP", Path("out"), num_processes=2, steps=4, callbacks=["my.hooks:Stop"],
                    extra=["--callbacks", "my.hooks:Stop"])  # what --set callbacks=... adds: the recipe's too
    assert args[-2:] == ["--callbacks", "my.hooks:Stop,shardtune.bench.probe:Probe"]


@pytest.mark.parametrize("logging", ["epoch", "no"])
def test_a_recipe_logging_by_epoch_or_not_at_all_is_benched_every_step(tmp_path, logging):
    """bench times every step (logging_steps 1): a recipe with logging_strategy epoch or no had every setup
    refused (logging_steps acts only under logging_strategy steps), so the bench itself sets that too."""
    from shardtune.bench.strategies import job_args
    from shardtune.config import load_train_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: m\ndataset_name: d.jsonl\nlogging_strategy: {logging}\n")
    args = job_args(str(recipe), "DDP", tmp_path / "out", num_processes=2, steps=4, extra=[])
    cfg = load_train_config(args)
    assert (cfg.run.logging_strategy, cfg.run.logging_steps) == ("steps", 1)


def test_a_plot_format_that_cannot_carry_shardtunes_mark_is_refused_before_the_runs(tmp_path, capsys):
    """matplotlib takes no metadata for JPEG or TIFF: such a --plot crashed after every run, and without a mark
    a second run could not replace it."""
    from shardtune.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d.jsonl\n")
    assert main(["bench", "strategies", str(recipe), "--plot", str(tmp_path / "p.jpg")]) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "p.jpg").exists()


def test_the_bench_keys_a_set_cannot_change_are_the_ones_each_setup_sets():
    """SET_BY_BENCH names every key job_args gives a setup (the probe's callbacks join the recipe's instead)."""
    from shardtune.bench.strategies import SET_BY_BENCH, job_args

    args = job_args("r.yaml", "MP", Path("out"), num_processes=2, steps=4, extra=[])
    set_keys = {a[2:] for a in args if a.startswith("--")} - {"callbacks"}
    assert set_keys <= set(SET_BY_BENCH)
    assert set(SET_BY_BENCH) - set_keys <= {"mp_devices"}  # set only where MP runs on CPU stand-ins
    assert args[args.index("--num_processes") + 1] == "1"  # one process drives MP's stages
    ddp = job_args("r.yaml", "DDP", Path("out"), num_processes=2, steps=4, extra=[])
    assert ddp[ddp.index("--num_processes") + 1] == "2"


@pytest.mark.parametrize(("pair", "says"), [
    ("max_steps=10", "--set 'max_steps=10': the bench sets max_steps for every setup itself; give --steps"),
    ("max-steps=10", "--set 'max-steps=10': the bench sets max_steps for every setup itself; give --steps"),
    ("evaluation_strategy=steps", "the bench sets eval_strategy for every setup itself"),
    ("output_dir=runs", "the bench sets output_dir for every setup itself; give --work_dir"),
])
def test_a_set_of_a_key_the_bench_sets_is_refused_before_any_setup(tmp_path, monkeypatch, capsys, pair, says):
    """--set max_steps=10 beside --steps went to every setup's job after the bench's own --max_steps, so the last
    one won without a word (and output_dir sent every setup into one folder): each setup then failed or timed
    something else than --steps asked, after minutes of runs."""
    from shardtune.bench import strategies
    from shardtune.cli import main

    monkeypatch.setattr(strategies, "run_setup", lambda *args, **kwargs: pytest.fail("a setup was started"))
    recipe = tiny_recipe(tmp_path)
    assert main(["bench", "strategies", str(recipe), "--set", pair]) == 2
    assert says in capsys.readouterr().err


def test_a_work_dir_holding_an_earlier_bench_is_refused_before_any_setup(tmp_path, monkeypatch, capsys):
    """Each setup refused its folder of an earlier bench (it holds a run), blamed on the recipe, after the setups
    before it had run; and nothing of the earlier runs may go."""
    from shardtune.bench import strategies
    from shardtune.cli import main

    monkeypatch.setattr(strategies, "run_setup", lambda *args, **kwargs: pytest.fail("a setup was started"))
    recipe = tiny_recipe(tmp_path)
    earlier = tmp_path / "work" / "FSDP"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert main(["bench", "strategies", str(recipe), "--strategies", "ddp,fsdp", "--work_dir",
                 str(tmp_path / "work")]) == 2
    assert (f"--work_dir {tmp_path / 'work'}: {earlier} holds an earlier run; give a new or empty --work_dir "
            f"(nothing in it is deleted)") in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["FSDP"]
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


@pytest.mark.parametrize("given, says", [
    (["--num_processes", "0"], "--num_processes 0: give 1 or more"),
    (["--steps", "1"], "--steps 1 --warmup_steps 1: the figures come from the steps after the warm-up ones"),
    (["--warmup_steps", "-1"], "--steps 6 --warmup_steps -1: the figures come from the steps after the warm-up"),
])
def test_bad_step_and_process_counts_are_named(given, says, tmp_path, capsys):
    """The three numbers were answered by one message naming all of them, and a negative --warmup_steps was taken
    (its figures then counted from the end of the run)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d.jsonl\n")
    assert shardtune_main(["bench", "strategies", str(recipe), *given]) == 2
    assert says in capsys.readouterr().err
