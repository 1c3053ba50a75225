"""``shardtune launch --slurm [FILE]`` and ``--kubernetes [FILE]``: the launch as a cluster job.

``job_shape`` turns the launch options into the job's shape (nodes, processes and GPUs per node, rendezvous
port, restarts, the seconds a stop leaves for the checkpoint) once; ``sbatch_script`` and ``pytorchjob_manifest``
render it. Every node runs ``python -m shardtune launch`` with a c10d rendezvous on the job's first node, so each
node's torchrun command, its checks and its exit codes are those of ``shardtune launch`` itself. The train
arguments get ``resume_from_checkpoint true`` unless they say otherwise, so a requeued, restarted or re-submitted
job carries on from its newest verified checkpoint.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from shardtune.cli.launch_command import (CLUSTER, DEFAULT_GRACE_S, DEFAULT_JOB_NAME, DEFAULT_MOUNT_PATH,
                                          KUBERNETES_ONLY, SLURM_ONLY)
from shardtune.errors import UsageError

if TYPE_CHECKING:
    from shardtune.config import TrainConfig

DEFAULT_PORT = 29500  # the rendezvous port when --main_process_port is not given (torchrun's own default)
# A Slurm job's first node may host other jobs' rendezvous (its GPUs split between jobs): there, without
# --main_process_port, the port is the job's own, from its id, below Linux's ephemeral ports (32768 on), which an
# outgoing connection could be holding.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
# Names of the Kubeflow training operator (training-operator v1.9, pkg/apis/kubeflow.org/v1/pytorch_types.go):
# the container it reads the port from, and that port's name.
KUBE_CONTAINER = "pytorch"
KUBE_PORT_NAME = "pytorchjob-port"


def _given(opts: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [f"--{name}" for name in names if getattr(opts, name) is not None]


def check_scheduler_options(opts: argparse.Namespace) -> None:
    """Refuse, in one line, a cluster option without its form and a combination the cluster decides itself."""
    slurm, kube = opts.slurm is not None, opts.kubernetes is not None
    if slurm and kube:
        raise UsageError("--slurm and --kubernetes each write one job: give one of them")
    form = "--slurm" if slurm else "--kubernetes"
    if not (slurm or kube):
        if stray := _given(opts, CLUSTER + SLURM_ONLY + KUBERNETES_ONLY):
            raise UsageError(f"{stray[0]} is an option of a cluster job: add --slurm [FILE] or --kubernetes [FILE], "
                             f"or leave {stray[0]} out")
        return
    if stray := _given(opts, KUBERNETES_ONLY if slurm else SLURM_ONLY):
        other = "--kubernetes" if slurm else "--slurm"
        raise UsageError(f"{stray[0]} is an option of {other}, not of {form}: leave it out")
    for name in CLUSTER + SLURM_ONLY + KUBERNETES_ONLY:  # an empty value was written as it was, or dropped
        if isinstance(value := getattr(opts, name), str) and not value.strip():
            raise UsageError(f"--{name} {value!r}: an empty value; give one, or leave --{name} out")
    if decided := _given(opts, ("machine_rank", "main_process_ip", "rdzv_id")):
        raise UsageError(f"{decided[0]}: with {form} the cluster decides each node's rank, and the rendezvous "
                         f"is the job's first node (c10d, named after the job): leave {decided[0]} out")
    if opts.num_machines is not None and ":" in str(opts.num_machines):
        raise UsageError(f"--num_machines {opts.num_machines}: a {form} job asks the cluster for a fixed number of "
                         f"nodes: give one number (an elastic range runs with 'shardtune launch' on each machine)")
    if opts.rdzv_backend not in (None, "c10d"):
        raise UsageError(f"--rdzv_backend {opts.rdzv_backend}: a {form} job always meets through c10d on its "
                         f"first node: leave --rdzv_backend out")
    if kube and not opts.image:
        raise UsageError("--kubernetes needs --image IMAGE: a container image with shardtune installed "
                         "(e.g. --image registry.example.com/team/shardtune:0.1)")
    if kube and opts.mount_path is not None:
        check_mount_path(opts)
    if kube:
        check_kube_names(opts)
    if opts.submit:
        if opts.dry_run:
            raise UsageError("--dry_run prints the job without writing it and --submit submits the written file: "
                             "give one of them")
        tool = "sbatch" if slurm else "kubectl"
        if shutil.which(tool) is None:
            raise UsageError(f"--submit runs {tool}, which is not on PATH here: leave --submit out and run "
                             f"'{submit_command(slurm, 'FILE')}' where {tool} is installed")


def check_mount_path(opts: argparse.Namespace) -> None:
    """``--mount_path`` says where ``--pvc`` goes: alone it would do nothing, and a relative one is refused by
    the container runtime only when the pods start (the job applied, its pods never running)."""
    if not opts.pvc:
        raise UsageError(f"--mount_path {opts.mount_path}: it is where --pvc CLAIM is mounted, and no --pvc is "
                         f"given: add --pvc CLAIM, or leave --mount_path out")
    if not opts.mount_path.startswith("/") or posixpath.normpath(opts.mount_path) == "/":
        raise UsageError(f"--mount_path {opts.mount_path}: the claim is mounted at a folder of the container from "
                         f"its root, not at the root itself: give an absolute path such as {DEFAULT_MOUNT_PATH}")


# Kubernetes' names (RFC 1123): a namespace is a label, a claim a subdomain (labels joined by dots).
KUBE_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
KUBE_NAMES = {"namespace": (re.compile(rf"^{KUBE_LABEL}$"), 63, "lower-case letters, digits and '-'"),
              "pvc": (re.compile(rf"^{KUBE_LABEL}(\.{KUBE_LABEL})*$"), 253, "lower-case letters, digits, '-' and '.'")}


def check_kube_names(opts: argparse.Namespace) -> None:
    """A namespace or claim name Kubernetes refuses: the claim's only when the operator makes the pods, which
    then never start, with the reason in the job's events alone."""
    for option, (pattern, longest, letters) in KUBE_NAMES.items():
        name = getattr(opts, option)
        if name is not None and (not pattern.match(name) or len(name) > longest):
            raise UsageError(f"--{option} {name}: not a name Kubernetes takes: {letters}, starting and ending "
                             f"with a letter or digit, at most {longest} characters; give it as 'kubectl get "
                             f"{'namespaces' if option == 'namespace' else 'pvc'}' lists it")


