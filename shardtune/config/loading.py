"""The training configuration: small typed sections, one precedence order, every problem reported at once.

Names are the ones users know from Transformers' ``TrainingArguments``, TRL's ``SFTConfig``, PEFT and Accelerate's
config files, so a recipe written for ``accelerate launch --config_file fsdp_config.yaml train.py --key value ...``
carries over. Precedence, lowest first (written once, here, and tested):

    defaults < Accelerate config file (--config_file) < YAML recipe < key=value overrides < --key value flags

The resolved config is written beside every checkpoint as flat YAML that ``shardtune train`` reads back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from shardtune.data.config import DataConfig
from shardtune.data.readers import looks_like_local_path
from shardtune.errors import UsageError, closest

DISTRIBUTED_TYPES = ("NO", "DDP", "FSDP", "MP", "PP")
PIPELINE_SCHEDULES = ("GPipe", "1F1B")
# Accelerate's names for data parallel; both mean one replica per process here.
DISTRIBUTED_ALIASES = {"MULTI_GPU": "DDP", "MULTI_CPU": "DDP", "MULTI_XPU": "DDP", "MULTI_NPU": "DDP",
                       "MULTI_MLU": "DDP", "MULTI_HPU": "DDP"}
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
# FSDP1's enum values, which older Accelerate configs write as numbers; HYBRID_SHARD_ZERO2 (5) keeps gathered
# parameters inside the node like SHARD_GRAD_OP, which FSDP2 spells HYBRID_SHARD without resharding.
SHARDING_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD"}
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES_STEPS = ("steps", "epoch", "no")
SECRET_KEYS = {"hub_token"}  # never written into config.yaml beside the checkpoints
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
# The data set that ``shardtune estimate --emit-config`` writes (memory/trace_setup.py): the user fills it in.
DATASET_PLACEHOLDER = "REPLACE_WITH_YOUR_DATASET"
# resume_from_checkpoint values that name no folder (train/checkpoint.py resolve_resume reads them the same way).
RESUME_NEWEST = ("true", "yes", "1", "latest")
RESUME_OFF = ("false", "no", "0", "")
MANIFEST = "manifest.json"  # written last into a checkpoint folder: its presence means the save completed
STEP_FOLDER = re.compile(r"step-(\d+)$")


@dataclass
class ModelConfig:
    model_name_or_path: str | None = None
    attn_implementation: str = "sdpa"
    use_flash_attn: bool = False  # flash_attention_2 when installed and on CUDA; sdpa otherwise, with a warning
    trust_remote_code: bool = False


@dataclass
class LoraConfig:
    use_peft_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
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


@dataclass
class RunConfig:
    output_dir: str | None = None
    seed: int = 42
    num_train_epochs: float = 1.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    bf16: bool = False
    fp16: bool = False
    logging_steps: int = 10
    logging_strategy: str = "steps"
    log_level: str = "passive"
    eval_strategy: str = "no"
    eval_steps: int | None = None
    report_to: str = "none"  # "tensorboard" writes event files beside metrics.jsonl
    ddp_timeout: int = 1800  # seconds a collective may wait before the run stops naming the rank and operation
    dry_run: bool = False
    # Trace the job at the end and record the predicted peak beside the measured one. The environment variable
    # SHARDTUNE_PREDICT_MEMORY=0 changes this default (test suites run hundreds of short jobs).
    predict_memory: bool = field(default_factory=lambda: os.environ.get("SHARDTUNE_PREDICT_MEMORY", "1") != "0")
    # Hub flags: the final model is uploaded where the hub is reachable (a warning, not a failure, where not).
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_strategy: str = "every_save"


@dataclass
class CheckpointConfig:
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
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
    # Accepted from FSDP1-era Accelerate configs; FSDP2 prefetches and keeps original parameters by design.
    fsdp_backward_prefetch: str | None = None
    fsdp_forward_prefetch: bool = False
    fsdp_use_orig_params: bool = True
    fsdp_version: int = 2
    mixed_precision: str | None = None  # Accelerate's key; bf16/fp16 flags win when set
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

    @property
    def mixed_precision(self) -> str:
        """bf16 / fp16 / no, from TrainingArguments' flags first, then Accelerate's ``mixed_precision``."""
        if self.run.bf16:
            return "bf16"
        if self.run.fp16:
            return "fp16"
        return (self.distributed.mixed_precision or "no").lower()

    def to_flat(self) -> dict[str, Any]:
        """Every key at the top level, as ``shardtune train`` reads it back (secrets left out)."""
        return {k: v for section in dataclasses.fields(self) for k, v in
                dataclasses.asdict(getattr(self, section.name)).items() if k not in SECRET_KEYS}


def _section_classes() -> dict[str, type]:
    return {f.name: type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)}


def known_keys() -> dict[str, str]:
    """Every accepted key and the section that holds it."""
    keys = {}
    for section, cls in _section_classes().items():
        for f in dataclasses.fields(cls):
            keys[f.name] = section
    return keys


# Keys of Accelerate config files that describe the machine or other launchers; read and deliberately unused.
ACCELERATE_IGNORED = {"compute_environment", "debug", "main_training_function", "downcast_bf16", "same_network",
                      "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "gpu_ids", "enable_cpu_affinity",
                      "dynamo_config", "megatron_lm_config", "ipex_config", "mpirun_config", "tpu_name",
                      "tpu_zone", "commands", "command_file", "fp8_config", "parallelism_config",
                      "fsdp_offload_optimizer"}
# TrainingArguments / TRL keys that shardtune accepts and that change nothing here (logging of other tools).
IGNORED_KEYS = {"logging_first_step", "logging_nan_inf_filter", "dataloader_num_workers", "remove_unused_columns",
                "overwrite_output_dir", "do_train", "do_eval", "run_name", "disable_tqdm", "save_safetensors",
                "optim", "include_num_input_tokens_seen", "ddp_find_unused_parameters"}


@dataclass
class Source:
    """Where a value came from, for error messages: a file and line, or the command line."""

    where: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.where}, line {self.line}" if self.line else self.where


def _yaml_with_lines(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Load a YAML mapping and the line of each top-level (and fsdp_config) key."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}; check the path") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix the syntax") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of key: value lines, got {type(data).__name__}")
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        lines[key_node.value] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for k, _ in value_node.value:
                lines[k.value] = k.start_mark.line + 1
    return data, lines


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    """Lift Accelerate's nested ``fsdp_config`` (and DeepSpeed's zero stage) to top-level keys."""
    flat = {}
    for key, value in data.items():
        if key == "fsdp_config" and isinstance(value, dict):
            flat.update(value)
        elif key == "deepspeed_config" and isinstance(value, dict):
            # ZeRO-3 shards parameters like FULL_SHARD; ZeRO-1/2 keep them whole like SHARD_GRAD_OP.
            stage = int(value.get("zero_stage", 3))
            flat["fsdp_sharding_strategy"] = "FULL_SHARD" if stage == 3 else "SHARD_GRAD_OP"
            if str(value.get("offload_param_device", "none")).lower() == "cpu":
                flat["fsdp_offload_params"] = True
        else:
            flat[key] = value
    return flat


def read_accelerate_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Source]]:
    """An Accelerate config file (``accelerate config`` output) as flat shardtune keys, read as it is."""
    path = Path(path)
    data, lines = _yaml_with_lines(path)
    flat = _flatten(data)
    if str(flat.get("distributed_type", "")).upper() == "DEEPSPEED":
        flat["distributed_type"] = "FSDP"
    values, sources = {}, {}
    for key, value in flat.items():
        if key in ACCELERATE_IGNORED:
            continue
        values[key] = value
        sources[key] = Source(str(path), lines.get(key))
    return values, sources


def read_yaml_recipe(path: str | Path) -> tuple[dict[str, Any], dict[str, Source]]:
    """A shardtune YAML recipe: flat keys (an ``fsdp_config:`` block is also accepted)."""
    path = Path(path)
    data, lines = _yaml_with_lines(path)
    flat = _flatten(data)
    return flat, {k: Source(str(path), lines.get(k)) for k in flat}


def parse_cli_pairs(argv: list[str]) -> tuple[list[str], dict[str, Any], dict[str, Any], dict[str, Source]]:
    """Split ``[CONFIG.yaml] key=value ... --key value --flag ...`` into files, overrides, flags and sources.

    ``key=value`` overrides and ``--key value`` flags are kept apart: flags win whatever their order on the line.
    A ``--key`` followed by another ``--key`` (or nothing) is a boolean flag set to true, as with HfArgumentParser.
    """
    files: list[str] = []
    overrides: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value = argv[i + 1]
                    i += 1
                else:
                    value = "true"
            flags[key] = value
            sources[key] = Source(f"command line (--{key})")
        elif "=" in arg:
            key, _, value = arg.partition("=")
            overrides[key] = value
            sources.setdefault(key, Source(f"command line ({key}=...)"))
        else:
            files.append(arg)
        i += 1
    return files, overrides, flags, sources


_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def parse_bool(value: Any) -> bool:
    """A boolean as recipes and the command line write it (true/false, yes/no, on/off, 1/0, any case)."""
    if isinstance(value, bool):
        return value
    lowered = str(value).lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected true or false")


def _coerce(value: Any, hint: Any) -> Any:
    """Turn a YAML or command-line value into the field's type; raises ValueError with the accepted form."""
    text = str(hint)
    optional = "None" in text
    if value is None or (isinstance(value, str) and value.lower() in {"none", "null"} and optional):
        if optional:
            return None
        raise ValueError("a value is required")
    if "bool" in text and "int" not in text.replace("bool", ""):
        return parse_bool(value)
    if text.startswith("int") or text == "<class 'int'>" or "int |" in text:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("expected an integer") from None
        if not number.is_integer():
            raise ValueError("expected an integer")
        return int(number)
    if "float" in text:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
        if not math.isfinite(number):
            raise ValueError("expected a finite number")
        return number
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


