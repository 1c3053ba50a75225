"""``shardtune launch [launcher options] train ...``: start a training job on N processes and M machines.

``run`` reads the launcher options (``launch_command.py``: the options and the torchrun command they make) and
either runs torchrun's agent in this process (``run_torchrun``: a stop becomes one line and an exit code) or
writes the job for a cluster scheduler (``schedulers.py``). The workers' side of a stop is here too.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardtune.cli.launch_command import (DESCRIPTION, JOB, TORCHRUN, launcher_parser,
                                          refuse_restarts_that_cannot_go_on, torchrun_command, true_or_false)
from shardtune.errors import UsageError, closest

__all__ = ["JOB", "TORCHRUN", "launcher_parser", "run", "run_torchrun", "torchrun_command"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run 'train' under torchrun on N processes / M machines",
                       description=DESCRIPTION, add_help=False)
    p.set_defaults(func=None)


def _is_bool_word(text: str) -> bool:
    try:
        true_or_false(text)
    except argparse.ArgumentTypeError:
        return False
    return True


# Launcher options that take no value (--dry_run may take true/false); every other one takes one (or is written
# --option=value).
LAUNCHER_FLAGS = ("--dry_run", "--dry-run", "-h", "--help", "--submit", "--requeue")
OPTIONAL_VALUE = ("--slurm", "--kubernetes")  # a value (the job's file) or none
EXAMPLE = "'shardtune launch --num_processes 2 train --model_name_or_path M ...'"


def _command_at(argv: list[str]) -> int:
    """Where the command (train) stands: the first word that is neither a launcher option nor its value, so that an
    option's value spelled 'train' (--partition train, a Slurm partition) is read as the value it is."""
    start = 0
    while start < len(argv) and argv[start].startswith("-"):
        following = argv[start + 1] if start + 1 < len(argv) else None
        if argv[start] in LAUNCHER_FLAGS:
            start += 2 if following is not None and _is_bool_word(following) else 1
        elif argv[start] in OPTIONAL_VALUE:  # --slurm [FILE]: a file, unless the next word is an option or train
            start += 1 if following is None or following.startswith("-") or following == "train" else 2
        else:
            start += 1 if "=" in argv[start] else 2
    return start


def _no_train(argv: list[str]) -> UsageError:
    """The error for a launch line without 'train': a mistyped launcher option, or command, or no job at all."""
    start = _command_at(argv)
    # An unknown launcher option, or a bad value of one before a 'train' further on (--dry_run maybe train), is
    # reported first.
    launcher_parser().parse_args(argv[:argv.index("train", start) if "train" in argv[start:] else start])
    if start >= len(argv):
        return UsageError(f"nothing to launch: write the job after the launcher options, e.g. {EXAMPLE}")
    word = argv[start]
    if closest(word, ["train"]):
        return UsageError(f"unknown command '{word}'; did you mean 'train'? (e.g. {EXAMPLE})")
    return UsageError(f"unknown command '{word}': launch runs 'train' after its options, e.g. {EXAMPLE}")


def _refuse_launcher_keys_in_files(user_args: list[str], train_argv: list[str]) -> None:
    """The processes and machines a recipe or an Accelerate file after 'train' asks for, where the launcher starts
    others: the launcher's own values, written ahead of the user's arguments, would win without a word (a recipe
    of num_processes 2 ran one process). Refused, saying where the value goes."""
    from shardtune.config.loading import key_origins, load_given_values

    origins = key_origins(user_args)
    asked, started = load_given_values(user_args), load_given_values(train_argv)
    for key in ("num_processes", "num_machines"):
        origin = origins.get(key)
        if origin is None or "command line" in str(origin):  # two values on the line: refused as such later
            continue
        if asked[key] != started[key]:
            raise UsageError(f"{origin}: {key}={asked[key]}, but the launcher starts {started[key]}; give it to "
                             f"the launcher (shardtune launch --{key} {asked[key]} train ...), which decides what "
                             f"starts, or to start {started[key]} take {key} out of the file (a run's saved "
                             f"config.yaml records the {key} it ran on)")