@dataclass(frozen=True)
class JobShape:
    """What both renderers need: the size of the job and how it stops and restarts."""

    name: str
    num_machines: int
    procs_per_node: int
    gpus_per_node: int  # 0: CPU processes, no GPU requested
    port: int
    port_given: bool  # by --main_process_port or the Accelerate file
    max_restarts: int
    grace_s: int
    cpus_per_task: int | None
    network_interface: str | None

    @property
    def num_processes(self) -> int:
        return self.num_machines * self.procs_per_node

    def describe(self, machines: str = "nodes") -> str:
        """``2 nodes x 8 GPUs, 16 processes``; one of a kind in the singular (``1 node x 1 GPU, 1 process``)."""
        def counted(n: int, things: str) -> str:  # things: a plural in -s, or -es after "ss"
            return f"{n} {things if n != 1 else things[:-2] if things.endswith('sses') else things[:-1]}"

        per_node = (counted(self.gpus_per_node, "GPUs") if self.gpus_per_node
                    else counted(self.procs_per_node, "CPU processes"))
        return f"{counted(self.num_machines, machines)} x {per_node}, {counted(self.num_processes, 'processes')}"


def job_shape(opts: argparse.Namespace) -> JobShape:
    """The job's shape from the launch options (the Accelerate file fills what they leave out), checked."""
    from shardtune.cli.launch_command import launch_size, option_picker

    pick = option_picker(opts)
    gpus = opts.gpus_per_node
    if gpus is not None and gpus < 0:
        raise UsageError(f"--gpus_per_node {gpus}: give 0 (CPU processes) or more")
    if pick("num_processes", None) is None and not gpus:
        raise UsageError("a cluster job needs its size: --gpus_per_node G (one process per GPU), or "
                         "--num_processes N (over all machines; with --gpus_per_node 0 for CPU processes)")
    num_machines, num_processes = launch_size(pick, default_per_machine=gpus)
    per_node = num_processes // num_machines
    if gpus is None:
        gpus = per_node
    elif gpus and gpus != per_node:
        raise UsageError(f"--gpus_per_node {gpus} but --num_processes {num_processes} over {num_machines} machines "
                         f"is {per_node} per node: shardtune runs one process per GPU; give one of the two")
    for name in ("grace_period", "cpus_per_task"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise UsageError(f"--{name} {getattr(opts, name)}: give 1 or more")
    return JobShape(name=opts.job_name or DEFAULT_JOB_NAME, num_machines=num_machines, procs_per_node=per_node,
                    gpus_per_node=gpus, port=pick.whole("main_process_port", DEFAULT_PORT, 1, 65535),
                    port_given=pick("main_process_port", None) is not None,
                    max_restarts=opts.max_restarts, grace_s=opts.grace_period or DEFAULT_GRACE_S,
                    cpus_per_task=opts.cpus_per_task, network_interface=opts.network_interface)


def python_words(opts: argparse.Namespace, default: str) -> list[str]:
    """The nodes' Python: ``--python`` split as the shell splits it, so that it may be a command that runs Python
    in a container (``apptainer exec --nv IMAGE python3``); the default (this Python's path) is one word."""
    if not opts.python:
        return [default]
    try:
        return shlex.split(opts.python)
    except ValueError as exc:  # an unclosed quote
        raise UsageError(f"--python {opts.python}: {exc}; quote a path with spaces inside it, e.g. "
                         f"--python \"'/path with spaces/python'\"") from None


class ShellExpr(str):
    """A word of a generated script that the shell expands (``$head_node``): written in double quotes."""


def shell_word(word: str) -> str:
    return f'"{word}"' if isinstance(word, ShellExpr) else shlex.quote(word)


def node_command(shape: JobShape, opts: argparse.Namespace, host: str, rdzv_id: str,
                 train_args: list[str], port: str | None = None) -> list[str]:
    """What every node runs after its Python: ``-m shardtune launch ... train ...``, a c10d rendezvous on
    ``host`` at ``port`` (default: the shape's). It is checked here by building the torchrun command that
    ``shardtune launch`` will build there (with the shape's port for one that the node's shell works out)."""
    from shardtune.cli.launch_command import launcher_parser, torchrun_command

    launch = ["--num_machines", str(shape.num_machines), "--num_processes", str(shape.num_processes)]
    if shape.num_machines > 1:
        launch += ["--rdzv_backend", "c10d", "--main_process_ip", host, "--main_process_port", str(shape.port),
                   "--rdzv_id", rdzv_id]
    elif opts.main_process_port is not None:  # one node asked for a port: torchrun's --master_port there, as by hand
        launch += ["--main_process_port", str(shape.port)]
    if opts.rdzv_conf is not None:  # refused below on one node, where no rendezvous is held
        launch += ["--rdzv_conf", opts.rdzv_conf]
    launch += ["--max_restarts", str(shape.max_restarts)]
    if opts.monitor_interval is not None:
        launch += ["--monitor_interval", str(opts.monitor_interval)]
    if opts.config_file:
        launch += ["--config_file", opts.config_file]
    torchrun_command(launcher_parser().parse_args(launch), train_args)
    if port is not None and shape.num_machines > 1:
        launch[launch.index("--main_process_port") + 1] = port
    return ["-m", "shardtune", "launch", *launch, "train", *train_args]


def node_train_config(opts: argparse.Namespace, shape: JobShape, train_args: list[str]) -> TrainConfig:
    """The config every node's ``shardtune train`` will read, checked here before it waits in a queue: keys and
    values only, for the model, data and checkpoint paths are the nodes' (they check them when they start), as the
    nodes see them (with the GPUs the job asks for, whatever this machine has)."""
    from shardtune.cli.common import LAUNCHER_KEYS, TRAIN_HELP
    from shardtune.config import load_train_config, raise_problems
    from shardtune.config.loading import repeated_cli_keys
    from shardtune.config.no_ops import job_gpus

    if any(a in TRAIN_HELP for a in train_args):
        raise UsageError("a cluster job runs training: ask 'shardtune train --help' for the train arguments")
    node_view = ["--num_processes", str(shape.num_processes), "--num_machines", str(shape.num_machines),
                 *(["--config_file", opts.config_file] if opts.config_file else []), *train_args]
    raise_problems(repeated_cli_keys(node_view, LAUNCHER_KEYS))
    with job_gpus(shape.gpus_per_node > 0):  # the nodes' GPUs, not this login node's
        return load_train_config(node_view)


def resumable_train_args(cfg: TrainConfig, train_args: list[str]) -> tuple[list[str], str]:
    """The train arguments with ``resume_from_checkpoint true`` added unless they set it; and a note, if any."""
    spec = cfg.checkpoint.resume_from_checkpoint
    if spec is None:
        return [*train_args, "--resume_from_checkpoint", "true"], ""
    from shardtune.train.layout import RESUME_NEWEST, RESUME_OFF

    if str(spec).lower() in RESUME_NEWEST:
        return train_args, ""
    if str(spec).lower() in RESUME_OFF:
        return train_args, (f"note: resume_from_checkpoint {spec}: a requeued or restarted job does not carry on, and "
                            f"its output_dir, holding the first run, is refused; leave the key out to resume")
    return train_args, (f"note: resume_from_checkpoint {spec}: a requeued or restarted job starts again from it; "
                        f"resume_from_checkpoint true carries on from the newest checkpoint instead")


SLURM_MAX_SIGNAL_S = 65535  # sbatch's bound on --signal's sig_time (man sbatch)
SLURM_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                        r"|(?:(?:(?P<h>\d+):)?(?P<m>\d+):)?(?P<mm>\d+))$")