Layers = list[tuple[dict[str, Any], dict[str, Source]]]


def build_config(layers: Layers, *, training: bool = True) -> TrainConfig:
    """Apply ``layers`` (lowest precedence first) onto the defaults; report every problem together. With
    ``training`` False (``data inspect``), nothing will be written, so no output_dir is needed, and the data set is
    read next, so it must be real data."""
    cfg, given, problems = _apply(layers, training=training)
    if not training:
        problems += _input_problems(cfg, given)
    _raise(problems)
    return cfg


def _raise(problems: list[str]) -> None:
    if problems:
        raise UsageError(" | ".join(problems) if len(problems) > 1 else problems[0])


def _apply(layers: Layers, *, training: bool) -> tuple[TrainConfig, dict[str, Source], list[str]]:
    """The config ``layers`` make, where each key's value came from, and every problem found."""
    cfg = TrainConfig()
    given: dict[str, Source] = {}
    sections = _section_classes()
    owner = known_keys()
    hints = {name: get_type_hints(cls) for name, cls in sections.items()}
    problems: list[str] = []
    for values, sources in layers:
        for key, value in values.items():
            source = sources.get(key, Source("config"))
            if key in IGNORED_KEYS or key in ACCELERATE_IGNORED:
                continue
            if key not in owner:
                hint = closest(key, list(owner))
                did_you_mean = f"; did you mean '{hint}'?" if hint else "; see 'shardtune train --help-keys'"
                problems.append(f"{source}: unknown key '{key}'{did_you_mean}")
                continue
            section = owner[key]
            try:
                coerced = _coerce(value, hints[section][key])
            except ValueError as exc:
                problems.append(f"{source}: {key}={value!r}: {exc}")
                continue
            setattr(getattr(cfg, section), key, coerced)
            given[key] = source
    _normalise(cfg)
    problems += [_located(problem, given) for problem in validate(cfg, training=training)]
    return cfg, given, problems


