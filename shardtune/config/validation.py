"""The rules between keys of a resolved config, and what a job about to start needs of this machine and its paths.

Each value on its own (a choice, a bound) is checked as its key declares (``keys.value_problems``). Every problem
is one line carrying the keys it is about, so that they are reported together, each with the file and line that set
its first key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from shardtune.config.compile import compile_problems
from shardtune.config.keys import Problem, shown, value_problems
from shardtune.config.optimizers import ADAM_KEYS, OPTIMIZERS, PURE_BF16_OPTIMS, non_cuda_alternative
from shardtune.config.schema import (CHECKPOINTING, COSINES, DATASET_PLACEHOLDER, DDP_ONLY, EARLY_STOPPING, EVAL_STEPS,
                                     EVALS_EVERY, EVALUATES, FLOOR, FSDP_ONLY, INVERSE_SQRT, LOGS_STEPS, LORA, MIN_LR,
                                     MP, PACKING, PLATEAU, POLYNOMIAL, PP, PUSH, QLORA, SAVE_STEPS, SIZE_WRAP, TRACKER,
                                     TRACKIO, TRANSFORMER_WRAP, WARMS_UP, WARMUP_LR, WSD, TRACKER_PACKAGES, DataConfig,
                                     DistributedConfig, LoraConfig, OptimConfig, TrainConfig, all_keys)
from shardtune.errors import UsageError, closest
from shardtune.hub import looks_like_local_path, model_folder_problem, num_layers, tokenizer_problem
from shardtune.strategies import DDP, NO, Strategy, lookup


def _strategy(d: DistributedConfig) -> Strategy:
    """The configured strategy's entry, NO for none or an unknown name (that name is a problem of its own)."""
    return lookup(d.distributed_type or NO) or NO


def validate(cfg: TrainConfig, *, training: bool = True) -> list[Problem]:
    """Every problem with the resolved config, one line each."""
    problems: list[Problem] = []
    if not cfg.model.model_name_or_path:
        problems.append(Problem("model_name_or_path", "model_name_or_path is required: a local model folder or a hub "
                                                      "name (e.g. --model_name_or_path ./my-model)"))
    if training and not cfg.run.output_dir:
        problems.append(Problem("output_dir", "output_dir is required (e.g. --output_dir out)"))
    idle = idle_keys(cfg)
    problems += [p for f in dataclasses.fields(cfg) if f.name != "data" for p in value_problems(getattr(cfg, f.name),
                                                                                                idle)]
    problems += data_problems(cfg.data)
    for rules in (_run_problems, lora_variant_problems, switch_problems, _validate_pipeline, _best_model_problems,
                  _optim_problems, dtype_problems):
        problems += rules(cfg)
    return problems + compile_problems(cfg.run)


def setup_problems(cfg: TrainConfig) -> list[Problem]:
    """The rules between the keys of a setup (strategy, precision, optimizer, method) that train refuses: those
    that read neither the model, the data nor the output folder, so that an estimate (and the setups it compares
    and recommends) is of a job that can run."""
    return [*lora_variant_problems(cfg), *_validate_pipeline(cfg), *_optim_problems(cfg), *dtype_problems(cfg)]


def _run_problems(cfg: TrainConfig) -> list[Problem]:
    """Training length and precision, and the pairings of run and distributed keys that cannot work."""
    r, d = cfg.run, cfg.distributed
    problems = []
    if r.bf16 and r.fp16:
        problems.append(Problem(("bf16", "fp16"), "bf16 and fp16 are both true; choose one"))
    if not r.save_safetensors:
        problems.append(Problem("save_safetensors", "save_safetensors=false asks for pickled .bin weights, which can "
                                                    "run code when loaded; shardtune writes safetensors only: leave "
                                                    "save_safetensors out"))
    if r.max_steps == 0 or r.max_steps < -1:
        problems.append(Problem("max_steps", f"max_steps={r.max_steps} must be a positive number of optimizer steps, "
                                             f"or -1 for epochs"))
    if r.num_train_epochs < 0 or (r.num_train_epochs == 0 and r.max_steps == -1):  # max_steps wins over 0 epochs
        problems.append(Problem("num_train_epochs", f"num_train_epochs={r.num_train_epochs} must be positive (or set "
                                                    f"max_steps)"))
    if cfg.lora.use_4bit_quantization and not cfg.lora.use_peft_lora:
        problems.append(Problem(("use_4bit_quantization", "use_peft_lora"), "use_4bit_quantization trains LoRA "
                                "adapters on a frozen 4-bit base (QLoRA); set use_peft_lora true as well"))
    if r.activation_offloading and not (r.gradient_checkpointing or d.fsdp_activation_checkpointing):
        # Without checkpointing every saved tensor of every op would cross the host bus twice a step: slower than
        # a smaller micro-batch. Offloading moves the layer inputs that checkpointing keeps.
        problems.append(Problem("activation_offloading", "activation_offloading=true moves the layer inputs that "
                                "gradient checkpointing keeps to CPU memory; set gradient_checkpointing true as well "
                                "(or leave activation_offloading out)"))
    if d.num_processes % d.num_machines:
        problems.append(Problem(("num_processes", "num_machines"), f"num_processes={d.num_processes} is the total "
                                f"over all machines and must be a multiple of num_machines={d.num_machines}"))
    if d.fsdp_forward_prefetch and d.fsdp_auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        problems.append(Problem(("fsdp_forward_prefetch", "fsdp_auto_wrap_policy"), f"fsdp_forward_prefetch=true "
                                f"prefetches the next decoder layer, which needs fsdp_auto_wrap_policy "
                                f"TRANSFORMER_BASED_WRAP (not {d.fsdp_auto_wrap_policy}); change the policy or leave "
                                f"fsdp_forward_prefetch false"))
    if len(r.report_to) > 1 and {"none", "all"} & set(r.report_to):  # a name that is no tracker: its own value
        problems.append(Problem("report_to", f"report_to={','.join(r.report_to)}: none and all stand alone; give one "
                                             f"of them, or tracker names"))
    return problems


