"""The training setup the estimator evaluates: the job a ``TrainConfig`` describes, on a number of GPUs.

A ``Setup`` is a view over a ``TrainConfig`` (config/schema.py): every training setting the formula depends on is
the config's own key, with the config's default and spelling, so ``shardtune estimate`` with no flags describes
the job ``shardtune train`` with no flags runs, and a recipe (``estimate --config``) is read as the trainer reads
it. What a config cannot say is declared here: the GPUs per node and the nodes (a launch's business), and which
loss to model (``shardtune``: the trainer's own; ``full`` and ``chunked``: other trainers', for comparisons). The
properties give the formula short names for the keys it reads; ``with_`` changes keys.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shardtune.config.optimizers import ESTIMATE_ALIASES, NOT_RUN, OPTIMIZERS as OPTIMIZER_TABLE, canonical
from shardtune.config.schema import MIXED_PRECISIONS, SHARDING_STRATEGIES, TrainConfig, all_keys, known_keys
from shardtune.errors import UsageError, check_choice
from shardtune.strategies import ZERO_STAGES, Strategy, resolve, strategy_named, zero_stage

METHODS = ("full", "lora", "qlora")  # what trains: LoraConfig.method, and method_keys' inverse
# The trainer's optim names (config/optimizers.py), and the estimator's earlier spellings as aliases.
OPTIMIZERS = (*OPTIMIZER_TABLE, *ESTIMATE_ALIASES)
ATTENTION = ("sdpa", "flash_attention_2", "eager")
LOSSES = ("shardtune", "full", "full-shifted", "chunked")
# What ``Setup.to_dict`` reports (the estimate's JSON "setup"): the properties below, by the CLI's option names.
SUMMARY = ("method", "strategy", "sharding_strategy", "offload_params", "num_gpus", "num_nodes", "batch_size",
           "seq_len", "gradient_accumulation_steps", "gradient_checkpointing", "activation_offloading",
           "mixed_precision", "pure_bf16", "optimizer", "torch_compile", "use_liger_kernel", "lora_r",
           "lora_target_modules", "use_dora", "lora_modules_to_save", "lora_bias", "attn_implementation",
           "nf4_double_quant", "loss", "world_size")


def method_keys(method: str) -> dict[str, bool]:
    """The keys that train ``method`` (full, lora or qlora): the inverse of ``LoraConfig.method``."""
    return {"use_peft_lora": method != "full", "use_4bit_quantization": method == "qlora"}


def mixed_precision_keys(mixed_precision: str) -> dict[str, Any]:
    """The keys that ask for ``mixed_precision`` (bf16, fp16 or no) whatever they held before: the inverse of
    ``TrainConfig.mixed_precision`` (TrainingArguments' flags, Accelerate's key left unset)."""
    return {"bf16": mixed_precision == "bf16", "fp16": mixed_precision == "fp16", "mixed_precision": None}


@functools.cache
def _key_sections() -> dict[str, str]:
    """``known_keys``, read once: a recommendation changes keys thousands of times."""
    return known_keys()


def with_keys(config: TrainConfig, **keys: Any) -> TrainConfig:
    """``config`` with ``keys`` (flat names, as ``to_flat`` gives them) changed; the sections they leave alone are
    shared with ``config``, so neither is to be changed in place afterwards."""
    owner = _key_sections()
    unknown = sorted(set(keys) - set(owner))
    if unknown:
        raise TypeError(f"not config keys: {', '.join(unknown)}")
    sections: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        sections.setdefault(owner[key], {})[key] = value
    return dataclasses.replace(config, **{name: dataclasses.replace(getattr(config, name), **values)
                                          for name, values in sections.items()})


@dataclass(frozen=True)
class Setup:
    """One concrete way to train: the job ``config`` describes on ``num_gpus`` x ``num_nodes`` GPUs."""

    config: TrainConfig = field(default_factory=TrainConfig)  # never changed in place: ``with_`` makes a new one
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    # Whether those GPUs compute bf16 natively (the card's Gpu.bf16): where the config leaves the precision to the
    # hardware, train picks bf16 on them and fp32 elsewhere (TrainConfig.precision_on). None: this machine's device.
    native_bf16: bool | None = True
    # shardtune: shardtune train's loss (the head fused with the loss: no logits kept, one chunk's fp32 logits at
    # a time, recomputed in backward); full: transformers' (fp32 logits of the whole micro-batch); chunked:
    # torchtune's, compiled.
    loss: str = "shardtune"
    # FSDP2: the embeddings and the head wrapped as FSDP units of their own (torchtune's ``custom_sharded_layers:
    # ['tok_embeddings', 'output']``, full_finetune_distributed.py), so they are resharded after their forward
    # like a decoder layer, instead of staying gathered in the root unit from forward to the end of backward.
    separate_root_units: bool = False
    # The training loop keeps the model's output (its fp32 logits, "full-shifted") until after backward
    # (fsdp_qlora train.py: ``output = None`` only after ``loss.backward()``).
    logits_held: bool = False
    # FSDP1 wrapping a model that sits on the CPU (or meta) with sync_module_states: every unit is moved to the GPU,
    # broadcast in 250 MB buckets, flattened and sharded there; the blocks this leaves cached on the default stream
    # are inside the reserved peak when the peak counter is reset without emptying the cache first.
    fsdp1_init_cache: bool = False
    # fsdp_qlora's loader (train.py load_and_quantize, low_memory) quantises each weight on the GPU and then moves
    # only its packed data to the CPU or meta: bitsandbytes' quantisation statistics (absmax, and the nested ones)
    # stay on every GPU, whole, since FSDP shards, gathers and offloads parameters and buffers only.
    nf4_stats_whole: bool = False
    # PP's micro-batches per batch: the job's pipeline_microbatches where it says one (a recipe, or estimate's
    # --pipeline-microbatches); None: one row each, as the recipe --emit-config writes (the most stages at work).
    pipeline_microbatches: int | None = None

    @property
    def microbatches(self) -> int:
        """The pipeline micro-batches each batch is split into under PP."""
        return self.pipeline_microbatches or self.batch_size

    @classmethod
    def of(cls, **changes: Any) -> Setup:
        """The default job with ``changes`` (see ``with_``)."""
        return cls().with_(**changes)

    def with_(self, **changes: Any) -> Setup:
        """This setup with ``changes``: config keys by their own names (``per_device_train_batch_size=4``,
        ``distributed_type=FSDP``), ``method`` (full/lora/qlora: ``use_peft_lora`` and ``use_4bit_quantization``),
        ``mixed_precision`` (bf16/fp16/no, whatever the bf16 and fp16 flags said), or this class's own fields."""
        own = _OWN_FIELDS
        keys = {k: v for k, v in changes.items() if k not in own}
        if "method" in keys:
            keys.update(method_keys(check_choice(keys.pop("method"), METHODS, "method")))
        if "mixed_precision" in keys:
            keys.update(mixed_precision_keys(check_choice(keys.pop("mixed_precision"), MIXED_PRECISIONS,
                                                          "mixed precision")))
        if isinstance(keys.get("distributed_type"), Strategy):
            keys["distributed_type"] = keys["distributed_type"].name
        return replace(self, config=with_keys(self.config, **keys) if keys else self.config,
                       **{k: v for k, v in changes.items() if k in own})

    # --- the strategy, and the GPUs it runs on ---
    @property
    def strategy(self) -> Strategy:
        """The registry's entry for the configured strategy (none configured: as ``shardtune launch`` resolves)."""
        return resolve(self.config.distributed.distributed_type, self.world_size > 1)

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def splits_layers(self) -> bool:
        """Model or pipeline parallel: each GPU holds a run of whole decoder layers."""
        return self.strategy.splits_layers

    @property
    def sharding_strategy(self) -> str:
        """The sharding FSDP2 runs: FULL_SHARD without resharding after forward is SHARD_GRAD_OP, and the reverse
        (``DistributedConfig.reshards_after_forward``)."""
        d = self.config.distributed
        if d.fsdp_sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return d.fsdp_sharding_strategy
        return "FULL_SHARD" if d.reshards_after_forward else "SHARD_GRAD_OP"

    @property
    def reshards_after_forward(self) -> bool:
        """As the trainer's plan sets it (HYBRID_SHARD without it keeps the layers gathered in the node)."""
        return self.config.distributed.reshards_after_forward

    @property
    def sharding_name(self) -> str | None:
        """The sharding as a run's summary.json names it: None where the strategy shards no parameters."""
        return self.sharding_strategy if self.strategy.shards_parameters else None

    @property
    def offload_params(self) -> bool:
        """FSDP's CPU offload of parameters, gradients and optimizer states (the key means nothing elsewhere)."""
        return self.strategy.shards_parameters and self.config.distributed.fsdp_offload_params

    # --- what trains ---
    @property
    def method(self) -> str:
        return self.config.lora.method

    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def lora_r(self) -> int:
        return self.config.lora.lora_r

    @property
    def lora_target_modules(self) -> str:
        return self.config.lora.lora_target_modules

    @property
    def lora_dropout(self) -> float:
        return self.config.lora.lora_dropout

    @property
    def use_dora(self) -> bool:
        """DoRA: trained magnitudes, and what its weight norm and scaling hold (Activations.dora_weight_norm)."""
        return self.config.lora.use_dora

    @property
    def lora_modules_to_save(self) -> tuple[str, ...]:
        """Modules PEFT trains a full copy of."""
        return tuple(self.config.lora.lora_modules_to_save)

    @property
    def lora_bias(self) -> str:
        """PEFT's ``bias``: which of the base's biases train (none, all, lora_only)."""
        return self.config.lora.lora_bias

    @property
    def nf4_double_quant(self) -> bool:
        return self.config.lora.use_nested_quant

    # --- the batch ---
    @property
    def batch_size(self) -> int:
        """Rows per device, per micro-batch."""
        return self.config.run.per_device_train_batch_size

    @property
    def seq_len(self) -> int:
        return self.config.data.max_seq_len

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.run.gradient_accumulation_steps

    # --- precision, memory savers, kernels ---
    @property
    def gradient_checkpointing(self) -> bool:
        return self.config.run.gradient_checkpointing or self.config.distributed.fsdp_activation_checkpointing

    @property
    def activation_offloading(self) -> bool:
        """The checkpointed layers' inputs wait in pinned host memory."""
        return self.config.run.activation_offloading

    @property
    def pure_bf16(self) -> bool:
        return self.config.model.pure_bf16

    @property
    def torch_compile(self) -> str | None:
        """The backend torch_compile compiles each decoder layer with (inductor unless named); None when off."""
        run = self.config.run
        return (run.torch_compile_backend or "inductor") if run.torch_compile else None

    @property
    def use_liger_kernel(self) -> bool:
        """Liger's kernels for the norms, activations and RoPE (on CUDA)."""
        return self.config.run.use_liger_kernel

    @property
    def mixed_precision(self) -> str:
        """bf16, fp16 or no; pure bf16 computes in bf16 whatever the flags say, as the trainer does."""
        return "bf16" if self.pure_bf16 else self.precision_asked

    @property
    def precision_asked(self) -> str:
        """What the config's keys pick on these GPUs (TrainConfig.precision_on), pure bf16 aside."""
        return self.config.mixed_precision if self.native_bf16 is None else self.config.precision_on(self.native_bf16)

    @property
    def optimizer(self) -> str:
        """A name of config/optimizers.py's table (Transformers' optim names)."""
        return self.config.optim.optim

    @property
    def attn_implementation(self) -> str:
        """The attention the trainer asks for: flash_attention_2 with use_flash_attn, else attn_implementation."""
        model = self.config.model
        return "flash_attention_2" if model.use_flash_attn else model.attn_implementation

    def label(self) -> str:
        """Short human name of the parallel setup, e.g. 'FSDP FULL_SHARD + CPU offload'."""
        if not self.strategy.shards_parameters:
            return self.strategy.label
        text = f"{self.strategy.label} {self.sharding_strategy}"
        return text + " + CPU offload" if self.offload_params else text

    def to_dict(self) -> dict[str, Any]:
        """The setup by the CLI's option names, the strategy by its name (the estimate's JSON)."""
        out = {name: getattr(self, name) for name in SUMMARY}
        out.update(strategy=self.strategy.name, sharding_strategy=self.sharding_name,
                   lora_modules_to_save=list(self.lora_modules_to_save))
        return out