def _located(problem: str, given: dict[str, Source]) -> str:
    """``problem`` led by the file and line that set the key it names first (the command line needs no pointer:
    the key is on it)."""
    key = re.match(r"[a-z][a-z0-9_]*", problem)
    source = given.get(key.group(0)) if key else None
    return f"{source}: {problem}" if source and source.line else problem


def _input_problems(cfg: TrainConfig, given: dict[str, Source]) -> list[str]:
    """The model or data named as local paths that are not there, or the --emit-config data placeholder: checked
    without any network call, since a hub name is only read when the job loads it."""
    problems = []
    where = {key: given.get(key, Source("config")) for key in ("model_name_or_path", "dataset_name")}
    model = cfg.model.model_name_or_path
    if model and looks_like_local_path(model) and not Path(model).expanduser().exists():
        problems.append(f"{where['model_name_or_path']}: model_name_or_path '{model}' does not exist: give a local "
                        f"model folder or a hub name (ORG/NAME)")
    data = cfg.data.dataset_name
    if data == DATASET_PLACEHOLDER:
        problems.append(f"{where['dataset_name']}: dataset_name is still the placeholder {DATASET_PLACEHOLDER} that "
                        f"'shardtune estimate --emit-config' writes; set dataset_name to your data (a local "
                        f"file/folder or a hub data set)")
    elif data and looks_like_local_path(data) and not Path(data).expanduser().exists():
        problems.append(f"{where['dataset_name']}: dataset_name '{data}' does not exist: check the path")
    return problems


