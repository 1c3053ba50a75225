"""The training configuration's schema: one small typed section per concern, and the values each key accepts.

Names are the ones users know from Transformers' ``TrainingArguments``, TRL's ``SFTConfig``, PEFT and Accelerate's
config files, so a recipe carries over. Reading (``loading``) and checking (``validation``) live beside this module.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from shardtune.config.optimizers import OPTIMIZERS
from shardtune.data.config import DataConfig

DISTRIBUTED_TYPES = ("NO", "DDP", "FSDP", "MP", "PP")
PIPELINE_SCHEDULES = ("GPipe", "1F1B")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
MIXED_PRECISIONS = ("bf16", "fp16", "no")
TORCH_DTYPES = ("auto", "float32", "bfloat16")  # float16 is refused: pure fp16 diverges without an fp32 master
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES_STEPS = ("steps", "epoch", "no")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
# Transformers' optimizer names the trainer runs: config/optimizers.py's table (built in train/optim.py).
ACCEPTED_OPTIMS = tuple(OPTIMIZERS)
# The final model is uploaded once, after training (train/loop.py push_to_hub): Transformers calls that "end".
HUB_STRATEGIES = ("end",)
# report_to: each experiment tracker, the module it imports and the PyPI package that provides it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow-skinny"), "trackio": ("trackio", "trackio")}
BACKWARD_PREFETCH = ("BACKWARD_PRE",)
FSDP_VERSIONS = (2,)  # the trainer shards with FSDP2's fully_shard
SECRET_KEYS = {"hub_token"}  # never written into config.yaml beside the checkpoints
# The data set that ``shardtune estimate --emit-config`` writes (memory/trace_setup.py): the user fills it in.
DATASET_PLACEHOLDER = "REPLACE_WITH_YOUR_DATASET"


@dataclass
class ModelConfig:
    model_name_or_path: str | None = None
    attn_implementation: str = "sdpa"
    use_flash_attn: bool = False  # flash_attention_2 when installed and on CUDA; sdpa otherwise, with a warning
    trust_remote_code: bool = False
    # TRL's model dtype: auto/float32 keep fp32 trainable weights under mixed precision; bfloat16 trains pure bf16
    # (weights, gradients and optimizer states in bf16, no fp32 master; stochastically rounded AdamW updates).
    torch_dtype: str | None = None
    dtype: str | None = None  # Transformers 5's name for torch_dtype

    @property
    def weights_dtype(self) -> str:
        """auto, float32 or bfloat16: torch_dtype or its alias dtype (validation refuses the two disagreeing)."""
        return str(self.torch_dtype or self.dtype or "auto").lower().removeprefix("torch.")

    @property
    def pure_bf16(self) -> bool:
        return self.weights_dtype == "bfloat16"


@dataclass
class LoraConfig:
    use_peft_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    use_dora: bool = False  # DoRA: a trained magnitude per output feature on top of the LoRA direction update
    use_rslora: bool = False  # rank-stabilised LoRA: scale the update by alpha / sqrt(r) instead of alpha / r
    # Modules trained in full beside the adapters and saved in the adapter folder (PEFT's modules_to_save).
    lora_modules_to_save: list[str] = field(default_factory=list)
    init_lora_weights: str = "true"  # PEFT's init_lora_weights: true, false, gaussian, pissa, pissa_niter_N, olora
    lora_bias: str = "none"  # PEFT's bias: none, all (every bias trains) or lora_only (biases of adapted layers)
    use_4bit_quantization: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_nested_quant: bool = True  # double quantisation of the quantisation constants (QLoRA paper, sec. 3)
    bnb_4bit_compute_dtype: str = "bfloat16"
    # bf16 storage so the packed 4-bit weights share a dtype with the rest and FSDP can shard them.
    bnb_4bit_quant_storage_dtype: str = "bfloat16"

    @property
    def method(self) -> str:
        """What trains, in the estimator's words (``Setup.method``): full, lora or qlora."""
        return "qlora" if self.use_4bit_quantization else "lora" if self.use_peft_lora else "full"