_OWN_FIELDS = frozenset(f.name for f in fields(Setup)) - {"config"}  # what a config cannot say


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
    autocast = master == 4 and setup.strategy.autocasts
    fp32_stream = autocast and setup.method != "qlora"
    return Dtypes(2, master, 2, 4 if fp32_stream else 2, autocast and setup.method == "full")


def normalize_sharding(value: str) -> str:
    """FSDP sharding strategy name, accepting DeepSpeed's ZeRO-1/2/3 names."""
    stage = zero_stage(value)
    if stage is not None and ZERO_STAGES[stage][1]:
        return ZERO_STAGES[stage][1]
    return check_choice(value.upper(), SHARDING_STRATEGIES + ("ZERO1", "ZERO2", "ZERO3"), "sharding strategy")


# The numbers the estimate reads, by their estimate option's name, each with the train key whose declared lower
# bound it keeps (None: the estimate's own counts, at least 1).
_NUMBERS = {"num_gpus": None, "num_nodes": None, "batch_size": "per_device_train_batch_size",
            "seq_len": "max_seq_len", "gradient_accumulation_steps": "gradient_accumulation_steps", "lora_r": "lora_r"}


def _checked_numbers(setup: Setup) -> None:
    lowest = {d.name: d.meta.ge for d in all_keys()}
    problems = []
    for name, key in _NUMBERS.items():
        value, low = getattr(setup, name), lowest[key] if key else 1
        if not isinstance(value, int) or value < low:
            problems.append(f"--{name.replace('_', '-')} must be a whole number >= {low} (got {value})"
                            + (": a row needs one token to predict from and one to predict" if name == "seq_len"
                               else ""))
    if problems:
        raise UsageError("; ".join(problems) + ".")