def checkpoint_folder_problem(folder: str | Path, label: str, *, or_else: str = "") -> str | None:
    """Why ``folder`` is not a complete checkpoint, as one line starting with ``label``; None when it is one.

    A folder that does not exist gets the step-N folders beside it listed, so a mistyped step is fixed at a glance.
    """
    path = Path(folder)
    if (path / MANIFEST).is_file():
        return None
    if path.exists():
        return (f"{label}: not a complete shardtune checkpoint (no {MANIFEST}); give an "
                f"output_dir/checkpoints/step-N folder{or_else}")
    parent = path.parent
    steps = sorted((int(m.group(1)), p) for p in parent.iterdir() if (m := STEP_FOLDER.match(p.name))
                   and p.is_dir()) if parent.is_dir() else []
    complete = [p.name for _, p in steps if (p / MANIFEST).is_file()]
    if complete:
        return f"{label}: no such folder; {parent} holds {', '.join(complete)}: give one of those{or_else}"
    if steps:
        beside = f"{parent} holds only incomplete checkpoints: {', '.join(p.name for _, p in steps)}"
    else:
        beside = f"{parent} holds no step-N folder" if parent.is_dir() else f"{parent} does not exist either"
    return f"{label}: no such folder ({beside}); give an output_dir/checkpoints/step-N folder{or_else}"


def _run_problems(cfg: TrainConfig, given: dict[str, Source]) -> list[str]:
    """What only a real run trips over, found before it loads a model: a missing model or data path, placeholder
    data, a missing checkpoint."""
    problems = _input_problems(cfg, given)
    spec = cfg.checkpoint.resume_from_checkpoint
    if spec is not None and spec.lower() not in RESUME_NEWEST + RESUME_OFF:
        where = given.get("resume_from_checkpoint", Source("config"))
        problem = checkpoint_folder_problem(spec, f"{where}: resume_from_checkpoint={spec}",
                                            or_else=", or true for the newest one")
        if problem:
            problems.append(problem)
    return problems


def _normalise(cfg: TrainConfig) -> None:
    """Canonical spellings: upper-case enum names, Accelerate's aliases and FSDP1 numbers."""
    d = cfg.distributed
    if d.distributed_type is not None:
        kind = str(d.distributed_type).upper()
        d.distributed_type = DISTRIBUTED_ALIASES.get(kind, kind)
    d.fsdp_sharding_strategy = SHARDING_NUMBERS.get(str(d.fsdp_sharding_strategy),
                                                    str(d.fsdp_sharding_strategy).upper())
    d.fsdp_auto_wrap_policy = str(d.fsdp_auto_wrap_policy).upper()
    d.fsdp_state_dict_type = str(d.fsdp_state_dict_type).upper()
    if d.mixed_precision is not None:
        d.mixed_precision = d.mixed_precision.lower()
    cfg.optim.lr_scheduler_type = cfg.optim.lr_scheduler_type.lower()
    for name in ("logging_strategy", "eval_strategy", "log_level"):
        setattr(cfg.run, name, getattr(cfg.run, name).lower())
    cfg.checkpoint.save_strategy = cfg.checkpoint.save_strategy.lower()


