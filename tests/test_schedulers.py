"""``shardtune launch --slurm / --kubernetes``: the sbatch script and the PyTorchJob it writes.

The sbatch script is checked by shellcheck, by what its srun line hands each node (the exact words, quoting
included), by its requeue logic, and by running it: stand-in ``srun`` and ``scontrol`` start a real 2-node x
1-process gloo training job of the tiny model on this machine. The manifest is validated against the PyTorchJob
v1 fields of the training-operator CRD (tests/data/pytorchjob_v1_schema.json, see its $comment).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main
from shardtune.cli.launch import launcher_parser, torchrun_command
from shardtune.cli.schedulers import check_scheduler_options, render_cluster_job, slurm_time_s
from shardtune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "tests" / "data" / "pytorchjob_v1_schema.json"
TRAIN = ["--model_name_or_path", "M", "--dataset_name", "chat.jsonl", "--output_dir", "out"]
TWO_BY_EIGHT = ["--num_machines", "2", "--gpus_per_node", "8"]


def render(argv: list[str]):
    """The cluster job that ``shardtune launch ARGV`` writes (argv holds 'train' and the train arguments)."""
    split = argv.index("train")
    opts = launcher_parser().parse_args(argv[:split])
    check_scheduler_options(opts)
    return render_cluster_job(opts, argv[split + 1:])


def srun_words(script: str) -> list[str]:
    """The words of the script's srun line, as the shell reads them, with $head_node, $rdzv_port and
    $SLURM_JOB_ID left as names (they expand to one word each)."""
    text = script.replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("srun "))
    return shlex.split(re.sub(r'"(\$\w+)"', r"'\1'", line.rstrip(" &")))


def test_sbatch_script_2x8_numbers_and_words():
    job = render(["--slurm", "job.sbatch", *TWO_BY_EIGHT, "--python", "/venv/bin/python", "--time", "1-00:00",
                  "--partition", "gpu", "--account", "proj", "--cpus_per_task", "32", "--grace_period", "240",
                  "train", *TRAIN, "--dataset_text_field", "it's a \"text\" $HOME"])
    text = job.text
    directives = re.findall(r"^#SBATCH (\S+)$", text, flags=re.M)
    assert directives == ["--job-name=shardtune", "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:8",
                          "--cpus-per-task=32", "--time=1-00:00", "--partition=gpu", "--account=proj",
                          "--output=%x-%j.out", "--signal=TERM@240"]
    assert "export OMP_NUM_THREADS=4\n" in text  # 32 cores / 8 processes
    words = srun_words(text)
    assert words[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32"]
    assert words[4:8] == ["/venv/bin/python", "-m", "shardtune", "launch"]
    train_at = words.index("train")
    assert words[train_at + 1:] == [*TRAIN, "--dataset_text_field", "it's a \"text\" $HOME",
                                    "--resume_from_checkpoint", "true"]
    # What each node's 'shardtune launch' makes of its options: torchrun on 2 nodes x 8, c10d on the first node
    # (at the port of job 4242: test_two_slurm_jobs_on_one_first_node_meet_on_ports_of_their_own).
    launch = [("24242" if w == "$rdzv_port" else w) for w in words[8:train_at]]
    cmd = torchrun_command(launcher_parser().parse_args(launch), words[train_at + 1:])
    joined = " ".join(cmd)
    assert "--nnodes 2 --nproc_per_node 8 --max_restarts 0" in joined
    assert "--rdzv_backend c10d --rdzv_endpoint $head_node:24242 --rdzv_id $SLURM_JOB_ID" in joined
    assert "-m shardtune train --num_processes 16 --num_machines 2" in joined
    assert "scontrol requeue" not in text  # only with --requeue


def node_launch(job) -> tuple[list[str], list[str]]:
    """(the launch options, the train arguments) each node of ``job`` runs 'shardtune launch' with."""
    words = srun_words(job.text)[4:] if job.slurm else yaml.safe_load(job.text)["spec"]["pytorchReplicaSpecs"][
        "Worker"]["template"]["spec"]["containers"][0]["command"]
    train_at = words.index("train")
    return words[words.index("launch") + 1:train_at], words[train_at + 1:]


@pytest.mark.parametrize("form", [["--slurm"], ["--kubernetes", "--image", "img:1"]])
def test_a_one_node_job_keeps_the_port_it_was_given(form):
    """--main_process_port on one node was dropped without a word: the node's torchrun ran --standalone on a port
    of its own choosing. It is the node's --master_port, as 'shardtune launch' on one machine makes it."""
    job = render([*form, "--gpus_per_node", "4", "--main_process_port", "31234", "train", *TRAIN])
    launch, train = node_launch(job)
    assert launch == ["--num_machines", "1", "--num_processes", "4", "--main_process_port", "31234",
                      "--max_restarts", "0"]
    cmd = " ".join(torchrun_command(launcher_parser().parse_args(launch), train))
    assert "--nnodes 1 --nproc_per_node 4 --max_restarts 0 --master_addr 127.0.0.1 --master_port 31234 -m" in cmd
    if not job.slurm:  # the port the pod declares is the one it listens on
        assert yaml.safe_load(job.text)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
            0]["ports"] == [{"name": "pytorchjob-port", "containerPort": 31234}]
    # Not given, torchrun picks a free port itself, as before.
    launch, train = node_launch(render([*form, "--gpus_per_node", "4", "train", *TRAIN]))
    assert "--main_process_port" not in launch
    assert "--standalone" in torchrun_command(launcher_parser().parse_args(launch), train)


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install shellcheck; `make test` installs it)")
@pytest.mark.parametrize("extra", [[], ["--requeue", "--network_interface", "ib0", "--cpus_per_task", "64",
                                        "--job_name", "my sft", "--error", "%x-%j.err"],
                                   ["--num_machines", "1"]])  # no first node to find: no head_node left unused
