"""The launcher's options and the torchrun command they make: shared by ``shardtune launch``, which runs it
here, and by its cluster jobs (``schedulers.py``), whose nodes run ``shardtune launch`` with it."""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any, NamedTuple

from shardtune.errors import UsageError, check_choice

DESCRIPTION = """``shardtune launch [launcher options] train ...``: start a training job on N processes and M machines.

It runs torchrun (``python -m torch.distributed.run``), the launcher PyTorch users know, with the rendezvous
that the options or an Accelerate config file describe. Run the same command on every machine, changing only
``--machine_rank``. ``--max_restarts K`` restarts failed workers; with ``resume_from_checkpoint true`` they carry
on from the newest complete checkpoint. With ``--rdzv_backend c10d``, ``--num_machines MIN:MAX`` lets the job go on
with fewer machines when one is lost (or start with MIN), keeping the global batch (docs/clusters.md).
``--slurm [FILE]`` and ``--kubernetes [FILE]`` write the same job as an sbatch script or a Kubeflow PyTorchJob
instead (``--submit`` hands it to sbatch / kubectl).
"""

DEFAULT_GRACE_S = 300
DEFAULT_JOB_NAME = "shardtune"
DEFAULT_MOUNT_PATH = "/workspace"  # where --pvc is mounted in every pod, and its working directory


# Accelerate launch's flags that are keys of the job here: what to write after 'train' instead.
ACCELERATE_FLAGS = {"use_fsdp": "--distributed_type FSDP", "multi_gpu": "--distributed_type DDP",
                    "use_deepspeed": "--deepspeed ds_config.json (run as FSDP)",
                    "deepspeed_config_file": "--deepspeed ds_config.json (run as FSDP)",
                    "zero_stage": "--deepspeed ds_config.json (its zero_optimization.stage, run as FSDP), or "
                                  "--distributed_type FSDP with --fsdp_sharding_strategy SHARD_GRAD_OP (ZeRO-1/2) or "
                                  "FULL_SHARD (ZeRO-3)"}
# Accelerate launch's flags that the environment says here.
ACCELERATE_ENVIRONMENT = {"cpu": "to train on CPUs, hide the GPUs: CUDA_VISIBLE_DEVICES= shardtune launch ...",
                          "gpu_ids": "choose the GPUs with CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES=0,1 shardtune "
                                     "launch ...",
                          "num_cpu_threads_per_process": "set OMP_NUM_THREADS: OMP_NUM_THREADS=N shardtune launch ..."}


# torchrun's rendezvous options, spelled as Accelerate spells them here (shardtune launch runs torchrun with them).
TORCHRUN_OPTIONS = {
    "nproc_per_node": "that is torchrun's processes per machine, and here --num_processes counts those of all "
                      "machines (Accelerate's meaning): give --num_processes (per machine x machines)",
    "nnodes": "that is torchrun's machine count: give --num_machines (N, or MIN:MAX for an elastic job)",
    "node_rank": "that is torchrun's machine rank: give --machine_rank",
    "master_addr": "that is torchrun's rendezvous address: give --main_process_ip",
    "master_port": "that is torchrun's rendezvous port: give --main_process_port",
    "rdzv_endpoint": "that is torchrun's rendezvous address and port: give --main_process_ip and --main_process_port",
    "standalone": "that is torchrun's single-machine rendezvous, the default here: leave it out",
}


def _train_key_placement(name: str) -> str | None:
    """Where an option ``shardtune launch`` does not take goes: torchrun's own under Accelerate's names, the job's
    after 'train'."""
    from shardtune.config.compile import DYNAMO_KEYS
    from shardtune.config.no_ops import NO_OPS
    from shardtune.config.schema import ALIASES, all_keys

    key = name.replace("-", "_")
    if key in TORCHRUN_OPTIONS:
        return TORCHRUN_OPTIONS[key]
    if key in ACCELERATE_FLAGS:
        return f"here the job says so after 'train': {ACCELERATE_FLAGS[key]}"
    if key in ACCELERATE_ENVIRONMENT:
        return ACCELERATE_ENVIRONMENT[key]
    if key in ALIASES or key in DYNAMO_KEYS or key in NO_OPS or any(d.name == key for d in all_keys()):
        return f"it is a key of the job: write it after 'train' (shardtune launch ... train --{key} VALUE)"
    return None


