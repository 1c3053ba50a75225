"""eval_loss is the mean over every target token of the eval split, as Transformers computes it row by row.

Real runs of ``shardtune train`` (tests/trainutil.py ``train_jobs``: the 1-process runs in one process, the
2-process ones in one pair of gloo processes), each evaluating the untrained model once (eval_on_start) on 13 eval
rows, a count that no batch size or world size here divides; fp32 throughout, so only the summation order differs.
"""

from __future__ import annotations

import json

import pytest

from tests.trainutil import flags, train_jobs, write_chat_data

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


@pytest.fixture(scope="module")
def runs(root):
    """(the workspace, each run's error or "")."""
    common = ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "data"), "--max_seq_len", "64",
              "--max_steps", "1", "--eval_on_start", "true", "--bf16", "false", "--save_strategy", "no",
              "--predict_memory", "false"]
    jobs = {name: (nproc, flags(*common, "--output_dir", str(root / name), *extra)) for name, nproc, extra in RUNS}
    return root, train_jobs(root, jobs)


def by_hand(root) -> tuple[float, int]:
    """The eval rows' mean token loss and target count, from Transformers: each conversation through the chat
    template, its assistant tokens the targets, one row at a time."""
    import torch
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