def _choice(problems: list[str], key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest(str(value), choices)
        did_you_mean = f" (did you mean {hint}?)" if hint else ""
        problems.append(f"{key}={value!r} is not accepted; use one of {', '.join(choices)}{did_you_mean}")


def validate(cfg: TrainConfig, *, training: bool = True) -> list[str]:
    """Every problem with the resolved config, one line each."""
    problems: list[str] = []
    d, r, o, lo, ck = cfg.distributed, cfg.run, cfg.optim, cfg.lora, cfg.checkpoint
    if not cfg.model.model_name_or_path:
        problems.append("model_name_or_path is required: a local model folder or a hub name "
                        "(e.g. --model_name_or_path ./my-model)")
    if training and not r.output_dir:
        problems.append("output_dir is required (e.g. --output_dir out)")
    if d.distributed_type is not None:
        _choice(problems, "distributed_type", d.distributed_type, DISTRIBUTED_TYPES)
    _choice(problems, "fsdp_sharding_strategy", d.fsdp_sharding_strategy, SHARDING_STRATEGIES)
    _choice(problems, "fsdp_auto_wrap_policy", d.fsdp_auto_wrap_policy, WRAP_POLICIES)
    _choice(problems, "fsdp_state_dict_type", d.fsdp_state_dict_type, STATE_DICT_TYPES)
    if d.mixed_precision is not None:
        _choice(problems, "mixed_precision", d.mixed_precision, MIXED_PRECISIONS)
    if r.bf16 and r.fp16:
        problems.append("bf16 and fp16 are both true; choose one")
    _choice(problems, "lr_scheduler_type", o.lr_scheduler_type, SCHEDULERS)
    _choice(problems, "logging_strategy", r.logging_strategy, STRATEGIES_STEPS)
    _choice(problems, "eval_strategy", r.eval_strategy, STRATEGIES_STEPS)
    _choice(problems, "save_strategy", ck.save_strategy, STRATEGIES_STEPS)
    _choice(problems, "log_level", r.log_level, LOG_LEVELS)
    _choice(problems, "report_to", r.report_to, ("none", "tensorboard"))
    _choice(problems, "bnb_4bit_quant_type", lo.bnb_4bit_quant_type, ("nf4", "fp4"))
    for key, value in (("per_device_train_batch_size", r.per_device_train_batch_size),
                       ("per_device_eval_batch_size", r.per_device_eval_batch_size),
                       ("gradient_accumulation_steps", r.gradient_accumulation_steps),
                       ("logging_steps", r.logging_steps), ("save_steps", ck.save_steps),
                       ("lora_r", lo.lora_r), ("num_processes", d.num_processes),
                       ("num_machines", d.num_machines), ("ddp_timeout", r.ddp_timeout),
                       ("save_total_limit", 1 if ck.save_total_limit is None else ck.save_total_limit)):
        if value < 1:
            problems.append(f"{key}={value} must be at least 1")
    if r.max_steps == 0 or r.max_steps < -1:
        problems.append(f"max_steps={r.max_steps} must be a positive number of optimizer steps, or -1 for epochs")
    if r.num_train_epochs <= 0 and r.max_steps == -1:
        problems.append(f"num_train_epochs={r.num_train_epochs} must be positive (or set max_steps)")
    if o.learning_rate < 0:
        problems.append(f"learning_rate={o.learning_rate} must not be negative")
    if not 0 <= o.warmup_ratio <= 1:
        problems.append(f"warmup_ratio={o.warmup_ratio} must be between 0 and 1")
    for key, value in (("warmup_steps", o.warmup_steps), ("weight_decay", o.weight_decay),
                       ("max_grad_norm", o.max_grad_norm)):
        if value < 0:
            problems.append(f"{key}={value} must not be negative")
    if not 0 <= lo.lora_dropout < 1:
        problems.append(f"lora_dropout={lo.lora_dropout} must be in [0, 1)")
    if lo.use_4bit_quantization and not lo.use_peft_lora:
        problems.append("use_4bit_quantization trains LoRA adapters on a frozen 4-bit base (QLoRA); "
                        "set use_peft_lora true as well")
    if r.eval_strategy == "steps" and (r.eval_steps or r.logging_steps) < 1:
        problems.append("eval_steps must be at least 1")
    if d.num_processes % d.num_machines:
        problems.append(f"num_processes={d.num_processes} is the total over all machines and must be a multiple "
                        f"of num_machines={d.num_machines}")
    problems += _validate_pipeline(cfg)
    problems += cfg.data.validate()
    return problems


def _validate_pipeline(cfg: TrainConfig) -> list[str]:
    """PP needs a known schedule and batches that split into whole pipeline micro-batches."""
    d, r = cfg.distributed, cfg.run
    problems: list[str] = []
    if d.pipeline_schedule.upper() not in {s.upper() for s in PIPELINE_SCHEDULES}:
        problems.append(f"pipeline_schedule={d.pipeline_schedule!r} is not accepted; use one of "
                        f"{', '.join(PIPELINE_SCHEDULES)}")
    if d.pipeline_microbatches < 1:
        problems.append(f"pipeline_microbatches={d.pipeline_microbatches} must be at least 1")
    elif d.distributed_type == "PP" and r.per_device_train_batch_size % d.pipeline_microbatches:
        problems.append(f"per_device_train_batch_size={r.per_device_train_batch_size} must be a multiple of "
                        f"pipeline_microbatches={d.pipeline_microbatches} (each batch is split into them)")
    if (d.distributed_type == "PP" and r.eval_strategy != "no" and d.pipeline_microbatches >= 1
            and r.per_device_eval_batch_size % d.pipeline_microbatches):
        problems.append(f"per_device_eval_batch_size={r.per_device_eval_batch_size} must be a multiple of "
                        f"pipeline_microbatches={d.pipeline_microbatches} (each eval batch is split into them)")
    if d.distributed_type == "PP" and cfg.mixed_precision == "fp16":
        # Each stage would need the loss scale in its backward and a skip decision shared by every stage.
        problems.append("fp16 with distributed_type=PP: the pipeline's stages do not scale the loss, so fp16 "
                        "gradients would underflow; use bf16 (or mixed_precision no)")
    return problems


def load_train_config(argv: list[str], *, training: bool = True) -> TrainConfig:
    """Resolve ``shardtune train`` arguments into a validated TrainConfig (see the module docstring); ``training``
    False reads them for a command that writes nothing (no output_dir needed)."""
    return build_config(_layers(argv), training=training)


def load_run_config(argv: list[str]) -> TrainConfig:
    """``load_train_config`` for a job about to start (``shardtune train``, ``shardtune launch``): it also refuses,
    before any model is loaded, the --emit-config dataset placeholder and a resume_from_checkpoint folder that is
    no complete checkpoint. A dry run reads neither. (Plain loads stay lenient: ``export`` reads a run's saved
    config, whose resume folder may since have been rotated away.)"""
    cfg, given, problems = _apply(_layers(argv), training=True)
    if not cfg.run.dry_run:
        problems += _run_problems(cfg, given)
    _raise(problems)
    return cfg


def _layers(argv: list[str]) -> Layers:
    files, overrides, flags, cli_sources = parse_cli_pairs(argv)
    layers: Layers = []
    accelerate_file = flags.pop("config_file", None) or overrides.pop("config_file", None)
    if accelerate_file:
        layers.append(read_accelerate_config(accelerate_file))
    for path in files:
        if not path.endswith((".yaml", ".yml")):
            raise UsageError(f"unexpected argument '{path}': give a YAML recipe (CONFIG.yaml), key=value or "
                             f"--key value")
        layers.append(read_yaml_recipe(path))
    layers.append((overrides, cli_sources))
    layers.append((flags, cli_sources))
    return layers


def save_resolved(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as flat YAML, atomically (temp file then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    tmp.replace(path)