def launcher_parser() -> argparse.ArgumentParser:
    from shardtune.cli.common import OneLineParser

    p = OneLineParser(prog="shardtune launch", description=DESCRIPTION)
    p.placed_elsewhere = _train_key_placement
    p.add_argument("--config_file", "--config-file", default=None,
                   help="an Accelerate config file (num_processes, num_machines, distributed_type, fsdp_config...)")
    p.add_argument("--num_processes", "--num-processes", type=int, default=None,
                   help="processes in all, over all machines (Accelerate's meaning); default: the config "
                        "file's, else the GPUs of this machine, else 1")
    p.add_argument("--num_machines", "--num-machines", default=None, metavar="N|MIN:MAX",
                   help="machines in the job; MIN:MAX (with --rdzv_backend c10d): an elastic job that runs on "
                        "any number of machines in that range")
    p.add_argument("--machine_rank", "--machine-rank", type=int, default=None)
    p.add_argument("--main_process_ip", "--main-process-ip", default=None)
    p.add_argument("--main_process_port", "--main-process-port", type=int, default=None,
                   help="the rendezvous port on machine rank 0 (default 29500; on one machine a free one; a --slurm "
                        "job of several nodes: 20000 + its job ID mod 10000)")
    p.add_argument("--rdzv_backend", "--rdzv-backend", default=None, help="static (default) or c10d")
    p.add_argument("--rdzv_id", "--rdzv-id", default=None,
                   help="c10d only: the job's rendezvous id, the same on every machine (torchrun's --rdzv_id)")
    p.add_argument("--rdzv_conf", "--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="torchrun's rendezvous settings, in seconds: " + ", ".join(RDZV_CONF_KEYS) +
                        " (the static rendezvous takes join_timeout alone: how long the machines wait for each "
                        "other, 900 s by default; c10d's is 600 s)")
    p.add_argument("--max_restarts", "--max-restarts", type=int, default=0)
    p.add_argument("--monitor_interval", type=float, default=None)
    p.add_argument("--dry_run", "--dry-run", nargs="?", const=True, default=False, type=true_or_false,
                   metavar="BOOL", help="print the torchrun command and exit (also --dry_run true, as train takes it)")
    add_scheduler_options(p)
    return p


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
JOB = ["-m", "shardtune", "train"]  # what torchrun starts on every rank


class LauncherOptions:
    """``pick(name, default)``: the launcher option ``name``, else the Accelerate file's value, else ``default``;
    ``named(name)`` says where a value came from, for a message about it."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.file_values: dict = {}
        if opts.config_file:
            from shardtune.config import read_accelerate_config

            self.file_values, _ = read_accelerate_config(opts.config_file)

    def __call__(self, name: str, default: Any) -> Any:
        value = getattr(self.opts, name)
        return value if value is not None else self.file_values.get(name, default)

    def named(self, name: str) -> str:
        if getattr(self.opts, name) is not None or name not in self.file_values:
            return f"--{name} {self(name, None)}"
        return f"{self.opts.config_file}: {name} {self.file_values[name]}"

    def whole(self, name: str, default: int | None, low: int, high: int | None = None, fix: str = "") -> int | None:
        """The option as a whole number in [low, high], or a UsageError naming it, where it was set and the range."""
        value = self(name, default)
        if value is None:
            return None
        text = str(value).strip()
        number = int(text) if text.lstrip("-").isdigit() else None
        if number is None or number < low or (high is not None and number > high):
            bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise UsageError(f"{self.named(name)}: give a whole number {bounds}{fix}")
        return number

    def host(self, name: str) -> str | None:
        """A host option (--main_process_ip) as given, refused when it cannot be a host name or address."""
        value = self(name, None)
        if value is not None and not HOST.match(str(value)):
            raise UsageError(f"{self.named(name)}: not a host name or IP address; give the address of machine rank "
                             f"0, e.g. 10.0.0.1 or node-0")
        return None if value is None else str(value)


def option_picker(opts: argparse.Namespace) -> LauncherOptions:
    """The launcher's options, with the Accelerate file filling what they leave out."""
    return LauncherOptions(opts)


