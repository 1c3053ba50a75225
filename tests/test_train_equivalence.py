"""The same global batch gives the same losses on 1 process, with accumulation, on DDP x2 and FSDP2 x2.

Real runs: single-process runs call ``shardtune train``; two-process runs go through ``shardtune launch``
(torchrun, gloo on CPU). fp32 throughout (``--bf16 false``, pinned: the default is bf16 where the CPU has it, and
bf16 rounds each strategy's sums differently) and no dropout, so the only differences are summation order.
"""

from __future__ import annotations

import math

import pytest

from tests.trainutil import flags, losses, run_shardtune, write_chat_data

REL_TOL = 1e-4
STEPS = 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("equivalence")
    model = make_model_folder(root / "model")
    data = write_chat_data(root / "chat.jsonl")
    return root, model, data


def common(model, data, out) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
            "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS), "--logging_steps", "1",
            "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--output_dir", str(out),
            "--bf16", "false"]


def train(assets, name: str, nproc: int, extra: list[str]) -> list[float]:
    root, model, data = assets
    out = root / name
    args = flags(*common(model, data, out), *extra)
    cmd = ["train", *args] if nproc == 1 else ["launch", "--num_processes", str(nproc), "train", *args]
    result = run_shardtune(cmd, root)
    assert result.returncode == 0, result.stderr[-3000:]
    found = losses(out)
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


@pytest.fixture(scope="module")
def full_reference(assets):
    return train(assets, "single", 1, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"])


@pytest.fixture(scope="module")
def lora_reference(assets):
    return train(assets, "lora_single", 1,
                 ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", *LORA])


def test_full_fine_tuning_learns(full_reference):
    assert full_reference[-1] < full_reference[0] - 0.5


@pytest.mark.parametrize("name,nproc,extra", FULL, ids=[r[0] for r in FULL])
def test_full_fine_tuning_same_losses(assets, full_reference, name, nproc, extra):
    assert_same(full_reference, train(assets, name, nproc, extra))


@pytest.mark.parametrize("name,nproc,extra", LORA_RUNS, ids=[r[0] for r in LORA_RUNS])
def test_lora_same_losses(assets, lora_reference, name, nproc, extra):
    assert lora_reference[-1] < lora_reference[0]
    assert_same(lora_reference, train(assets, name, nproc, [*extra, *LORA]))


def test_length_grouped_unpacked_rows_train_alike_on_one_process_and_ddp(assets):
    """group_by_length on unpacked rows: every split of the global batch trains on the same steps, so DDP x2
    gives one process's losses, and the rows of each micro-batch are of about one length."""
    grouped = ["--packing", "False", "--group_by_length", "True", "--max_seq_len", "48", *LORA]
    single = train(assets, "grouped_single", 1, ["--per_device_train_batch_size", "4",
                                                 "--gradient_accumulation_steps", "2", *grouped])
    ddp = train(assets, "grouped_ddp", 2, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                           "2", "--distributed_type", "DDP", *grouped])
    assert single[-1] < single[0]
    assert_same(single, ddp)


def test_qlora_under_fsdp_trains_like_one_process(assets):
    """NF4 base (bf16 storage) sharded by FSDP2 on 2 ranks: finite, falling, and equal to one process."""
    qlora = [*LORA, "--use_4bit_quantization", "True", "--bf16", "True"]
    single = train(assets, "qlora_single", 1, ["--per_device_train_batch_size", "4",
                                               "--gradient_accumulation_steps", "2", *qlora])
    fsdp = train(assets, "qlora_fsdp", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                           *qlora])
    assert fsdp[-1] < fsdp[0]
    assert_same(single, fsdp)


def test_added_tokens_of_a_tied_head_train_alike_under_fsdp(tmp_path):
    """A tied head and a tokenizer that gains tokens (llama-3's template tokens): PEFT's trainable token rows are
    one parameter held by the embeddings' and the head's adapters. Filled from rank 0 it once met a plain tensor
    under its second name; now FSDP x2 trains like one process, the new rows included (<|eot_id|> is a target)."""
    from shardtune.testing.families import make_family_folder

    model = make_family_folder(tmp_path / "model", "llama3")
    data = write_chat_data(tmp_path / "chat.jsonl", rows=200)
    added = ["--chat_template_format", "llama-3", "--add_special_tokens", "True", *LORA]
    assets = (tmp_path, model, data)
    single = train(assets, "tied_single", 1, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
                                             "2", *added])
    fsdp = train(assets, "tied_fsdp", 2, ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                                          *added])
    assert single[-1] < single[0]
    assert_same(single, fsdp)
