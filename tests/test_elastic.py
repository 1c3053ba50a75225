"""Elastic jobs without starting one: ``--num_machines MIN:MAX`` and ``--rdzv_conf`` on the torchrun command line,
their refusals, and the rule that keeps the global batch when a resume runs on another number of processes.
The jobs themselves run between two namespace hosts in ``tests/test_multihost.py``."""

from __future__ import annotations

import logging

import pytest

from shardtune.cli.launch_command import launcher_parser, torchrun_command
from shardtune.errors import UsageError
from shardtune.train.resume import accumulation_for

TWO_HOSTS = ["--num_processes", "4", "--main_process_ip", "10.200.0.1", "--rdzv_backend", "c10d"]


def command(*launch: str) -> list[str]:
    return torchrun_command(launcher_parser().parse_args(list(launch)), ["--output_dir", "o"])


def value_after(cmd: list[str], option: str) -> str:
    return cmd[cmd.index(option) + 1]


def test_an_elastic_range_reaches_torchrun_and_counts_processes_at_its_largest():
    cmd = command("--num_machines", "1:2", *TWO_HOSTS, "--rdzv_conf", "last_call_timeout=5, keep_alive_interval=2")
    assert value_after(cmd, "--nnodes") == "1:2"
    assert value_after(cmd, "--nproc_per_node") == "2"  # 4 processes over at most 2 machines
    assert value_after(cmd, "--rdzv_endpoint") == "10.200.0.1:29500"
    assert value_after(cmd, "--rdzv_conf") == "last_call_timeout=5,keep_alive_interval=2"
    assert cmd[cmd.index("train") + 1:] == ["--num_processes", "4", "--num_machines", "2", "--output_dir", "o"]
    assert value_after(command("--num_machines", "2:2", *TWO_HOSTS), "--nnodes") == "2"  # no range at all


@pytest.mark.parametrize("launch,message", [
    (["--num_machines", "1:2", "--num_processes", "2", "--main_process_ip", "h"],
     "--num_machines 1:2 is an elastic range: add --rdzv_backend c10d"),
    (["--num_machines", "3:2", *TWO_HOSTS], "--num_machines 3:2: the range MIN:MAX needs 1 <= MIN <= MAX"),
    (["--num_machines", "0:2", *TWO_HOSTS], "needs 1 <= MIN <= MAX"),
    # a count of 0 (also in --slurm / --kubernetes) was told of ranges it never asked for
    (["--num_machines", "0", *TWO_HOSTS], "--num_machines 0: a job runs on 1 machine or more: give --num_machines 1"),
    (["--num_machines", "1-2", *TWO_HOSTS], "--num_machines 1-2: give a number of machines N, or a range MIN:MAX"),
    (["--num_machines", "1:2", "--num_processes", "3", "--main_process_ip", "h", "--rdzv_backend", "c10d"],
     "--num_processes 3 is the total over all machines and must be a multiple of --num_machines 2"),
    (["--num_machines", "2", *TWO_HOSTS, "--rdzv_conf", "last_call=5"],
     "--rdzv_conf: unknown setting 'last_call'; did you mean last_call_timeout?"),
    (["--num_machines", "2", *TWO_HOSTS, "--rdzv_conf", "join_timeout=soon"],
     "--rdzv_conf join_timeout=soon: give a whole number of seconds"),
    # c10d on one machine, and a c10d setting on the static rendezvous
    (["--num_processes", "2", "--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=60"],
     "--rdzv_conf join_timeout=60 configures the rendezvous of several machines"),
    (["--num_machines", "2", "--num_processes", "4", "--main_process_ip", "10.200.0.1", "--machine_rank", "0",
      "--rdzv_conf", "keep_alive_interval=60"],
     "--rdzv_conf keep_alive_interval=60: the static rendezvous (the default) takes join_timeout alone"),
])
def test_bad_elastic_options_are_refused_in_one_line(launch, message):
    with pytest.raises(UsageError) as err:
        command(*launch)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_cluster_job_refuses_an_elastic_range():
    from shardtune.cli.schedulers import check_scheduler_options

    opts = launcher_parser().parse_args(["--slurm", "--num_machines", "1:4", "--gpus_per_node", "8"])
    with pytest.raises(UsageError, match="a --slurm job asks the cluster for a fixed number of nodes"):
        check_scheduler_options(opts)