def data_problems(data: DataConfig) -> list[Problem]:
    """Every problem of the data section, its values and the rules between its keys (``prepare_datasets`` asks
    too, for a section made without the rest of a config)."""
    problems = value_problems(data)
    if not data.dataset_name:
        problems.append(Problem("dataset_name", "dataset_name is missing: give a JSONL/JSON/Parquet/CSV file or "
                                                "folder, a saved `datasets` folder or a hub name."))
    local = data.dataset_name and (looks_like_local_path(data.dataset_name)
                                   or Path(data.dataset_name).expanduser().exists())
    if data.dataset_config_name and local:
        problems.append(Problem("dataset_config_name", f"dataset_config_name picks a configuration (subset) of a hub "
                                                       f"data set, and {data.dataset_name} is local; leave it out"))
    if data.add_special_tokens and data.chat_template_format == "none":
        problems.append(Problem("add_special_tokens", "add_special_tokens needs a named chat_template_format (chatml, "
                                                      "llama-3, ...): the tokenizer's own template already has its "
                                                      "tokens."))
    if data.chat_template_path and not data.chat_template_path.lower().endswith((".jinja", ".j2")):
        problems.append(Problem("chat_template_path", f"chat_template_path '{data.chat_template_path}': only a Jinja "
                                                      f"template file (.jinja or .j2) is read here; for a tokenizer's "
                                                      f"template, give its chat_template.jinja"))
    if data.chat_template_path and data.chat_template_format != "none":
        problems.append(Problem(("chat_template_path", "chat_template_format"),
                                f"chat_template_path and chat_template_format {data.chat_template_format} both name "
                                f"the chat template; give one of them"))
    if data.group_by_length and data.packing:
        problems.append(Problem(("group_by_length", "packing"), "group_by_length groups unpacked rows by length, and "
                                "packed rows all have max_seq_len tokens: set packing false to group, or leave "
                                "group_by_length out."))
    if not data.train_split_names():
        problems.append(Problem("splits", f"splits '{data.splits}' names no train split: include one whose name "
                                          f"contains 'train' (e.g. train,test)."))
    if not data.dataset_text_field:
        problems.append(Problem("dataset_text_field", "dataset_text_field is empty: name the column of raw-text rows "
                                                      "(default: text)."))
    return problems


LORA_INITS = ("true", "false", "gaussian", "pissa", "pissa_niter_N", "olora")
# init_lora_weights methods of PEFT that need more than the weights (data, a loftq_config): not run here.
LORA_INITS_REFUSED = {"eva": "it initialises from activations on data", "corda": "it needs a data pass",
                      "loftq": "it needs a loftq_config", "lora_ga": "it needs gradients of a data pass"}


def _init_problems(lo: LoraConfig) -> list[Problem]:
    """init_lora_weights: PEFT's methods that run here (pissa_niter_N for any N), and the pairings PiSSA and OLoRA
    cannot work with."""
    init = lo.init_lora_weights.strip().lower()
    if init in LORA_INITS_REFUSED or (init not in LORA_INITS and not re.fullmatch(r"pissa_niter_[1-9][0-9]*", init)):
        why = f"is not run by shardtune ({LORA_INITS_REFUSED[init]})" if init in LORA_INITS_REFUSED else \
            "is not accepted"
        hint = closest(init, LORA_INITS) if init not in LORA_INITS_REFUSED else None
        return [Problem("init_lora_weights", f"init_lora_weights={lo.init_lora_weights!r} {why}; use one of "
                                             f"{', '.join(LORA_INITS)}{f' (did you mean {hint}?)' if hint else ''}")]
    if not init.startswith(("pissa", "olora")):
        return []
    pairings = (("use_4bit_quantization", lo.use_4bit_quantization, "the base would be re-quantised after taking the "
                 "adapter out of it, so the adapter no longer fits the 4-bit base it is loaded on; use "
                 "init_lora_weights true (or gaussian) for QLoRA"),
                ("use_dora", lo.use_dora, "a DoRA adapter cannot be converted back to one for the unmodified base; "
                 "use init_lora_weights true with DoRA"))
    return [Problem(("init_lora_weights", other), f"init_lora_weights={init} with {other}: {why}")
            for other, on, why in pairings if on]


