"""Checks of a resolved config: every problem found, one line each, so they are reported together."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardtune.config.compile import compile_problems
from shardtune.config.optimizers import ADAM_KEYS, OPTIMIZERS, PURE_BF16_OPTIMS, non_cuda_alternative
from shardtune.config.schema import (ACCEPTED_OPTIMS, BACKWARD_PREFETCH, DATASET_PLACEHOLDER, DISTRIBUTED_TYPES, FSDP_VERSIONS,
                                     HUB_STRATEGIES, LOG_LEVELS, MIXED_PRECISIONS, PIPELINE_SCHEDULES, SCHEDULERS,
                                     SHARDING_STRATEGIES, STATE_DICT_TYPES, STRATEGIES_STEPS, TRACKER_PACKAGES,
                                     TORCH_DTYPES, WRAP_POLICIES,
                                     DistributedConfig, OptimConfig, TrainConfig)
from shardtune.hub import looks_like_local_path, model_folder_problem
from shardtune.errors import closest
from shardtune.strategies import NO, Strategy, lookup


MAX_SEED = 2**32 - 1


def _choice(problems: list[str], key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest(str(value), choices)
        did_you_mean = f" (did you mean {hint}?)" if hint else ""
        problems.append(f"{key}={value!r} is not accepted; use one of {', '.join(choices)}{did_you_mean}")


def _strategy(d: DistributedConfig) -> Strategy:
    """The configured strategy's entry, NO for none or an unknown name (that name is a problem of its own)."""
    return lookup(d.distributed_type or NO) or NO


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
    problems += report_to_problems(r.report_to)
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
    if not r.save_safetensors:
        problems.append("save_safetensors=false asks for pickled .bin weights, which can run code when loaded; "
                        "shardtune writes safetensors only: leave save_safetensors out")
    if r.max_steps == 0 or r.max_steps < -1:
        problems.append(f"max_steps={r.max_steps} must be a positive number of optimizer steps, or -1 for epochs")
    if r.num_train_epochs < 0 or (r.num_train_epochs == 0 and r.max_steps == -1):  # max_steps wins over 0 epochs
        problems.append(f"num_train_epochs={r.num_train_epochs} must be positive (or set max_steps)")
    if not 0 <= r.seed <= MAX_SEED:  # what numpy's and torch's generators take
        problems.append(f"seed={r.seed} must be from 0 to {MAX_SEED} (2**32 - 1)")
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
    if r.activation_offloading and not (r.gradient_checkpointing or d.fsdp_activation_checkpointing):
        # Without checkpointing every saved tensor of every op would cross the host bus twice a step: slower than
        # a smaller micro-batch. Offloading moves the layer inputs that checkpointing keeps.
        problems.append("activation_offloading=true moves the layer inputs that gradient checkpointing keeps to CPU "
                        "memory; set gradient_checkpointing true as well (or leave activation_offloading out)")
    problems += lora_variant_problems(cfg)
    if r.eval_strategy == "steps" and (r.eval_steps or r.logging_steps) < 1:
        problems.append("eval_steps must be at least 1")
    if d.num_processes % d.num_machines:
        problems.append(f"num_processes={d.num_processes} is the total over all machines and must be a multiple "
                        f"of num_machines={d.num_machines}")
    problems += _validate_pipeline(cfg)
    problems += compile_problems(r)
    problems += _best_model_problems(cfg)
    problems += _unsupported(cfg)
    problems += dtype_problems(cfg)
    problems += cfg.data.validate()
    return problems


LORA_BIASES = ("none", "all", "lora_only")
LORA_INITS = ("true", "false", "gaussian", "pissa", "pissa_niter_N", "olora")
# init_lora_weights methods of PEFT that need more than the weights (data, a loftq_config): not run here.
LORA_INITS_REFUSED = {"eva": "it initialises from activations on data", "corda": "it needs a data pass",
                      "loftq": "it needs a loftq_config", "lora_ga": "it needs gradients of a data pass"}