def test_sbatch_script_is_shellcheck_clean(extra, tmp_path):
    job = render(["--slurm", *TWO_BY_EIGHT, *extra, "train", *TRAIN])
    (tmp_path / "job.sbatch").write_text(job.text)
    proc = subprocess.run(["shellcheck", "--severity=style", str(tmp_path / "job.sbatch")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout


FAKE_SRUN = """#!{python}
# Stand-in srun: runs its command once per node on this machine, as Slurm's srun runs one task per node.
import os, signal, subprocess, sys, json
args = sys.argv[1:]
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
while args and args[0].startswith("-"):
    if args[0].startswith("--nodes="):
        nodes = int(args[0].split("=")[1])
    args.pop(0)
mode = os.environ.get("FAKE_SRUN", "run")
if mode == "dump":
    open(os.environ["FAKE_SRUN_DUMP"], "w").write(json.dumps(args))
    sys.exit(0)
if mode.startswith("exit:"):  # the launchers' exit code, after the test's go-ahead file appears
    open(os.environ["FAKE_SRUN_STARTED"], "w").close()
    while not os.path.exists(os.environ["FAKE_SRUN_GO"]):
        __import__("time").sleep(0.02)
    sys.exit(int(mode[5:]))
# FAKE_SRUN_HOSTS: a command prefix per node (ip netns exec ...), so that each node's task runs on its own host.
hosts = json.loads(os.environ.get("FAKE_SRUN_HOSTS") or "null") or [[]] * nodes
procs = [subprocess.Popen(hosts[i] + args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                                 "SLURM_LOCALID": "0"}}) for i in range(nodes)]
signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs])
codes = [p.wait() for p in procs]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""

FAKE_SCONTROL = """#!/bin/bash
# Stand-in scontrol: the nodes are FAKE_NODE_NAMES (namespace hosts) or this machine; other commands are logged.
if [ "$1 $2" = "show hostnames" ] && [ -n "$FAKE_NODE_NAMES" ]; then
    for name in $FAKE_NODE_NAMES; do echo "$name"; done
elif [ "$1 $2" = "show hostnames" ]; then
    for _ in $(seq "$SLURM_JOB_NUM_NODES"); do echo 127.0.0.1; done
else
    echo "$*" >> "$FAKE_SCONTROL_LOG"
fi
"""


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """PATH with the stand-ins first, and the variables Slurm gives a batch script."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        for tool in ("srun", "scontrol"):
            (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAULT_"))}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_JOB_NODELIST": "node[01-02]", "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"), **extra})
    return env