def lora_variant_problems(cfg: TrainConfig) -> list[Problem]:
    """PEFT's LoRA variants (DoRA, rsLoRA, modules_to_save, init, bias, regex targets): bad values and the
    pairings that cannot work, one line each."""
    lo = cfg.lora
    problems = _init_problems(lo)
    init = lo.init_lora_weights.strip().lower()
    if init.startswith(("pissa", "olora")) and _strategy(cfg.distributed).pipelined:
        problems.append(Problem(("init_lora_weights", "distributed_type"), f"init_lora_weights={init} with "
                                f"distributed_type {cfg.distributed.distributed_type}: the stages' adapters are not "
                                f"converted for the unmodified base; use FSDP or DDP, or init_lora_weights true"))
    target = lo.lora_target_modules.strip()
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            problems.append(Problem("lora_target_modules", f"lora_target_modules={target!r}: not a regular "
                                    f"expression ({exc}); write re:<pattern>, e.g. re:.*\\.(q_proj|v_proj)"))
    elif target != "all-linear" and re.search(r"[*+?()\[\]{}|^$\\]", target):
        # PEFT reads a target_modules string as a regex; here a name list is the plain form, and no module name
        # holds these characters: the run would stop after loading the model, offered one of the names.
        problems.append(Problem("lora_target_modules", f"lora_target_modules={target!r} is a regular expression "
                                f"(PEFT's target_modules string), which is written with re: in front here: "
                                f"re:{target}"))
    elif any(len(item.split()) > 1 for item in target.split(",")):  # TRL's command-line words, written in YAML
        problems.append(Problem("lora_target_modules", f"lora_target_modules={target!r}: a module name holds no "
                                f"spaces; separate the names with commas: {','.join(target.replace(',', ' ').split())}"
                                f" (or write them as a YAML list)"))
    return problems


# What each ``needs=`` of the schema means. A key declared with one does nothing without it, so a value other than
# its default is refused there rather than dropped.
SWITCHES: dict[str, Callable[[TrainConfig], bool]] = {
    LORA: lambda cfg: cfg.lora.use_peft_lora,
    QLORA: lambda cfg: cfg.lora.use_4bit_quantization,
    PACKING: lambda cfg: cfg.data.packing,
    CHECKPOINTING: lambda cfg: cfg.run.gradient_checkpointing or cfg.distributed.fsdp_activation_checkpointing,
    PP: lambda cfg: _strategy(cfg.distributed).pipelined,
    MP: lambda cfg: _strategy(cfg.distributed).drives_several_devices,
    EVAL_STEPS: lambda cfg: cfg.run.eval_strategy == "steps",
    EVALUATES: lambda cfg: cfg.run.eval_strategy != "no" or cfg.run.eval_on_start,
    EVALS_EVERY: lambda cfg: cfg.run.eval_strategy != "no",
    SAVE_STEPS: lambda cfg: cfg.checkpoint.save_strategy == "steps",
    PUSH: lambda cfg: cfg.run.push_to_hub,
    TRACKER: lambda cfg: any(name != "none" for name in cfg.run.report_to),
    TRACKIO: lambda cfg: "trackio" in cfg.run.report_to,
    WARMS_UP: lambda cfg: cfg.optim.lr_scheduler_type not in ("constant", "reduce_lr_on_plateau"),
    MIN_LR: lambda cfg: cfg.optim.lr_scheduler_type in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"),
    FLOOR: lambda cfg: cfg.optim.lr_scheduler_type in ("cosine_with_min_lr", "cosine_warmup_with_min_lr",
                                                       "reduce_lr_on_plateau"),
    PLATEAU: lambda cfg: cfg.optim.lr_scheduler_type == "reduce_lr_on_plateau",
    WARMUP_LR: lambda cfg: cfg.optim.lr_scheduler_type == "cosine_warmup_with_min_lr",
    COSINES: lambda cfg: cfg.optim.lr_scheduler_type in ("cosine", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                                                         "cosine_with_restarts", "warmup_stable_decay"),
    POLYNOMIAL: lambda cfg: cfg.optim.lr_scheduler_type == "polynomial",
    INVERSE_SQRT: lambda cfg: cfg.optim.lr_scheduler_type == "inverse_sqrt",
    WSD: lambda cfg: cfg.optim.lr_scheduler_type == "warmup_stable_decay",
    FSDP_ONLY: lambda cfg: _strategy(cfg.distributed).shards_parameters,
    SIZE_WRAP: lambda cfg: cfg.distributed.fsdp_auto_wrap_policy == "SIZE_BASED_WRAP",
    TRANSFORMER_WRAP: lambda cfg: (cfg.distributed.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
                                   and _strategy(cfg.distributed).shards_parameters),
    LOGS_STEPS: lambda cfg: cfg.run.logging_strategy == "steps" or (cfg.run.eval_strategy == "steps"
                                                                     and cfg.run.eval_steps is None),
    EARLY_STOPPING: lambda cfg: cfg.run.early_stopping_patience is not None,
    DDP_ONLY: lambda cfg: _strategy(cfg.distributed) is DDP or (_strategy(cfg.distributed).one_device
                                                               and _processes(cfg) > 1),
}


def _processes(cfg: TrainConfig) -> int:
    """The job's processes: the config's, or torchrun's where it started this one (``torchrun -m shardtune train``
    with no distributed_type runs DDP, whatever num_processes says)."""
    return max(cfg.distributed.num_processes, int(os.environ.get("WORLD_SIZE", "1") or 1))


# The keys declared with ``needs=``, each with its declaration.
SWITCHED = {d.name: d for d in all_keys() if d.meta.needs}


def idle_keys(cfg: TrainConfig) -> set[str]:
    """The keys whose setting ``cfg`` leaves off (lora_r of a full fine-tune): a config written for it leaves them
    out."""
    return {name for name, d in SWITCHED.items() if not SWITCHES[d.meta.needs](cfg)}