def lora_variant_problems(cfg: TrainConfig) -> list[str]:
    """PEFT's LoRA variants (DoRA, rsLoRA, modules_to_save, init, bias, regex targets): bad values and the
    pairings that cannot work, one line each."""
    import re

    lo = cfg.lora
    problems = []
    init = lo.init_lora_weights.strip().lower()
    bias = lo.lora_bias.strip().lower()
    if bias == "true":
        problems.append("lora_bias=true: here lora_bias is PEFT's `bias` (none, all, lora_only); PEFT's boolean "
                        "lora_bias (a bias on lora_B) is not run; use lora_bias all or lora_only, or leave it out")
    elif bias != "false":
        _choice(problems, "lora_bias", bias, LORA_BIASES)
    if init in LORA_INITS_REFUSED:
        problems.append(f"init_lora_weights={lo.init_lora_weights!r} is not run by shardtune ({LORA_INITS_REFUSED[init]}); "
                        f"use one of {', '.join(LORA_INITS)}")
    elif init not in LORA_INITS and not re.fullmatch(r"pissa_niter_[1-9][0-9]*", init):
        _choice(problems, "init_lora_weights", init, LORA_INITS)
    mutating = init.startswith(("pissa", "olora"))
    if mutating and lo.use_4bit_quantization:
        problems.append(f"init_lora_weights={init} with use_4bit_quantization: the base would be re-quantised "
                        f"after taking the adapter out of it, so the adapter no longer fits the 4-bit base it is "
                        f"loaded on; use init_lora_weights true (or gaussian) for QLoRA")
    if mutating and lo.use_dora:
        problems.append(f"init_lora_weights={init} with use_dora: a DoRA adapter cannot be converted back to one "
                        f"for the unmodified base; use init_lora_weights true with DoRA")
    if mutating and _strategy(cfg.distributed).pipelined:
        problems.append(f"init_lora_weights={init} with distributed_type {cfg.distributed.distributed_type}: the "
                        f"stages' adapters are not converted for the unmodified base; use FSDP or DDP, or "
                        f"init_lora_weights true")
    target = lo.lora_target_modules.strip()
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            problems.append(f"lora_target_modules={target!r}: not a regular expression ({exc}); "
                            f"write re:<pattern>, e.g. re:.*\\.(q_proj|v_proj)")
    changed = [key for key, value in (("use_dora", lo.use_dora), ("use_rslora", lo.use_rslora),
                                      ("lora_modules_to_save", lo.lora_modules_to_save),
                                      ("init_lora_weights", init != "true"), ("lora_bias", bias not in ("none", "false")))
               if value]
    if changed and not lo.use_peft_lora:
        problems.append(f"{', '.join(changed)} set without use_peft_lora: they shape LoRA adapters; set "
                        f"use_peft_lora true (full fine-tuning trains every weight already)")
    return problems


# The eval record's metrics (step.evaluate); Transformers users may write them without "eval_".
EVAL_METRICS = ("eval_loss", "eval_perplexity")


def metric_name(given: str | None) -> str:
    """``metric_for_best_model`` as the eval record names it: "loss" and "eval_loss" are both eval_loss."""
    name = given or "eval_loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def _best_model_problems(cfg: TrainConfig) -> list[str]:
    """The settings that cannot work together, one line each (exit 2 before anything runs)."""
    ck, r = cfg.checkpoint, cfg.run
    problems: list[str] = []
    wanted = ck.load_best_model_at_end or r.early_stopping_patience is not None
    if ck.metric_for_best_model is not None and metric_name(ck.metric_for_best_model) not in EVAL_METRICS:
        problems.append(f"metric_for_best_model={ck.metric_for_best_model!r} is not a metric evaluation writes; "
                        f"use one of {', '.join(EVAL_METRICS)}")
    if (ck.metric_for_best_model is not None or ck.greater_is_better is not None) and not wanted:
        problems.append("metric_for_best_model and greater_is_better choose the best evaluation, which only "
                        "load_best_model_at_end or early_stopping_patience use: set one of them, or leave these out")
    if wanted and r.eval_strategy == "no":
        problems.append("load_best_model_at_end and early_stopping_patience compare evaluations: set eval_strategy "
                        "(steps or epoch) and an eval split")
    if ck.load_best_model_at_end and r.eval_strategy != "no":
        every = r.eval_steps or r.logging_steps
        if ck.save_strategy != r.eval_strategy:
            problems.append(f"load_best_model_at_end needs save_strategy equal to eval_strategy (they are "
                            f"{ck.save_strategy} and {r.eval_strategy}), so that every checkpoint has its evaluation")
        elif ck.save_strategy == "steps" and ck.save_steps % every:
            problems.append(f"load_best_model_at_end needs save_steps ({ck.save_steps}) to be a multiple of "
                            f"eval_steps ({every}), so that every checkpoint has its evaluation")
    if r.early_stopping_patience is not None and r.early_stopping_patience < 1:
        problems.append(f"early_stopping_patience={r.early_stopping_patience} must be at least 1 evaluation")
    if r.early_stopping_threshold < 0:
        problems.append(f"early_stopping_threshold={r.early_stopping_threshold} must not be negative")
    if r.neftune_noise_alpha is not None and not r.neftune_noise_alpha > 0:
        problems.append(f"neftune_noise_alpha={r.neftune_noise_alpha} must be positive (NEFTune's paper uses 5)")
    return problems


