"""DDP (``distributed_type: DDP``): a whole replica per rank, gradients all-reduced by torch's reducer."""

from __future__ import annotations

from torch import nn

from shardtune.dist import DistInfo
from shardtune.train.plan import Plan


def apply_ddp(model: nn.Module, plan: Plan, info: DistInfo) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` when there are several processes (one process: as it is)."""
    if not info.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=plan.find_unused_parameters,
                                   **dict(plan.ddp_kwargs))
