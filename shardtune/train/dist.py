"""The process group: who am I, on which device, and reductions that also work on one process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def init_distributed(timeout_s: int, *, group_for_one: bool = False) -> DistInfo:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); a lone process joins nothing.

    The timeout bounds every collective, so a rank that hangs stops the job with an error naming the operation
    instead of waiting forever. Work that may legitimately take long (tokenisation) must not sit inside a
    collective: the data pipeline waits on its own group. ``group_for_one`` makes a one-process group when
    nothing launched us, for FSDP on a single device (e.g. to offload parameters to the CPU).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    elif group_for_one and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