def _validate_pipeline(cfg: TrainConfig) -> list[str]:
    """PP needs a known schedule and batches that split into whole pipeline micro-batches."""
    d, r = cfg.distributed, cfg.run
    problems: list[str] = []
    if d.pipeline_schedule.upper() not in {s.upper() for s in PIPELINE_SCHEDULES}:
        problems.append(f"pipeline_schedule={d.pipeline_schedule!r} is not accepted; use one of "
                        f"{', '.join(PIPELINE_SCHEDULES)}")
    pipeline = _strategy(d).pipelined
    if d.pipeline_microbatches < 1:
        problems.append(f"pipeline_microbatches={d.pipeline_microbatches} must be at least 1")
    elif pipeline and r.per_device_train_batch_size % d.pipeline_microbatches:
        problems.append(f"per_device_train_batch_size={r.per_device_train_batch_size} must be a multiple of "
                        f"pipeline_microbatches={d.pipeline_microbatches} (each batch is split into them)")
    if (pipeline and r.eval_strategy != "no" and d.pipeline_microbatches >= 1
            and r.per_device_eval_batch_size % d.pipeline_microbatches):
        problems.append(f"per_device_eval_batch_size={r.per_device_eval_batch_size} must be a multiple of "
                        f"pipeline_microbatches={d.pipeline_microbatches} (each eval batch is split into them)")
    if pipeline and cfg.mixed_precision == "fp16":
        # Each stage would need the loss scale in its backward and a skip decision shared by every stage.
        problems.append(f"fp16 with distributed_type={d.distributed_type}: the pipeline's stages do not scale the "
                        f"loss, so fp16 gradients would underflow; use bf16 (or mixed_precision no)")
    return problems


def _unsupported(cfg: TrainConfig) -> list[str]:
    """Keys that recipes for other trainers carry, with a value this trainer does not run: refused, never ignored."""
    d, r = cfg.distributed, cfg.run
    problems = []
    if d.fsdp_version not in FSDP_VERSIONS:
        fsdp1 = "; fsdp_version 1 (FullyShardedDataParallel) is not available" if d.fsdp_version == 1 else ""
        problems.append(f"fsdp_version={d.fsdp_version} is not accepted: shardtune runs FSDP2 (fully_shard){fsdp1}; "
                        f"set fsdp_version 2 or leave it out (the fsdp_* keys keep their meaning)")
    if d.fsdp_backward_prefetch is not None and d.fsdp_backward_prefetch.upper() not in BACKWARD_PREFETCH:
        problems.append(f"fsdp_backward_prefetch={d.fsdp_backward_prefetch!r} is not accepted: FSDP2 always "
                        f"prefetches the next unit's parameters before the current one's backward (BACKWARD_PRE); "
                        f"set fsdp_backward_prefetch BACKWARD_PRE or leave it out")
    if d.fsdp_forward_prefetch and d.fsdp_auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        problems.append(f"fsdp_forward_prefetch=true prefetches the next decoder layer, which needs "
                        f"fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP (not {d.fsdp_auto_wrap_policy}); change the "
                        f"policy or leave fsdp_forward_prefetch false")
    if r.hub_strategy not in HUB_STRATEGIES:
        problems.append(f"hub_strategy={r.hub_strategy!r} is not accepted: push_to_hub uploads the final model once, "
                        f"at the end of training; use hub_strategy end or leave it out")
    problems += _optim_problems(cfg)
    return problems


