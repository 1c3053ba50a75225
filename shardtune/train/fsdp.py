"""FSDP2 (``distributed_type: FSDP``): ``fully_shard`` on each wrap unit, then the root, and loading from rank 0.

FSDP2 (``fully_shard``) shards each decoder layer (or each block of ``fsdp_min_num_params`` parameters) and then
the root, so one layer's parameters are gathered at a time. ``parallelize`` calls ``apply_fsdp`` after
checkpointing and compiling the layers (torchtitan's order).

How Accelerate's FSDP1 sharding strategies map onto FSDP2:
- FULL_SHARD (ZeRO-3): shard parameters, gradients and optimizer states; reshard after forward.
- SHARD_GRAD_OP (ZeRO-2): the same shards, but parameters stay gathered from forward to backward.
- HYBRID_SHARD: a 2-D mesh, sharded inside a node and replicated across nodes (cheap intra-node traffic).
- NO_SHARD: a 2-D mesh whose shard dimension has size 1, i.e. DDP done by FSDP (every rank holds everything).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardtune.config.keys import Problem
from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.train.plan import Plan, layer_class_names, unwrap


def _layer_classes(model: nn.Module, plan: Plan) -> set[str]:
    names = layer_class_names(model, plan)
    if not names:
        raise UsageError(Problem("fsdp_auto_wrap_policy", "fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP: cannot "
                                 "tell this model's decoder layer class; set fsdp_transformer_layer_cls_to_wrap (e.g. "
                                 "LlamaDecoderLayer) or use SIZE_BASED_WRAP"))
    return names


def _head_modules(model: nn.Module) -> set[int]:
    """Ids of the LM head and every module inside it (PEFT's LoRA layers of it).

    The fused loss (train/loss.py) calls the head once per chunk of tokens, and a rank's chunk count follows its
    own token count. As its own FSDP unit the head would all-gather on every call, so ranks with different
    counts would issue different collectives and hang or mismatch; inside its parent's unit it is gathered once.
    """
    get_head = getattr(unwrap(model), "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    return {id(m) for m in head.modules()} if head is not None else set()


def _wrap_targets(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """Modules that become their own FSDP unit, children before parents (fully_shard needs that order)."""
    if plan.wrap_policy == "NO_WRAP":
        return []
    head = _head_modules(model)
    if plan.wrap_policy == "TRANSFORMER_BASED_WRAP":
        names = _layer_classes(model, plan)
        targets = [m for m in model.modules() if type(m).__name__ in names and id(m) not in head]
        if not targets:
            # Otherwise only the root would be sharded: the whole model gathered at once, silently.
            own = sorted(getattr(unwrap(model), "_no_split_modules", None) or ())
            # a file's key (Accelerate docs' BertLayer copied for a Llama): placed at its line (cli.train)
            raise UsageError(Problem("fsdp_transformer_layer_cls_to_wrap",
                                     f"fsdp_transformer_layer_cls_to_wrap={','.join(sorted(names))}: no module of "
                                     f"this model has that class; its decoder layers are "
                                     f"{', '.join(own) or 'unknown'}"))
        return targets
    # SIZE_BASED_WRAP: post-order, a module becomes a unit once the parameters not yet in a unit reach the minimum.
    targets: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module, name: str = "") -> int:
        free = sum(visit(child, child_name) for child_name, child in module.named_children())
        free += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in claimed)
        # Containers without a forward (ModuleList) cannot be units: their parameters go up to the parent. Nor can
        # a PEFT layer's base_layer, whose weight the layer reads without calling it (trainable token rows are
        # copied into the embeddings' weight, DoRA takes the base weight's norm): FSDP gathers a unit's
        # parameters only around its own forward.
        runs = type(module).forward is not nn.Module.forward and name != "base_layer"
        if free >= plan.min_num_params and module is not model and runs and id(module) not in head:
            targets.append(module)
            claimed.update(id(p) for p in module.parameters())
            return 0
        return free

    visit(model)
    return targets


def _mesh(plan: Plan, info: DistInfo):
    from torch.distributed.device_mesh import init_device_mesh

    device_type = info.device.type
    if plan.sharding == "HYBRID_SHARD":
        return init_device_mesh(device_type, (info.num_nodes, info.world_size // info.num_nodes),
                                mesh_dim_names=("replicate", "shard"))
    if plan.sharding == "NO_SHARD":
        return init_device_mesh(device_type, (info.world_size, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (info.world_size,), mesh_dim_names=("shard",))


def apply_fsdp(model: nn.Module, plan: Plan, info: DistInfo) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # A DeviceMesh reads real rank tensors, so it is built outside fake mode (``shardtune estimate --trace``
    # runs this function under FakeTensorMode); a no-op in a real run.
    with unset_fake_temporarily():
        mesh = _mesh(plan, info)
    # Gradients of fp32 master weights are reduced in fp32 whatever the compute dtype (bf16 sums over many ranks
    # lose bits); pure bf16 reduces in bf16, the dtype its sharded gradients are kept in (Precision.reduce_dtype).
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=info.device.type == "cuda") if plan.offload else OffloadPolicy()
    units = _wrap_targets(model, plan)
    for module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mp,
                offload_policy=offload)
    if plan.forward_prefetch:
        # Decoder layers run in model order: each starts the next one's all-gather before its own forward
        # (torchtitan's explicit prefetch), overlapping communication that FSDP2 would otherwise issue on demand.
        for layer, following in zip(units, units[1:]):
            layer.set_modules_to_forward_prefetch([following])
    return model


def _first_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor under its first name only. A tensor shared by two modules (PEFT's trainable
    token rows of a tied head: the embeddings' and the head's adapter hold one parameter) is one parameter after
    fully_shard; loaded under both names, the second copy would meet a plain tensor where FSDP2 put a DTensor.
    Loading it once fills both places."""
    seen: set[tuple] = set()
    first = {}
    for name, tensor in state.items():
        # state_dict() detaches each entry into a new tensor object: the memory tells the shared ones apart
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if where not in seen:
            seen.add(where)
            first[name] = tensor
    return first


def load_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None,
                    buffers: dict[str, torch.Tensor] | None, info: DistInfo, *, offload: bool = False) -> None:
    """Fill a model that was built on meta on every rank but 0 with rank 0's weights, shard by shard.

    This is ``fsdp_cpu_ram_efficient_loading`` with ``fsdp_sync_module_states``: only rank 0 ever holds the full
    weights in CPU RAM; the others receive just their shards, so host memory does not grow with the ranks.
    Non-persistent buffers (rotary frequencies) are not in the state dict and are broadcast separately.
    With ``offload`` (FSDP's CPU offload) the shards are made in CPU RAM, where FSDP keeps them (it refuses GPU
    shards at the first forward), and only the buffers go to the GPU, as FSDP puts them on rank 0.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not info.is_main:
        model.to_empty(device=torch.device("cpu") if offload else info.device)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != info.device:
                    module._buffers[key] = buf.to(info.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, _first_names(full_state) if info.is_main else {}, options=options)
    for name, buf in model.named_buffers():
        source = buffers[name].to(info.device) if info.is_main and buffers is not None else buf
        if info.is_main:
            buf.data.copy_(source)
        dist.broadcast(buf.data, src=0)