@dataclass
class OptimConfig:
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch"  # Transformers' optimizer names: torch's AdamW, bitsandbytes' 8-bit/paged, ...


@dataclass
class RunConfig:
    output_dir: str | None = None
    # A folder holding an earlier run is refused unless resuming; true deletes that run's files first.
    overwrite_output_dir: bool = False
    seed: int = 42
    num_train_epochs: float = 1.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    # Keep the inputs that gradient checkpointing saves of each decoder layer in pinned CPU memory, copied on a side
    # stream while compute goes on and brought back one layer ahead in backward (torchtune's name; needs checkpointing).
    activation_offloading: bool = False
    # Liger's Triton kernels for RMSNorm, RoPE and SwiGLU on CUDA (TRL's key; pip install liger-kernel); on a CPU a
    # warning and transformers' modules. The loss stays shardtune's fused one.
    use_liger_kernel: bool = False
    # Compile each decoder layer with torch.compile (dynamic shapes, so packed lengths do not recompile); off by
    # default: on a CPU it did not pay (docs/choosing-a-setup.md). A backend that cannot compile: a warning, then eager.
    torch_compile: bool = False
    torch_compile_backend: str | None = None  # a torch.compile backend (default inductor); setting it turns compile on
    torch_compile_mode: str | None = None  # default, reduce-overhead, max-autotune, ...; setting it turns compile on
    # None: bf16 mixed precision where the hardware computes bf16 natively (CUDA 8.0+, CPUs with AVX512-BF16 or AMX),
    # fp32 elsewhere (TrainConfig.precision_on); a run records what it chose (config.yaml). false opts out.
    bf16: bool | None = None
    fp16: bool = False
    logging_steps: int = 10
    logging_strategy: str = "steps"
    log_level: str = "passive"
    eval_strategy: str = "no"
    eval_steps: int | None = None
    eval_on_start: bool = False  # evaluate once before the first step (a baseline for the curve)
    # Stop when metric_for_best_model has not improved by more than the threshold for this many evaluations.
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0
    neftune_noise_alpha: float | None = None  # NEFTune: uniform noise on the input embeddings while training
    # Experiment trackers that get every metrics.jsonl record and the config, on rank 0: names of TRACKER_PACKAGES,
    # "all" (every installed one) or "none"; resolved to the list of names at load.
    report_to: list[str] = field(default_factory=list)
    run_name: str | None = None  # the run's name in every tracker; default: the output_dir's folder name
    ddp_timeout: int = 1800  # seconds a collective may wait before the run stops naming the rank and operation
    dry_run: bool = False
    # shardtune logs the first step by default (Transformers does not): false leaves step 1 to logging_steps.
    logging_first_step: bool = True
    disable_tqdm: bool = False  # no progress bar (the log lines and metrics.jsonl stay)
    save_safetensors: bool = True  # final/ and checkpoints hold no pickles: false is refused
    # Trace the job at the end and record the predicted peak beside the measured one. The environment variable
    # SHARDTUNE_PREDICT_MEMORY=0 changes this default (test suites run hundreds of short jobs).
    predict_memory: bool = field(default_factory=lambda: os.environ.get("SHARDTUNE_PREDICT_MEMORY", "1") != "0")
    # Hub flags: the final model is uploaded where the hub is reachable (a warning, not a failure, where not).
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_strategy: str = "end"  # the final model is uploaded once, at the end of training
    # Callbacks made on every rank: importable classes, package.module:Class (see shardtune/train/callbacks.py).
    callbacks: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None  # the best checkpoint is kept beyond it (load_best_model_at_end)
    load_best_model_at_end: bool = False  # final/ holds the best checkpoint's weights, not the last step's
    metric_for_best_model: str | None = None  # an eval record's key (eval_loss, eval_perplexity); default eval_loss
    greater_is_better: bool | None = None  # default: false for a loss or perplexity, true otherwise
    resume_from_checkpoint: str | None = None  # a checkpoint folder, or "true" for the newest in output_dir


