"""eval_loss is the mean over every target token of the eval split, as Transformers computes it row by row.

Real runs of ``shardtune train`` (tests/trainutil.py ``train_jobs``: the 1-process runs in one process, the
2-process ones in one pair of gloo processes), each evaluating the untrained model once (eval_on_start) on 13 eval
rows, a count that no batch size or world size here divides; fp32 throughout, so only the summation order differs.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.trainutil import flags, job_log, train_jobs, write_chat_data

REL_TOL = 1e-6
EVAL_ROWS = 13

# (name, processes, options): how the eval rows are batched, packed and split over the ranks.
RUNS = [
    ("unpacked_b3", 1, ["--packing", "false", "--per_device_eval_batch_size", "3"]),
    ("packed_b1", 1, ["--packing", "true", "--per_device_eval_batch_size", "1"]),
    # TRL's eval_packing: the eval rows packed or not, whatever packing does to the training rows
    ("eval_unpacked_b16", 1, ["--packing", "true", "--eval_packing", "false", "--per_device_eval_batch_size", "16"]),
    ("eval_packed_b2", 1, ["--packing", "false", "--eval_packing", "true", "--per_device_eval_batch_size", "2"]),
    ("ddp_unpacked_b3", 2, ["--distributed_type", "DDP", "--packing", "false", "--per_device_eval_batch_size", "3"]),
    ("fsdp_packed_b2", 2, ["--distributed_type", "FSDP", "--packing", "true", "--per_device_eval_batch_size", "2"]),
    # 13 rows in batches of 16 on 2 ranks: rank 1 has no row at all
    ("fsdp_eval_unpacked_b16", 2, ["--distributed_type", "FSDP", "--packing", "true", "--eval_packing", "false",
                                   "--per_device_eval_batch_size", "16", "--use_peft_lora", "true"]),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The tiny model and a data folder of 60 training and 13 eval conversations."""
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("eval_loss")
    make_model_folder(root / "model")
    (root / "data").mkdir()
    write_chat_data(root / "data" / "train.jsonl", rows=60)
    write_chat_data(root / "data" / "test.jsonl", rows=EVAL_ROWS, seed=1)
    return root


# Early stopping with the best checkpoint loaded at the end, full fine-tuning, on 1 process and FSDP2 x2: evaluated
# every 2 steps, the loss falls, so with greater_is_better true step 2 is the best and steps 4 and 6 stop the run.
STOPPING = ["--max_steps", "20", "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps",
            "--save_steps", "2",
            "--load_best_model_at_end", "true", "--greater_is_better", "true", "--early_stopping_patience", "2",
            "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--packing", "true",
            "--per_device_eval_batch_size", "3"]
STOPPED = [("stop_single", 1, [*STOPPING, "--per_device_train_batch_size", "2"]),
           ("stop_fsdp", 2, [*STOPPING, "--per_device_train_batch_size", "1", "--distributed_type", "FSDP"])]


@pytest.fixture(scope="module")
def runs(root):
    """(the workspace, each run's error or "")."""
    common = ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "data"), "--max_seq_len", "64",
              "--max_steps", "1", "--eval_on_start", "true", "--bf16", "false", "--save_strategy", "no",
              "--predict_memory", "false"]
    jobs = {name: (nproc, flags(*common, "--output_dir", str(root / name), *extra))
            for name, nproc, extra in [*RUNS, *STOPPED]}
    return root, train_jobs(root, jobs)


def by_hand(root) -> tuple[float, int]:
    """The eval rows' mean token loss and target count, from Transformers: each conversation through the chat
    template, its assistant tokens the targets, one row at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    prefix = tokenizer("")["input_ids"]  # what the tokenizer puts before any text (its BOS)
    loss_sum, count = 0.0, 0
    for line in (root / "data" / "test.jsonl").read_text().splitlines():
        encoded = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = torch.tensor([prefix + encoded["input_ids"]])
        targets = torch.tensor([0] * len(prefix) + encoded["assistant_masks"])[1:].bool()
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        token_loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        loss_sum += token_loss[targets].sum().item()
        count += int(targets.sum())
    return loss_sum / count, count


@pytest.fixture(scope="module")
def reference(runs):
    return by_hand(runs[0])


@pytest.mark.parametrize("name", [name for name, _, _ in RUNS])
def test_eval_loss_is_the_mean_over_every_eval_token(runs, reference, name):
    """Every setup evaluates each of the 13 rows once (none dropped where the ranks' batches do not divide them,
    none counted twice), to Transformers' loss. eval_packing was refused as a no-op, though it only regroups the
    eval rows: it now packs them or not, to the same loss."""
    root, errors = runs
    assert not errors[name], errors[name]
    first = json.loads((root / name / "metrics.jsonl").read_text().splitlines()[0])
    loss, count = reference
    assert first["step"] == 0 and first["eval_tokens"] == count
    assert first["eval_loss"] == pytest.approx(loss, rel=REL_TOL)


def test_the_global_batch_and_the_steps_it_makes_are_said_at_start(runs):
    """The same per-device batch on 2 processes is twice the global batch: other steps, other losses, half the
    steps per epoch. Nothing said so (only rows left out of an epoch were told); now every run states its global
    batch, its factors and its steps, as Transformers' Trainer states its total train batch size."""
    root, errors = runs
    said = {}
    for name, nproc in (("unpacked_b3", 1), ("ddp_unpacked_b3", 2)):
        assert not errors[name], errors[name]
        (line,) = [line for line in job_log(root, name, nproc).splitlines() if "batch: global batch" in line]
        said[name] = line.split("] ", 1)[1]
    # 60 unpacked rows, per_device_train_batch_size 8 (the default), no accumulation
    assert said["unpacked_b3"] == (
        "batch: global batch of 8 rows per optimizer step (per_device_train_batch_size 8 x "
        "gradient_accumulation_steps 1 x 1 process), 7 steps per epoch, 1 in all (max_steps 1)"
        "; 4 of the 60 training rows are left out of each epoch: the last global batch would be incomplete (which "
        "rows, the epoch's order decides)")
    assert said["ddp_unpacked_b3"].startswith(
        "batch: global batch of 16 rows per optimizer step (per_device_train_batch_size 8 x "
        "gradient_accumulation_steps 1 x 2 processes), 3 steps per epoch, 1 in all")


