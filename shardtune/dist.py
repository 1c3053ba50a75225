"""The process group: who am I, on which device, and reductions that also work on one process."""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardtune.errors import UsageError, first_line

T = TypeVar("T")


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment while in here, and what was there put back after: a caller that
    goes on in this process (a notebook, a test) finds it as it was (``launch``'s workers' variables, a run's
    ``full_determinism`` settings)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job (torchrun's environment variables, or a single process)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


# What torchrun sets for each process it starts (``shardtune launch`` runs it); a process group of several needs the
# rendezvous address too.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


def launch_environment_problem() -> str | None:
    """What is wrong with torchrun's variables in this environment, where some of them are set but they describe no
    job (a RANK exported in the shell, a launch script that sets half of them); None where none is set, or where
    they describe one. torch found it only deep in a run, in a traceback (RANK=1 alone trained as rank 1 of 1
    until the sampler refused it)."""
    given = {name: os.environ[name] for name in RANK_VARIABLES if name in os.environ}
    if not given:
        return None
    numbers = {name: int(value) for name, value in given.items() if value.strip().isdigit()}
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in given]
    if len(numbers) < len(given):
        problem = " and ".join(f"{name}={value!r}" for name, value in given.items() if name not in numbers) + \
            " is not a whole number"
    elif missing:
        problem = f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not"
    elif not numbers["RANK"] < numbers["WORLD_SIZE"]:
        problem = f"RANK={numbers['RANK']} is not below WORLD_SIZE={numbers['WORLD_SIZE']}"
    elif numbers["WORLD_SIZE"] > 1 and (missing := [name for name in RENDEZVOUS_VARIABLES if not os.environ.get(name)]):
        problem = f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not"
    else:
        return None
    shown = ", ".join(f"{name}={value}" for name, value in given.items())
    return (f"the environment sets {shown}, but {problem}: these are torchrun's variables, which shardtune launch "
            f"sets for each process it starts ({', '.join(RANK_VARIABLES + RENDEZVOUS_VARIABLES)}); run shardtune "
            f"launch --num_processes N train ..., or unset {' '.join(given)} to train on one process")


def init_distributed(timeout_s: int, *, group_for_one: bool = False) -> DistInfo:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); a lone process joins nothing.

    The timeout bounds every collective, so a rank that hangs stops the job with an error naming the operation
    instead of waiting forever. Work that may legitimately take long (tokenisation) must not sit inside a
    collective: the data pipeline waits on its own group. ``group_for_one`` makes a one-process group when
    nothing launched us, for FSDP on a single device (e.g. to offload parameters to the CPU).
    """
    if problem := launch_environment_problem():
        raise UsageError(problem)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # On CUDA, NCCL for CUDA tensors and gloo for CPU ones: FSDP's CPU offload reduces the gradient norm of CPU
    # shards, and object collectives (checkpoint and export gathers) then travel through host memory, not
    # through a GPU buffer the size of what is gathered.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    elif group_for_one and not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, local_rank, local_world_size, device)


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small vector over all ranks in float64 (exact for token counts); identity on one process."""
    tensor = values.to(device=device, dtype=torch.float64) if isinstance(values, torch.Tensor) else \
        torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


class RankFailed(RuntimeError):
    """Work one rank did for the others failed there; raised on the other ranks, naming it, the work and the cause.

    ``interrupted``: that rank was stopped (KeyboardInterrupt, SystemExit), nothing is wrong with disk or input.
    """

    def __init__(self, rank: int, what: str, kind: str, message: str, interrupted: bool = False) -> None:
        cause = f"{kind}: {first_line(message)}" if message.strip() else kind  # KeyboardInterrupt has no message
        super().__init__(f"rank {rank} failed {what}: {cause}")
        self.rank, self.kind, self.message, self.interrupted = rank, kind, message, interrupted


