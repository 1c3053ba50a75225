"""Machines of a job that never meet: each launcher says what it waits for and for how long, gives up after
``--rdzv_conf join_timeout`` with a line naming what to check, and stops at once on Ctrl-C while it waits (torch
waited out its 15-minute rendezvous timeout in silence, deaf to Ctrl-C and SIGTERM)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardtune.cli.launch_command import launcher_parser, meeting, torchrun_command
from shardtune.errors import UsageError
from tests.trainutil import shardtune_env, tiny_workspace


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "meet", rows=8)


def launcher(work, port: int, *extra: str) -> subprocess.Popen:
    train = ["train", "--model_name_or_path", str(work / "model"), "--dataset_name", str(work / "chat.jsonl"),
             "--max_steps", "1", "--output_dir", str(work / "out")]
    # Ctrl-C as a terminal delivers it: a test run started in the background of a script (nohup ... &) ignores
    # SIGINT, and every process it starts would inherit that
    return subprocess.Popen([sys.executable, "-m", "shardtune", "launch", "--num_machines", "2", "--num_processes",
                             "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *extra, *train],
                            cwd=work, env=shardtune_env(work), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(90)
def test_a_machine_alone_says_what_it_waits_for_gives_up_naming_what_to_check_and_stops_on_ctrl_c(work):
    with socket.socket() as closed, socket.socket() as free, socket.socket() as free_too:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: nobody answers there
        free.bind(("127.0.0.1", 0))
        free_too.bind(("127.0.0.1", 0))
        port_0, port_term = free.getsockname()[1], free_too.getsockname()[1]
        free.close()
        free_too.close()
        terminated = launcher(work, port_term, "--machine_rank", "0")
        joining = launcher(work, closed.getsockname()[1], "--machine_rank", "1", "--rdzv_conf", "join_timeout=2")
        # c10d's rendezvous timed out with RendezvousTimeoutError's traceback
        elastic = launcher(work, port_0 + 1 if port_0 < 65535 else port_0 - 1, "--rdzv_backend", "c10d",
                           "--rdzv_conf", "join_timeout=2")
        hosting = launcher(work, port_0, "--machine_rank", "0")
        try:
            waiting = hosting.stderr.readline()
            while not listening(port_0):  # until torch's agent waits in its store
                time.sleep(0.2)
            started = time.monotonic()
            hosting.send_signal(signal.SIGINT)
            _, hosting_err = hosting.communicate(timeout=30)
            stopped_after_s = time.monotonic() - started
            while not listening(port_term):
                time.sleep(0.2)
            terminated.send_signal(signal.SIGTERM)
            _, terminated_err = terminated.communicate(timeout=30)
            _, joining_err = joining.communicate(timeout=120)
            _, elastic_err = elastic.communicate(timeout=120)
        finally:
            for p in (joining, hosting, elastic, terminated):
                p.kill()
    assert waiting.startswith(f"shardtune launch: machine rank 0 of 2: waiting up to 900 s for the other machines to "
                              f"join on 127.0.0.1:{port_0} (the same command there, with --machine_rank 1)")
    assert hosting.returncode == 130 and stopped_after_s < 15, (hosting.returncode, stopped_after_s, hosting_err)
    assert "stopped by SIGINT while no worker ran (waiting for the machines to meet)" in hosting_err
    # SIGTERM (a scheduler's stop): the code of a stop with no checkpoint saved for it, as once workers run
    assert terminated.returncode == 1, terminated_err
    assert "stopped by SIGTERM while no worker ran (waiting for the machines to meet)" in terminated_err
    assert joining.returncode == 1, joining_err
    assert "machine rank 1 of 2: joining the job's rendezvous on 127.0.0.1:" in joining_err
    last = joining_err.strip().splitlines()[-1]
    assert last.startswith("shardtune launch: the machines did not meet within 2 s on 127.0.0.1:"), joining_err
    assert "--main_process_ip 127.0.0.1 (machine rank 0's address" in last and "join_timeout=SECONDS" in last
    assert "Traceback" not in joining_err
    assert elastic.returncode == 1 and "Traceback" not in elastic_err, elastic_err
    assert elastic_err.strip().splitlines()[-1].startswith(
        "shardtune launch: the machines did not meet within 2 s on 127.0.0.1:"), elastic_err


TWO = ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.1"]


def parsed(*launch: str):
    return launcher_parser().parse_args(list(launch))


def test_join_timeout_reaches_the_static_rendezvous_and_its_other_settings_are_refused():
    opts = parsed(*TWO, "--machine_rank", "1", "--rdzv_conf", "join_timeout=30")
    cmd = torchrun_command(opts, [])
    assert cmd[cmd.index("--rdzv_conf") + 1] == "timeout=30" and meeting(opts).timeout_s == 30
    assert meeting(parsed(*TWO, "--machine_rank", "0")).timeout_s == 900
    assert meeting(parsed(*TWO, "--rdzv_backend", "c10d")).timeout_s == 600
    with pytest.raises(UsageError, match="static rendezvous .* takes join_timeout alone; last_call_timeout is a c10d"):
        torchrun_command(parsed(*TWO, "--machine_rank", "0", "--rdzv_conf", "last_call_timeout=5"), [])


@pytest.mark.timeout(180)
def test_an_output_dir_that_the_machines_do_not_share_is_refused_at_the_start(work):
    """Machine rank 1 sees its own disk at output_dir's path (a mount namespace over it): the run trained until its
    first checkpoint and failed there with 'Parent directory ... does not exist'."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a mount namespace (the second machine's own disk) needs root and unshare")
    disk = work / "disk"
    disk.mkdir()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    args = ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), "--machine_rank", "{rank}", "train", "--model_name_or_path",
            str(work / "model"), "--dataset_name", str(work / "chat.jsonl"), "--max_steps", "4", "--save_steps", "2",
            "--predict_memory", "false", "--output_dir", str(disk / "run")]
    launch = [sys.executable, "-m", "shardtune", "launch"]
    own_disk = f"mount -t tmpfs tmpfs {shlex.quote(str(disk))} && exec {shlex.join(launch + args)}"
    machines = [subprocess.Popen(launch + [a.format(rank=0) for a in args], cwd=work, env=shardtune_env(work),
                                 stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True),
                subprocess.Popen(["unshare", "-m", "sh", "-c", own_disk.format(rank=1)], cwd=work,
                                 env=shardtune_env(work), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)]
    try:
        errors = [m.communicate(timeout=150)[1] for m in machines]
    finally:
        for m in machines:
            m.kill()
    for machine, err in zip(machines, errors):
        assert machine.returncode == 2, err
        assert f"output_dir {disk / 'run'} is not shared between the machines" in err, err
    assert not any(disk.iterdir())  # rank 0's folder, made for the run, is gone