def slurm_time_s(text: str) -> int | None:
    """Seconds of a Slurm time limit (``minutes``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``); None: unlimited."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = SLURM_TIME.match(text)
    if not m:
        raise UsageError(f"--time {text}: not a Slurm time limit; write minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                         f"D-HH:MM:SS (e.g. --time 2-00:00:00)")
    v = {k: int(x) for k, x in m.groupdict().items() if x is not None}
    if "d" in v:
        seconds = ((v["d"] * 24 + v["dh"]) * 60 + v.get("dm", 0)) * 60 + v.get("ds", 0)
    elif "m" not in v:  # a lone number is minutes
        seconds = v["mm"] * 60
    else:
        seconds = (v.get("h", 0) * 60 + v["m"]) * 60 + v["mm"]
    return seconds or None  # Slurm reads a limit of zero as no limit


def _directives(shape: JobShape, opts: argparse.Namespace) -> list[str]:
    """The ``#SBATCH`` lines."""
    lines = [f"--job-name={shape.name}", f"--nodes={shape.num_machines}", "--ntasks-per-node=1"]
    if shape.gpus_per_node:
        lines.append(f"--gres=gpu:{shape.gpus_per_node}")
    for flag, value in (("cpus-per-task", shape.cpus_per_task), ("time", opts.time),
                        ("partition", opts.partition), ("account", opts.account),
                        ("output", opts.output or "%x-%j.out"), ("error", opts.error)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    lines.append(f"--signal=TERM@{shape.grace_s}")
    if opts.requeue:
        lines += ["--requeue", "--open-mode=append"]
    return [f"#SBATCH {_directive(line)}" for line in lines]


def _directive(line: str) -> str:
    """One ``--flag=value`` for an ``#SBATCH`` line: sbatch reads a value with spaces in double quotes."""
    flag, _, value = line.partition("=")
    if any(c in value for c in '"\n'):
        raise UsageError(f"{flag} {value!r}: a Slurm directive cannot hold a double quote or a line break")
    return f'{flag}="{value}"' if any(c.isspace() for c in value) else line


def wrap_words(words: list[str], width: int = 100, indent: str = "    ") -> str:
    """Shell words joined into continued lines of at most ``width`` columns; an option keeps its value with it
    and 'train' starts a line of its own."""
    groups: list[str] = []
    i = 0
    while i < len(words):
        take = 2 if (words[i].startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("-")
                     and words[i + 1] != "train") else 1
        groups.append(" ".join(shell_word(w) for w in words[i:i + take]))
        i += take
    lines, line = [], ""
    for group in groups:
        if line and (len(indent) + len(line) + 1 + len(group) + 2 > width or group == "train"):
            lines.append(line)
            line = group
        else:
            line = f"{line} {group}" if line else group
    lines.append(line)
    return " \\\n".join(indent + text for text in lines)


SLURM_HEAD = ("#!/bin/bash\n"
              "# {describe}. Submit it with: sbatch {file}\n"
              "# Written by 'shardtune launch'. {meet}. On SIGTERM ({grace_s} s before the time limit, on preemption "
              "or scancel) the workers save a\n"
              "# verified checkpoint and exit 143; resume_from_checkpoint true makes a requeued or re-submitted job "
              "carry on.\n")

SLURM_BODY = """\
set -euo pipefail

{env}
{hosts}# Slurm signals this shell itself only when the whole job is cancelled or preempted (the time-limit warning
# goes to the nodes' launchers alone): it then waits while they save{leave_requeue}.
{trap}

srun {srun_options} \\
{command} &
launchers=$!
while :; do
    status=0
    wait "$launchers" || status=$?
    # A trapped signal ends 'wait' early: wait on while the launchers save.
    kill -0 "$launchers" 2>/dev/null || break
done
{requeue}exit "$status"
"""

SLURM_HOSTS = """\
# The first of the job's hosts (no pipe into head: scontrol could die of SIGPIPE under pipefail).
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${hosts%%$'\n'*}
"""

SLURM_PORT = f"""\
# The rendezvous port, this job's own: on a port another job's rendezvous holds on that node, torchrun would join
# that job's store without a word and fail when that job ends (--main_process_port P fixes one).
rdzv_port=$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))
"""
# Each of the script's two first lines of comment is its own: the wrapped lines of SLURM_HEAD.
MEET_ON_FIRST_NODE = "Each node runs 'shardtune launch' (torchrun) with a c10d rendezvous on the\n# job's first node"
ON_ONE_NODE = "The node runs 'shardtune launch' (torchrun), its processes meeting\n# on that node"

SLURM_REQUEUE = """\
if [ "$status" -eq 143 ] && [ "$stopping" -eq 0 ]; then
    # Stopped by the time-limit warning after a verified checkpoint: queue the job again to carry on from it.
    scontrol requeue "$SLURM_JOB_ID"
fi
"""


def sbatch_script(shape: JobShape, opts: argparse.Namespace, file: str, train_args: list[str]) -> str:
    """The sbatch script: one ``srun`` task per node, each running ``shardtune launch`` for its node."""
    if shape.grace_s > SLURM_MAX_SIGNAL_S:
        raise UsageError(f"--grace_period {shape.grace_s}: Slurm sends its signal at most {SLURM_MAX_SIGNAL_S} s "
                         f"before the time limit (sbatch refuses --signal=TERM@{shape.grace_s}): give "
                         f"--grace_period {SLURM_MAX_SIGNAL_S} or less")
    if opts.time and (limit := slurm_time_s(opts.time)) is not None and limit <= shape.grace_s:
        raise UsageError(f"--time {opts.time} leaves no training before the SIGTERM {shape.grace_s} s ahead of "
                         f"the limit (--grace_period): give a longer --time or a shorter --grace_period")
    own_port = shape.num_machines > 1 and not shape.port_given
    words = [*python_words(opts, sys.executable),
             *node_command(shape, opts, ShellExpr("$head_node"), ShellExpr("$SLURM_JOB_ID"), train_args,
                           port=ShellExpr("$rdzv_port") if own_port else None)]
    srun = [f"--nodes={shape.num_machines}", "--ntasks-per-node=1"]
    if shape.cpus_per_task:  # srun no longer inherits sbatch's --cpus-per-task (Slurm 22.05)
        srun.append(f"--cpus-per-task={shape.cpus_per_task}")
    head = SLURM_HEAD.format(describe=f"Slurm job '{shape.name}': {shape.describe()}", file=file,
                             grace_s=shape.grace_s, meet=MEET_ON_FIRST_NODE if shape.num_machines > 1 else ON_ONE_NODE)
    # One node needs no first node's name: torchrun meets on the node itself (--standalone, or --master_port).
    hosts = SLURM_HOSTS + (SLURM_PORT if own_port else "") + "\n" if shape.num_machines > 1 else ""
    env = ["PYTHONUNBUFFERED=1", *job_env(shape)]  # the training operator sets PYTHONUNBUFFERED in the pods
    body = SLURM_BODY.format(hosts=hosts, srun_options=" ".join(srun),
                             env="".join(f"export {shlex.quote(line)}\n" for line in env),
                             command=wrap_words(words), requeue=SLURM_REQUEUE if opts.requeue else "",
                             leave_requeue=", and leaves any requeue to Slurm" if opts.requeue else "",
                             trap="stopping=0\ntrap 'stopping=1' TERM" if opts.requeue else "trap 'true' TERM")
    return head + "\n".join(_directives(shape, opts)) + "\n" + body


def job_env(shape: JobShape) -> list[str]:
    """``NAME=value`` for the workers' environment, the same in both forms."""
    env = []
    if shape.cpus_per_task:  # the node's cores shared out among its processes
        env.append(f"OMP_NUM_THREADS={max(1, shape.cpus_per_task // shape.procs_per_node)}")
    if shape.network_interface:
        env += [f"NCCL_SOCKET_IFNAME={shape.network_interface}", f"GLOO_SOCKET_IFNAME={shape.network_interface}"]
    return env


def _container(shape: JobShape, opts: argparse.Namespace, train_args: list[str]) -> dict:
    """The one container of every pod, named and with the port the training operator looks for."""
    host = f"{shape.name}-worker-0"  # the operator's name for the first pod, and its service
    container: dict = {"name": KUBE_CONTAINER, "image": opts.image,
                       "command": [*python_words(opts, "python3"),
                                   *node_command(shape, opts, host, shape.name, train_args)],
                       "ports": [{"name": KUBE_PORT_NAME, "containerPort": shape.port}]}
    if env := job_env(shape):
        container["env"] = [dict(zip(("name", "value"), line.split("=", 1))) for line in env]
    if opts.pvc:
        container["workingDir"] = _mount_path(opts)
    resources: dict = {}
    if shape.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": shape.gpus_per_node}
    if shape.cpus_per_task:
        resources["requests"] = {"cpu": shape.cpus_per_task}
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if opts.pvc:
        container["volumeMounts"].append({"name": "shared", "mountPath": _mount_path(opts)})
    return container


KUBE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pytorchjob_manifest(shape: JobShape, opts: argparse.Namespace, train_args: list[str]) -> dict:
    """The PyTorchJob (kubeflow.org/v1): ``num_machines`` Worker pods meeting through c10d on worker 0."""
    longest = 63 - len(f"-worker-{shape.num_machines - 1}")  # pods and their services are NAME-worker-I
    if not KUBE_NAME.match(shape.name) or len(shape.name) > longest:
        raise UsageError(f"--job_name {shape.name}: a PyTorchJob name is lower-case letters, digits and '-', "
                         f"starts with a letter and has at most {longest} characters (e.g. --job_name llama-sft)")
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # the DataLoader's shared memory
    if opts.pvc:
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": opts.pvc}})
    pod = {"terminationGracePeriodSeconds": shape.grace_s, "containers": [_container(shape, opts, train_args)],
           "volumes": volumes}
    metadata = {"name": shape.name, **({"namespace": opts.namespace} if opts.namespace else {})}
    # ExitCode: 143 (stopped after a checkpoint) and other signals restart the pod, which resumes; 1 and 2 do not.
    worker = {"replicas": shape.num_machines, "restartPolicy": "ExitCode", "template": {"spec": pod}}
    elastic = {"rdzvBackend": "c10d", "minReplicas": shape.num_machines, "maxReplicas": shape.num_machines,
               "maxRestarts": shape.max_restarts}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
            "spec": {"nprocPerNode": str(shape.procs_per_node), "elasticPolicy": elastic,
                     "pytorchReplicaSpecs": {"Worker": worker}}}