def overruled_keys(cfg: TrainConfig, layer_of: Mapping[str, int], reset: set[str]) -> set[str]:
    """Idle keys given in an earlier layer than the setting that turned them off (a recipe's save_steps under
    --save_strategy no, its fsdp_* keys under --distributed_type DDP), or whose setting is itself such a key, now
    ``reset`` (its fsdp_min_num_params, under its SIZE_BASED_WRAP): the later layer overrides the setting as a
    whole, so they are set back to their defaults rather than refused. ``layer_of``: each given key's layer."""
    return {name for name in (idle_keys(cfg) & set(layer_of)) - reset
            if any(layer_of.get(key, -1) > layer_of[name] or key in reset for key in _switch_keys(name))}


# Settings that more keys than the one their ``needs`` names turn on or off: a job of several processes with no
# distributed_type runs DDP; checkpointing is either key's, and so is evaluating.
SWITCHED_ALSO = {DDP_ONLY: ("num_processes",), CHECKPOINTING: ("fsdp_activation_checkpointing",),
                 EVALUATES: ("eval_on_start",), LOGS_STEPS: ("eval_strategy", "eval_steps"),
                 TRANSFORMER_WRAP: ("distributed_type",)}


def _switch_key(name: str) -> str:
    """The key that turns ``name``'s setting on: the first word of its ``needs``."""
    return SWITCHED[name].meta.needs.split()[0]


def _switch_keys(name: str) -> tuple[str, ...]:
    """Every key whose value decides whether ``name``'s setting is on."""
    return (_switch_key(name), *SWITCHED_ALSO.get(SWITCHED[name].meta.needs, ()))


def switch_problems(cfg: TrainConfig) -> list[Problem]:
    """Keys set while the setting they act under is off, one line per setting."""
    found: dict[str, dict[str, str]] = {}  # setting -> {key: its value as written}
    idle = idle_keys(cfg)
    for name, d in SWITCHED.items():
        if name not in idle:
            continue
        section = getattr(cfg, d.section)
        value = getattr(section, name)
        if not _acts_as(value, getattr(type(section)(), name)) and value not in d.meta.idle:
            text = "(given)" if d.meta.secret else ",".join(map(str, value)) if isinstance(value, list) else \
                shown(value)
            found.setdefault(d.meta.needs, {})[name] = text
    problems = []
    for needs, given in found.items():
        several = len(given) > 1
        problems.append(Problem((*given, _switch_key(next(iter(given)))),
                                f"{', '.join(f'{k}={v}' for k, v in given.items())} set without {needs}: "
                                f"{'they act' if several else 'it acts'} only with it; set {needs}, or leave "
                                f"{'them' if several else 'it'} out"))
    return problems


def _acts_as(value: object, default: object) -> bool:
    """Whether ``value`` does what the default does: strings in any case and without spaces around them; unset
    where the default is false (recipes write ddp_find_unused_parameters: null for Transformers' "not set")."""
    if isinstance(default, bool):
        return bool(value) == default
    if isinstance(value, str) and isinstance(default, str):
        return value.strip().lower() == default.strip().lower()
    return value == default


# The eval record's metrics (step.evaluate); Transformers users may write them without "eval_".
EVAL_METRICS = ("eval_loss", "eval_perplexity")


def metric_name(given: str | None) -> str:
    """``metric_for_best_model`` as the eval record names it: "loss" and "eval_loss" are both eval_loss."""
    name = given or "eval_loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def _best_model_problems(cfg: TrainConfig) -> list[Problem]:
    """The settings that cannot work together, one line each (exit 2 before anything runs)."""
    ck, r = cfg.checkpoint, cfg.run
    problems: list[Problem] = []
    plateau = cfg.optim.lr_scheduler_type == "reduce_lr_on_plateau"
    wanted = ck.load_best_model_at_end or r.early_stopping_patience is not None or plateau
    if ck.metric_for_best_model is not None and metric_name(ck.metric_for_best_model) not in EVAL_METRICS:
        problems.append(Problem("metric_for_best_model", f"metric_for_best_model={ck.metric_for_best_model!r} is not "
                                f"a metric evaluation writes; use one of {', '.join(EVAL_METRICS)}"))
    if (ck.metric_for_best_model is not None or ck.greater_is_better is not None) and not wanted:
        problems.append(Problem(("metric_for_best_model", "greater_is_better"), "metric_for_best_model and "
                                "greater_is_better choose the best evaluation, which only load_best_model_at_end, "
                                "early_stopping_patience and lr_scheduler_type reduce_lr_on_plateau use: set one of "
                                "them, or leave these out"))
    if wanted and r.eval_strategy == "no":
        problems.append(Problem(("load_best_model_at_end", "early_stopping_patience", "lr_scheduler_type",
                                 "eval_strategy"),
                                "load_best_model_at_end, early_stopping_patience and lr_scheduler_type "
                                "reduce_lr_on_plateau compare evaluations: set eval_strategy (steps or epoch) and an "
                                "eval split"))
    if ck.load_best_model_at_end and r.eval_strategy != "no":
        every = r.eval_steps or r.logging_steps
        if ck.save_strategy != r.eval_strategy:
            problems.append(Problem(("load_best_model_at_end", "save_strategy"), f"load_best_model_at_end needs "
                                    f"save_strategy equal to eval_strategy (they are {ck.save_strategy} and "
                                    f"{r.eval_strategy}), so that every checkpoint has its evaluation"))
        elif ck.save_strategy == "steps" and every >= 1 and ck.save_steps % every:
            problems.append(Problem(("load_best_model_at_end", "save_steps"), f"load_best_model_at_end needs "
                                    f"save_steps ({ck.save_steps}) to be a multiple of eval_steps ({every}), so that "
                                    f"every checkpoint has its evaluation"))
    return problems