def run(argv: list[str]) -> int:
    """Entry point of ``shardtune launch``."""
    split = _command_at(argv)
    if split >= len(argv) or argv[split] != "train":
        if any(a in ("-h", "--help") for a in argv):
            launcher_parser().print_help()
            return 0
        raise _no_train(argv)
    opts = launcher_parser().parse_args(argv[:split])
    from shardtune.cli.schedulers import check_scheduler_options, write_cluster_job

    check_scheduler_options(opts)
    if opts.slurm is not None or opts.kubernetes is not None:
        return write_cluster_job(opts, argv[split + 1:])
    cmd = torchrun_command(opts, argv[split + 1:])
    if not opts.dry_run:
        _refuse_unknown_host(opts)
    from shardtune.cli.common import LAUNCHER_KEYS, TRAIN_HELP, load_job_config
    from shardtune.hub import offline_unless_reachable

    job = next(i for i in range(len(cmd)) if cmd[i:i + len(JOB)] == JOB)
    train_argv = cmd[job + len(JOB):]  # what every rank's 'shardtune train' reads
    if not any(a in TRAIN_HELP for a in train_argv):
        _refuse_launcher_keys_in_files(argv[split + 1:], train_argv)
    if opts.dry_run:
        if not any(a in TRAIN_HELP for a in train_argv):
            from shardtune.config.loading import check_given_values

            # a bad value is refused in a dry run too, and a key given twice, and restarts the launch refuses;
            # missing paths are not
            refuse_restarts_that_cannot_go_on(opts, check_given_values(train_argv, LAUNCHER_KEYS))
        print(shlex.join(cmd))
        return 0
    if not any(a in TRAIN_HELP for a in train_argv):
        # Checked once here, as one line, rather than on every rank amid torchrun's output. Keys and values
        # only: neither the model nor the data is opened.
        cfg = load_job_config(train_argv)
        refuse_restarts_that_cannot_go_on(opts, cfg)
        # Decided once for every rank (they inherit the environment), before torchrun starts them.
        offline_unless_reachable(cfg.model.model_name_or_path, cfg.data.dataset_name)
    from shardtune.cli.launch_command import NOT_MET, meeting
    from shardtune.errors import EXIT_FAILED

    machines = meeting(opts)
    if machines is not None:  # torchrun says nothing while it waits (15 min by default)
        print(machines.announce(), file=sys.stderr, flush=True)
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    try:
        return run_torchrun(cmd[len(TORCHRUN):])
    except (RuntimeError, RendezvousTimeoutError) as exc:  # the agent's rendezvous, before any worker starts
        if "EADDRINUSE" in str(exc):
            raise _port_in_use(opts) from None
        if machines is None or not (isinstance(exc, RendezvousTimeoutError) or any(m in str(exc) for m in NOT_MET)):
            raise
        print(machines.not_met(exc), file=sys.stderr)
        return EXIT_FAILED


def _refuse_unknown_host(opts: argparse.Namespace) -> None:
    """A --main_process_ip that this machine cannot resolve (node-O for node-0): torch retried it in silence until
    the rendezvous timeout (15 minutes), then failed with a traceback."""
    import socket

    from shardtune.cli.launch_command import meeting, option_picker

    machines = meeting(opts)
    if machines is None:
        return
    try:
        socket.getaddrinfo(machines.ip, machines.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"{option_picker(opts).named('main_process_ip')}: this machine cannot resolve that host "
                         f"({exc.strerror}): give machine rank 0's IP address (e.g. 10.0.0.1), or a host name every "
                         f"machine resolves") from None


def _port_in_use(opts: argparse.Namespace) -> UsageError:
    """The rendezvous port given is taken on this machine (another job's rendezvous, or another program): torch's
    traceback said so only at its end."""
    from shardtune.cli.launch_command import option_picker

    pick = option_picker(opts)
    given = pick.named("main_process_port") if pick("main_process_port", None) is not None else \
        "--main_process_port 29500 (its default)"
    return UsageError(f"{given}: that port is already in use on this machine (another job's rendezvous, or another "
                      f"program): give a free one with --main_process_port (the same on every machine), or, on one "
                      f"machine, leave it out and a free port is picked")


# What carries a stopped run on, said where no checkpoint was saved for the stop.
RESUME_HINT = ("resume_from_checkpoint true carries on from the newest earlier checkpoint under "
               "output_dir/checkpoints, where there is one (else the run starts over)")
