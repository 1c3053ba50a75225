"""Every key shardtune accepts acts, or is a listed no-op whose acting values are refused (exit 2, naming the key).

Walks the whole vocabulary: the train keys (TrainConfig), the TrainingArguments/TRL and Accelerate keys accepted
as no-ops (config/no_ops.py), and, in tests/test_deepspeed.py, every DeepSpeed key shardtune maps.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.config.no_ops import NO_OPS
from shardtune.config.schema import known_keys
from shardtune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
# Where a key is declared or documented, not read: a key named only here changes nothing.
DECLARING = {"shardtune/config/schema.py", "shardtune/data/config.py"}


def names_read_by_product_code() -> set[str]:
    """Attribute names read (``cfg.run.key``) and exact string constants (``values["key"]``, key tuples) in
    shardtune/, outside the files that declare the keys."""
    found: set[str] = set()
    for path in (ROOT / "shardtune").rglob("*.py"):
        if path.relative_to(ROOT).as_posix() in DECLARING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_train_key_is_read_by_the_code_that_runs():
    """A key no code reads is accepted and changes nothing: the defect this test exists for."""
    unread = sorted(set(known_keys()) - names_read_by_product_code())
    assert not unread, f"accepted but read by nothing: {unread}; make each act, or refuse it (config/no_ops.py)"


def test_the_reader_scan_finds_an_unread_key(tmp_path, monkeypatch):
    """The scan itself: a key only the schema mentions is reported."""
    assert "output_dir" in names_read_by_product_code()
    assert "a_key_nobody_reads_f3" not in names_read_by_product_code()


def test_no_op_keys_are_not_train_keys_and_are_documented():
    doc = (ROOT / "docs" / "config.md").read_text()
    section = doc.split("## Accepted, changing nothing", 1)[1]
    for key in NO_OPS:
        assert key not in known_keys(), f"{key} is both a train key and a no-op"
        assert f"| `{key}` |" in section, f"{key} is not listed in docs/config.md"


def test_no_op_keys_load_with_the_values_that_change_nothing(tmp_path):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndebug: false\ndowncast_bf16: 'no'\ngpu_ids: all\n"
                   "main_training_function: main\nsame_network: true\nenable_cpu_affinity: false\nuse_cpu: false\n"
                   "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\ndynamo_config:\n  dynamo_backend: NO\n"
                   "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 1\n"
                   "distributed_type: FSDP\nnum_processes: 2\n")
    cfg = load_train_config(["--config_file", str(acc), *BASE, "--do_train", "true", "--do_eval", "true",
                             "--remove_unused_columns", "false", "--dataloader_num_workers", "4",
                             "--include_num_input_tokens_seen", "true", "--logging_nan_inf_filter", "false"])
    assert (cfg.distributed.distributed_type, cfg.distributed.num_processes) == ("FSDP", 2)


# An acting value of each no-op that has one: refused in one line naming the key.
ACTING = {"compute_environment": "AMAZON_SAGEMAKER", "downcast_bf16": "yes", "tpu_env": ["X=1"],
          "tpu_use_cluster": True, "tpu_use_sudo": True, "tpu_name": "pod", "tpu_zone": "us-central2-b",
          "commands": ["python x.py"], "command_file": "cmds.sh", "use_cpu": True, "gpu_ids": "0,1",
          "megatron_lm_config": {"megatron_lm_tp_degree": 2},
          "ipex_config": {"ipex": True}, "mpirun_config": {"mpirun_hostfile": "hosts"},
          "fp8_config": {"backend": "TE"}, "parallelism_config": {"parallelism_config_tp_size": 2},
          "fsdp_offload_optimizer": True}


def test_every_no_op_with_acting_values_lists_one_here():
    assert sorted(ACTING) == sorted(key for key, entry in NO_OPS.items() if entry.instead)


@pytest.mark.parametrize("key", sorted(ACTING))
def test_an_acting_value_of_a_no_op_key_is_refused(tmp_path, key):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text(json.dumps({key: ACTING[key], "distributed_type": "NO"}))  # JSON is YAML
    with pytest.raises(UsageError, match=rf"{acc}, line 1: {key}=.* would change what runs .*: "):
        load_train_config(["--config_file", str(acc), *BASE])


def test_keys_that_used_to_be_ignored_now_act(tmp_path, capsys):
    from shardtune.train.metrics import MetricsLog
    from shardtune.train.plan import make_plan

    cfg = load_train_config([*BASE, "--ddp_find_unused_parameters", "true", "--logging_first_step", "false",
                             "--disable_tqdm", "true", "--logging_steps", "5"])
    from shardtune.dist import DistInfo

    import torch

    info = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    plan = make_plan(cfg.distributed, info, param_dtype=None, gradient_checkpointing=False, use_reentrant=False)
    assert plan.strategy == "DDP" and plan.find_unused_parameters
    log = MetricsLog(tmp_path, info, strategy="steps", every=5, first_step=cfg.run.logging_first_step)
    assert [s for s in range(1, 11) if log.should_log(s, at_epoch_end=False, last=False)] == [5, 10]
    with pytest.raises(UsageError, match="save_safetensors=false asks for pickled .bin weights"):
        load_train_config([*BASE, "--save_safetensors", "false"])