@pytest.mark.timeout(150)
def test_machines_with_other_versions_are_refused_naming_them(work):
    """Two VMs set up apart, machine 1 with another torch: they trained together without a word. Every rank now
    refuses at the start, naming the package and each rank's version, and nothing is written."""
    import torch

    from tests.trainutil import one_rank_per_machine

    train = ["train", "--model_name_or_path", str(work / "model"), "--dataset_name", str(work / "chat.jsonl"),
             "--output_dir", str(work / "versions"), "--max_steps", "1"]
    other_torch = ("import runpy, sys, torch; torch.__version__ = '2.0.0'; sys.argv[0] = 'shardtune'; "
                   "runpy.run_module('shardtune', run_name='__main__')")
    ended = one_rank_per_machine([["-m", "shardtune", *train], ["-c", other_torch, *train]], work,
                                 {"HF_HUB_OFFLINE": "1"})
    said = [err for _, err in ended]
    assert [code for code, _ in ended] == [2, 2], said
    for err in said:
        assert (f"shardtune train: error: the job's machines run different versions: torch '{torch.__version__}' "
                f"(rank 0) / '2.0.0' (rank 1): install the same versions on every machine") in err, err[-3000:]
    assert not (work / "versions").exists()


def test_a_survivor_names_the_machine_whose_rank_is_gone(tmp_path):
    """Machine 0's rank saw a closed connection to a rank on the other machine: it said 'a rank on another machine is
    gone' without saying which machine; the host that ran it, from the job's process table, is now named."""
    import torch

    from shardtune.config import TrainConfig
    from shardtune.dist import DistInfo
    from shardtune.train.loop import peer_lost

    cfg = TrainConfig()
    cfg.run.output_dir = str(tmp_path)
    info = DistInfo(0, 3, 0, 1, torch.device("cpu"))
    table = [(socket.gethostname(), os.getpid()), ("node-b", 1234), ("node-b", 1235)]
    message = str(peer_lost(cfg, info, table))
    assert message.startswith("a rank on another machine is gone (the connection to it closed); the job's other "
                              "machine: node-b (rank 1 to 2): see that machine's messages, and training cannot go "
                              "on without it; no checkpoint was saved yet"), message


def test_a_main_process_ip_this_machine_cannot_resolve_is_refused_at_once(monkeypatch, capsys):
    """A typo in machine rank 0's host name: the launcher retried it in silence for 15 minutes."""
    from shardtune.cli import launch
    from shardtune.cli import main

    monkeypatch.setattr(launch, "run_torchrun", lambda args: pytest.fail("torchrun started"))
    code = main(["launch", "--num_machines", "2", "--num_processes", "2", "--machine_rank", "1", "--main_process_ip",
                 "node-0.invalid", "train", "--model_name_or_path", "m", "--dataset_name", "d"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("shardtune launch: error: --main_process_ip node-0.invalid: this machine "
                                            "cannot resolve that host ("), err
    assert err[-1].endswith("give machine rank 0's IP address (e.g. 10.0.0.1), or a host name every machine "
                            "resolves")


@pytest.mark.timeout(150)
def test_machines_given_other_process_counts_are_told_to_give_the_launcher_the_same_ones(work):
    """--num_processes 2 on machine 0 and 4 on machine 1 (read as per machine, torchrun's way) was refused with
    'give each machine's shardtune launch the same arguments after train', where the option goes before it."""
    from tests.trainutil import one_rank_per_machine

    train = ["-m", "shardtune", "train", "--model_name_or_path", str(work / "model"), "--dataset_name",
             str(work / "chat.jsonl"), "--output_dir", str(work / "counts"), "--max_steps", "1", "--num_machines", "2"]
    ended = one_rank_per_machine([train + ["--num_processes", "2"], train + ["--num_processes", "4"]], work,
                                 {"HF_HUB_OFFLINE": "1"})
    assert [code for code, _ in ended] == [2, 2], ended
    for _, err in ended:
        assert ("different settings: num_processes 2 (rank 0) / 4 (rank 1): every rank must train with the same ones; "
                "give each machine's shardtune launch the same --num_processes, counted over all machines (only "
                "--machine_rank differs)") in err, err[-3000:]