def manifest_text(shape: JobShape, opts: argparse.Namespace, file: str, train_args: list[str],
                  output_dir: str | None) -> str:
    import yaml

    head = [f"# PyTorchJob '{shape.name}': {shape.describe('pods')}. Apply it with: kubectl apply -f {file}",
            "# Written by 'shardtune launch'. Each pod runs 'shardtune launch' (torchrun) with a c10d rendezvous on",
            f"# {shape.name}-worker-0. On SIGTERM the workers save a verified checkpoint within "
            f"terminationGracePeriodSeconds",
            "# and exit 143; the pod restarts and resume_from_checkpoint true carries on from it."]
    if output_dir and not opts.pvc:
        head.append(f"# output_dir {output_dir} is on each pod's own disk and goes with the pod: give --pvc CLAIM "
                    f"to share it.")
    body = yaml.safe_dump(pytorchjob_manifest(shape, opts, train_args), sort_keys=False, width=1000)
    return "\n".join(head) + "\n" + body


@dataclass(frozen=True)
class ClusterJob:
    """A rendered job: which form, the file it goes to, its text, and notes to print."""

    slurm: bool
    file: str
    text: str
    notes: list[str]


def render_cluster_job(opts: argparse.Namespace, train_args: list[str]) -> ClusterJob:
    """The sbatch script or PyTorchJob manifest for the launch options ``opts`` and ``train_args``."""
    slurm = opts.slurm is not None
    shape = job_shape(opts)
    file = (opts.slurm if slurm else opts.kubernetes) or f"{shape.name}.{'sbatch' if slurm else 'yaml'}"
    cfg = node_train_config(opts, shape, train_args)
    from shardtune.cli.launch_command import refuse_restarts_that_cannot_go_on

    if cfg.checkpoint.resume_from_checkpoint is not None:  # unset, the job adds resume_from_checkpoint true
        refuse_restarts_that_cannot_go_on(opts, cfg)  # as every node's launcher would, after the wait in the queue
    args, note = resumable_train_args(cfg, train_args)
    notes = [note] if note else []
    if slurm:
        if shape.cpus_per_task is None and shape.procs_per_node > 1:  # sbatch's default: 1 CPU per task
            notes.append(f"note: no --cpus_per_task: Slurm gives each node's task 1 CPU unless the cluster sets "
                         f"more (DefCpuPerGPU, whole nodes), and the node's {shape.procs_per_node} processes would "
                         f"share it: give --cpus_per_task C, the cores for all of them")
        return ClusterJob(True, file, sbatch_script(shape, opts, file, args), notes)
    output_dir = cfg.run.output_dir
    if output_dir and not opts.pvc:
        notes.append(f"note: output_dir {output_dir} is on each pod's own disk and goes with the pod: give --pvc "
                     f"CLAIM (a ReadWriteMany claim) to keep checkpoints for restarts")
    elif output_dir:
        check_output_dir_on_claim(opts, output_dir, train_args)
    return ClusterJob(False, file, manifest_text(shape, opts, file, args, output_dir), notes)