def dtype_problems(cfg: TrainConfig) -> list[str]:
    """torch_dtype / dtype (TRL's and Transformers 5's names): a value the trainer runs, and what pure bf16 pairs
    with."""
    m = cfg.model
    same = {str(v).lower().removeprefix("torch.") for v in (m.torch_dtype, m.dtype)}
    if m.torch_dtype and m.dtype and len(same) > 1:
        return [f"torch_dtype={m.torch_dtype} and dtype={m.dtype} disagree (dtype is Transformers 5's name for "
                f"torch_dtype); give one of them"]
    key = "torch_dtype" if m.torch_dtype else "dtype"
    if m.weights_dtype in ("float16", "half"):
        return [f"{key}=float16: pure fp16 training diverges without an fp32 master copy (fp16's range overflows "
                f"and small updates vanish); leave {key} out and set fp16 true for fp16 mixed precision, or use "
                f"{key} bfloat16"]
    if m.weights_dtype not in TORCH_DTYPES:
        return [f"{key}={getattr(m, key)!r} is not accepted; use one of {', '.join(TORCH_DTYPES)}"]
    if not m.pure_bf16:
        return []
    problems = []
    if cfg.optim.optim not in PURE_BF16_OPTIMS:
        problems.append(f"{key}=bfloat16 with optim {cfg.optim.optim}: in pure bf16 only "
                        f"{' and '.join(PURE_BF16_OPTIMS)} keep small updates (stochastic rounding); use one of them, "
                        f"or leave {key} out for fp32 master weights")
    if cfg.mixed_precision == "fp16":
        problems.append(f"{key}=bfloat16 with fp16 mixed precision: bf16 weights compute in bf16; set fp16 false "
                        f"(and mixed_precision bf16 or no)")
    if cfg.lora.use_4bit_quantization:
        problems.append(f"{key}=bfloat16 with use_4bit_quantization: QLoRA's base is 4-bit and its small adapters "
                        f"keep fp32 weights; leave {key} out")
    return problems


def _optim_problems(cfg: TrainConfig) -> list[str]:
    """An optimizer name the trainer does not run, a setting it would not read, or a pairing that cannot run."""
    o = cfg.optim
    if o.optim not in ACCEPTED_OPTIMS:
        hint = closest(o.optim, ACCEPTED_OPTIMS)
        return [f"optim={o.optim!r} is not accepted; use one of {', '.join(ACCEPTED_OPTIMS)}"
                + (f" (did you mean {hint}?)" if hint else "")]
    spec = OPTIMIZERS[o.optim]
    problems = []
    defaults = OptimConfig()
    for key in ADAM_KEYS:  # Transformers passes these only to the optimizers that have them; here that is told
        if key not in spec.reads and getattr(o, key) != getattr(defaults, key):
            problems.append(f"{key}={getattr(o, key)} does nothing with optim {o.optim} (it has no such setting); "
                            f"leave {key} out or pick an optimizer that reads it (e.g. adamw_torch)")
    if spec.kind == "adafactor" and _strategy(cfg.distributed).shards_parameters:
        # Transformers' Adafactor averages the squared gradient over whole rows and columns and keeps that state
        # as plain tensors, which FSDP2's sharded (DTensor) parameters cannot mix with.
        problems.append(f"optim adafactor with distributed_type {cfg.distributed.distributed_type}: Adafactor's "
                        f"factored state needs whole rows and columns of each weight, which FSDP shards; use DDP "
                        f"(or one process) for adafactor, or a low-memory optimizer that shards: adamw_8bit or "
                        f"lion_8bit")
    return problems


def device_problems(cfg: TrainConfig) -> list[str]:
    """What this machine cannot run, for a job about to start here (an emitted or traced config is not checked):
    bitsandbytes that QLoRA or the optimizer needs and that does not import, and a paged optimizer without CUDA,
    which bitsandbytes would silently run unpaged."""
    name = cfg.optim.optim
    problems = bitsandbytes_problems(cfg)
    if problems or name not in OPTIMIZERS or not OPTIMIZERS[name].needs_cuda:
        return problems
    import torch  # only asked for a paged optimizer: the other checks need no torch

    if torch.cuda.is_available():
        return []
    return [f"optim={name} pages its state through CUDA unified memory, and no CUDA GPU is visible; use optim "
            f"{non_cuda_alternative(name)} (the same optimizer, not paged)"]