def test_sbatch_script_runs_two_nodes_of_real_training(tmp_path, monkeypatch, restore_logging):
    """The script as Slurm would run it, with srun and scontrol stood in: 2 nodes x 1 CPU process, gloo, whose
    losses are those of the same global batches on one process. Where network namespaces can be made (root,
    iproute2: CI), each node is its own host (tests/netns.py) and srun starts each node's task in its namespace;
    elsewhere both nodes are this machine, and the test reports the host check skipped."""
    from shardtune.testing.tiny import make_model_folder
    from tests import netns
    from tests.ports import held_stores
    from tests.trainutil import flags, losses, write_chat_data

    make_model_folder(tmp_path / "M")
    write_chat_data(tmp_path / "chat.jsonl", rows=200)
    train = ["--model_name_or_path", "M", "--dataset_name", "chat.jsonl", "--output_dir", "out", "--max_steps", "2",
             "--max_seq_len", "64", "--per_device_train_batch_size", "2", "--logging_steps", "1",
             "--save_strategy", "no", "--distributed_type", "DDP", "--use_peft_lora", "False"]
    env = slurm_env(tmp_path, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def run_job(port: int) -> subprocess.CompletedProcess:
        job = render(["--slurm", "job.sbatch", "--num_machines", "2", "--num_processes", "2", "--gpus_per_node", "0",
                      "--main_process_port", str(port), "--python", sys.executable, "--requeue", "train", *train])
        (tmp_path / "job.sbatch").write_text(job.text)
        return subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)

    no_hosts = netns.unavailable()
    if no_hosts is None:
        with netns.two_hosts("sb") as hosts:
            seen = tmp_path / "seen"  # each node's task writes the host it runs on
            note = ["sh", "-c", 'echo "$(hostname) $(ip -4 -o addr show dev "$GLOO_SOCKET_IFNAME")" >> "$0"; '
                    'exec "$@"', str(seen)]
            env.update(FAKE_NODE_NAMES=" ".join(h.hostname for h in hosts), FAKE_SRUN_HOSTS=json.dumps(
                [h.command(["env", f"GLOO_SOCKET_IFNAME={h.iface}", *note]) for h in hosts]))
            proc = run_job(29500)  # the first host's own network namespace: no other process binds there
        ran_on = sorted((line.split()[0], line.split()[4]) for line in seen.read_text().splitlines())
        assert ran_on == [(h.hostname, f"{h.addr}/24") for h in hosts], ran_on
    else:  # both nodes on this machine: the rendezvous store is one this test holds on a port the OS chose
        store = held_stores(1)[0]  # each node's torchrun finds its port taken and joins it as a client
        proc = run_job(store.port)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "strategy: DDP on 2 process(es)" in proc.stderr  # one world of both nodes' processes
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    monkeypatch.chdir(tmp_path)  # the reference, in this process: no second interpreter to start
    assert main(["train", *flags(*train, "--output_dir", "alone", "--distributed_type", "NO",
                                 "--gradient_accumulation_steps", "2")]) == 0
    for step, (nodes, reference) in enumerate(zip(losses(tmp_path / "out"), losses(tmp_path / "alone")), 1):
        assert abs(nodes - reference) <= 1e-4 * reference, f"step {step}: {nodes} on 2 nodes, {reference} on one"
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["num_processes"] == 2
    assert (tmp_path / "out" / "final").is_dir()
    assert not (tmp_path / "scontrol.log").exists()  # finished: nothing requeued
    if no_hosts is not None:
        pytest.skip(f"trained on 2 nodes of this machine; the check that each node is its own host needs network "
                    f"namespaces: {no_hosts}")


def _signals(pid: int, field: str) -> set[int]:
    """The signals in one mask of /proc/PID/status: SigCgt (caught), ShdPnd and SigPnd (pending)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(f"{field}:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def _wait_until_taken(pid: int, signum: int) -> None:
    """Until the process's handler has taken ``signum`` (it is no longer pending): then its trap runs before the
    launchers' exit can be seen, however loaded the machine."""
    deadline = time.monotonic() + 30
    while signum in _signals(pid, "ShdPnd") | _signals(pid, "SigPnd"):
        assert time.monotonic() < deadline, f"process {pid} left signal {signum} pending for 30 s"
        time.sleep(0.001)


def run_stopping(tmp_path: Path, exit_code: int, *, cancel: bool, requeue: bool = True) -> tuple[int, str]:
    """The script with launchers that exit with ``exit_code``; ``cancel``: the batch shell itself gets SIGTERM
    first, as on scancel or preemption. Returns its exit code and what it asked scontrol."""
    job = render(["--slurm", "job.sbatch", *TWO_BY_EIGHT, *(["--requeue"] if requeue else []), "train", *TRAIN])
    (tmp_path / "job.sbatch").write_text(job.text)
    started, go = tmp_path / "started", tmp_path / "go"
    for left in (started, go):  # an earlier call's
        left.unlink(missing_ok=True)
    env = slurm_env(tmp_path, FAKE_SRUN=f"exit:{exit_code}", FAKE_SRUN_STARTED=str(started), FAKE_SRUN_GO=str(go))
    proc = subprocess.Popen(["bash", "job.sbatch"], cwd=tmp_path, env=env)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if cancel:
        assert signal.SIGTERM in _signals(proc.pid, "SigCgt")  # the trap is set before srun starts
        proc.send_signal(signal.SIGTERM)
        _wait_until_taken(proc.pid, signal.SIGTERM)  # the shell takes it while it waits on the launchers
    go.touch()
    code = proc.wait(timeout=30)
    log = tmp_path / "scontrol.log"
    return code, log.read_text() if log.exists() else ""


