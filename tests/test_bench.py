"""``shardtune bench strategies``: the per-setup figures are computed from what the probe measured."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardtune.bench import Result, StageClock, explain, format_table, summarise
from shardtune.errors import UsageError
from tests.trainutil import run_shardtune, write_chat_data


def write_probe(folder, rank, **fields):
    record = {"rank": rank, "strategy": "DDP", "wall_s": [], "cpu_s": [], "tokens": [], "stage_s": [],
              "gpu_util": []} | fields
    (folder / f"probe-rank-{rank}.json").write_text(json.dumps(record))


def test_summarise_skips_warmup_and_takes_the_slowest_rank(tmp_path):
    write_probe(tmp_path, 0, wall_s=[9.0, 1.0, 2.0], cpu_s=[9.0, 0.5, 1.0], tokens=[100, 100, 300])
    write_probe(tmp_path, 1, wall_s=[9.0, 1.5, 1.0], cpu_s=[1.0, 0.75, 0.25])
    res = summarise("ddp", tmp_path, warmup_steps=1)
    # Steps 2 and 3: the slower rank sets each step's wall time (1.5 s and 2.0 s).
    assert res.wall_per_step_s == pytest.approx((1.5 + 2.0) / 2)
    assert res.tokens_per_s == pytest.approx(400 / 3.5)
    assert res.busy == pytest.approx([1.5 / 3.0, 1.0 / 2.5])


def test_summarise_mp_reports_each_stage(tmp_path):
    write_probe(tmp_path, 0, strategy="MP", wall_s=[5.0, 2.0, 2.0], cpu_s=[5.0, 2.0, 2.0], tokens=[1, 10, 10],
                stage_s=[[1.0, 1.0], [0.6, 0.8], [0.4, 0.6]])
    res = summarise("mp", tmp_path, warmup_steps=1)
    assert res.stages_or_ranks == 2
    assert res.busy == pytest.approx([1.0 / 4.0, 1.4 / 4.0])
    assert "one stage busy at a time" in explain(res, 2)


def test_stage_clock_attributes_forward_and_backward_to_each_stage(tmp_path):
    from shardtune.tiny import make_model_folder
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(make_model_folder(tmp_path / "m", num_layers=4)))
    clock = StageClock(model, ((0, 1), (1, 4)))
    ids = torch.randint(0, 100, (4, 64))
    model(input_ids=ids, labels=ids).loss.backward()  # first calls initialise kernels: not what is measured
    clock.seconds = [0.0, 0.0]
    start = time.thread_time()
    clock.switch(None)
    model(input_ids=ids, labels=ids).loss.backward()
    spent = time.thread_time() - start
    assert clock._running is None  # the backward pass ended with no stage running
    first, rest = clock.seconds
    assert first > 0 and rest > 0 and first + rest <= spent
    assert rest > first  # three layers (and the head) against one layer


def test_table_has_a_row_and_a_line_per_setup():
    rows = [Result("mp", 1, 2, 0.5, 1000.0, [0.4, 0.45], "x", 2**30, 2**29),
            Result("ddp", 2, 2, error="exit 1: boom")]
    rows[0].explanation = explain(rows[0], 2)
    rows[1].explanation = explain(rows[1], 2)
    table = format_table(rows, "CAVEAT")
    assert "| MP | 1 | 0.500 | 1000 | 40% / 45% | 1.00 | 0.50 |" in table
    assert "- DDP: did not run: exit 1: boom" in table and table.endswith("CAVEAT")


def test_bad_strategy_is_a_usage_error():
    from shardtune.cli.bench import parse_strategies

    assert parse_strategies("MP, fsdp") == ["mp", "fsdp"]
    with pytest.raises(UsageError, match="zero"):
        parse_strategies("mp,zero")


def test_bench_command_end_to_end_mp(tmp_path):
    from shardtune.tiny import make_model_folder

    model = make_model_folder(tmp_path / "model", num_layers=4)
    data = write_chat_data(tmp_path / "chat.jsonl", rows=400)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\nsplits: train\nmax_seq_len: 64\n"
                      f"packing: true\nper_device_train_batch_size: 4\n")
    result = run_shardtune(["bench", "strategies", str(recipe), "--strategies", "mp", "--steps", "3",
                            "--out", str(tmp_path / "res.json"), "--work_dir", str(tmp_path / "work")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "res.json").read_text())
    probe = json.loads((tmp_path / "work" / "mp" / "probe" / "probe-rank-0.json").read_text())
    walls = probe["wall_s"][1:]
    assert row["tokens_per_s"] == pytest.approx(sum(probe["tokens"][1:]) / sum(walls))
    assert len(row["busy"]) == 2 and all(0 < b <= 1 for b in row["busy"])
    assert row["estimate_bytes"] > 0 and row["peak_memory_bytes"] > 0 and len(row["losses"]) == 3
    assert "| MP |" in (tmp_path / "res.md").read_text()