def validate(setup: Setup) -> Setup:
    """Check every setting the estimate reads, report the numbers' problems in one line, and return the setup with
    names normalised (the strategy by its registry name, the optimizer by the trainer's)."""
    _checked_numbers(setup)
    if (refused := NOT_RUN.get(str(setup.optimizer).lower())) is not None:
        raise UsageError(f"--optimizer {setup.optimizer}: {refused}")
    d = setup.config.distributed
    asked = strategy_named(d.distributed_type) if d.distributed_type is not None else None
    setup = setup.with_(
        distributed_type=asked, fsdp_sharding_strategy=normalize_sharding(d.fsdp_sharding_strategy),
        mixed_precision=check_choice(setup.precision_asked, MIXED_PRECISIONS, "mixed precision"),
        optim=canonical(check_choice(setup.optimizer, OPTIMIZERS, "optimizer")),
        attn_implementation=check_choice(setup.config.model.attn_implementation, ATTENTION,
                                         "attention implementation"),
        loss=check_choice(setup.loss, LOSSES, "loss"))
    if asked is not None and asked.one_device and setup.world_size > 1:
        one = " ".join(f"--num-{what} 1" for what, count in (("gpus", setup.num_gpus), ("nodes", setup.num_nodes))
                       if count > 1)  # the options that ask for more than one (not --num-gpus 1 when it is 1)
        raise UsageError(f"--strategy {asked} uses one GPU but --num-gpus x --num-nodes is {setup.world_size}: "
                         f"use another strategy, or {one}.")
    if asked is not None and asked.drives_several_devices and setup.num_nodes > 1:
        raise UsageError(f"--strategy {asked}: one process drives the GPUs of its own machine, not {setup.num_nodes} "
                         f"machines; use PP (a process per GPU, across machines) or FSDP, or --num-nodes 1.")
    if setup.pure_bf16 and setup.precision_asked == "fp16":
        raise UsageError("--pure-bf16 keeps weights in bfloat16: it needs --mixed-precision bf16.")
    if setup.activation_offloading and not setup.gradient_checkpointing:
        raise UsageError("--activation-offloading moves the layer inputs that gradient checkpointing keeps to host "
                         "memory: use it with --gradient-checkpointing.")
    if d.fsdp_offload_params and not setup.strategy.shards_parameters:
        raise UsageError("--offload-params is FSDP's CPU offload: use it with --strategy FSDP (or auto).")
    return setup


__all__ = ["ATTENTION", "LOSSES", "METHODS", "MIXED_PRECISIONS", "OPTIMIZERS", "SHARDING_STRATEGIES", "Dtypes",
           "Setup", "dtypes", "normalize_sharding", "validate"]