def _validate_pipeline(cfg: TrainConfig) -> list[Problem]:
    """PP needs batches that split into whole pipeline micro-batches, and no fp16 loss scaling; MP one process."""
    d, r = cfg.distributed, cfg.run
    if _strategy(d).drives_several_devices and d.num_processes > 1:
        # Refused by every worker only once they had started (on a cluster, after the job's wait in the queue).
        return [Problem(("distributed_type", "num_processes"), f"distributed_type={d.distributed_type} runs in one "
                        f"process over several devices (mp_devices), not on {d.num_processes} processes; start it "
                        f"with 'shardtune train' (or launch --num_processes 1), or use PP to split the layers "
                        f"across processes")]
    if not _strategy(d).pipelined or d.pipeline_microbatches < 1:
        return []
    problems = [Problem((f"per_device_{kind}_batch_size", "pipeline_microbatches"), f"per_device_{kind}_batch_size="
                        f"{size} must be a multiple of pipeline_microbatches={d.pipeline_microbatches} (each "
                        f"{'' if kind == 'train' else 'eval '}batch is split into them)")
                for kind, size, used in (("train", r.per_device_train_batch_size, True),
                                         ("eval", r.per_device_eval_batch_size, SWITCHES[EVALUATES](cfg)))
                if used and size % d.pipeline_microbatches]
    stages = d.num_processes  # one stage per process, over all machines
    if d.pipeline_schedule.upper() == "1F1B" and d.pipeline_microbatches < stages:
        # torch.distributed.pipelining's 1F1B fills the pipeline with one micro-batch per stage before it steps.
        problems.append(Problem(("pipeline_microbatches", "pipeline_schedule", "num_processes"),
                                f"pipeline_schedule 1F1B needs at least one micro-batch per stage: "
                                f"pipeline_microbatches={d.pipeline_microbatches} for {stages} stages (processes); "
                                f"raise pipeline_microbatches to {stages} or more (per_device_train_batch_size a "
                                f"multiple of it), or use pipeline_schedule GPipe"))
    if cfg.mixed_precision == "fp16":
        # Each stage would need the loss scale in its backward and a skip decision shared by every stage.
        problems.append(Problem(("fp16", "mixed_precision", "distributed_type"), f"fp16 with distributed_type="
                                f"{d.distributed_type}: the pipeline's stages do not scale the loss, so fp16 gradients "
                                f"would underflow; use bf16 (or mixed_precision no)"))
    if r.gradient_checkpointing and r.use_reentrant:
        # A stage's backward asks autograd for the gradients of the hidden states it received (to send them back),
        # which reentrant checkpointing cannot give: every stage after the first stopped with a traceback.
        problems.append(Problem(("use_reentrant", "distributed_type"), f"use_reentrant true with distributed_type="
                                f"{d.distributed_type}: a pipeline stage's backward asks for the gradients of the "
                                f"hidden states it received, which reentrant checkpointing cannot give; set "
                                f"use_reentrant false (PyTorch's default checkpointing)"))
    return problems


def dtype_problems(cfg: TrainConfig) -> list[Problem]:
    """What pure bf16 (torch_dtype bfloat16) pairs with, and QLoRA's storage dtype with the mixed precision."""
    return [*_pure_bf16_problems(cfg), *_storage_dtype_problems(cfg)]


def _storage_dtype_problems(cfg: TrainConfig) -> list[Problem]:
    """The model loads in bnb_4bit_quant_storage_dtype: a half dtype other than autocast's has the first forward
    fail deep in autocast ("Unexpected floating ScalarType in at::autocast::prioritize"), which mixes one half
    dtype with float32 but never with the other."""
    storage, precision = cfg.lora.bnb_4bit_quant_storage_dtype, cfg.mixed_precision
    other = {"float16": "fp16", "bfloat16": "bf16"}.get(storage)  # float32, unset or a value refused on its own: None
    if not cfg.lora.use_4bit_quantization or cfg.model.pure_bf16 or other is None or precision in ("no", other):
        return []
    autocast = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    return [Problem(("bnb_4bit_quant_storage_dtype", precision, "mixed_precision"), f"bnb_4bit_quant_storage_dtype="
                    f"{storage} with {precision} mixed precision: the model loads in its storage dtype, and "
                    f"{precision} autocast cannot mix {storage} weights into its {autocast} ops (the first step would "
                    f"fail); set "
                    f"bnb_4bit_quant_storage_dtype {autocast} (or leave it out: the run's compute dtype) or float32, "
                    f"or compute in {other} ({other} true instead of {precision})")]