def run_and_share(work: Callable[[], T], *, runs: bool, what: str, group: Any = None,
                  on_failure: Callable[[], None] | None = None) -> list[T | None]:
    """Run ``work`` on the ranks where ``runs`` is true, then tell every rank how it went, before anyone goes on.

    Without this, the ranks that wait for a file rank 0 writes learn of its failure only at their next collective,
    which fails without the cause, or waits until ``ddp_timeout`` (30 min by default) where the backend does not
    notice that rank 0 left. A rank whose ``work`` raised re-raises its own error, also a KeyboardInterrupt or
    SystemExit (Ctrl-C on that rank alone stays Ctrl-C there); every other rank raises ``RankFailed`` naming the
    first rank that failed. ``on_failure`` runs on every rank before that, once all of them know (so no rank
    still writes), to remove what was half-written. Returns every rank's result (None where ``work`` did not
    run), gathered, so keep it small (a path). It is a collective: every rank of ``group`` must call it. On one
    process it is just ``work()``.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        try:
            return [work() if runs else None]
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise
    # (result, error type, error message, interrupted: the error was no Exception, e.g. KeyboardInterrupt)
    status: tuple[T | None, str, str, bool] | None = None
    error = None
    if runs:
        try:
            status = (work(), "", "", False)
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, even of Ctrl-C; re-raised below
            status, error = (None, type(exc).__name__, str(exc), not isinstance(exc, Exception)), exc
    statuses: list[tuple[T | None, str, str, bool] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, status, group=group)
    failed = [(rank, other) for rank, other in enumerate(statuses) if other is not None and other[1]]
    if failed and on_failure is not None:
        on_failure()
    if error is not None:
        raise error
    if failed:
        rank, (_, kind, message, interrupted) = failed[0]
        raise RankFailed(rank, what, kind, message, interrupted)
    return [other[0] if other is not None else None for other in statuses]


# What a collective raises once a peer's process has ended: gloo's connection to it closed or reset, NCCL's
# communicator torn down. (A collective that times out says so instead; a failure shared by run_and_share is a
# RankFailed.)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "communicator was aborted")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a collective, says that a peer's process is gone."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, RankFailed) and \
        any(mark in str(exc) for mark in PEER_GONE)


def process_table(info: DistInfo) -> list[tuple[str, int]]:
    """(host, pid) of every rank, gathered once at the start: when a collective fails because a rank is gone,
    the others can tell which one. A collective; ``[]`` on one process."""
    if not info.distributed:
        return []
    table: list[Any] = [None] * info.world_size
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    return [tuple(entry) for entry in table]


def _differing(mine: dict[str, Any], info: DistInfo) -> tuple[list[str], str]:
    """The keys of ``mine`` whose value differs between ranks, and the first four of them in words, each with every
    rank's value ("" where all agree). A collective."""
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine)
    differing = [key for key in mine if any(other.get(key) != mine[key] for other in every)]
    if not differing:
        return [], ""

    def values(key: str) -> str:
        by_value: dict[str, list[int]] = {}
        for rank, other in enumerate(every):
            by_value.setdefault(repr(other.get(key)), []).append(rank)
        return " / ".join(f"{value} (rank {', '.join(map(str, ranks))})" for value, ranks in by_value.items())

    more = f"; and {len(differing) - 4} more" if len(differing) > 4 else ""
    return differing, "; ".join(f"{key} {values(key)}" for key in differing[:4]) + more