def _mount_path(opts: argparse.Namespace) -> str:
    """Where ``--pvc`` is mounted in every pod, and its working directory."""
    return opts.mount_path or DEFAULT_MOUNT_PATH


def check_output_dir_on_claim(opts: argparse.Namespace, output_dir: str, train_args: list[str]) -> None:
    """Refuse an ``output_dir`` that the pods would write outside the ``--pvc`` claim: on their own disk, its
    checkpoints go with the pod that wrote them, and a restarted pod has none to resume from."""
    from shardtune.config.loading import key_origins

    mount = posixpath.normpath(_mount_path(opts))
    in_pod = posixpath.normpath(posixpath.join(mount, output_dir))  # relative: under the working directory, the mount
    if PurePosixPath(in_pod).is_relative_to(mount):
        return
    where = key_origins(train_args).get("output_dir", "the train arguments")
    raise UsageError(f"{where}: output_dir {output_dir} is outside {mount}, where --pvc {opts.pvc} is mounted: its "
                     f"checkpoints would be on the pod's own disk and go with the pod; give an output_dir under "
                     f"{mount} (a relative one such as runs/NAME is kept there), or mount the claim above it "
                     f"(--mount_path)")


def check_log_folders(opts: argparse.Namespace) -> None:
    """Refuse an ``--output`` / ``--error`` whose folder is missing, or that names a folder itself: Slurm cannot
    open the log, and fails the job before its first line, writing no log at all. Relative paths are read from this
    folder, as sbatch reads them from the one it is run in; a folder written with a Slurm pattern (``%u``) cannot
    be checked here."""
    for flag, path in (("--output", opts.output), ("--error", opts.error)):
        if path and (path.endswith("/") or Path(path).is_dir()):
            raise UsageError(f"{flag} {path}: a folder, where Slurm writes the log to a file: give a file in it, "
                             f"e.g. {flag} {posixpath.join(path, '%x-%j.out')}")
        folder = Path(path).parent if path else None
        if folder is not None and "%" not in str(folder) and not folder.is_dir():
            raise UsageError(f"{flag} {path}: folder {folder} does not exist here, and Slurm would fail the job "
                             f"without writing any log: create it (mkdir -p {shlex.quote(str(folder))}) or give "
                             f"another path")


