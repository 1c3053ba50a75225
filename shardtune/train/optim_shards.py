"""bitsandbytes' optimizers on FSDP2's DTensor shards: each rank steps its own shard, the state stays sharded.

bitsandbytes' update kernels take plain tensors: given FSDP2's DTensor parameters they fail (mixed Tensor and
DTensor arguments, or no sharding rule registered). Their update is elementwise within 256-value blocks, so each
rank can run it on its local shard (``to_local()``, the same storage): that is the same optimizer applied blockwise
to the shard, which is what FSDP's sharded optimizer state means. Two things make the state a well-formed sharded
state that DCP saves and loads per rank:

- the 8-bit or 32-bit choice (bitsandbytes keeps fp32 state below ``min_8bit_size`` values) is made on the whole
  tensor's size, not the shard's, so every rank keeps the same state keys;
- moments shaped like the weight become DTensors with the weight's placements; a per-block absmax (one fp32 per 256
  values of *this rank's* shard) becomes a DTensor sharded over the same mesh dimensions, each rank's piece padded
  to the longest shard's block count, so DCP writes every rank's absmax (a plain tensor would be saved once, from
  one rank, and restored to all). The 256-entry quantisation maps are the same on every rank and stay plain.

A checkpoint of these states resumes bitwise at the same world size and sharding. Block boundaries follow the
shard, so 8-bit state cannot be resharded: every 8-bit state records its shard count (1 for plain tensors: one
process, DDP, pipeline stages, which bitsandbytes steps as it always does), and ``load_state_dict`` refuses a
checkpoint made over another count rather than read codes against another shard's scales.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtune.errors import UsageError

QUANT_BLOCK = 256  # bitsandbytes' blockwise optimizer kernels use one absmax per 256 values
_PER_BLOCK = ("absmax1", "absmax2")  # one value per block of this rank's shard
_SHARED = ("qmap1", "qmap2")  # the same 256-entry map on every rank
SHARD_COUNT = "shard_count"  # our entry in every 8-bit state: how many shards its blocks were made over


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW stepping FSDP2's DTensor parameters through their local shards.

    AdamW is elementwise, so each rank updating its own shard (``to_local()``, the same storage) is the whole
    update, computed by the same multi-tensor kernels as on one process, and the state stays the DTensors torch
    makes, which DCP saves and loads per rank as before. Handed DTensors instead, every foreach op of the kernel
    goes through DTensor's sharding propagation, whose first pass over a list of hundreds of LoRA tensors takes
    seconds: 6 s of SmolLM2-135M's first FSDP2 step on CPU, with its 420 adapter matrices. Plain tensors pass
    through unchanged."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for values in lists:  # parameters, gradients, moments, step counts: as the kernel will read them
            values[:] = [value.to_local() if isinstance(value, DTensor) else value for value in values]
        return has_complex


class LocalShardSteps:
    """Mixin placed before a bitsandbytes optimizer class: DTensor parameters are stepped shard by shard."""

    _whole_numel: int | None = None
    fp32_state: frozenset[int] = frozenset()  # ids of the parameters whose state stays fp32 (embeddings)

    def get_config(self, gindex, pindex, group):
        config = super().get_config(gindex, pindex, group)
        if id(group["params"][pindex]) in self.fp32_state:
            config["optim_bits"] = 32
        if self._whole_numel is not None:  # decide 8-bit vs fp32 state on the whole tensor: same on every rank
            config["min_8bit_size"] = 0 if self._whole_numel >= config["min_8bit_size"] else math.inf
        return config

    @torch.no_grad()
    def init_state(self, group, p, gindex, pindex):
        if not isinstance(p, DTensor):
            super().init_state(group, p, gindex, pindex)
            if any(key in self.state[p] for key in _PER_BLOCK):  # blocks over the whole tensor
                self.state[p][SHARD_COUNT] = 1
            return
        local = p.to_local()
        self._whole_numel = p.numel()
        try:
            super().init_state(group, local, gindex, pindex)
        finally:
            self._whole_numel = None
        state = {key: _sharded(key, value, p) for key, value in self.state.pop(local).items()}
        if "unorm_vec" in state:
            raise ValueError("max_unorm is not supported on FSDP shards (the norm spans every rank)")
        if any(key in state for key in _PER_BLOCK):  # blocks follow the shard: the checkpoint records how many
            state[SHARD_COUNT] = _pieces(p)
        self.state[p] = state

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Refuses 8-bit state saved over a different number of shards: its blocks would not line up."""
        # Saved states are keyed as the saved groups list their parameters (ids or names): match them by position.
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for key, p in zip(saved_keys, params):
            # DCP loads into the keys of the state it is given: every 8-bit state has this one, so it is read.
            now, saved = self.state.get(p, {}).get(SHARD_COUNT), state_dict["state"].get(key, {}).get(SHARD_COUNT)
            if now is not None and saved is not None and saved != now:
                raise UsageError(
                    f"the checkpoint's 8-bit optimizer state was made over {saved} shard(s) of each weight and this "
                    f"run has {now}: bitsandbytes quantises in blocks of {QUANT_BLOCK} values of a shard, which "
                    f"another sharding misaligns; resume with the checkpoint's number of FSDP processes")
        return super().load_state_dict(state_dict, *args, **kwargs)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        if not isinstance(p, DTensor):
            return super().update_step(group, p, gindex, pindex)
        state = self.state[p]
        local = p.to_local()
        views = {key: _local(key, value, local.numel()) for key, value in state.items()}
        if local.numel() == 0:  # a shard with no rows: nothing to update, but the step count stays in line
            state["step"] += 1
            return
        local.grad = p.grad.to_local()
        self.state[local] = views
        try:
            super().update_step(group, local, gindex, pindex)
        finally:
            del self.state[local]
            local.grad = None
        state["step"] = views["step"]  # the kernels write the tensors in place; the count is a Python int


def _pieces(p: DTensor) -> int:
    """How many shards ``p`` is cut into (replicas of a shard, as HSDP's, count once)."""
    return math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if isinstance(pl, Shard))


def _blocks(numel: int) -> int:
    return math.ceil(numel / QUANT_BLOCK)


def _longest_shard_numel(p: DTensor) -> int:
    """Values in the largest shard of ``p`` (torch.chunk's rule: the first shards take the ceiling)."""
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(mesh_dim))
    return math.prod(shape)


def _sharded(key: str, value, p: DTensor):
    """One freshly made state entry of ``p``'s local shard, as the sharded state DCP saves."""
    if not isinstance(value, torch.Tensor) or key in _SHARED:
        return value
    if key in _PER_BLOCK:
        width = _blocks(_longest_shard_numel(p))
        padded = torch.zeros(width, dtype=value.dtype, device=value.device)
        padded[: value.numel()] = value
        placements = [Shard(0) if isinstance(pl, Shard) else Replicate() for pl in p.placements]
        return DTensor.from_local(padded, p.device_mesh, placements, run_check=False, shape=(width * _pieces(p),),
                                  stride=(1,))
    if value.shape != p.to_local().shape:
        raise ValueError(f"optimizer state {key!r} of shape {tuple(value.shape)} is neither per-value nor per-block")
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _local(key: str, value, local_numel: int):
    """The plain tensor (a view of the same storage) bitsandbytes' kernel updates for this rank's shard."""
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    return local[: _blocks(local_numel)] if key in _PER_BLOCK else local