def test_stop_at_the_time_limit_requeues_the_job(tmp_path):
    assert run_stopping(tmp_path, 143, cancel=False) == (143, "requeue 4242\n")


def test_cancel_or_preemption_waits_for_the_save_and_does_not_requeue(tmp_path):
    assert run_stopping(tmp_path, 143, cancel=True) == (143, "")
    # The launchers end only after the go-ahead, which comes after the shell took SIGTERM: the shell's status is
    # theirs (not the 143 of its interrupted wait) only if it waited for them.
    assert run_stopping(tmp_path, 7, cancel=True) == (7, "")


def test_no_requeue_without_requeue_option_or_on_failure(tmp_path):
    assert run_stopping(tmp_path, 143, cancel=False, requeue=False) == (143, "")
    assert run_stopping(tmp_path, 1, cancel=False) == (1, "")


def srun_ran(tmp_path: Path, job, job_id: str) -> list[str]:
    """The words the script hands srun, run as Slurm job ``job_id`` (srun stood in, writing them down)."""
    (tmp_path / "job.sbatch").write_text(job.text)
    dump = tmp_path / f"srun-{job_id}.json"
    env = slurm_env(tmp_path, FAKE_SRUN="dump", FAKE_SRUN_DUMP=str(dump), SLURM_JOB_ID=job_id)
    subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, check=True, timeout=60)
    return json.loads(dump.read_text())


def test_two_slurm_jobs_on_one_first_node_meet_on_ports_of_their_own(tmp_path):
    """Every 2-node job met on port 29500 of its first node: a second job there (the node's GPUs split between
    jobs) found it taken, and torchrun's c10d joined the first job's store as a client without a word, so the
    second job failed when the first one ended. Without --main_process_port the port is the job's own."""
    job = render(["--slurm", "--num_machines", "2", "--gpus_per_node", "4", "train", *TRAIN])
    ports = {}
    for job_id in ("4242", "4243", "1234567"):
        words = srun_ran(tmp_path, job, job_id)
        ports[job_id] = words[words.index("--main_process_port") + 1]
        assert words[words.index("--rdzv_id") + 1] == job_id
    assert ports == {"4242": "24242", "4243": "24243", "1234567": "24567"}
    given = render(["--slurm", "--num_machines", "2", "--gpus_per_node", "4", "--main_process_port", "29600", "train",
                    *TRAIN])
    words = srun_ran(tmp_path, given, "4242")
    assert words[words.index("--main_process_port") + 1] == "29600"


def manifest(argv: list[str]) -> dict:
    return yaml.safe_load(render(["--kubernetes", *argv]).text)


