"""The same global batch gives the same losses on 1 process, with accumulation, on DDP x2 and FSDP2 x2.

Real runs of ``shardtune train``, each through the command's own entry point: the 1-process runs one after
another in one process, the 2-process runs in one pair of gloo processes (tests/trainutil.py ``train_jobs``:
importing torch and transformers is most of a tiny run's time). fp32 throughout (``--bf16 false``, pinned: the
default is bf16 where the CPU has it, and bf16 rounds each strategy's sums differently) and no dropout, so the only
differences are summation order.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from tests.trainutil import flags, losses, train_jobs, write_chat_data

REL_TOL = 1e-4
STEPS = 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("equivalence")
    # As Llama 3's base models hold their chat template's tokens, the tiny model's ChatML tokens, which the data
    # writes, have rows it never trained: every run revives them, and LoRA trains them (trained_template_rows).
    model = make_model_folder(root / "model", untrained=UNTRAINED)
    data = write_chat_data(root / "chat.jsonl")
    return root, model, data


UNTRAINED = ("<|im_start|>", "<|im_end|>")


def common(model, data, out) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
            "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS), "--logging_steps", "1",
            "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--output_dir", str(out),
            "--bf16", "false", "--callbacks", "tests.setup_probe:SetupProbe"]  # what each run set up


def job(assets, name: str, nproc: int, extra: list[str]) -> tuple[str, tuple[int, list[str]]]:
    root, model, data = assets
    return name, (nproc, flags(*common(model, data, root / name), *extra))


def losses_of(runs, name: str) -> list[float]:
    root, errors = runs
    assert not errors[name], errors[name]
    found = losses(root / name)
    assert len(found) == STEPS and all(math.isfinite(x) for x in found)
    return found


def assert_same(reference: list[float], other: list[float]) -> None:
    for step, (a, b) in enumerate(zip(reference, other), start=1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: {a} vs {b}"


# (name, processes, options): every row trains on global batches of 8 rows.
FULL = [
    ("accum", 1, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]),
    # Eager attention adds the mask to the scores: the packed rows' block mask must reach it in that form.
    ("eager_attention", 1, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                            "--attn_implementation", "eager"]),
    ("ddp", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                "--distributed_type", "DDP"]),
    # With FSDP2's explicit forward prefetch (fsdp_forward_prefetch): the next layer is gathered early, same math.
    ("fsdp_full_shard", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                            "--fsdp_forward_prefetch", "True"]),
    ("fsdp_shard_grad_op", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                               "--distributed_type", "FSDP", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"]),
]
LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear"]
LORA_RUNS = [
    ("lora_ddp", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                     "--distributed_type", "DDP"]),
    ("lora_fsdp_checkpointed", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                   "--gradient_checkpointing", "True"]),
    # FSDP on one process (no launcher) is how a single GPU offloads parameters and optimizer to the CPU.
    ("lora_fsdp_one_process_offload", 1, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                          "4", "--distributed_type", "FSDP", "--fsdp_offload_params", "True"]),
    # The other sharding strategies, wrap policies and offload, each on 2 processes. With a minimum this small,
    # SIZE_BASED_WRAP would make the head its own unit, gathered once per loss chunk: the ranks' chunk counts
    # differ, so it must stay in its parent's unit (it once desynchronised the collectives at step 3).
    ("lora_fsdp_size_based_wrap", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                      "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP",
                                      "--fsdp_min_num_params", "2000"]),
    ("lora_fsdp_hybrid_shard", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                   "--fsdp_sharding_strategy", "HYBRID_SHARD"]),
    ("lora_fsdp_no_shard", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                               "--distributed_type", "FSDP", "--fsdp_sharding_strategy", "NO_SHARD"]),
    ("lora_fsdp_offload_two_processes", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                            "--fsdp_offload_params", "True"]),
]


SINGLE = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
GROUPED = ["--packing", "False", "--group_by_length", "True", "--max_seq_len", "48", *LORA]
QLORA = [*LORA, "--use_4bit_quantization", "True", "--bf16", "True"]
ADDED = ["--chat_template_format", "llama-3", "--add_special_tokens", "True", *LORA]
EVALUATED = ["--splits", "train,test", "--eval_strategy", "steps", "--eval_steps", "2"]


@pytest.fixture(scope="module")
def runs(assets):
    """Every run of this module: the 1-process runs in one process, the 2-process runs in one pair (train_jobs);
    each as ``shardtune train`` (``shardtune launch --num_processes 2``) runs it. (root, each run's error or "")."""
    from shardtune.testing.families import make_family_folder

    root, model, data = assets
    tied = (root, make_family_folder(root / "llama3", "llama3"), data)
    # The same training rows, with an eval split beside them that only the FSDP run reads
    evals = root / "with_eval"
    evals.mkdir()
    (evals / "train.jsonl").write_text(data.read_text())
    write_chat_data(evals / "test.jsonl", rows=20, seed=1)
    with_eval = (root, model, evals)
    jobs = dict([
        job(assets, "single", 1, SINGLE), job(assets, "lora_single", 1, [*SINGLE, *LORA]),
        *(job(assets, name, nproc, extra) for name, nproc, extra in FULL),
        *(job(assets, name, nproc, [*extra, *LORA]) for name, nproc, extra in LORA_RUNS),
        job(assets, "grouped_single", 1, [*SINGLE, *GROUPED]),
        job(assets, "grouped_ddp", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                                       "--distributed_type", "DDP", *GROUPED]),
        job(with_eval, "qlora_single", 1, [*SINGLE, *QLORA]),
        job(with_eval, "qlora_fsdp", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP", *QLORA,
                                         *EVALUATED]),
        # A callback setting flags on rank 1 only (a regression would hang its collectives: ddp_timeout bounds it)
        job(with_eval, "ddp_one_rank_flags", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                                 "2", "--distributed_type", "DDP", "--splits", "train,test",
                                                 "--ddp_timeout", "120", "--callbacks",
                                                 "tests.setup_probe:SetupProbe,tests.faults:OneRankSteers"]),
        job(tied, "tied_single", 1, [*SINGLE, *ADDED]),
        job(tied, "tied_fsdp", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP", *ADDED])])
    return root, train_jobs(root, jobs)


def _units(found: dict, key: str) -> set:
    return {json.dumps(unit[key]) for unit in found["fsdp_units"] if unit["mesh_shape"] is not None}


# What each row varies, as the run set it up (tests/setup_probe.py): on a CPU most of these change no loss, so the
# losses alone could not tell a setting that acts from one that is dropped.
SET_UP = {
    "accum": lambda p: {len(step) for step in p["row_lengths"]} == {4},  # micro-batches per optimizer step
    "eager_attention": lambda p: p["attn_implementation"] == "eager",
    "ddp": lambda p: p["fsdp_units"] == [] and {len(step) for step in p["row_lengths"]} == {2},
    "fsdp_full_shard": lambda p: _units(p, "reshard_after_forward") == {"true"}
    and any(u["forward_prefetch"] for u in p["fsdp_units"]),
    # Its gradients stay sharded: reduce-scattered every micro-batch, not held whole through the accumulation.
    "fsdp_shard_grad_op": lambda p: _units(p, "reshard_after_forward") == {"false"}
    and p["gradient_sync"] == [True, True],
    "lora_ddp": lambda p: p["fsdp_units"] == [],
    "lora_fsdp_checkpointed": lambda p: _units(p, "mesh_shape") == {"[2]"},
    "lora_fsdp_one_process_offload": lambda p: _units(p, "offload") == {'["CPUOffloadPolicy"]'}
    and _units(p, "mesh_shape") == {"[1]"},
    # Each adapted linear layer (2 layers x 7) is a unit with its base weight, which it reads itself; the template's
    # trained token rows are one with the embeddings they are copied into.
    "lora_fsdp_size_based_wrap": lambda p: sum((u["package"], u["module"]) == ("peft", "Linear")
                                               for u in p["fsdp_units"]) == 2 * 7
    and {"TrainableTokensLayer", "LlamaForCausalLM"} <= {u["module"] for u in p["fsdp_units"]},
    "lora_fsdp_hybrid_shard": lambda p: _units(p, "mesh_dims") == {'["replicate", "shard"]'}
    and _units(p, "mesh_shape") == {"[1, 2]"},
    # NO_SHARD reshards after forward (kept, the gathered copies would hold every parameter twice) and reduces
    # only on the last micro-batch (its shards are whole: deferring costs no memory)
    "lora_fsdp_no_shard": lambda p: _units(p, "mesh_shape") == {"[2, 1]"}
    and _units(p, "reshard_after_forward") == {"true"} and p["gradient_sync"] == [False, True],
    "lora_fsdp_offload_two_processes": lambda p: _units(p, "offload") == {'["CPUOffloadPolicy"]'}
    and _units(p, "mesh_shape") == {"[2]"},
}


def assert_set_up(runs, name: str) -> None:
    """The setting the row varies acted, on every rank; the references ran without it."""
    from tests.setup_probe import probe

    root, _ = runs
    for rank in range(dict((r[0], r[1]) for r in FULL + LORA_RUNS)[name]):
        found = probe(root / name, rank)
        assert SET_UP[name](found), (name, found)
    for reference in ("single", "lora_single"):
        found = probe(root / reference)
        assert found["attn_implementation"] == "sdpa" and found["fsdp_units"] == [], found


def test_full_fine_tuning_learns(runs):
    reference = losses_of(runs, "single")
    assert reference[-1] < reference[0] - 0.5


@pytest.mark.parametrize("name", [r[0] for r in FULL])
def test_full_fine_tuning_same_losses(runs, name):
    assert_same(losses_of(runs, "single"), losses_of(runs, name))
    assert_set_up(runs, name)
    # the same rows per step: the same tokens, counted over every rank and micro-batch
    assert tokens_seen(runs, name) == tokens_seen(runs, "single")


def tokens_seen(runs, name: str) -> list[int]:
    root, _ = runs
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_seen"] for r in records if "loss" in r]


@pytest.mark.parametrize("name", [r[0] for r in LORA_RUNS])
def test_lora_same_losses(runs, name):
    reference = losses_of(runs, "lora_single")
    assert reference[-1] < reference[0]
    assert_same(reference, losses_of(runs, name))
    assert_set_up(runs, name)
    # The template's rows the base never trained train in the adapter alike (FSDP's ranks on meta learn which from
    # rank 0), from the mean of the trained rows.
    from torch.testing import assert_close

    expected = trained_template_rows(runs, "lora_single")
    assert_close(trained_template_rows(runs, name), expected, rtol=REL_TOL, atol=REL_TOL * float(expected.abs().max()))


def trained_template_rows(runs, name: str):
    """The rows of ``UNTRAINED`` the run's final adapter holds (PEFT's trainable tokens: embeddings, then head),
    after checking that it trains exactly those."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    root, _ = runs
    final = root / name / "final"
    ids = AutoTokenizer.from_pretrained(final).convert_tokens_to_ids(list(UNTRAINED))
    assert json.loads((final / "adapter_config.json").read_text())["trainable_token_indices"] == {
        "embed_tokens": ids, "lm_head": ids}
    found = {k: t for k, t in load_file(final / "adapter_model.safetensors").items() if "trainable_tokens_delta" in k}
    return torch.cat([found[k] for k in sorted(found)])


def test_callbacks_get_the_model_as_transformers_hands_it_not_the_ddp_wrapper(runs):
    """Under DDP every callback event got ``model`` as DistributedDataParallel, where Transformers' Trainer hands
    callbacks its ``self.model``: the model itself (a PEFT model stays one; FSDP2's module is the model)."""
    from tests.setup_probe import probe

    root, errors = runs
    expected = {"ddp": "LlamaForCausalLM", "lora_ddp": "PeftModelForCausalLM",
                "fsdp_full_shard": "FSDPLlamaForCausalLM", "single": "LlamaForCausalLM"}
    for name, model_class in expected.items():
        assert not errors[name], errors[name]
        for rank in range(2 if name != "single" else 1):
            assert probe(root / name, rank)["model_class"] == {"on_train_begin": model_class,
                                                               "on_step_end": model_class}, (name, rank)


def test_a_flag_one_ranks_callback_sets_acts_on_every_rank(runs):
    """A callback setting should_save, should_evaluate or should_training_stop on one rank only (as one deciding
    from its rank's own clock does) had the ranks part ways in their collectives; the flags are now agreed over the
    ranks, so every rank saves, evaluates and stops together, and the steps train as on one process."""
    root, errors = runs
    name = "ddp_one_rank_flags"
    assert not errors[name], errors[name]
    seen = [json.loads((root / name / f"one_rank_steers_rank{rank}.json").read_text()) for rank in range(2)]
    assert seen[0] == seen[1] == {"evaluated": [2], "saved": ["step-1"], "ended_at": 3}, seen
    summary = json.loads((root / name / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stopped_by"] == "callback stop"
    assert_same(losses_of(runs, "single")[:3], losses(root / name))


def test_length_grouped_unpacked_rows_train_alike_on_one_process_and_ddp(runs):
    """group_by_length on unpacked rows: every split of the global batch trains on the same steps, so DDP x2
    gives one process's losses, and the rows of each micro-batch are of about one length."""
    from tests.setup_probe import probe

    single = losses_of(runs, "grouped_single")
    assert single[-1] < single[0]
    assert_same(single, losses_of(runs, "grouped_ddp"))
    # Each micro-batch's rows are of about one length: their spread (longest - shortest) against the spread of the
    # same rows dealt into micro-batches of the same size at random.
    root, _ = runs
    batches = [batch for step in probe(root / "grouped_single")["row_lengths"] for batch in step]
    rows = [n for batch in batches for n in batch]
    assert len(set(rows)) > 1  # the data's rows differ in length

    def spread(groups) -> float:
        return sum(max(g) - min(g) for g in groups) / len(groups)

    dealt = random.Random(0).sample(rows, len(rows))
    size = len(batches[0])
    assert spread(batches) < 0.25 * spread([dealt[i:i + size] for i in range(0, len(dealt), size)])


def test_qlora_under_fsdp_trains_like_one_process(runs):
    """NF4 base (bf16 storage) sharded by FSDP2 on 2 ranks: finite, falling, and equal to one process, which did
    not evaluate: the FSDP run's evaluation at step 2 leaves its training as it was. (bitsandbytes repacked the 4-bit
    weights for its CPU inference kernel, which has no backward, on a CPU with AVX512-BF16: the steps after it lost
    the gradient through the base, and FSDP's gathered weights were rewritten, step 3's loss 3% off.)"""
    from tests.setup_probe import probe

    fsdp = losses_of(runs, "qlora_fsdp")
    assert fsdp[-1] < fsdp[0]
    assert_same(losses_of(runs, "qlora_single"), fsdp)
    root, _ = runs
    evals = [r for r in map(json.loads, (root / "qlora_fsdp" / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and evals[1]["eval_loss"] < evals[0]["eval_loss"], evals
    root, _ = runs
    layers = [probe(root / name, rank)["linear4bit"] for name, rank in (("qlora_single", 0), ("qlora_fsdp", 0),
                                                                       ("qlora_fsdp", 1))]
    assert layers[0] > 0 and len(set(layers)) == 1, layers  # the base's linear layers are NF4 in every run


def test_added_tokens_of_a_tied_head_train_alike_under_fsdp(runs):
    """A tied head and a tokenizer that gains tokens (llama-3's template tokens): PEFT's trainable token rows are
    one parameter held by the embeddings' and the head's adapters. Filled from rank 0 it once met a plain tensor
    under its second name; now FSDP x2 trains like one process, the new rows included (<|eot_id|> is a target)."""
    from tests.setup_probe import probe

    single = losses_of(runs, "tied_single")
    assert single[-1] < single[0]
    assert_same(single, losses_of(runs, "tied_fsdp"))
    root, _ = runs
    vocab = json.loads((root / "llama3" / "config.json").read_text())["vocab_size"]
    rows = {probe(root / name, rank)["embedding_rows"] for name, rank in (("tied_single", 0), ("tied_fsdp", 1))}
    assert len(rows) == 1 and rows.pop() > vocab  # the template's tokens were added to the embeddings
    # The new rows trained and were saved: each final adapter holds PEFT's trainable token rows for exactly the
    # added ids (the tied head shares them), moved from their zero start, and FSDP's equal one process's.
    import torch
    from safetensors.torch import load_file
    from torch.testing import assert_close

    added = list(range(vocab, probe(root / "tied_single")["embedding_rows"]))
    deltas = []
    for name in ("tied_single", "tied_fsdp"):
        final = root / name / "final"
        assert json.loads((final / "adapter_config.json").read_text())["trainable_token_indices"] == {
            "embed_tokens": added}
        found = {k: t for k, t in load_file(final / "adapter_model.safetensors").items()
                 if "trainable_tokens_delta" in k}
        # One parameter, saved under the embeddings' name and the tied head's.
        assert any("embed_tokens" in k for k in found), sorted(found)
        delta = next(iter(found.values()))
        assert all(torch.equal(t, delta) for t in found.values()), sorted(found)
        assert delta.shape[0] == len(added) and delta.abs().amax(dim=1).min() > 0, delta
        deltas.append(delta)
    assert_close(deltas[1], deltas[0], rtol=REL_TOL, atol=REL_TOL * float(deltas[0].abs().max()))



FP16_REL_TOL = 1e-3  # fp16's 10-bit mantissa: each strategy's sums round differently (2e-5 to 1e-4 seen at step 3)


@pytest.fixture(scope="module")
def fp16_runs(assets):
    """fp16 mixed precision (a T4's or V100's choice) with its loss scaler: one process, DDP x2 and FSDP2 x2
    (FSDP's sharded scaler), each with a checkpoint at its last step, and with the memory check a user's run
    has (the tests turn it off elsewhere): DDP with accumulation crashed in it at step 2, its tracker refusing
    the DDP wrapper's second forward."""
    root, model, data = assets
    fp16 = ["--fp16", "true", "--save_strategy", "steps", "--save_steps", str(STEPS), "--predict_memory", "true"]
    jobs = dict([job(assets, "fp16_single", 1, [*SINGLE, *fp16]),
                 job(assets, "fp16_ddp", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                             "2", "--distributed_type", "DDP", *fp16]),
                 job(assets, "fp16_fsdp", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                              *fp16])])
    return root, train_jobs(root, jobs)


@pytest.mark.parametrize("name", ["fp16_ddp", "fp16_fsdp"])
def test_fp16_trains_alike_on_one_process_ddp_and_fsdp(fp16_runs, name):
    reference = losses_of(fp16_runs, "fp16_single")
    assert reference[-1] < reference[0]
    for step, (a, b) in enumerate(zip(reference, losses_of(fp16_runs, name)), start=1):
        assert abs(a - b) <= FP16_REL_TOL * abs(a), f"step {step}: {a} vs {b}"
    root, _ = fp16_runs
    state = json.loads((root / name / "checkpoints" / f"step-{STEPS}" / "trainer_state.json").read_text())
    # torch's initial scale, every step an update counted towards the scale's growth: the scaler ran each step
    assert (state["scaler"]["scale"], state["scaler"]["_growth_tracker"]) == (2.0**16, STEPS), state["scaler"]