class MachineRange(NamedTuple):
    """How many machines the job runs on: ``min == max`` for a fixed size, else an elastic range."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:  # torchrun's --nnodes
        return f"{self.min}:{self.max}" if self.elastic else str(self.max)


def machine_range(value: Any) -> MachineRange:
    """``--num_machines`` as given: a count ``N`` or an elastic range ``MIN:MAX`` (torchrun's ``--nnodes``)."""
    text = str(value).strip()
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"--num_machines {text}: give a number of machines N, or a range MIN:MAX such as 1:2 "
                         "(with --rdzv_backend c10d)")
    low, high = int(parts[0]), int(parts[-1])
    if len(parts) == 1 and low < 1:  # a count, not a range: no MIN:MAX to speak of
        raise UsageError(f"--num_machines {text}: a job runs on 1 machine or more: give --num_machines 1 or more")
    if low < 1 or high < low:
        raise UsageError(f"--num_machines {text}: the range MIN:MAX needs 1 <= MIN <= MAX, e.g. 1:2")
    return MachineRange(low, high)


def launch_size(pick: LauncherOptions, default_per_machine: int | None = None) -> tuple[int, int]:
    """(num_machines, num_processes) of the job, checked; processes default to ``default_per_machine`` per
    machine, else this machine's GPUs (at least 1). An elastic range counts its largest size."""
    num_machines = machine_range(pick("num_machines", 1)).max
    num_processes = pick.whole("num_processes", None, 1)
    if num_processes is None:
        per_machine = max(1, _local_gpus()) if default_per_machine is None else default_per_machine
        num_processes = num_machines * per_machine
    if num_processes < 1:
        raise UsageError("--num_processes and --num_machines must be at least 1")
    if num_processes % num_machines:
        raise UsageError(f"--num_processes {num_processes} is the total over all machines and must be a multiple "
                         f"of --num_machines {num_machines}")
    return num_machines, num_processes


