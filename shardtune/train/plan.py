"""The plan: which strategy a run uses and how, resolved once from the config and the launch.

Every fact about a strategy that code outside ``parallelize`` needs is a property here (where weights load, whether
each rank reads its own slice of the batch, how optimizer state is keyed), derived from the strategy's entry in
``shardtune/strategies.py``, so the loop, the step and the checkpoint never branch on the strategy's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import DistributedConfig
from shardtune.dist import DistInfo
from shardtune.strategies import Strategy, resolve, strategy_named


@dataclass(frozen=True)
class Plan:
    """What ``parallelize`` applies."""

    strategy: Strategy  # its entry in shardtune/strategies.py (a name, NO/DDP/FSDP/MP/PP, is looked up)
    sharding: str = "FULL_SHARD"
    reshard_after_forward: bool = True
    offload: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    layer_classes: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    param_dtype: torch.dtype | None = None  # FSDP's gather dtype (mixed precision); None keeps the stored one
    compute_dtype: torch.dtype = torch.float32  # autocast's dtype (one process, DDP, MP, each PP stage)
    reduce_dtype: torch.dtype = torch.float32  # FSDP's gradient reduce-scatter dtype (bf16 in pure bf16)
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    activation_offloading: bool = False  # checkpointed layers' inputs wait in host memory (train/offload.py)
    liger_kernel: bool = False  # Liger's RMSNorm, RoPE and SwiGLU kernels on CUDA (train/liger.py)
    # MP and PP: [first, end) decoder layers of each stage (model_parallel.plan_stages).
    stage_bounds: tuple[tuple[int, int], ...] = ()
    devices: tuple[str, ...] = ()  # MP: the device of each stage
    pipeline_schedule: str = "1F1B"
    pipeline_microbatches: int = 1
    forward_prefetch: bool = False  # FSDP: gather the next decoder layer while this one runs forward
    find_unused_parameters: bool = False  # DDP: ddp_find_unused_parameters
    # DDP's other arguments set by the ddp_* keys (bucket_cap_mb, broadcast_buffers, static_graph); unset: torch's.
    ddp_kwargs: tuple[tuple[str, object], ...] = ()
    compile_backend: str | None = None  # torch_compile: the backend that compiles each decoder layer; None: eager
    compile_mode: str | None = None  # torch_compile_mode
    # FSDP's fsdp_cpu_ram_efficient_loading with fsdp_sync_module_states on several ranks: rank 0 loads the
    # weights, the others build on meta and receive their shards (parallelize.load_from_rank0).
    loads_from_rank0: bool = False
    # How checkpoints hold the weights: FSDP may gather them (FULL_STATE_DICT); every other strategy writes shards.
    state_dict_type: str = "SHARDED_STATE_DICT"

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", strategy_named(self.strategy, "distributed_type"))

    @property
    def defers_gradient_sync(self) -> bool:
        """Whether gradients are reduced only on the last micro-batch of an accumulation (``Strategy``)."""
        return self.strategy.defers_gradient_sync(self.sharding)

    @property
    def places_weights_itself(self) -> bool:
        """Whether the weights load into CPU RAM and ``parallelize`` moves them where they belong.

        FSDP2 moves each unit's weights to the GPU as it shards them, MP puts each stage on its device and PP keeps
        one stage per process: loading the whole model onto one GPU first would need the very memory these setups
        exist to avoid (a model larger than one GPU could not start).
        """
        return self.strategy.places_weights_itself

    @property
    def shards_batch(self) -> bool:
        """Whether each rank reads its own slice of the global batch (data parallel); pipeline stages read it all."""
        return self.strategy.shards_batch

    def data_split(self, info: DistInfo) -> tuple[int, int]:
        """(world size, rank) the samplers split batches over: every pipeline stage reads the whole batch."""
        return (info.world_size, info.rank) if self.shards_batch else (1, 0)

    @property
    def sharded_grad_scaler(self) -> bool:
        """FSDP's fp16 loss scaler (``ShardedGradScaler``), whose [1]-shaped ``found_inf`` fused AdamW refuses."""
        return self.strategy.shards_parameters and self.compute_dtype == torch.float16

    def num_devices(self, info: DistInfo) -> int:
        """The devices the job computes on: one per process, except MP's one process driving several."""
        return len(self.devices) if self.strategy.drives_several_devices else info.world_size

    def describe(self, info: DistInfo) -> str:
        """The strategy in the start-up log: "a single process", "FSDP FULL_SHARD on 2 process(es)", "FSDP
        FULL_SHARD + CPU offload (...) on 8 process(es)"."""
        if self.strategy.one_device:
            return "a single process"
        setup = self.strategy.name
        if self.strategy.shards_parameters:  # a DeepSpeed ZeRO stage with offload lands here: say all of it
            setup += f" {self.sharding}" + (" + CPU offload (parameters, gradients, optimizer step)"
                                              if self.offload else "")
        return f"{setup} on {info.world_size} process(es)"

    def summary(self) -> dict[str, object]:
        """How the run was sharded, by the names ``shardtune estimate --json`` gives its setup, for summary.json."""
        shards = self.strategy.shards_parameters
        return {"strategy": self.strategy.name, "sharding_strategy": self.sharding if shards else None,
                "offload_params": shards and self.offload}