def bitsandbytes_problems(cfg: TrainConfig) -> list[str]:
    """QLoRA's 4-bit base and bitsandbytes' optimizers need the package to import (a missing one, or a build
    that does not load on this machine), found before anything is written rather than as a traceback after the
    data is tokenised. Imported only for a job that uses it."""
    users = [f"optim {cfg.optim.optim}"] if OPTIMIZERS.get(cfg.optim.optim) and \
        OPTIMIZERS[cfg.optim.optim].library == "bitsandbytes" else []
    if cfg.lora.use_4bit_quantization:
        users.insert(0, "use_4bit_quantization (QLoRA)")
    if not users:
        return []
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the RuntimeError of a build that cannot load here
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}" if str(exc).strip() else type(exc).__name__
        optim_too = len(users) > cfg.lora.use_4bit_quantization
        instead = " and ".join(fix for fix, used in (("use_4bit_quantization false (plain LoRA)",
                                                       cfg.lora.use_4bit_quantization),
                                                      ("optim adamw_torch", optim_too)) if used)
        return [f"{' and '.join(users)} need{'s' if len(users) == 1 else ''} bitsandbytes, which does not import "
                f"here ({why}): pip install -U 'bitsandbytes>=0.46', or train with {instead}"]
    return []


def resolve_report_to(names: list[str]) -> list[str]:
    """``report_to`` as Transformers reads it: "none" alone is no tracker, "all" alone every installed one (in
    TRACKER_PACKAGES' order); other names lower-cased, repeats dropped, for ``report_to_problems`` to check."""
    lowered = list(dict.fromkeys(name.strip().lower() for name in names if name.strip()))
    if lowered == ["none"]:
        return []
    if lowered == ["all"]:
        return [name for name in TRACKER_PACKAGES if tracker_installed(name)]
    return lowered


def report_to_problems(names: list[str]) -> list[str]:
    """A name that is no tracker, or "none"/"all" beside other names."""
    choices = (*TRACKER_PACKAGES, "all", "none")
    problems: list[str] = []
    for name in names:
        _choice(problems, "report_to", name, choices)
    if len(names) > 1 and {"none", "all"} & set(names):
        problems.append(f"report_to={','.join(names)}: none and all stand alone; give one of them, or tracker names")
    return problems


def tracker_installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKER_PACKAGES[name][0]) is not None


def missing_tracker_message(name: str) -> str:
    """One line for a tracker whose package is not installed: what to install, or what to drop."""
    package = TRACKER_PACKAGES[name][1]
    return (f"report_to {name} needs the {package} package, which is not installed: pip install {package} (or pip "
            f"install 'shardtune[trackers]' for all of them), or remove {name} from report_to")


def tracker_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """Trackers named in ``report_to`` whose package is missing, found before anything is written."""
    where = given.get("report_to", "config")
    return [f"{where}: {missing_tracker_message(name)}" for name in cfg.run.report_to
            if name in TRACKER_PACKAGES and not tracker_installed(name)]


def input_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """The model or data named as local paths that are not there, or the --emit-config data placeholder: checked
    without any network call, since a hub name is only read when the job loads it. ``given`` says where each key
    was set (a file and line, or the command line)."""
    problems = []
    where = {key: given.get(key, "config") for key in ("model_name_or_path", "dataset_name")}
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


def context_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """max_seq_len beyond the positions the model covers (its config's max_position_embeddings): refused, not
    capped, since a row that long would train positions the model never learned (and a model with learned
    position embeddings would stop mid-run on the first such row). A model whose config cannot be read before
    loading (a hub model not yet downloaded) is not checked."""
    from shardtune.hub import context_length

    model, seq_len = cfg.model.model_name_or_path, cfg.data.max_seq_len
    found = context_length(model) if model and isinstance(seq_len, int) else None
    if found is None or seq_len <= found[0]:
        return []
    limit, where = found
    named = f"{given['max_seq_len']}: max_seq_len {seq_len}" if "max_seq_len" in given else \
        f"max_seq_len {seq_len} (the default)"
    return [f"{named} is beyond the {limit} positions model_name_or_path '{model}' covers ({where}); set "
            f"max_seq_len {limit} or less, or give the model a longer context first (rope_scaling in its config.json)"]


def model_folder_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """A local model folder or file that a training job could not load: no config.json, no weights, its own code
    not allowed, a GGUF cut short, a file that is neither (``hub.model_folder_problem``), told before any tokenizer
    or data is read. (``data inspect`` reads
    only the tokenizer, so it does not ask.)"""
    model = cfg.model.model_name_or_path
    if not model or not Path(model).expanduser().exists():  # an existing path is read, whatever its name
        return []
    problem = model_folder_problem(model, f"model_name_or_path '{model}'", trust_fix="set trust_remote_code true",
                                   trust_remote_code=cfg.model.trust_remote_code)
    return [f"{given.get('model_name_or_path', 'config')}: {problem}"] if problem else []