def torchrun_command(opts: argparse.Namespace, train_args: list[str]) -> list[str]:
    """The torchrun command line for ``opts``; the Accelerate file fills what the options leave out."""
    pick = option_picker(opts)
    num_machines, num_processes = launch_size(pick)
    machines = machine_range(pick("num_machines", 1))
    check_agent_options(opts)
    cmd = TORCHRUN + ["--nnodes", str(machines),
           "--nproc_per_node", str(num_processes // num_machines), "--max_restarts", str(opts.max_restarts)]
    if opts.monitor_interval is not None:
        cmd += ["--monitor_interval", str(opts.monitor_interval)]
    rdzv = check_choice(str(pick("rdzv_backend", "static")), RDZV_BACKENDS, "--rdzv_backend")
    port = pick.whole("main_process_port", None, 1, 65535, fix=" (the TCP port of machine rank 0; default 29500)")
    others = "1" if num_machines == 2 else f"1 to {num_machines - 1}"
    rank = pick.whole("machine_rank", None, 0, num_machines - 1,
                      fix=f" (--num_machines {num_machines}: 0 on the main machine, then {others})")
    if machines.elastic and rdzv != "c10d":
        raise UsageError(f"--num_machines {machines} is an elastic range: add --rdzv_backend c10d (a static "
                         f"rendezvous waits for a fixed number of machines), or give one number")
    if opts.rdzv_conf is not None and num_machines < 2:
        raise UsageError(f"--rdzv_conf {opts.rdzv_conf} configures the rendezvous of several machines: add "
                         f"--num_machines 2 or more, or leave --rdzv_conf out")
    if opts.rdzv_id and not (num_machines > 1 and rdzv == "c10d"):
        raise UsageError(f"--rdzv_id {opts.rdzv_id} names a c10d rendezvous of several machines: add "
                         f"--rdzv_backend c10d and --num_machines 2 or more, or leave --rdzv_id out")
    ip = pick.host("main_process_ip")
    if num_machines > 1:
        if not ip:
            raise UsageError("multi-machine launch needs --main_process_ip (the address of machine rank 0) and "
                             "--main_process_port")
        port = port or 29500
        if rdzv == "c10d":
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{ip}:{port}"]
            if opts.rdzv_id:
                cmd += ["--rdzv_id", opts.rdzv_id]
            if opts.rdzv_conf is not None:
                cmd += ["--rdzv_conf", rdzv_conf(opts.rdzv_conf)]
        else:
            if rank is None:
                raise UsageError("multi-machine launch needs --machine_rank (0 on the main machine, then 1, 2, ...)")
            cmd += ["--node_rank", str(rank), "--master_addr", str(ip), "--master_port", str(port)]
            if opts.rdzv_conf is not None:
                cmd += ["--rdzv_conf", f"timeout={join_timeout(opts.rdzv_conf, static=True)}"]
    elif port:
        cmd += ["--master_addr", str(ip or "127.0.0.1"), "--master_port", str(port)]
    else:
        cmd += ["--standalone"]
    cmd += JOB
    if opts.config_file:
        cmd += ["--config_file", opts.config_file]
    cmd += ["--num_processes", str(num_processes), "--num_machines", str(num_machines)]
    return cmd + train_args


RDZV_BACKENDS = ("static", "c10d")  # what shardtune starts torchrun with (etcd needs a server of its own)
# A host name or an IPv4/IPv6 address: letters, digits, dots, dashes, colons (no spaces, no URL); or a shell variable
# that a cluster job's script expands on each node ("$head_node").
HOST = re.compile(r"^[A-Za-z0-9_.:%-]+$|^\[[0-9A-Fa-f:.%]+\]$|^\$\{?\w+\}?$")


def check_agent_options(opts: argparse.Namespace) -> None:
    """torchrun's own numbers, refused in one line where torchrun would stop with an AssertionError."""
    if opts.max_restarts < 0:
        raise UsageError(f"--max_restarts {opts.max_restarts}: give 0 (no restart) or more")
    interval = opts.monitor_interval
    if interval is not None and not (math.isfinite(interval) and interval > 0):
        raise UsageError(f"--monitor_interval {interval}: give a number of seconds above 0 (torchrun's default is "
                         f"0.1)")


# torchrun's c10d rendezvous settings (torch.distributed.elastic.rendezvous.dynamic_rendezvous), all in seconds:
# join_timeout (wait for MIN machines), last_call_timeout (then for more, up to MAX), close_timeout, and
# keep_alive_interval x keep_alive_max_attempt (how soon a lost machine is dropped from the next round), and the
# store's read_timeout.
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval",
                  "keep_alive_max_attempt", "read_timeout")


def rdzv_conf(text: str) -> str:
    """``--rdzv_conf`` checked: known keys with whole positive values; torchrun would ignore a mistyped key."""
    from shardtune.errors import closest

    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if key not in RDZV_CONF_KEYS:
            near = closest(key, list(RDZV_CONF_KEYS))
            hint = f"did you mean {near}? " if near else ""
            raise UsageError(f"--rdzv_conf: unknown setting {key!r}; {hint}known: {', '.join(RDZV_CONF_KEYS)}")
        if not sep or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--rdzv_conf {key}={value}: give a whole number of seconds (or attempts), 1 or more, "
                             f"e.g. {key}=30")
    return ",".join(item.replace(" ", "") for item in text.split(","))


# How long torchrun waits for the machines to meet, unless --rdzv_conf join_timeout says: its static rendezvous
# (torch.distributed.launcher.api's default timeout) and its c10d one (dynamic_rendezvous's join_timeout).
JOIN_TIMEOUT_S = {"static": 900, "c10d": 600}