def needs_process_group(cfg: DistributedConfig) -> bool:
    """FSDP2 needs a process group (a device mesh) even in a single process, e.g. to offload to the CPU."""
    return resolve(cfg.distributed_type, False).shards_parameters


def resolve_strategy(cfg: DistributedConfig, info: DistInfo) -> Strategy:
    """The configured strategy, or DDP when launched on several processes (``strategies.resolve``)."""
    return resolve(cfg.distributed_type, info.distributed)


def make_plan(cfg: DistributedConfig, info: DistInfo, *, param_dtype: torch.dtype | None,
              gradient_checkpointing: bool, use_reentrant: bool, activation_offloading: bool = False,
              liger_kernel: bool = False, compute_dtype: torch.dtype = torch.float32,
              reduce_dtype: torch.dtype = torch.float32,
              compile_backend: str | None = None, compile_mode: str | None = None) -> Plan:
    strategy = resolve_strategy(cfg, info)
    layers = tuple(c.strip() for c in (cfg.fsdp_transformer_layer_cls_to_wrap or "").split(",") if c.strip())
    return Plan(strategy=strategy, sharding=cfg.fsdp_sharding_strategy,
                reshard_after_forward=cfg.reshards_after_forward,
                offload=cfg.fsdp_offload_params, wrap_policy=cfg.fsdp_auto_wrap_policy, layer_classes=layers,
                min_num_params=cfg.fsdp_min_num_params, param_dtype=param_dtype, compute_dtype=compute_dtype,
                reduce_dtype=reduce_dtype,
                gradient_checkpointing=gradient_checkpointing or cfg.fsdp_activation_checkpointing,
                use_reentrant=use_reentrant, activation_offloading=activation_offloading,
                liger_kernel=liger_kernel, pipeline_schedule=cfg.pipeline_schedule,
                pipeline_microbatches=cfg.pipeline_microbatches,
                state_dict_type=cfg.fsdp_state_dict_type if strategy.shards_parameters else "SHARDED_STATE_DICT",
                forward_prefetch=cfg.fsdp_forward_prefetch, find_unused_parameters=bool(cfg.ddp_find_unused_parameters),
                ddp_kwargs=tuple((name, value) for name, value in (
                    ("bucket_cap_mb", cfg.ddp_bucket_cap_mb), ("broadcast_buffers", cfg.ddp_broadcast_buffers),
                    ("static_graph", cfg.ddp_static_graph)) if value is not None),
                compile_backend=compile_backend, compile_mode=compile_mode,
                loads_from_rank0=(strategy.shards_parameters and info.distributed and cfg.fsdp_cpu_ram_efficient_loading
                                  and cfg.fsdp_sync_module_states))


def layer_class_names(model: nn.Module, plan: Plan) -> set[str]:
    """The decoder layers' class names: those fsdp_transformer_layer_cls_to_wrap gives, else the model's own
    ``_no_split_modules`` (empty when neither says)."""
    return set(plan.layer_classes) or set(getattr(unwrap(model), "_no_split_modules", None) or ())


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The model under DDP's wrapper (a PEFT model stays one): what Transformers' Trainer hands callbacks as
    ``model`` (its ``self.model``; FSDP2 wraps in place, so nothing to peel)."""
    return getattr(model, "module", model)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under DDP and PEFT wrappers (FSDP2 wraps in place, so nothing to peel)."""
    model = unwrap_ddp(model)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model