def validate(doc: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


MANIFESTS = {
    "plain": [*TWO_BY_EIGHT, "--image", "img:1", "train", *TRAIN],
    "pvc": [*TWO_BY_EIGHT, "--image", "img:1", "--pvc", "runs", "--namespace", "ml", "--cpus_per_task", "16",
            "--network_interface", "eth0", "--max_restarts", "3", "--job_name", "llama-sft", "train", *TRAIN],
    "cpu": ["--num_machines", "3", "--num_processes", "6", "--gpus_per_node", "0", "--image", "img:1", "train", *TRAIN],
}


@pytest.mark.parametrize("name", MANIFESTS)
def test_pytorchjob_manifest_matches_the_crd(name):
    doc = manifest(MANIFESTS[name])
    assert validate(doc) == []


def test_pytorchjob_manifest_numbers():
    doc = manifest(MANIFESTS["pvc"])
    spec = doc["spec"]
    assert spec["nprocPerNode"] == "8"
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"cpu": 16}}
    assert container["env"] == [{"name": "OMP_NUM_THREADS", "value": "2"}, {"name": "NCCL_SOCKET_IFNAME",
                                 "value": "eth0"}, {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"}]
    assert container["workingDir"] == "/workspace"
    assert pod["volumes"][1] == {"name": "shared", "persistentVolumeClaim": {"claimName": "runs"}}
    command = container["command"]
    assert command[:4] == ["python3", "-m", "shardtune", "launch"]
    train_at = command.index("train")
    cmd = " ".join(torchrun_command(launcher_parser().parse_args(command[4:train_at]), command[train_at + 1:]))
    assert "--nnodes 2 --nproc_per_node 8 --max_restarts 3" in cmd
    assert f"--rdzv_endpoint llama-sft-worker-0:{container['ports'][0]['containerPort']} --rdzv_id llama-sft" in cmd
    assert command[train_at + 1:] == [*TRAIN, "--resume_from_checkpoint", "true"]
    assert manifest(MANIFESTS["cpu"])["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
        0].get("resources") is None


def test_the_schema_refuses_what_the_crd_does_not_define():
    doc = manifest(MANIFESTS["plain"])
    doc["spec"]["nprocsPerNode"] = "8"  # misspelt
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "2"  # wrong type
    del doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"]
    problems = validate(doc)
    assert len(problems) == 3, problems
    assert any("nprocsPerNode" in p for p in problems) and any("'name' is a required" in p for p in problems)


BAD = [
    (["--slurm", "--kubernetes", "--gpus_per_node", "8"], "--slurm and --kubernetes"),
    (["--slurm", "--machine_rank", "1", "--gpus_per_node", "8"], "--machine_rank"),
    (["--slurm", "--main_process_ip", "10.0.0.1", "--gpus_per_node", "8"], "--main_process_ip"),
    (["--slurm", "--rdzv_backend", "static", "--gpus_per_node", "8"], "--rdzv_backend static"),
    (["--slurm", "--num_machines", "2", "--num_processes", "15"], "must be a multiple of --num_machines 2"),
    (["--slurm", "--num_machines", "2", "--num_processes", "8", "--gpus_per_node", "8"], "--gpus_per_node 8"),
    (["--slurm", "--num_machines", "2"], "needs its size"),
    (["--slurm", "--gpus_per_node", "8", "--image", "x"], "--image is an option of --kubernetes"),
    (["--kubernetes", "--gpus_per_node", "8", "--image", "x", "--time", "10"], "--time is an option of --slurm"),
    (["--kubernetes", "--gpus_per_node", "8"], "--kubernetes needs --image"),
    (["--kubernetes", "--gpus_per_node", "8", "--image", "x", "--job_name", "My_Job"], "--job_name My_Job"),
    (["--time", "10", "--num_processes", "2"], "--time is an option of a cluster job"),
    (["--slurm", "--gpus_per_node", "8", "--time", "3 days"], "--time 3 days: not a Slurm time limit"),
    (["--slurm", "--gpus_per_node", "8", "--time", "5"], "leaves no training"),
    # sbatch refused the script it wrote: "Invalid --signal specification"
    (["--slurm", "--gpus_per_node", "8", "--grace_period", "70000"], "--grace_period 70000: Slurm sends its signal"),
    (["--slurm", "--gpus_per_node", "8", "--submit"], "--submit runs sbatch, which is not on PATH"),
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--submit"], "--submit runs kubectl"),
    # empty values: written as they were (#SBATCH --partition=, which sbatch refuses), or dropped for the default
    (["--slurm", "--gpus_per_node", "8", "--partition="], "--partition '': an empty value; give one, or leave"),
    (["--slurm", "--gpus_per_node", "8", "--time", ""], "--time '': an empty value"),
    (["--slurm", "--gpus_per_node", "8", "--job_name", " "], "--job_name ' ': an empty value"),
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--pvc="], "--pvc '': an empty value"),
    # a --mount_path that did nothing (no --pvc), and one the pods could not start with (their runtime refuses it)
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--mount_path", "/data"],
     "--mount_path /data: it is where --pvc CLAIM is mounted, and no --pvc is given"),
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--pvc", "runs", "--mount_path", "data"],
     "--mount_path data: the claim is mounted at a folder of the container from its root"),
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--pvc", "runs", "--mount_path", "/"],
     "--mount_path /: the claim is mounted at a folder"),
    # names Kubernetes refuses: the claim's only when the operator makes the pods, which never start
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--pvc", "Shared_Runs"],
     "--pvc Shared_Runs: not a name Kubernetes takes: lower-case letters, digits, '-' and '.'"),
    (["--kubernetes", "--image", "x", "--gpus_per_node", "8", "--namespace", "ml.team"],
     "--namespace ml.team: not a name Kubernetes takes: lower-case letters, digits and '-',"),
]