def join_timeout(text: str | None, *, static: bool) -> int | None:
    """``--rdzv_conf``'s join_timeout (checked), or None where it gives none. The static rendezvous has no other
    setting: another key is refused there, naming the c10d rendezvous that takes it."""
    if text is None:
        return None
    settings = dict(item.split("=", 1) for item in rdzv_conf(text).split(","))
    others = [key for key in settings if key != "join_timeout"]
    if static and others:
        raise UsageError(f"--rdzv_conf {others[0]}={settings[others[0]]}: the static rendezvous (the default) takes "
                         f"join_timeout alone; {others[0]} is a c10d setting: add --rdzv_backend c10d, or leave it out")
    return int(settings["join_timeout"]) if "join_timeout" in settings else None


class Meeting(NamedTuple):
    """Where and how long the machines of a job of several wait for each other: what a launcher says it waits
    for, and what to check when they never met."""

    machines: MachineRange
    rank: int | None  # None under c10d, where the rendezvous hands out the machine ranks
    ip: str
    port: int
    timeout_s: int

    def announce(self) -> str:
        where = f"{self.ip}:{self.port}"
        if self.rank == 0:
            others = "1" if self.machines.max == 2 else f"1 to {self.machines.max - 1}"
            return (f"shardtune launch: machine rank 0 of {self.machines}: waiting up to {self.timeout_s} s for the "
                    f"other machines to join on {where} (the same command there, with --machine_rank {others})")
        me = "a machine" if self.rank is None else f"machine rank {self.rank}"
        return (f"shardtune launch: {me} of {self.machines}: joining the job's rendezvous on {where}, waiting up to "
                f"{self.timeout_s} s for the other machines")

    def not_met(self, exc: BaseException) -> str:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        ranks = "" if self.rank is None else f" and its own --machine_rank from 0 to {self.machines.max - 1}"
        return (f"shardtune launch: the machines did not meet within {self.timeout_s} s on {self.ip}:{self.port} "
                f"({first}): check that every machine runs the same command, with --num_machines {self.machines}, "
                f"--main_process_ip {self.ip} (machine rank 0's address, reachable from the others) and "
                f"--main_process_port {self.port} (open in machine rank 0's firewall){ranks}; "
                f"--rdzv_conf join_timeout=SECONDS waits longer")


# What torch's static rendezvous raises when the machines never met: the store's server, no client joined; a
# client, the server never answered (c10d's raises RendezvousTimeoutError).
NOT_MET = ("waiting for clients", "while trying to connect to")


def meeting(opts: argparse.Namespace) -> Meeting | None:
    """The rendezvous this launcher waits in, for a job of several machines (None on one); the options have been
    checked (``torchrun_command``)."""
    pick = option_picker(opts)
    machines = machine_range(pick("num_machines", 1))
    if machines.max < 2:
        return None
    backend = str(pick("rdzv_backend", "static"))
    rank = None if backend == "c10d" else int(pick("machine_rank", 0))
    timeout_s = join_timeout(opts.rdzv_conf, static=backend != "c10d") or JOIN_TIMEOUT_S[backend]
    return Meeting(machines, rank, str(pick("main_process_ip", "")), int(pick("main_process_port", 29500)),
                   timeout_s)


def true_or_false(text: str) -> bool:
    """--dry_run's optional value, read as train reads its booleans."""
    from shardtune.config import parse_bool

    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None



def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA means CPU processes
        return 0


# Which options belong to which form; each is refused, named, where it would change nothing.
SLURM_ONLY = ("time", "partition", "account", "output", "error", "requeue")
KUBERNETES_ONLY = ("image", "namespace", "pvc", "mount_path")
CLUSTER = ("submit", "job_name", "gpus_per_node", "cpus_per_task", "grace_period", "python", "network_interface")