# Set by the launcher for its workers: its pid (they die with it) and where they report how a SIGTERM ended them.
LAUNCHER_PID = "SHARDTUNE_LAUNCHER_PID"
STOP_REPORT = "SHARDTUNE_STOP_REPORT"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """A worker of ``shardtune launch`` is killed when the launcher dies, even by SIGKILL (the kernel's parent-death
    signal): nothing trains on, unseen, holding GPUs and the output folder. Linux only; elsewhere nothing happens."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def report_stop(summary: dict | None, message: str) -> None:
    """How a SIGTERM ended this worker: for the launcher to say (each machine's first worker writes it), or, for
    ``shardtune train`` run on its own, printed on rank 0. ``summary`` None: it stopped before any checkpoint."""
    path = os.environ.get(STOP_REPORT)
    if not path:
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr)
        return
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    import json

    from shardtune.files import write_text

    report = {k: summary[k] for k in ("steps", "max_steps", "last_checkpoint")} if summary else {}
    write_text(path, json.dumps(report))


def report_finished(summary: dict) -> None:
    """A worker that finished its run tells the launcher (each machine's first worker does): a SIGTERM that reaches
    the launcher in the run's last moments (its export of final/), which the workers no longer answer with a
    checkpoint, then ends the launch as the finished run it is, not as a stop before any checkpoint."""
    path = os.environ.get(STOP_REPORT)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    import json

    from shardtune.files import write_text

    write_text(path, json.dumps({"finished": True, "steps": summary.get("steps"), "final": summary.get("final")}))


def _stopped_by_sigterm(report: str) -> int:
    """The launcher's line and exit code after SIGTERM, from what its workers reported."""
    import json

    from shardtune.errors import EXIT_FAILED, EXIT_PREEMPTED

    try:
        with open(report) as f:
            stop = json.load(f)
    except (OSError, ValueError):
        stop = {}
    if stop.get("finished"):
        print(f"shardtune launch: SIGTERM came after training finished ({stop['steps']} steps; "
              f"{stop['final'] or 'final/'} written): nothing to resume", file=sys.stderr)
        return 0
    if stop.get("last_checkpoint"):
        print(f"shardtune launch: stopped by SIGTERM at step {stop['steps']} of {stop['max_steps']}; checkpoint "
              f"{stop['last_checkpoint']} saved and verified: run the same command with resume_from_checkpoint "
              f"true to finish (exit code {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    print(f"shardtune launch: stopped by SIGTERM before the workers saved a checkpoint: no checkpoint was saved for "
          f"it; {RESUME_HINT}", file=sys.stderr)
    return EXIT_FAILED


def first_failure(failures: dict) -> tuple[int, Any]:
    """(rank, failure) that ended the job. torchrun stamps failures in whole seconds, so the rank that died and a
    survivor that then exited (its collective failed) can tie; its dict lists them in the order its agent saw them,
    which breaks the tie (a survivor waits for the agent to see the dead rank: ``dist.ended_ranks``), and a rank
    killed by a signal comes before an exit. SIGTERM is what the agent itself sends the others: such a death comes
    last."""
    first = min(f.timestamp for f in failures.values())
    tied = [(seen, rank, f) for seen, (rank, f) in enumerate(failures.items()) if f.timestamp == first]

    def cause_first(item: tuple[int, int, Any]) -> tuple[int, int]:
        code = item[2].exitcode
        return (2 if code == -signal.SIGTERM else 0 if code < 0 else 1), item[0]

    _, rank, failure = min(tied, key=cause_first)
    return rank, failure



# How long the launcher waits, after a SIGTERM, for its workers to finish their step and save; the scheduler's own
# grace (Slurm's --signal=TERM@S, Kubernetes' terminationGracePeriodSeconds) is what really bounds it.
SIGTERM_WAIT_S = 1800
# A SIGTERM this soon after the first is the same stop, delivered twice: on scancel or preemption Slurm signals
# every process of the job, the nodes' launchers and the batch step's srun, which forwards its own to them.
SIGTERM_REPEAT_S = 5.0


def _is_worker(pid: int, launcher: int) -> bool:
    """A process this launcher's agent started as a rank (not, say, a resource tracker it also started)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return f"{LAUNCHER_PID}={launcher}".encode() in env and any(v.startswith(b"LOCAL_RANK=") for v in env)


@contextmanager
def _sigterm_waits_for_the_save(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """torchrun's agent answers SIGTERM by passing it on and SIGKILLing the workers 30 s later, which cuts a large
    model's save short (a cluster job's grace is 300 s). That wait (its shutdown timeout) serves every stop, also
    that of the ranks left after one failed, which never reach a step's end: it cannot simply be made longer.
    So the launcher takes SIGTERM itself (Linux): it passes it on to its workers, waits until they have saved and
    ended (up to SIGTERM_WAIT_S; a second SIGTERM, SIGTERM_REPEAT_S after the first or later, ends the wait), then
    stops the agent as SIGTERM does. The agent is told to leave SIGTERM alone (``args.signals_to_handle``,
    torchrun's --signals_to_handle); yields the same list as an environment variable, where torch releases without
    that option read it."""
    import threading
    import time

    from torch.distributed.elastic.multiprocessing import SignalException

    from shardtune.dist import children, process_state

    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        yield {}
        return
    launcher, waiting = os.getpid(), []

    def stop(signum, frame) -> None:  # noqa: ARG001
        if waiting:  # a second SIGTERM: stop now, unless it is the first one again
            if time.monotonic() - waiting[0] < SIGTERM_REPEAT_S:
                return
            raise SignalException(f"Process {launcher} got signal: SIGTERM", sigval=signal.SIGTERM)
        waiting.append(time.monotonic())
        workers = [pid for pid in children(launcher) if _is_worker(pid, launcher)]
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + SIGTERM_WAIT_S
        while any(process_state(pid) == "running" for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        raise SignalException(f"Process {launcher} got signal: SIGTERM", sigval=signal.SIGTERM)

    handled = getattr(args, "signals_to_handle", None) or os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE",
                                                                         "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    handled = ",".join(name for name in handled.split(",") if name.strip() != "SIGTERM")
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = handled
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield {"TORCHELASTIC_SIGNALS_TO_HANDLE": handled}
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _stop_at_once_without_workers() -> Iterator[None]:
    """Ctrl-C or SIGTERM while no worker runs (the machines still meeting, which torch waits for inside one C++
    call that no Python signal handler interrupts: it ran on for the whole rendezvous timeout, 15 minutes) ends the
    launch at once, saying so: there is nothing to save. The signal's byte reaches a thread through the wakeup fd,
    which Python writes before any handler can run. Once the launcher has started a process (a worker, running,
    just forked, or ended and not yet reaped), its handlers answer every signal, as before: a SIGTERM while the
    workers start, or a second one after they saved and ended, gets the launcher's report, not this exit."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import select

    from shardtune.dist import children
    from shardtune.errors import EXIT_FAILED

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    launcher = os.getpid()

    def workers_began() -> bool:
        # Any child: the agent starts none before the machines meet, and a worker just forked has not yet the
        # environment that tells it a worker (_is_worker) until it execs.
        return bool(children(launcher))

    def watch() -> None:
        # Once a worker has begun, the launcher's own handlers answer every signal: a second SIGTERM after the
        # workers saved and ended must not cut the launcher's report short. Until then, looked at every 0.2 s.
        began = False
        while True:
            if not select.select([read_end], [], [], 0.2)[0]:
                began = began or workers_began()
                continue
            if not (signum := os.read(read_end, 1)):
                break
            began = began or workers_began()
            if began or signum[0] not in (signal.SIGINT, signal.SIGTERM):
                continue
            name = signal.Signals(signum[0]).name
            print(f"shardtune launch: stopped by {name} while no worker ran (waiting for the machines to meet): "
                  f"nothing was started or saved; {RESUME_HINT}", file=sys.stderr, flush=True)
            # as a stop with no checkpoint saved for it says: nothing new to resume from (Ctrl-C: its own code)
            os._exit(EXIT_FAILED if signum[0] == signal.SIGTERM else 128 + signum[0])
        os.close(read_end)

    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="shardtune-launch-signals", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_end)  # the watcher reads the pipe's end, closes it and returns


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun's agent in this process; a failed worker becomes one line and its exit code.

    The agent forwards SIGTERM to every worker (they save a checkpoint and exit) and restarts failed workers
    up to --max_restarts times. Workers print their own errors, so the agent's long report is cut to its gist.
    The workers die with this process, even when it is killed with SIGKILL.
    """
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from shardtune.dist import environment
    from shardtune.errors import EXIT_PREEMPTED

    args = get_args_parser().parse_args(torchrun_args)
    # torchrun sets OMP_NUM_THREADS=1 for every worker with a four-line banner; the cores this process may use (a
    # Slurm or container allocation, not the machine's count) shared out instead, and said by nothing (a value the
    # user set stays).
    per_node = max(1, int(args.nproc_per_node)) if str(args.nproc_per_node).isdigit() else 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none
    scratch = tempfile.mkdtemp(prefix="shardtune-launch-")
    report = os.path.join(scratch, "stop.json")
    workers = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, usable // per_node)),
               # Restarted workers sharing the agent's rendezvous store can read the previous attempt's addresses
               # and fail to connect (pytorch/pytorch#135712): give the workers their own store.
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
               STOP_REPORT: report, LAUNCHER_PID: str(os.getpid())}
    try:
        with _sigterm_waits_for_the_save(args) as agent, environment(workers | agent), \
                _stop_at_once_without_workers():
            torchrun(args)
    except ChildFailedError as exc:
        rank, failure = first_failure(exc.failures)
        code = failure.exitcode
        if code == EXIT_PREEMPTED and os.path.exists(report):  # the workers had the SIGTERM, not this process
            return _stopped_by_sigterm(report)
        if code < 0:
            what = f"was killed by signal {-code}"
            code = 128 - code
        else:
            what = f"exited with code {code}"
        print(f"shardtune launch: rank {rank} {what} (see its messages above)", file=sys.stderr)
        return code
    except SignalException as exc:
        # The agent has already passed the signal on and waited for the workers; on SIGTERM they save and stop,
        # on anything else (Ctrl-C) they stop where they are.
        if exc.sigval == signal.SIGTERM:
            return _stopped_by_sigterm(report)
        name = signal.Signals(int(exc.sigval)).name
        print(f"shardtune launch: interrupted ({name}); no checkpoint was saved for it: {RESUME_HINT}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0