@dataclass
class DistributedConfig:
    distributed_type: str | None = None  # None: DDP when launched on several processes, else NO
    fsdp_sharding_strategy: str = "FULL_SHARD"
    fsdp_offload_params: bool = False
    fsdp_auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    fsdp_transformer_layer_cls_to_wrap: str | None = None  # default: the model's own decoder layer class
    fsdp_min_num_params: int = 100_000_000
    fsdp_cpu_ram_efficient_loading: bool = True
    fsdp_sync_module_states: bool = True
    fsdp_state_dict_type: str = "SHARDED_STATE_DICT"
    fsdp_reshard_after_forward: bool | None = None  # FSDP2's name; overrides what the sharding strategy implies
    fsdp_activation_checkpointing: bool = False
    # FSDP2 prefetches the next unit's parameters before the current one's backward: BACKWARD_PRE, the only one.
    fsdp_backward_prefetch: str | None = None
    fsdp_forward_prefetch: bool = False  # also all-gather the next decoder layer while this one runs forward
    fsdp_version: int = 2  # shardtune runs FSDP2 (fully_shard); 1 is refused
    ddp_find_unused_parameters: bool | None = None  # DDP's find_unused_parameters (None: false)
    mixed_precision: str | None = None  # Accelerate's key; bf16/fp16 flags win when set
    # A DeepSpeed config JSON (Transformers/TRL's --deepspeed), mapped onto FSDP2 when the config is read
    # (config/deepspeed.py); the mapped values are in this config, the path is kept to say where they came from.
    deepspeed: str | None = None
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    # PP: one stage of decoder layers per process; each batch is split into this many pipeline micro-batches.
    pipeline_schedule: str = "1F1B"
    pipeline_microbatches: int = 2
    mp_devices: str | None = None  # MP: comma-separated devices (cuda:0,cuda:1); default: every visible GPU


@dataclass
class TrainConfig:
    """The whole job, one section per concern; functions receive only the section they need."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def precision_on(self, native_bf16: bool) -> str:
        """bf16 / fp16 / no on hardware that does (or does not) compute bf16 natively: TrainingArguments' flags
        first, then Accelerate's ``mixed_precision``; where neither says, bf16 if native, else no (fp32)."""
        if self.run.bf16:
            return "bf16"
        if self.run.fp16:
            return "fp16"
        asked = self.distributed.mixed_precision
        if self.run.bf16 is False:  # the opt-out: a recipe's mixed_precision bf16 does not bring bf16 back
            return "fp16" if asked == "fp16" else "no"
        if asked is not None:
            return asked.lower()
        return "bf16" if native_bf16 else "no"

    @property
    def precision_left_to_hardware(self) -> bool:
        """Nothing in the config chooses the precision: the device decides (``precision_on``)."""
        return self.run.bf16 is None and not self.run.fp16 and self.distributed.mixed_precision is None

    @property
    def mixed_precision(self) -> str:
        """bf16 / fp16 / no for a job on this machine: ``precision_on`` this process's device, asked only where
        the config leaves the choice to the hardware."""
        if not self.precision_left_to_hardware:
            return self.precision_on(False)
        from shardtune.hardware import local_native_bf16

        return self.precision_on(local_native_bf16()[0])

    def to_flat(self) -> dict[str, Any]:
        """Every key at the top level, as ``shardtune train`` reads it back (secrets left out)."""
        return {k: v for section in dataclasses.fields(self) for k, v in
                dataclasses.asdict(getattr(self, section.name)).items() if k not in SECRET_KEYS}


def section_classes() -> dict[str, type]:
    """Each section's name and its dataclass."""
    return {f.name: type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)}


def known_keys() -> dict[str, str]:
    """Every accepted key and the section that holds it."""
    keys = {}
    for section, cls in section_classes().items():
        for f in dataclasses.fields(cls):
            keys[f.name] = section
    return keys