def _pure_bf16_problems(cfg: TrainConfig) -> list[Problem]:
    """What pure bf16 (torch_dtype bfloat16) pairs with."""
    if not cfg.model.pure_bf16:
        return []
    key, problems = "torch_dtype", []
    if cfg.optim.optim not in PURE_BF16_OPTIMS:
        problems.append(Problem((key, "optim"), f"{key}=bfloat16 with optim {cfg.optim.optim}: in pure bf16 only "
                                f"{' and '.join(PURE_BF16_OPTIMS)} keep small updates (stochastic rounding); use one "
                                f"of them, or leave {key} out for fp32 master weights"))
    if cfg.mixed_precision == "fp16":
        problems.append(Problem((key, "fp16", "mixed_precision"), f"{key}=bfloat16 with fp16 mixed precision: bf16 "
                                f"weights compute in bf16; set fp16 false (and mixed_precision bf16 or no)"))
    return problems


def _schedule_problems(o: OptimConfig) -> list[Problem]:
    """A schedule that Transformers' get_scheduler would refuse to build with its settings."""
    problems = []
    floored = o.lr_scheduler_type in ("cosine_with_min_lr", "cosine_warmup_with_min_lr")
    if floored and o.min_lr_rate is None and o.min_lr is None:
        problems.append(Problem(("lr_scheduler_type",), f"lr_scheduler_type {o.lr_scheduler_type} needs min_lr_rate, "
                                f"the share of learning_rate the cosine decays to (e.g. min_lr_rate 0.1), or min_lr, "
                                f"that rate; set one, or use cosine (decay to 0)"))
    if floored and o.min_lr_rate is not None and o.min_lr is not None:
        problems.append(Problem(("min_lr", "min_lr_rate"), f"min_lr={o.min_lr} and min_lr_rate={o.min_lr_rate} both "
                                f"set the cosine's floor (min_lr = min_lr_rate x learning_rate); give one"))
    if floored and o.min_lr is not None and o.min_lr > o.learning_rate:
        problems.append(Problem(("min_lr", "learning_rate"), f"min_lr={o.min_lr} is above learning_rate "
                                f"{o.learning_rate}: the cosine decays from learning_rate down to min_lr; lower "
                                f"min_lr or raise learning_rate"))
    if o.lr_scheduler_type == "warmup_stable_decay" and o.num_decay_steps is None:
        problems.append(Problem(("lr_scheduler_type",), "lr_scheduler_type warmup_stable_decay needs num_decay_steps, "
                                "the steps of its final decay (e.g. lr_scheduler_kwargs: {num_decay_steps: 100}); "
                                "set it, or use another schedule"))
    if o.lr_scheduler_type == "warmup_stable_decay" and o.num_cycles is not None and o.decay_type != "cosine":
        problems.append(Problem(("num_cycles", "decay_type"), f"num_cycles={o.num_cycles} with decay_type "
                                f"{o.decay_type}: warmup_stable_decay reads it for a cosine decay only; set "
                                f"decay_type cosine, or leave num_cycles out"))
    if o.lr_scheduler_type == "polynomial" and o.lr_end >= o.learning_rate:  # a decay that does not go down
        problems.append(Problem(("lr_end", "learning_rate"), f"lr_end={o.lr_end} with learning_rate "
                                f"{o.learning_rate}: the polynomial decay runs from learning_rate down to lr_end, a "
                                f"rate (not a share of learning_rate) that must be below it; lower lr_end or raise "
                                f"learning_rate"))
    return problems


def _optim_problems(cfg: TrainConfig) -> list[Problem]:
    """A setting the optimizer or the schedule would not read, or a pairing that cannot run."""
    o = cfg.optim
    schedule = _schedule_problems(o)
    if o.optim not in OPTIMIZERS:  # a problem of its own value
        return schedule
    spec = OPTIMIZERS[o.optim]
    defaults = OptimConfig()
    # Transformers passes these only to the optimizers that have them; here that is told.
    problems = [Problem((key, "optim"), f"{key}={getattr(o, key)} does nothing with optim {o.optim} (it has no such "
                                        f"setting); leave {key} out or pick an optimizer that reads it (e.g. "
                                        f"adamw_torch)")
                for key in ADAM_KEYS if key not in spec.reads and getattr(o, key) != getattr(defaults, key)] + schedule
    if o.adam_epsilon == 0 and "adam_epsilon" in spec.reads:
        # AdamW divides by sqrt(v) + epsilon: a weight whose gradient is still 0 makes 0 / 0.
        problems.append(Problem(("adam_epsilon",), f"adam_epsilon=0 turns every weight whose gradient is 0 so far "
                                                   f"(unused embedding rows; LoRA's A at the first step) into NaN "
                                                   f"with optim {o.optim}; use a small positive value such as 1e-8 "
                                                   f"(Transformers' default)"))
    if spec.kind == "adafactor" and _strategy(cfg.distributed).shards_parameters:
        # Transformers' Adafactor averages the squared gradient over whole rows and columns and keeps that state
        # as plain tensors, which FSDP2's sharded (DTensor) parameters cannot mix with.
        problems.append(Problem(("optim", "distributed_type"), f"optim adafactor with distributed_type "
                                f"{cfg.distributed.distributed_type}: Adafactor's factored state needs whole rows and "
                                f"columns of each weight, which FSDP shards; use DDP (or one process) for adafactor, "
                                f"or a low-memory optimizer that shards: adamw_8bit or lion_8bit"))
    return problems