def refuse_other_settings(settings: dict[str, Any], info: DistInfo, *, may_differ: tuple[str, ...] = ()) -> None:
    """Every rank must run with the same ``settings`` (the resolved training keys): machines started with other
    arguments ran together without a word, each rank with its own learning rate or batch (DDP's replicas drifted
    apart, the sampler's shards overlapped). A UsageError on every rank names the keys and each rank's value;
    ``may_differ`` (machine_rank) is left out. A collective; nothing on one process."""
    if not info.distributed:
        return
    mine = {key: value for key, value in settings.items() if key not in may_differ}
    keys, shown = _differing(mine, info)
    if not keys:
        return
    # the launcher's own options (--num_processes 2 on one machine, 4 on the other) go before 'train'
    from shardtune.config.schema import LAUNCHER_SET

    keys = keys[:4]  # those the message names
    launcher = [f"--{key}" for key in LAUNCHER_SET if key in keys]
    where = " and ".join(filter(None, (
        f"the same {' and '.join(launcher)}, counted over all machines" if launcher else "",
        "the same arguments after 'train'" if len(keys) > len(launcher) else "")))
    raise UsageError(f"the job's processes were started with different settings: {shown}: every rank must "
                     f"train with the same ones; give each machine's shardtune launch {where} (only --machine_rank "
                     f"differs)")


# The packages whose versions decide what a step computes and how ranks talk: machines with others ran together.
VERSIONED = ("transformers", "peft")


def refuse_other_versions(info: DistInfo) -> None:
    """Every rank must run the same shardtune, torch, transformers and peft: machines set up apart (pip install on
    each VM) trained together with other versions without a word, their collectives or numbers apart. A UsageError
    on every rank names the packages and each rank's version. A collective; nothing on one process."""
    if not info.distributed:
        return
    from importlib import metadata

    import shardtune

    versions = {"shardtune": shardtune.__version__, "torch": torch.__version__}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    differing, shown = _differing(versions, info)
    if differing:
        raise UsageError(f"the job's machines run different versions: {shown}: install the same versions on every "
                         f"machine (pip install shardtune==VERSION torch==VERSION ... on each)")


def ended_ranks(table: list[tuple[str, int]], rank: int, wait_s: float = 10.0) -> list[int] | None:
    """The ranks on this host whose processes have ended; None when every rank here still runs, so the one that is
    gone ran on another host. A rank that failed closes its connections a moment before its process ends, and its
    launcher sees the end when it reaps the process: this waits up to ``wait_s`` for a rank's process to be gone
    (a zombie, ended but not yet reaped, counts once the wait is over), so that the launcher has seen that death
    before this rank's own exit and names the right rank first."""
    host = socket.gethostname()
    here = [r for r, (h, _) in enumerate(table) if h == host and r != rank]
    deadline = time.monotonic() + wait_s
    while True:
        states = {r: process_state(table[r][1]) for r in here}
        gone = [r for r, state in states.items() if state == "gone"]
        if gone or not here:
            return gone or None
        if time.monotonic() > deadline:
            return [r for r, state in states.items() if state == "zombie"] or None
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from Linux's /proc (elsewhere none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # ended while this read it
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


def process_state(pid: int) -> str:
    """'running', 'zombie' (ended, its parent not told yet) or 'gone'."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):  # no /proc (macOS): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "running"
        return "running"
    return "zombie" if state in ("Z", "X") else "running"


_long_groups: dict[timedelta, Any] = {}


def long_wait_group(timeout: timedelta) -> Any:
    """A gloo group of every rank whose collectives wait up to ``timeout`` (the default group's may be shorter).

    Made once per process and timeout, by every rank (making it is a collective); ``shutdown`` destroys it.
    """
    if timeout not in _long_groups:
        _long_groups[timeout] = dist.new_group(backend="gloo", timeout=timeout)
    return _long_groups[timeout]


def shutdown() -> None:
    """Destroy every process group now, while the interpreter can still run gloo's worker threads to the end.

    A group left for interpreter exit (held by a reference cycle, as FSDP's device mesh holds it, or by a module
    global) is destroyed during finalisation: a worker thread still releasing a collective's tensors
    (all_gather_object's) takes the GIL then and aborts the process ("terminate called without an active
    exception") after the run's work is done, with a failed exit status.
    """
    if dist.is_initialized():
        for group in _long_groups.values():
            dist.destroy_process_group(group)
        _long_groups.clear()  # their last references
        gc.collect()
        dist.destroy_process_group()
