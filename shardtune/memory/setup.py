"""The training setup the estimator evaluates: method, parallelism, precision, batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardtune.config.optimizers import ESTIMATE_ALIASES, OPTIMIZERS as OPTIMIZER_TABLE, canonical
from shardtune.config.schema import MIXED_PRECISIONS, SHARDING_STRATEGIES, TrainConfig
from shardtune.errors import UsageError, check_choice

METHODS = ("full", "lora", "qlora")
STRATEGIES = ("single", "ddp", "fsdp", "mp", "pp")
# DeepSpeed names, mapped to the FSDP strategy that keeps the same things sharded. FSDP has no optimizer-only
# sharding, so ZeRO-1 maps to SHARD_GRAD_OP, which shards gradients as well (less memory than ZeRO-1, not more).
ZERO_ALIASES = {"ZERO3": "FULL_SHARD", "ZERO-3": "FULL_SHARD", "ZERO2": "SHARD_GRAD_OP", "ZERO-2": "SHARD_GRAD_OP",
                "ZERO1": "SHARD_GRAD_OP", "ZERO-1": "SHARD_GRAD_OP"}
# The trainer's optim names (config/optimizers.py), and the estimator's earlier spellings as aliases.
OPTIMIZERS = (*OPTIMIZER_TABLE, *ESTIMATE_ALIASES)
ATTENTION = ("sdpa", "flash_attention_2", "eager")
LOSSES = ("shardtune", "full", "chunked")
# What ``shardtune train`` runs with no flags, from the one place defaults live (config/schema.py): the Setup's
# defaults read it, so ``shardtune estimate MODEL`` with no options describes that very job.
TRAIN_DEFAULTS = TrainConfig()


def default_mixed_precision(native_bf16: bool) -> str:
    """The precision ``shardtune train`` picks with no flags on a GPU that does (or does not) compute bf16."""
    return TRAIN_DEFAULTS.precision_on(native_bf16)


@dataclass(frozen=True)
class Setup:
    """One concrete way to train: everything the memory formula depends on."""

    method: str = TRAIN_DEFAULTS.lora.method
    strategy: str = "single"
    sharding_strategy: str = TRAIN_DEFAULTS.distributed.fsdp_sharding_strategy
    offload_params: bool = TRAIN_DEFAULTS.distributed.fsdp_offload_params
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    batch_size: int = TRAIN_DEFAULTS.run.per_device_train_batch_size  # per device, per micro-batch
    seq_len: int = TRAIN_DEFAULTS.data.max_seq_len
    gradient_accumulation_steps: int = TRAIN_DEFAULTS.run.gradient_accumulation_steps
    gradient_checkpointing: bool = TRAIN_DEFAULTS.run.gradient_checkpointing
    # The checkpointed layers' inputs wait in pinned host memory (shardtune train's activation_offloading).
    activation_offloading: bool = TRAIN_DEFAULTS.run.activation_offloading
    # On a GPU that computes bf16 (every card --gpu offers); the CLI asks default_mixed_precision for others.
    mixed_precision: str = default_mixed_precision(True)
    pure_bf16: bool = TRAIN_DEFAULTS.model.pure_bf16
    optimizer: str = TRAIN_DEFAULTS.optim.optim  # a name of config/optimizers.py's table (Transformers' optim names)
    lora_r: int = TRAIN_DEFAULTS.lora.lora_r
    lora_target_modules: str = TRAIN_DEFAULTS.lora.lora_target_modules
    use_dora: bool = TRAIN_DEFAULTS.lora.use_dora  # DoRA's trained magnitudes (counted; extra activations traced)
    lora_modules_to_save: tuple[str, ...] = ()  # modules PEFT trains a full copy of
    attn_implementation: str = TRAIN_DEFAULTS.model.attn_implementation
    nf4_double_quant: bool = TRAIN_DEFAULTS.lora.use_nested_quant
    # shardtune: shardtune train's loss (the head fused with the loss: no logits kept, one chunk's fp32 logits at
    # a time, recomputed in backward); full: transformers' (fp32 logits of the whole micro-batch); chunked:
    # torchtune's, compiled.
    loss: str = "shardtune"

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    def with_(self, **changes) -> "Setup":
        return replace(self, **changes)

    def label(self) -> str:
        """Short human name of the parallel setup, e.g. 'FSDP FULL_SHARD + offload'."""
        if self.strategy == "fsdp":
            text = f"FSDP {self.sharding_strategy}"
            return text + " + CPU offload" if self.offload_params else text
        return {"single": "single GPU", "ddp": "DDP", "mp": "model parallel", "pp": "pipeline parallel"}[self.strategy]

    @property
    def splits_layers(self) -> bool:
        """Model or pipeline parallel: each GPU holds a run of whole decoder layers."""
        return self.strategy in ("mp", "pp")


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a setup stores, by role."""

    compute: int  # bytes of an activation / gathered weight (2 for bf16 and fp16)
    master: int  # bytes of a trainable parameter as stored (and of its gradient)
    frozen: int  # bytes of a frozen base weight (LoRA)
    residual: int  # bytes of the residual stream between layers
    autocast_copies: bool  # torch.autocast keeps a compute-dtype copy of each fp32 weight it casts