def device_problems(cfg: TrainConfig) -> list[Problem]:
    """What this machine cannot run, for a job about to start here (an emitted or traced config is not checked):
    bitsandbytes that QLoRA or the optimizer needs and that does not import, and a paged optimizer without CUDA,
    which bitsandbytes would silently run unpaged."""
    name = cfg.optim.optim
    problems = bitsandbytes_problems(cfg) + tf32_problems(cfg)
    if problems or name not in OPTIMIZERS or not OPTIMIZERS[name].needs_cuda:
        return problems
    import torch  # only asked for a paged optimizer: the other checks need no torch

    if torch.cuda.is_available():
        return []
    return [Problem("optim", f"optim={name} pages its state through CUDA unified memory, and no CUDA GPU is visible; "
                             f"use optim {non_cuda_alternative(name)} (the same optimizer, not paged)")]


def tf32_problems(cfg: TrainConfig) -> list[Problem]:
    """tf32 true where no GPU has TensorFloat-32 (NVIDIA Ampere, compute capability 8.0, and newer), as
    Transformers refuses it."""
    if not cfg.run.tf32:
        return []
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        return []
    has = (f"this job's GPU, {torch.cuda.get_device_name()}, is compute capability "
           f"{'.'.join(map(str, torch.cuda.get_device_capability()))}" if torch.cuda.is_available()
           else "this job has no CUDA GPU")
    return [Problem("tf32", f"tf32 true needs an NVIDIA GPU of the Ampere generation or newer (compute capability "
                            f"8.0+), and {has}; leave tf32 out")]


FLASH_PACKAGES = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3"}


def flash_unavailable(attn: str, on_cuda: bool, fp32: bool) -> str | None:
    """Why flash attention (``attn``: flash_attention_2 or _3) cannot run on this job, or None where it can: the
    one reason both the check before a job starts and use_flash_attn's fallback at run time give."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if not on_cuda:
        return "it runs on CUDA GPUs only and this job has none"
    if not (is_flash_attn_2_available() if attn == "flash_attention_2" else is_flash_attn_3_available()):
        return f"the {FLASH_PACKAGES[attn]} package is not installed (pip install {FLASH_PACKAGES[attn]})"
    if fp32:
        return "it computes in bf16 or fp16 only, and this job computes in fp32 (set bf16 true)"
    return None


def attention_problems(cfg: TrainConfig) -> list[Problem]:
    """Flash attention named as attn_implementation where it cannot run: transformers would refuse to build the
    model after the data is tokenised (a dry run builds it too). use_flash_attn is the key that falls back."""
    attn = cfg.model.attn_implementation
    if attn not in FLASH_PACKAGES:
        return []
    import torch

    why = flash_unavailable(attn, torch.cuda.is_available(), cfg.mixed_precision == "no" and not cfg.model.pure_bf16)
    if why is None:
        return []
    return [Problem("attn_implementation", f"attn_implementation={attn}: {why}; use attn_implementation sdpa (the "
                                           f"default), with use_flash_attn true to take flash attention where it "
                                           f"can run")]


def bitsandbytes_problems(cfg: TrainConfig) -> list[Problem]:
    """QLoRA's 4-bit base and bitsandbytes' optimizers need the package to import (a missing one, or a build
    that does not load on this machine), found before anything is written rather than as a traceback after the
    data is tokenised. Imported only for a job that uses it."""
    qlora, spec = cfg.lora.use_4bit_quantization, OPTIMIZERS.get(cfg.optim.optim)
    users = {"use_4bit_quantization (QLoRA)": "use_4bit_quantization false (plain LoRA)"} if qlora else {}
    if spec and spec.library == "bitsandbytes":
        users[f"optim {cfg.optim.optim}"] = "optim adamw_torch"
    try:
        if users:
            import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the RuntimeError of a build that cannot load here
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}" if str(exc).strip() else type(exc).__name__
        return [Problem(("use_4bit_quantization", "optim") if qlora else "optim",
                        f"{' and '.join(users)} need{'s' if len(users) == 1 else ''} bitsandbytes, which does not "
                        f"import here ({why}): pip install -U 'bitsandbytes>=0.46', or train with "
                        f"{' and '.join(users.values())}")]
    return []


def resolve_report_to(names: list[str]) -> list[str]:
    """``report_to`` as Transformers reads it: "none" alone is no tracker, "all" alone every installed one (in
    TRACKER_PACKAGES' order); repeats dropped."""
    names = list(dict.fromkeys(names))
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [name for name in TRACKER_PACKAGES if tracker_installed(name)]
    return names


def tracker_installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKER_PACKAGES[name][0]) is not None


def missing_tracker_message(name: str) -> str:
    """One line for a tracker whose package is not installed: what to install, or what to drop."""
    package = TRACKER_PACKAGES[name][1]
    return (f"report_to {name} needs the {package} package, which is not installed: pip install {package} (or pip "
            f"install 'shardtune[trackers]' for all of them), or remove {name} from report_to")


def tracker_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """Trackers named in ``report_to`` whose package is missing, and their environment variables that cannot be
    read, found before anything is written."""
    where = given.get("report_to", "config")
    problems = [f"{where}: {missing_tracker_message(name)}" for name in cfg.run.report_to
                if name in TRACKER_PACKAGES and not tracker_installed(name)]
    if "mlflow" in cfg.run.report_to:
        try:
            mlflow_tags()
        except UsageError as exc:
            problems.append(str(exc))
    return problems