def add_scheduler_options(p: argparse.ArgumentParser) -> None:
    """The launcher's cluster-job options, in the words Slurm and Kubernetes users know."""
    g = p.add_argument_group("cluster jobs (instead of starting torchrun here)")
    g.add_argument("--slurm", nargs="?", const="", default=None, metavar="FILE",
                   help="write an sbatch script for the job (default FILE: JOB_NAME.sbatch)")
    g.add_argument("--kubernetes", nargs="?", const="", default=None, metavar="FILE",
                   help="write a Kubeflow PyTorchJob manifest for the job (default FILE: JOB_NAME.yaml)")
    g.add_argument("--submit", action="store_true", default=None,
                   help="then submit it: sbatch FILE / kubectl apply -f FILE")
    g.add_argument("--job_name", "--job-name", default=None, help=f"default: {DEFAULT_JOB_NAME}")
    g.add_argument("--gpus_per_node", "--gpus-per-node", type=int, default=None,
                   help="GPUs per node, one process each (default: --num_processes / --num_machines); 0: CPU only")
    g.add_argument("--cpus_per_task", "--cpus-per-task", type=int, default=None,
                   help="CPU cores per node (Slurm --cpus-per-task; Kubernetes cpu request)")
    g.add_argument("--grace_period", "--grace-period", type=int, default=None, metavar="SECONDS",
                   help="time to save a checkpoint after SIGTERM: Slurm --signal=TERM@SECONDS before the time limit, "
                        f"Kubernetes terminationGracePeriodSeconds (default {DEFAULT_GRACE_S})")
    g.add_argument("--python", default=None,
                   help="the nodes' Python with shardtune installed, or a command that runs it, split as the shell "
                        "splits it (apptainer exec --nv IMAGE python3); default: this one for Slurm, python3 in the "
                        "image for Kubernetes")
    g.add_argument("--network_interface", "--network-interface", default=None, metavar="IFACE",
                   help="the interface the nodes talk over (NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    g.add_argument("--time", default=None, help="Slurm time limit (minutes, HH:MM:SS, D-HH:MM, ...)")
    g.add_argument("--partition", default=None, help="Slurm partition")
    g.add_argument("--account", default=None, help="Slurm account")
    g.add_argument("--output", default=None, help="Slurm output file pattern (default: %%x-%%j.out)")
    g.add_argument("--error", default=None, help="Slurm error file pattern (default: with the output)")
    g.add_argument("--requeue", action="store_true", default=None,
                   help="Slurm: requeue on preemption, and after a stop at the time limit (it resumes)")
    g.add_argument("--image", default=None, help="Kubernetes: the container image with shardtune (required)")
    g.add_argument("--namespace", default=None, help="Kubernetes namespace")
    g.add_argument("--pvc", default=None, metavar="CLAIM",
                   help="Kubernetes: a ReadWriteMany PersistentVolumeClaim mounted on every pod as the working "
                        "directory, so output_dir and its checkpoints outlive the pods")
    g.add_argument("--mount_path", "--mount-path", default=None,
                   help=f"where --pvc is mounted (default {DEFAULT_MOUNT_PATH})")


def refuse_restarts_that_cannot_go_on(opts: argparse.Namespace, cfg: Any) -> None:
    """``--max_restarts`` without ``resume_from_checkpoint``: the restarted workers find the failed attempt's
    checkpoints and metrics in output_dir and refuse them as an earlier run, so every restart ended in exit 2
    (bad input) after the real failure. ``overwrite_output_dir true`` (start afresh each time) is left to act."""
    from shardtune.train.layout import RESUME_OFF

    resume = str(cfg.checkpoint.resume_from_checkpoint or "").lower()
    if opts.max_restarts > 0 and resume in RESUME_OFF and not cfg.run.overwrite_output_dir:
        raise UsageError(f"--max_restarts {opts.max_restarts}: a restarted worker finds this run's own checkpoints "
                         f"in output_dir and, without resume_from_checkpoint, refuses them as an earlier run: add "
                         f"--resume_from_checkpoint true after 'train' (a restart then carries on from the newest "
                         f"complete checkpoint), or leave --max_restarts out")