def dtypes(setup: Setup) -> Dtypes:
    """The element sizes ``setup`` trains with (mixed precision, pure bf16, autocast copies)."""
    if setup.mixed_precision == "no":
        return Dtypes(4, 4, 4, 4, False)
    master = 2 if setup.pure_bf16 else 4
    # fp32 weights under autocast (single GPU, DDP, MP, PP): the residual stream stays fp32, from fp32 embeddings
    # (full fine-tuning) or from the fp32 upcast of a bf16 base's embeddings (LoRA, train/model.py
    # Precision.upcasts_residual; not QLoRA). FSDP2's MixedPrecisionPolicy gathers bf16 weights and casts each
    # layer's input, so everything is bf16 there. Only full fine-tuning's fp32 matmul weights get autocast copies.
    autocast = master == 4 and setup.strategy != "fsdp"
    fp32_stream = autocast and setup.method != "qlora"
    return Dtypes(2, master, 2, 4 if fp32_stream else 2, autocast and setup.method == "full")


def normalize_sharding(value: str) -> str:
    """FSDP sharding strategy name, accepting DeepSpeed's ZeRO-1/2/3 names."""
    key = value.upper().replace("_", "-") if value.upper().startswith("ZERO") else value.upper()
    if key in ZERO_ALIASES:
        return ZERO_ALIASES[key]
    return check_choice(value.upper(), SHARDING_STRATEGIES + ("ZERO1", "ZERO2", "ZERO3"), "sharding strategy")


def validate(setup: Setup) -> Setup:
    """Check every field, report all problems in one line, and return the setup with names normalised."""
    problems = []
    for name in ("num_gpus", "num_nodes", "batch_size", "seq_len", "gradient_accumulation_steps", "lora_r"):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"--{name.replace('_', '-')} must be a whole number >= 1 (got {value})")
    if problems:
        raise UsageError("; ".join(problems) + ".")
    setup = setup.with_(
        method=check_choice(setup.method, METHODS, "method"),
        strategy=check_choice(setup.strategy, STRATEGIES, "strategy"),
        sharding_strategy=normalize_sharding(setup.sharding_strategy),
        mixed_precision=check_choice(setup.mixed_precision, MIXED_PRECISIONS, "mixed precision"),
        optimizer=canonical(check_choice(setup.optimizer, OPTIMIZERS, "optimizer")),
        attn_implementation=check_choice(setup.attn_implementation, ATTENTION, "attention implementation"),
        loss=check_choice(setup.loss, LOSSES, "loss"),
    )
    if setup.strategy == "single" and setup.world_size > 1:
        raise UsageError(
            f"--strategy single uses one GPU but --num-gpus x --num-nodes is {setup.world_size}: "
            "use ddp, fsdp, mp or pp, or --num-gpus 1."
        )
    if setup.pure_bf16 and setup.mixed_precision != "bf16":
        raise UsageError("--pure-bf16 keeps weights in bfloat16: it needs --mixed-precision bf16.")
    if setup.activation_offloading and not setup.gradient_checkpointing:
        raise UsageError("--activation-offloading moves the layer inputs that gradient checkpointing keeps to host "
                         "memory: use it with --gradient-checkpointing.")
    if setup.offload_params and setup.strategy != "fsdp":
        raise UsageError("--offload-params is FSDP's CPU offload: use it with --strategy fsdp (or auto).")
    return setup