@pytest.mark.parametrize("packing, eval_packing, packed", [("true", None, True), ("true", "false", False),
                                                           ("false", "true", True), ("false", None, False)])
def test_eval_packing_packs_the_eval_rows_alone(root, tmp_path, packing, eval_packing, packed):
    """eval_packing decides the eval rows' grouping (unset: packing's), the training rows keep packing's, and the
    tokens are the same either way."""
    from shardtune.config import load_train_config
    from shardtune.data import load_tokenizer, prepare_datasets

    extra = ["--eval_packing", eval_packing] if eval_packing else []
    cfg = load_train_config(["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "data"),
                             "--max_seq_len", "64", "--eval_strategy", "steps", "--packing", packing, *extra,
                             "--output_dir", str(tmp_path / "out")])
    tokenizer = load_tokenizer(str(root / "model"), cfg.data)
    data = prepare_datasets(cfg.data, tokenizer, seed=0, cache_dir=str(tmp_path / "cache"))
    assert (len(data.train) < 60) == (packing == "true")
    assert (len(data.eval) < EVAL_ROWS) == packed
    assert sum(map(len, data.eval["input_ids"])) == data.report.eval.tokens
    assert data.report.eval.documents == EVAL_ROWS and data.report.eval.packing == packed


def test_early_stopping_and_the_best_model_are_the_same_on_fsdp(runs):
    """FSDP2 x2 evaluates, stops and picks the best as one process does (the same eval losses, the stop at step 6,
    step 2 the best), and its final/ holds the best checkpoint's weights, which are one process's."""
    from safetensors.torch import load_file

    from shardtune.train.export import export_checkpoint

    root, errors = runs
    found = {}
    for name, _, _ in STOPPED:
        assert not errors[name], errors[name]
        lines = (root / name / "metrics.jsonl").read_text().splitlines()
        evals = [(r["step"], r["eval_loss"]) for r in map(json.loads, lines) if "eval_loss" in r]
        summary = json.loads((root / name / "summary.json").read_text())
        assert [step for step, _ in evals] == [0, 2, 4, 6] and evals[1][1] > evals[2][1] > evals[3][1]
        assert (summary["stopped_by"], summary["steps"], summary["best_step"], summary["final_step"]) == (
            "early stopping", 6, 2, 2)
        found[name] = evals, load_file(root / name / "final" / "model.safetensors")
    (single, one), (fsdp, sharded) = found["stop_single"], found["stop_fsdp"]
    assert [loss for _, loss in fsdp] == pytest.approx([loss for _, loss in single], rel=1e-5)
    export_checkpoint(root / "stop_fsdp" / "checkpoints" / "step-2", root / "fsdp_step2")
    best = load_file(root / "fsdp_step2" / "model.safetensors")
    assert sorted(sharded) == sorted(best) == sorted(one)
    assert all(torch.equal(sharded[k], best[k]) for k in best)
    assert all(close(sharded[k], one[k]) for k in one)
    last = root / "stop_fsdp" / "checkpoints" / "step-6"
    export_checkpoint(last, root / "fsdp_step6")
    assert not all(torch.equal(sharded[k], v) for k, v in load_file(root / "fsdp_step6" / "model.safetensors").items())


def test_only_rank_0_draws_the_eval_bar(runs):
    """Each rank evaluates its own batches, and only rank 0 draws a bar of them: a bar from every rank was as many
    interleaved bars in a launched job's log as processes. (tests/test_callbacks.py: the bar on one process.)"""
    from tests.trainutil import JOB_MARK

    root, errors = runs
    assert not errors["ddp_unpacked_b3"], errors["ddp_unpacked_b3"]
    bars = []
    for rank in (0, 1):
        sections = (root / f"jobs_2_rank{rank}.log").read_text().split(JOB_MARK)[1:]
        log = next(text for name, _, text in (s.partition("\n") for s in sections) if name == "ddp_unpacked_b3")
        bars.append(set(re.findall(r"(?:^|[\r\n])eval: +\d+%\|[^|]*\| \d+/(\d+) ", log)))
    # rank 0's share of the 13 eval rows, in 3 batches of at most 3
    assert bars == [{"3"}, set()]


def close(a, b) -> bool:
    """Equal but for summation order: Adam's first steps move each weight by about the learning rate whatever
    its gradient's size, so 1e-5 is 0.2% of the two steps' change (the weights of step 6 are 3 times as far)."""
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)