def saved(batch: int, accumulation: int) -> dict:
    return {"per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation}


@pytest.mark.parametrize("world,batch,accumulation,expected", [
    (1, 2, 2, 4),   # a machine lost: 2 x 2 x 2 = 8 rows kept as 2 x 4 x 1
    (4, 2, 2, 1),   # machines gained: 2 x 1 x 4
    (2, 2, 2, 2),   # the same world: unchanged
    (1, 4, 1, 2),   # another micro-batch on one process: 4 x 2 x 1
    (1, 2, 4, 4),   # already set for the new world by hand
])
def test_accumulation_keeps_the_checkpoints_global_batch(world, batch, accumulation, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        got = accumulation_for("ckpt", saved(2, 2), saved(batch, accumulation), saved_world=2, world=world)
    assert got == expected
    assert batch * got * world == 2 * 2 * 2
    said = [r.getMessage() for r in caplog.records]
    if got != accumulation:
        assert said == [f"resume on {world} process(es), the checkpoint was saved on 2: gradient_accumulation_steps "
                        f"{accumulation} -> {got} keeps its global batch of 8 rows per step "
                        f"(per_device_train_batch_size {batch} x {got} x {world})"]
    else:
        assert said == []
    # every rank checks; only rank 0 says it (each rank of a 4-process resume printed the line)
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        caplog.clear()
        assert accumulation_for("ckpt", saved(2, 2), saved(batch, accumulation), saved_world=2, world=world,
                                main=False) == expected
    assert caplog.records == []


def test_a_global_batch_no_accumulation_can_keep_is_refused_naming_the_fix():
    with pytest.raises(UsageError) as err:
        accumulation_for("ckpt", saved(2, 2), saved(2, 2), saved_world=2, world=3)
    assert str(err.value) == (
        "ckpt: the checkpoint's global batch of 8 rows per step (2 process(es)) cannot be kept on 3: 8 is not a "
        "multiple of per_device_train_batch_size 2 x 3 process(es). Resume on a number of processes that divides "
        "it, or set per_device_train_batch_size so that it does")


def test_another_split_of_the_same_global_batch_is_said(caplog):
    """per_device_train_batch_size 2 -> 4 with gradient_accumulation_steps 2 -> 1 on as many processes keeps the
    global batch and the data order: it resumed without a word, where every other changed key is said."""
    with caplog.at_level(logging.INFO, logger="shardtune"):
        assert accumulation_for("ckpt", saved(2, 2), saved(4, 1), saved_world=2, world=2) == 1
        assert accumulation_for("ckpt", saved(2, 2), saved(2, 2), saved_world=2, world=2) == 2
        assert accumulation_for("ckpt", saved(2, 2), saved(4, 1), saved_world=2, world=2, main=False) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "resume: per_device_train_batch_size 2 -> 4 and gradient_accumulation_steps 2 -> 1 keep the checkpoint's "
        "global batch of 8 rows per step, and so its data order"]


@pytest.mark.parametrize("now,is_now,fix", [
    (saved(2, 4), "16 now (2 x 4 x 2)", "Set gradient_accumulation_steps 2 to keep it"),
    (saved(1, 2), "4 now (1 x 2 x 2)", "Set gradient_accumulation_steps 4 to keep it"),
    (saved(3, 1), "6 now (3 x 1 x 2)", "Set per_device_train_batch_size 2 and gradient_accumulation_steps 2 back"),
])
def test_changing_the_global_batch_on_the_same_world_is_still_refused(now, is_now, fix):
    """The refusal named neither value of the keys that changed nor the accumulation that keeps the batch ('Keep the
    global batch, e.g. with gradient_accumulation_steps'); it names both and the value to set."""
    with pytest.raises(UsageError) as err:
        accumulation_for("ckpt", saved(2, 2), now, saved_world=2, world=2)
    assert str(err.value) == (
        f"ckpt: the global batch was 8 rows per step (per_device_train_batch_size 2 x gradient_accumulation_steps 2 x "
        f"2 process(es)) and is {is_now}; the data position counts steps of the first. {fix}, or start a new run in "
        f"another output_dir")