def mlflow_tags() -> dict[str, str]:
    """MLFLOW_TAGS, a JSON object of the MLflow run's tags, as Transformers' MLflowCallback reads it."""
    import json

    text = os.environ.get("MLFLOW_TAGS")
    if not text:
        return {}
    try:
        tags = json.loads(text)
    except json.JSONDecodeError as exc:
        tags = exc
    if not isinstance(tags, dict):
        raise UsageError(f"the environment variable MLFLOW_TAGS={text!r} (report_to mlflow) is not a JSON object; "
                         f"set it as MLFLOW_TAGS='{{\"team\": \"nlp\"}}', or unset it")
    return {str(key): str(value) for key, value in tags.items()}


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
    template = cfg.data.chat_template_path
    if template and not Path(template).expanduser().is_file():
        problems.append(f"{given.get('chat_template_path', 'config')}: chat_template_path '{template}' is not a "
                        f"file: check the path")
    return problems


def context_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """max_seq_len beyond the positions the model covers (its config's max_position_embeddings): refused, not
    capped, since a row that long would train positions the model never learned (and a model with learned
    position embeddings would stop mid-run on the first such row). A model whose config cannot be read before
    loading (a hub model not yet downloaded) is not checked."""
    from shardtune.hub import context_length

    model, seq_len = cfg.model.model_name_or_path, cfg.data.max_seq_len
    found = context_length(model) if model and isinstance(seq_len, int) else None
    named = f"{given['max_seq_len']}: max_seq_len {seq_len}" if "max_seq_len" in given else \
        f"max_seq_len {seq_len} (the default)"
    problem = beyond_context(seq_len, found, named, f"model_name_or_path '{model}'", "max_seq_len")
    return [problem] if problem else []


def stage_problems(cfg: TrainConfig, given: Mapping[str, object],
                   layers: tuple[int, str] | None = None) -> list[str]:
    """PP with more stages (processes), or MP with more (its mp_devices), than the model has decoder layers: some
    stage would hold none. Refused from the model's config before the data is tokenised or a weight loaded (the
    trainer would only find it when placing the stages); a model whose config cannot be read without loading it,
    and MP on every visible GPU (mp_devices unset), are left to that later check. ``layers``: the model's decoder
    layers and where they were read, where the caller has them (a catalog model's); else read from the model."""
    d, model, strategy = cfg.distributed, cfg.model.model_name_or_path, _strategy(cfg.distributed)
    if strategy.pipelined:
        stages, key, each = d.num_processes, "num_processes", "process"
        fix = "launch {layers} processes or fewer (--num_processes {layers})"
    elif strategy.drives_several_devices and d.mp_devices:
        stages, key, each = len(d.mp_device_names), "mp_devices", "device"
        fix = "name {layers} devices or fewer in mp_devices"
    else:
        return []
    found = layers or (num_layers(model) if stages > 1 and model else None)
    problem = too_many_stages(strategy, stages, found, f"distributed_type={d.distributed_type}",
                              f"model_name_or_path '{model}'", each, fix)
    return [f"{given.get(key, 'config')}: {problem}"] if problem else []


def too_many_stages(strategy: Strategy, stages: int, found: tuple[int, str] | None, named: str, model: str,
                    each: str, fix: str) -> str | None:
    """``strategy`` (MP or PP, ``named`` as the user set it) over ``stages`` devices when ``found`` (the decoder
    layers ``model`` has, and where that was read) are fewer, as train and estimate refuse it: one line with both
    counts and ``fix`` (its ``{layers}`` the layer count); None where every stage holds a layer, or ``found`` is
    None."""
    if found is None or not strategy.leaves_a_stage_empty(stages, found[0]):
        return None
    layers, where = found
    kind = "pipeline" if strategy.pipelined else "model-parallel"
    return (f"{named} runs one {kind} stage per {each}: {stages} stages for the {layers} decoder layers of {model} "
            f"({where}); {fix.format(layers=layers)}")


def beyond_context(seq_len: int, found: tuple[int, str] | None, named: str, model: str, option: str) -> str | None:
    """A sequence length (``named``, as the user gave it) beyond the positions ``found`` for ``model`` (its
    length and where it was read), as train and estimate refuse it; None within them."""
    if found is None or seq_len <= found[0]:
        return None
    limit, where = found
    return (f"{named} is beyond the {limit} positions {model} covers ({where}); set {option} {limit} or less, or "
            f"give the model a longer context first (rope_scaling in its config.json)")


def model_folder_problems(cfg: TrainConfig, given: Mapping[str, object]) -> list[str]:
    """A local model folder or file that a training job could not load: no config.json, no weights, its own code
    not allowed, a GGUF cut short, a file that is neither (``hub.model_folder_problem``), told before any tokenizer
    or data is read. (``data inspect`` reads
    only the tokenizer, so it does not ask.)"""
    model = cfg.model.model_name_or_path
    if not model or not Path(model).expanduser().exists():  # an existing path is read, whatever its name
        return []
    name = f"model_name_or_path '{model}'"
    problem = model_folder_problem(model, name, trust_fix="set trust_remote_code true",
                                   trust_remote_code=cfg.model.trust_remote_code)
    if problem is None and Path(model).expanduser().is_dir():  # the trainer reads its tokenizer first
        problem = tokenizer_problem(name, model)
    return [f"{given.get('model_name_or_path', 'config')}: {problem}"] if problem else []