@pytest.mark.parametrize("argv, says", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_combinations_exit_2_with_one_line(argv, says, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither sbatch nor kubectl
    monkeypatch.chdir(tmp_path)
    assert main(["launch", *argv, "train", *TRAIN]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("output_dir, mount", [("/scratch/run", None), ("../run", None), ("/workspace2/run", None),
                                               ("/workspace/run", "/data/")])
def test_an_output_dir_outside_the_claim_is_refused(output_dir, mount, capsys, tmp_path, monkeypatch):
    """--pvc mounts the claim at --mount_path, the pods' working directory: an output_dir outside it was written to
    the pod's own disk without a word, and a restarted pod found no checkpoint to resume from."""
    monkeypatch.chdir(tmp_path)
    mounted = ["--mount_path", mount] if mount else []
    assert main(["launch", "--kubernetes", "--image", "img:1", "--gpus_per_node", "8", "--pvc", "runs", *mounted,
                 "train", *TRAIN[:-1], output_dir]) == 2
    at = (mount or "/workspace").rstrip("/")
    assert capsys.readouterr().err == (
        f"shardtune launch: error: command line (--output_dir): output_dir {output_dir} is outside {at}, where --pvc "
        f"runs is mounted: its checkpoints would be on the pod's own disk and go with the pod; give an output_dir "
        f"under {at} (a relative one such as runs/NAME is kept there), or mount the claim above it (--mount_path)\n")
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_outside_the_claim_is_named_where_the_recipe_sets_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sft.yaml").write_text("model_name_or_path: M\ndataset_name: chat.jsonl\noutput_dir: /scratch/run\n")
    assert main(["launch", "--kubernetes", "--dry_run", "--image", "img:1", "--gpus_per_node", "8", "--pvc", "runs",
                 "train", "sft.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardtune launch: error: sft.yaml, line 3: output_dir /scratch/run is outside /workspace,")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("output_dir, mount", [("out", None), ("runs/../out", None), ("/workspace/runs/a", None),
                                               ("/workspace", None), ("/data/run", "/data"), ("run", "/data/")])
def test_an_output_dir_on_the_claim_is_kept(output_dir, mount):
    """Relative to the pods' working directory, the claim, or under its mount: written as given."""
    doc = manifest([*TWO_BY_EIGHT, "--image", "img:1", "--pvc", "runs", *(["--mount_path", mount] if mount else []),
                    "train", *TRAIN[:-1], output_dir])
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["workingDir"] == container["volumeMounts"][1]["mountPath"] == (mount or "/workspace")
    assert container["command"][-4:] == ["--output_dir", output_dir, "--resume_from_checkpoint", "true"]


def test_a_bad_train_key_is_refused_before_writing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--slurm", "--gpus_per_node", "8", "train", *TRAIN, "--learning_rat", "1e-4"]) == 2
    assert "learning_rate" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_use_cpu_is_checked_against_the_gpus_the_cluster_job_asks_for(capsys, tmp_path, monkeypatch):
    """Accelerate's use_cpu true is decided by the nodes' GPUs (--gpus_per_node), not the login node's: a GPU job
    is refused before it waits in a queue, and a CPU job loads on a login node that has a GPU."""
    import torch

    monkeypatch.chdir(tmp_path)
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\n"
                   "use_cpu: true\nmachine_rank: 0\nnum_machines: 1\nnum_processes: 2\n")
    for login_has_gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: login_has_gpu)
        assert main(["launch", "--slurm", "--config_file", str(acc), "--gpus_per_node", "2", "--dry_run",
                     "train", *TRAIN]) == 2
        err = capsys.readouterr().err
        assert "use_cpu=True would change what runs" in err and "--gpus_per_node 0" in err, err
        assert main(["launch", "--slurm", "--config_file", str(acc), "--gpus_per_node", "0", "--dry_run",
                     "train", *TRAIN]) == 0
        assert "Slurm job 'shardtune': 1 node x 2 CPU processes, 2 processes." in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accelerate.yaml"]


def test_write_and_submit(tmp_path, monkeypatch, capsys):
    """The file is written where asked, and --submit hands it to sbatch (a stand-in that records its argument)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/sbatch.args\necho "Submitted batch job 7"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--slurm", "--gpus_per_node", "4", "train", *TRAIN]) == 0
    wrote = "shardtune launch: wrote shardtune.sbatch; submit it with: sbatch shardtune.sbatch\n"
    assert capsys.readouterr().out == wrote
    assert "#SBATCH --gres=gpu:4" in (tmp_path / "shardtune.sbatch").read_text()
    assert main(["launch", "--slurm", "j.sh", "--submit", "--gpus_per_node", "4", "train", *TRAIN]) == 0
    assert (tmp_path / "sbatch.args").read_text() == "j.sh\n"
    assert os.access(tmp_path / "j.sh", os.X_OK)


def test_resume_given_by_the_user_is_kept_with_a_note(capsys):
    job = render(["--slurm", "--gpus_per_node", "8", "train", *TRAIN, "--resume_from_checkpoint", "out/ck/step-9"])
    assert srun_words(job.text)[-2:] == ["--resume_from_checkpoint", "out/ck/step-9"]
    assert job.notes and "starts again from it" in job.notes[0]
    assert srun_words(render(["--slurm", "--gpus_per_node", "8", "train", *TRAIN, "--resume_from_checkpoint",
                              "latest"]).text).count("--resume_from_checkpoint") == 1
    off = render(["--slurm", "--gpus_per_node", "8", "train", *TRAIN, "--resume_from_checkpoint", "false"])
    assert srun_words(off.text)[-2:] == ["--resume_from_checkpoint", "false"] and "does not carry on" in off.notes[0]


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("10:30", 630), ("2:00:00", 7200), ("1-12", 129600),
                                           ("1-00:30", 88200), ("0-00:00:45", 45), ("UNLIMITED", None),
                                           ("0", None), ("0:00", None)])  # Slurm: a limit of zero is none
def test_slurm_time_limits(text, seconds):
    assert slurm_time_s(text) == seconds


@pytest.mark.parametrize("option", ["--slurm", "--kubernetes"])
def test_a_cluster_job_in_a_folder_that_does_not_exist_is_one_line(option, tmp_path, capsys, monkeypatch):
    """The job file's folder missing: a 29-line FileNotFoundError traceback, exit 1."""
    from shardtune.cli import main

    monkeypatch.chdir(tmp_path)
    extra = ["--image", "img"] if option == "--kubernetes" else []
    argv = ["launch", option, "nodir/job", "--gpus_per_node", "2", *extra, "train", "--model_name_or_path", "M",
            "--dataset_name", "d.jsonl", "--output_dir", "o"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the error alone: the job's notes only with the job
    assert err == [f"shardtune launch: error: {option} nodir/job: folder nodir does not exist; create it or "
                       f"give another path"]
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("form", [["--slurm"], ["--kubernetes", "--image", "img:1"]])
def test_restarts_that_the_nodes_would_refuse_are_refused_when_the_job_is_written(form, capsys, tmp_path,
                                                                                    monkeypatch):
    """--max_restarts 2 with resume_from_checkpoint false: the job was written with a note, and every node's
    launcher then refused it (exit 2) once the job left the queue. Refused now as those launchers refuse it."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", *form, *TWO_BY_EIGHT, "--cpus_per_task", "16", "--max_restarts", "2", "train", *TRAIN]
    assert main([*argv, "--resume_from_checkpoint", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardtune launch: error: --max_restarts 2: a restarted worker finds this run's own "
                          "checkpoints") and "\n" not in err
    assert list(tmp_path.iterdir()) == []
    assert main([*argv, "--resume_from_checkpoint", "false", "--overwrite_output_dir", "true"]) == 0  # afresh
    capsys.readouterr()
    assert main([*argv[:2], "unset.job", *argv[2:]]) == 0  # left out, the job resumes: its restarts carry on


def test_python_may_be_a_command_that_runs_it_in_a_container(tmp_path):
    """--python "apptainer exec --nv IMG python3" (a Slurm cluster's container) was written as one quoted word,
    a program of that name, which no node has. It is the command the nodes run, word by word."""
    python = "apptainer exec --nv /shared/sft.sif python3"
    job = render(["--slurm", *TWO_BY_EIGHT, "--cpus_per_task", "64", "--python", python, "train", *TRAIN])
    words = srun_ran(tmp_path, job, "4242")  # as srun gets them from the script's shell
    assert words[:8] == ["apptainer", "exec", "--nv", "/shared/sft.sif", "python3", "-m", "shardtune", "launch"]
    command = yaml.safe_load(render(["--kubernetes", *TWO_BY_EIGHT, "--image", "img:1", "--python", python, "train",
                                     *TRAIN]).text)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]["command"]
    assert command[:6] == ["apptainer", "exec", "--nv", "/shared/sft.sif", "python3", "-m"]
    spaced = render(["--slurm", "--gpus_per_node", "1", "--python", "'/my venv/bin/python'", "train", *TRAIN])
    assert srun_ran(tmp_path, spaced, "4242")[:2] == ["/my venv/bin/python", "-m"]
    with pytest.raises(UsageError, match="--python '/my venv/bin/python: No closing quotation; quote a path"):
        render(["--slurm", "--gpus_per_node", "1", "--python", "'/my venv/bin/python", "train", *TRAIN])


def test_a_slurm_job_without_cpus_per_task_says_its_processes_share_one_cpu():
    """Without --cpus_per_task sbatch asks 1 CPU per task, one task per node: a node's 8 GPU processes ran on one
    core without a word (its OMP_NUM_THREADS 1). Said on writing; not said with the cores given, or one process."""
    notes = render(["--slurm", *TWO_BY_EIGHT, "train", *TRAIN]).notes
    assert [n for n in notes if "--cpus_per_task" in n] == [
        "note: no --cpus_per_task: Slurm gives each node's task 1 CPU unless the cluster sets more (DefCpuPerGPU, "
        "whole nodes), and the node's 8 processes would share it: give --cpus_per_task C, the cores for all of them"]
    assert not render(["--slurm", *TWO_BY_EIGHT, "--cpus_per_task", "64", "train", *TRAIN]).notes
    assert not render(["--slurm", "--num_machines", "2", "--gpus_per_node", "1", "train", *TRAIN]).notes


@pytest.mark.parametrize("option", ["--output", "--error"])
def test_a_log_folder_that_does_not_exist_is_refused(option, tmp_path, capsys, monkeypatch):
    """--output logs/%x-%j.out without logs/: the script was written, and Slurm failed the job at its start with
    no log anywhere to say why. Refused when the script is written; with the folder there, it is written."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--slurm", "--gpus_per_node", "1", option, "logs/%x-%j.log", "train", *TRAIN]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"shardtune launch: error: {option} logs/%x-%j.log: folder logs does not exist here, and Slurm would fail the "
        f"job without writing any log: create it (mkdir -p logs) or give another path")
    assert not (tmp_path / "shardtune.sbatch").exists()
    (tmp_path / "logs").mkdir()
    assert main(argv) == 0
    assert f"#SBATCH {option}=logs/%x-%j.log" in (tmp_path / "shardtune.sbatch").read_text()
    # The folder itself, written where the log file goes: Slurm cannot open it as the log either.
    for given in ("logs", "logs/"):
        assert main(["launch", "--slurm", "d.sbatch", "--gpus_per_node", "1", option, given, "train", *TRAIN]) == 2
        assert capsys.readouterr().err.strip() == (
            f"shardtune launch: error: {option} {given}: a folder, where Slurm writes the log to a file: give a file "
            f"in it, e.g. {option} logs/%x-%j.out")
    assert not (tmp_path / "d.sbatch").exists()
    # A folder named with Slurm's patterns (the user's, the job's) is Slurm's to read: not checked here.
    assert main(["launch", "--slurm", "u.sbatch", "--gpus_per_node", "1", option, "/scratch/%u/%j.log", "train",
                 *TRAIN]) == 0


def test_the_launcher_shares_out_the_cores_it_may_use(monkeypatch):
    """OMP_NUM_THREADS came from the machine's core count: on a node shared by a Slurm allocation (or a container's
    CPU set) the workers' threads oversubscribed the cores the job had. It shares out the cores this process may
    run on."""
    import os

    import torch.distributed.run

    from shardtune.cli import launch

    workers = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: workers.append(dict(os.environ)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the test run's own
    before = dict(os.environ)
    assert launch.run_torchrun(["--standalone", "--nproc_per_node", "2", "-m", "shardtune", "train"]) == 0
    assert workers[0]["OMP_NUM_THREADS"] == "2"
    assert workers[0][launch.LAUNCHER_PID] == str(os.getpid())
    # ... and only the workers: this process's environment is as it was (a train run here after the launcher
    # returned was killed as the orphan of a launcher that had ended: it took down a test worker).
    assert dict(os.environ) == before


def doc_examples() -> list[tuple[str, str]]:
    """(command, the file it writes) for each cluster-job example in docs/clusters.md."""
    page = (ROOT / "docs" / "clusters.md").read_text()
    pattern = r"```console\n\$ (shardtune launch --(?:slurm|kubernetes).*?)\n```\n.*?```(?:bash|yaml)\n(.*?)```"
    return [(cmd.replace("\\\n", " "), body) for cmd, body in re.findall(pattern, page, flags=re.S)]


def test_docs_show_what_the_tool_writes():
    examples = doc_examples()
    assert len(examples) == 2
    for command, body in examples:
        argv = shlex.split(command)[2:]
        assert render(argv).text == body, f"docs/clusters.md is stale for: {command}"
