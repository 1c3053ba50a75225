"""The strategies, one entry each: everything the rest of shardtune asks about a way to spread training.

A strategy is spelled one way everywhere: its ``name`` here is the config's ``distributed_type``, the value of
``shardtune estimate --strategy`` (typed in any case) and ``shardtune bench strategies --strategies``, and what
the estimator's JSON, the bench's results and the docs print. Other tools' spellings (Accelerate's MULTI_GPU,
DeepSpeed's ZeRO stages) are read here and nowhere else.

Each entry says how the trainer runs it (the function that wraps or splits the model and the runner that steps it,
as lazy ``module:name`` references, so this module stays a leaf that imports no torch) and the few facts from which
``train/plan.py:Plan``, the runners, the estimator and the bench derive what they need: whether every rank holds
a replica, whether parameters are sharded, whether the decoder layers are split into stages and whether those
stages form a pipeline. Code elsewhere asks these facts; it never compares strategy names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from shardtune.errors import UsageError, closest


@dataclass(frozen=True, eq=False)
class Strategy:
    """One way to spread training over devices, and what follows from it. It is its name: it prints as the name
    and equals it (``plan.strategy == "FSDP"`` in a user's callback reads as it looks)."""

    name: str  # the one spelling: the config's distributed_type
    label: str  # the estimator's words for it in tables and reasons
    why: str  # the estimator's reason to recommend it, once it fits
    # ``module:function`` taking (model, plan, info) and returning the model wrapped or split; None: as built.
    parallelize: str | None
    runner: str  # ``module:Class`` of the runner that steps it (train/runner.py:Runner says what it offers)
    one_device: bool = False  # trains on one device; several processes make it DDP (``resolve``)
    replicates: bool = False  # a whole replica per rank; gradients all-reduced (DDP's reducer buckets)
    # Parameters, gradients and optimizer states sharded over the ranks and gathered a unit at a time in the
    # compute dtype by FSDP2's own MixedPrecisionPolicy (no autocast); fp16 needs the sharded loss scaler.
    shards_parameters: bool = False
    splits_layers: bool = False  # each device holds a run of whole decoder layers (stages)
    # The stages form a pipeline: one process per stage, every stage reads the whole batch, micro-batches keep
    # several stages busy. Without it one process drives every stage's device, one stage at a time.
    pipelined: bool = False
    aliases: tuple[str, ...] = ()  # other tools' names for it (Accelerate's distributed_type values)

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        return self.name == (other.name if isinstance(other, Strategy) else other)

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def data_parallel(self) -> bool:
        """Every rank trains on its own rows and the gradients are reduced over the ranks."""
        return self.replicates or self.shards_parameters

    def defers_gradient_sync(self, sharding: str) -> bool:
        """Whether gradients are reduced only on the last micro-batch of an accumulation (``sharding``: the FSDP
        sharding strategy). Where every rank holds whole gradients anyway (DDP, and NO_SHARD, whose shards are
        whole) deferring saves communication for free. Every other FSDP sharding reduce-scatters each micro-batch
        (as torchtitan and torchtune do): deferring would keep each rank's unsharded gradients, in the reduce dtype,
        through the whole accumulation, the memory that sharding the gradients (ZeRO-2 and up) was chosen to save.
        The trainer's runner and the estimate (memory/timing.py) both read it here."""
        return self.replicates or (self.shards_parameters and sharding == "NO_SHARD")

    @property
    def autocasts(self) -> bool:
        """Mixed precision through torch.autocast (FSDP2 casts the gathered parameters itself instead)."""
        return not self.shards_parameters

    @property
    def shards_batch(self) -> bool:
        """Each rank reads its own slice of the global batch; pipeline stages all read the whole of it."""
        return not self.pipelined

    @property
    def drives_several_devices(self) -> bool:
        """One process computes on several devices (MP's stages): the job's devices are not its processes."""
        return self.splits_layers and not self.pipelined

    @property
    def places_weights_itself(self) -> bool:
        """The weights load into CPU RAM and the strategy moves each part where it belongs (a shard, a stage)."""
        return self.shards_parameters or self.splits_layers

    def leaves_a_stage_empty(self, num_stages: int, num_layers: int) -> bool:
        """Splits ``num_layers`` decoder layers into more stages (MP's devices, PP's processes) than there are
        layers: some stage would hold none, a job the trainer refuses and the estimator leaves out."""
        return self.splits_layers and num_stages > num_layers

    def load(self, attribute: str) -> Any:
        """The function or class that ``attribute`` (``parallelize`` or ``runner``) names, imported now."""
        module, _, name = getattr(self, attribute).partition(":")
        return getattr(importlib.import_module(module), name)


NO = Strategy("NO", "single GPU", "it fits on the one GPU", parallelize=None,
              runner="shardtune.train.runner:LocalRunner", one_device=True)
DDP = Strategy("DDP", "DDP", "the model, gradients and optimizer states fit on one GPU, so DDP replicates them and "
                             "only all-reduces gradients (fastest)",
               parallelize="shardtune.train.ddp:apply_ddp", runner="shardtune.train.runner:LocalRunner",
               replicates=True,
               aliases=("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"))
FSDP = Strategy("FSDP", "FSDP", "sharding parameters, gradients and optimizer states fits",
                parallelize="shardtune.train.fsdp:apply_fsdp", runner="shardtune.train.runner:LocalRunner",
                shards_parameters=True)
MP = Strategy("MP", "model parallel", "naive model parallel fits, but only one GPU works at a time",
              parallelize="shardtune.train.model_parallel:split_across_devices",
              runner="shardtune.train.runner:LocalRunner", splits_layers=True)
PP = Strategy("PP", "pipeline parallel", "each GPU holds a run of layers, and micro-batches keep several GPUs "
                                         "working at once",
              parallelize="shardtune.train.pipeline_parallel:split_for_stage",
              runner="shardtune.train.pipeline_parallel:PipelineRunner", splits_layers=True, pipelined=True)

STRATEGIES: tuple[Strategy, ...] = (NO, DDP, FSDP, MP, PP)
NAMES: tuple[str, ...] = tuple(s.name for s in STRATEGIES)
_BY_NAME = {name: s for s in STRATEGIES for name in (s.name, *s.aliases)}

def lookup(name: str | Strategy) -> Strategy | None:
    """The strategy ``name`` spells, in any case, or by one of its aliases; None when it is none."""
    if isinstance(name, Strategy):
        return name
    return _BY_NAME.get(str(name).upper())


def strategy_named(name: str | Strategy, what: str = "strategy") -> Strategy:
    """The strategy ``name`` spells, in any case; else a UsageError naming the choices and the nearest one."""
    found = lookup(name)
    if found is not None:
        return found
    # A strategy's label begins with the word people say for it ("single GPU", "pipeline parallel").
    said = [s.name for s in STRATEGIES if s.label.split()[0].lower() == str(name).lower()]
    hint = said[0] if said else closest(str(name), NAMES)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    raise UsageError(f"unknown {what} '{name}': choose one of {', '.join(NAMES)}.{did_you_mean}")


def resolve(distributed_type: str | Strategy | None, several_processes: bool) -> Strategy:
    """The strategy a run uses: the configured one, or DDP when started on several processes with none (or NO)."""
    chosen = NO if distributed_type is None else strategy_named(distributed_type, "distributed_type")
    return DDP if chosen.one_device and several_processes else chosen


def no_as_ddp(distributed_type: str | None, world_size: int, done: str) -> str:
    """What ``train`` says at start (``done`` "trained") and ``estimate --config`` says ("estimated") where a
    recipe's distributed_type NO runs on several processes, as DDP; "" otherwise."""
    if distributed_type != "NO" or world_size < 2:
        return ""
    return (f"distributed_type NO on {world_size} processes: {done} as DDP, each process a slice of every batch (NO "
            f"alone would have each train the whole model on its own)")


# DeepSpeed's ZeRO stages and the strategy that keeps the same things sharded. FSDP has no optimizer-only sharding,
# so ZeRO-1 becomes SHARD_GRAD_OP, which shards gradients as well (less memory than ZeRO-1, the same traffic).
ZERO_STAGES: dict[int, tuple[Strategy, str | None]] = {
    0: (DDP, None), 1: (FSDP, "SHARD_GRAD_OP"), 2: (FSDP, "SHARD_GRAD_OP"), 3: (FSDP, "FULL_SHARD")}


def zero_mapping(stage: int) -> str:
    """What ZeRO stage ``stage`` runs as, in words: "ZeRO-2 -> FSDP SHARD_GRAD_OP" (with why for ZeRO-1)."""
    strategy, sharding = ZERO_STAGES[stage]
    name = f"ZeRO-{stage}" if stage else "ZeRO-0 (off)"
    target = f"{strategy.name} {sharding}" if sharding else strategy.name
    note = (" (ZeRO-1 shards only optimizer states; SHARD_GRAD_OP also shards gradients: less memory, same "
            "traffic)") if stage == 1 else ""
    return f"{name} -> {target}{note}"


def zero_stage(name: str) -> int | None:
    """The ZeRO stage that ``name`` spells (zero3, ZeRO-3, zero_3, ZERO3), or None when it spells none."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key.startswith("zero") and key[4:].isdigit() and int(key[4:]) in ZERO_STAGES:
        return int(key[4:])
    return None