def submit_command(slurm: bool, file: str) -> str:
    return f"sbatch {shlex.quote(file)}" if slurm else f"kubectl apply -f {shlex.quote(file)}"


def print_notes(job: ClusterJob) -> None:
    for note in job.notes:
        print(note, file=sys.stderr)


def write_cluster_job(opts: argparse.Namespace, train_args: list[str]) -> int:
    """``shardtune launch --slurm/--kubernetes``: write the job (print it with --dry_run), submit with --submit."""
    from shardtune.files import with_digest, write_text

    job = render_cluster_job(opts, train_args)
    text = with_digest(job.text)  # edited, the job is its user's: a later launch leaves it alone
    if opts.dry_run:
        print_notes(job)
        print(text, end="")
        return 0
    from shardtune.cli.common import check_output_file

    option = "--slurm" if job.slurm else "--kubernetes"
    if not (folder := Path(job.file).parent).is_dir() and not folder.exists():
        raise UsageError(f"{option} {job.file}: folder {folder} does not exist; create it or give another path")
    check_output_file(job.file, option)
    if job.slurm:
        check_log_folders(opts)
    print_notes(job)  # after the checks: a refusal stays one line
    write_text(job.file, text)
    if job.slurm:
        Path(job.file).chmod(0o755)
    command = submit_command(job.slurm, job.file)
    if not opts.submit:
        print(f"shardtune launch: wrote {job.file}; submit it with: {command}")
        return 0
    print(f"shardtune launch: wrote {job.file}; running: {command}")
    return subprocess.run(shlex.split(command), check=False).returncode
