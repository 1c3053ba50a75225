"""Reading a training configuration: YAML recipes, Accelerate config files, key=value and --key value.

A recipe written for ``accelerate launch --config_file fsdp_config.yaml train.py --key value ...`` carries over.
Precedence, lowest first (written once, here, and tested):

    defaults < Accelerate config file (--config_file) < YAML recipe < key=value overrides < --key value flags

A key set twice in one file is refused (naming both lines), and so is, on the ``train`` and ``launch`` command
lines, a key given two different values (naming both arguments): one of them would be dropped without a word.
Setting a key in a file and again on the command line is the override above, and stays legal.

The resolved config is written beside every checkpoint as flat YAML that ``shardtune train`` reads back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.compile import DYNAMO_KEYS, dynamo_values, normalise_compile
from shardtune.config.deepspeed import (FP16_TUNING, Mapped, accelerate_block, is_deepspeed_json, json_document,
                                       map_accelerate_block, read_deepspeed_file, same_value)
from shardtune.config.keys import parse_bool, shown
from shardtune.config.no_ops import (NO_OPS, TRAINED_TOKEN_KEYS, UNSET, at_transformers_default, no_op_problem,
                                     off)
from shardtune.config.schema import (ALIASES, DATASET_PLACEHOLDER, FSDP1_RESHARD, ZERO2_HYBRID, DataConfig, TrainConfig,
                                     all_keys)
from shardtune.config.validation import (attention_problems, context_problems, device_problems, idle_keys,
                                         input_problems, model_folder_problems, overruled_keys, resolve_report_to,
                                         stage_problems, tracker_problems, validate)
from shardtune.config.yaml_keys import key_lines, repeated_key_line, repeated_keys
from shardtune.errors import UsageError, closest
from shardtune.files import with_digest, write_text
from shardtune.hub import data_file_kind
from shardtune.strategies import FSDP


@dataclass
class Origin:
    """Where a value came from, for error messages: a file and line, or the command line."""

    where: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.where}, line {self.line}" if self.line else self.where

    @property
    def on_command_line(self) -> bool:
        return self.where.startswith(COMMAND_LINE)


COMMAND_LINE = "command line"  # how an Origin names the command line, before the flag it names


def _yaml_with_lines(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Load a YAML mapping and the line of each top-level (and fsdp_config) key; a key set twice is refused, also
    once at the top and once under fsdp_config (both become the same flat key)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not a YAML text file (byte {exc.start} is not UTF-8); give the recipe "
                         f"itself") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        repeated = repeated_keys(node)
        flat_lines = key_lines(node, lift="fsdp_config")  # before constructing, which folds '<<' merges in
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix the syntax") from None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of key: value lines, got {type(data).__name__}")
    for section in NESTED_SECTIONS:  # a scalar or a list there would be read as an unknown key named after it
        if data.get(section) is not None and not isinstance(data[section], dict):
            line = flat_lines.get(section, [0])[0]
            raise UsageError(f"{path}{f', line {line}' if line else ''}: {section} must be a mapping of keys "
                             f"(as 'accelerate config' writes it), got {type(data[section]).__name__}")
    found = {key for key, _ in repeated}
    repeated += [(key, at) for key, at in flat_lines.items() if len(at) > 1 and key not in found]
    raise_problems([repeated_key_line(path, key, at) for key, at in repeated])
    return data, {key: at[0] for key, at in flat_lines.items()}


NESTED_SECTIONS = ("fsdp_config", "deepspeed_config")  # the blocks of an Accelerate file that _flatten lifts


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    """Lift Accelerate's nested ``fsdp_config`` block to top-level keys (``deepspeed_config`` is mapped whole)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(value if key == "fsdp_config" and isinstance(value, dict) else {key: value})
    return flat


def read_accelerate_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Origin]]:
    """An Accelerate config file (``accelerate config`` output) as flat shardtune keys, read as it is; a DeepSpeed
    JSON given in its place is named as one, with the option that reads it."""
    values, sources = read_yaml_recipe(path)
    deepspeed = sorted({"zero_optimization", "train_micro_batch_size_per_gpu"} & set(values))
    if deepspeed and "distributed_type" not in values:
        raise UsageError(f"--config_file {path}: a DeepSpeed config, not an Accelerate one (it has "
                         f"{' and '.join(deepspeed)}): pass it as --deepspeed {path}")
    return values, sources


def _mapped_deepspeed_block(values: dict[str, Any], sources: dict[str, Origin], path: str | Path) -> None:
    """Accelerate's ``distributed_type: DEEPSPEED`` and its ``deepspeed_config`` block, in a file's ``values``, as
    the FSDP2 keys they mean (docs/deepspeed.md)."""
    block, where = accelerate_block(values), sources.pop("deepspeed_config", Origin(str(path)))
    values.pop("deepspeed_config", None)
    if str(values.get("distributed_type", "")).upper() == "DEEPSPEED":  # the block's stage says which FSDP
        values["distributed_type"] = FSDP.name
    if block is not None:
        mapped = map_accelerate_block(block, str(path))
        raise_problems(mapped.problems + _block_clashes(mapped.values, [(values, sources)], path))
        values.update(mapped.carried())
        sources.update({key: Origin(f"{path}{DEFAULTED if key in mapped.defaulted else IN_BLOCK}", where.line)
                        for key in mapped.values})


IN_BLOCK = " (deepspeed_config)"  # how an Origin names a value an Accelerate deepspeed_config block set
DEFAULTED = " (Accelerate's default ZeRO stage)"  # ... and one Accelerate's default gave: a --deepspeed file's wins


def _block_clashes(block: dict[str, Any], layers: Layers, path: str | Path) -> list[str]:
    """The training values of an Accelerate ``deepspeed_config`` block (``block``, of the file ``path``) that
    ``layers`` set otherwise: refused, as a --deepspeed file's are and as Transformers refuses them (the block's
    value was listed as what runs, and the other one ran). Its distributed keys are the launch's, which a later
    --distributed_type may change."""
    distributed = {d.name for d in all_keys() if d.section == "distributed"}
    return [f"{sources.get(key, Origin('config'))}: {key}={values[key]!r}, but the deepspeed_config block of {path} "
            f"sets {value!r}: make them agree, or write auto there"
            for key, value in block.items() if key not in distributed
            for values, sources in layers if key in values and not same_value(values[key], value)]


def deepspeed_layer(layers: Layers) -> tuple[dict[str, Any], dict[str, Origin]] | None:
    """The DeepSpeed JSON that ``deepspeed`` names (the highest layer that sets it), mapped, as a layer; None
    when no layer names one. Values its file sets that a higher layer sets otherwise are refused, as Transformers
    refuses them; ``train_batch_size`` must be micro-batch x accumulation x processes (accumulation is derived from
    it where nothing else sets it)."""
    found = _mapped_deepspeed(layers)
    if found is None:
        return None
    mapped, path, origin = found
    where = Origin(f"{path} (DeepSpeed, named at {origin})" if origin else f"{path} (DeepSpeed)")
    return mapped.carried(), {key: where for key in mapped.values}


def _mapped_deepspeed(layers: Layers) -> tuple[Mapped, str, Origin | None] | None:
    """The DeepSpeed JSON that ``layers`` name, mapped and checked against them (``deepspeed_layer``), with the path
    as named and where it was named; None when no layer names one."""
    named = [(values["deepspeed"], sources.get("deepspeed")) for values, sources in layers
             if values.get("deepspeed") not in (None, "", "none", "None")]
    if not named:
        return None
    path, origin = named[-1]
    try:
        mapped = read_deepspeed_file(path)
    except UsageError as exc:  # named in a recipe: which one, and that a relative path is the working directory's
        if origin is None or not origin.line:
            raise
        relative = "" if Path(path).expanduser().is_absolute() or Path(path).expanduser().exists() else \
            f" (a relative path is read from the working directory, {Path.cwd()})"
        raise UsageError(f"{origin}: {exc}{relative}") from None
    problems = list(mapped.problems)
    for key, value in mapped.values.items():
        for values, sources in layers:
            defaulted = sources.get(key, Origin("")).where.endswith(DEFAULTED)
            if key in values and key != "deepspeed" and not defaulted and not same_value(values[key], value):
                problems.append(mapped.clash(key, f"{sources.get(key, Origin('config'))}: {key}={values[key]!r}"))
    for mine, other, clashes, relation in EXCLUDED:
        for values, sources in layers:
            if mine in mapped.values and other in values and clashes(mapped.values[mine], values[other]):
                said = f"{sources.get(other, Origin('config'))}: {other}={values[other]!r}"
                problems.append(mapped.clash(mine, said, other, relation))
    if mapped.train_batch_size is not None:
        problems += _check_train_batch_size(mapped, layers)
    raise_problems(problems)
    return mapped, str(path), origin


def _on(value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:  # refused as a value of its key
        return False


# A key a DeepSpeed file sets, another key a layer may set, whether the two settings cannot both run, and how the
# refusal says so: a warm-up step count wins over warmup_ratio (a ratio set above would be dropped), and bf16 and
# fp16 cannot both compute (the refusal names the file's entry and the other setting's place, not only the file).
EXCLUDED = (("warmup_steps", "warmup_ratio", lambda mine, other: not same_value(other, 0), "which decides over"),
            ("bf16", "fp16", lambda mine, other: mine is True and _on(other), "which cannot run with"),
            ("fp16", "bf16", lambda mine, other: mine is True and _on(other), "which cannot run with"))


def load_given_values(argv: list[str]) -> dict[str, Any]:
    """Every key's value in the job ``argv`` describes, checked as keys only (nothing is read), flat."""
    return _apply(_layers(argv), training=False)[0].to_flat()


def key_origins(argv: list[str]) -> dict[str, Origin]:
    """Where each key the job ``argv`` describes was set (a file and line, or the command line)."""
    return _apply(_layers(argv), training=False)[1]


def deepspeed_mappings(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(which DeepSpeed config, the line of each of its keys) of every one the job ``argv`` describes reads: the
    JSON that ``deepspeed`` names and each file's ``deepspeed_config`` block. What ``shardtune train`` prints at
    start, so that a mapping is never silent."""
    files, overrides, flags, _ = parse_cli_pairs(argv)
    accelerate_file = flags.get("config_file") or overrides.get("config_file")
    # the file the job reads, as it reads it (a JSON recipe's too), with what the rest of the config made of it
    mapped = _mapped_deepspeed(_user_layers(argv)[0])
    found = [(mapped[1], mapped[0].lines)] if mapped else []
    for path in [*([accelerate_file] if accelerate_file else []), *files]:  # lowest layer first
        block = accelerate_block(_yaml_with_lines(Path(path))[0])
        if block is not None:
            found.append((f"{path} (deepspeed_config)", map_accelerate_block(block, path).lines))
    return found


def _check_train_batch_size(mapped, layers: Layers) -> list[str]:
    """DeepSpeed's train_batch_size against the config's micro-batch x accumulation x processes."""
    said = {key: value for values, _ in layers for key, value in values.items()} | mapped.values  # the latest
    defaults, total = TrainConfig(), mapped.train_batch_size
    micro = int(said.get("per_device_train_batch_size", defaults.run.per_device_train_batch_size))
    procs = int(said.get("num_processes", defaults.distributed.num_processes))
    accum = said.get("gradient_accumulation_steps")
    if accum is None and total % (micro * procs) == 0:
        accum = mapped.values["gradient_accumulation_steps"] = total // (micro * procs)
        mapped.lines.append(f"train_batch_size {total} -> gradient_accumulation_steps {accum} (= {total} / ({micro} x "
                            f"{procs} processes))")
        return []
    accum = int(defaults.run.gradient_accumulation_steps if accum is None else accum)
    if micro * accum * procs == total:
        mapped.lines.append(f"train_batch_size {total} = {micro} x {accum} x {procs} processes")
        return []
    return [f"{mapped.where}: train_batch_size {total} is not per_device_train_batch_size {micro} x "
            f"gradient_accumulation_steps {accum} x {procs} processes ({micro * accum * procs}): make them agree, "
            f"or write auto"]


def read_yaml_recipe(path: str | Path) -> tuple[dict[str, Any], dict[str, Origin]]:
    """A shardtune YAML recipe: flat keys (Accelerate's ``fsdp_config:`` and ``deepspeed_config:`` blocks are also
    accepted, as in an Accelerate file)."""
    data, lines = _yaml_with_lines(Path(path))
    flat = _flatten(data)
    sources = {k: Origin(str(path), lines.get(k)) for k in flat}
    _mapped_deepspeed_block(flat, sources, path)
    _fsdp1_spellings(flat, sources)
    return flat, sources


def _fsdp1_spellings(values: dict[str, Any], sources: dict[str, Origin]) -> None:
    """Accelerate's FSDP1 spellings, read in the layer that writes them (a file, key=value or --key):

    - its files from 1.6 on write the sharding strategy under ``fsdp_reshard_after_forward``, where FSDP2 reads a
      boolean: in a layer that does not say ``fsdp_version: 2`` (Accelerate's FSDP1 is its default), such a value is
      ``fsdp_sharding_strategy``;
    - HYBRID_SHARD_ZERO2 (5) keeps the gathered parameters from forward to backward: HYBRID_SHARD and, unless that
      layer says otherwise, no resharding."""
    reshard = values.get("fsdp_reshard_after_forward")
    if (str(reshard).strip().upper() in FSDP1_RESHARD and str(values.get("fsdp_version", 1)).strip() != "2"
            and not isinstance(reshard, bool)):
        said = values.get("fsdp_sharding_strategy")
        if said is not None and str(said).strip().upper() != str(reshard).strip().upper():
            raise UsageError(f"{sources['fsdp_reshard_after_forward']}: fsdp_reshard_after_forward={reshard!r} is "
                             f"FSDP1's sharding strategy, and {sources['fsdp_sharding_strategy']} says "
                             f"fsdp_sharding_strategy={said!r}: keep one of them")
        values["fsdp_sharding_strategy"] = values.pop("fsdp_reshard_after_forward")
        sources["fsdp_sharding_strategy"] = sources.pop("fsdp_reshard_after_forward")
    if str(values.get("fsdp_sharding_strategy", "")).strip().upper() in ZERO2_HYBRID:
        values.setdefault("fsdp_reshard_after_forward", False)
        sources.setdefault("fsdp_reshard_after_forward", sources["fsdp_sharding_strategy"])


# Keys whose values TRL's parser (HfArgumentParser, nargs +) takes as several words: --lora_target_modules q_proj
# v_proj; here they are one comma-separated value.
NARGS_KEYS = ("lora_target_modules", "lora_modules_to_save")


def _another_value(arg: str) -> bool:
    """Whether ``arg``, after a NARGS_KEYS key's value, is one more of its words: not a flag, a key=value or a
    recipe file."""
    return not arg.startswith("--") and "=" not in arg and not arg.endswith((".yaml", ".yml", ".json"))


class BareFlag(str):
    """The value of a ``--key`` given no value: true, as HfArgumentParser reads a flag; refused for a key that
    takes no true (``--max_steps --lr 1e-4``, ``--output_dir --max_steps 5``: a missing value, not the text
    'true'), naming the flag."""


def _cli_items(argv: list[str]) -> list[tuple[str, str, Any, str]]:
    """Each argument as (kind, key, value, as typed): kind is ``file``, ``override`` (key=value) or ``flag``
    (--key value, whose dashes in the key read as underscores: --foo-bar is --foo_bar)."""
    items = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            typed = arg
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    words = [argv[i + 1]]
                    i += 1
                    if key.replace("-", "_") in NARGS_KEYS:  # TRL's --lora_target_modules q_proj v_proj
                        while i + 1 < len(argv) and _another_value(argv[i + 1]):
                            words.append(argv[i + 1])
                            i += 1
                    value, typed = ",".join(words), f"{arg} {' '.join(words)}"
                else:
                    value = BareFlag("true")
            if key == "config" and value != "true":  # TRL's `trl sft --config recipe.yaml`: the recipe itself
                items.append(("file", value, None, typed))
            else:
                items.append(("flag", key.replace("-", "_"), value, typed))
        elif "=" in arg and not (arg.endswith((".yaml", ".yml")) and Path(arg).expanduser().is_file()):
            # (a recipe whose path holds '=', sweep/lr=1e-3/recipe.yaml, is a file: a key has no '/' or '.yaml')
            key, _, value = arg.partition("=")
            items.append(("override", key, value, arg))
        else:
            items.append(("file", arg, None, arg))
        i += 1
    return items


def parse_cli_pairs(argv: list[str]) -> tuple[list[str], dict[str, Any], dict[str, Any], dict[str, Origin]]:
    """Split ``[CONFIG.yaml] key=value ... --key value --flag ...`` into files, overrides, flags and sources.

    ``key=value`` overrides and ``--key value`` flags are kept apart: flags win whatever their order on the line.
    A ``--key`` followed by another ``--key`` (or nothing) is a boolean flag set to true, as with HfArgumentParser.
    A key given twice keeps its last value here; the commands refuse that first (``repeated_cli_keys``).
    """
    files: list[str] = []
    overrides: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    sources: dict[str, Origin] = {}
    for kind, key, value, _ in _cli_items(argv):
        if kind == "flag":
            flags[key] = value
            sources[key] = Origin(f"{COMMAND_LINE} (--{key})")
        elif kind == "override":
            overrides[key] = value
            sources.setdefault(key, Origin(f"{COMMAND_LINE} ({key}=...)"))
        else:
            files.append(key)
    return files, overrides, flags, sources


def repeated_cli_keys(argv: list[str], hints: Mapping[str, str] | None = None) -> list[str]:
    """One problem per key that the command line gives two different values (as ``--key v``, ``--key=v``,
    ``key=v``, a spelling with dashes or another tool's name: TRL's ``max_length=v`` and ``--max_seq_len v``): the
    one that would win depends on rules nobody should have to recall. The same value twice loses nothing and passes
    (``shardtune launch`` repeats its --num_processes this way). Two names of one key, each once, among the
    ``--key`` flags alone (or the ``key=value`` ones alone) are left to the config's own check, which names both
    (``_alias_problems``). ``hints`` adds a word to the problem of a key, after the fix."""
    given: dict[str, list[tuple[str, Any, str, str]]] = {}
    for kind, key, value, typed in _cli_items(argv):
        if kind != "file":
            given.setdefault(ALIASES.get(key, key), []).append((typed, value, kind, key))
    problems = []
    for key, uses in given.items():
        if len({str(value) for _, value, _, _ in uses}) < 2:
            continue
        names, kinds = [name for *_, name in uses], {kind for _, _, kind, _ in uses}
        if len(kinds) == 1 and len(set(names)) == len(names) > 1:
            continue
        times = "twice" if len(uses) == 2 else f"{len(uses)} times"
        listed = ", ".join(typed for typed, *_ in uses[:-1]) + f" and {uses[-1][0]}"
        hint = (hints or {}).get(key, "")
        problems.append(f"command line: key '{key}' is given {times} ({listed}); keep one{hint}")
    return problems


Layers = list[tuple[dict[str, Any], dict[str, Origin]]]


# Other tools' keys with no counterpart of the same meaning here, and what to write instead: a spelling near
# another key would otherwise be offered (dataset_train_split -> dataset_num_proc).
_SPLITS = "here the split names go in one key: splits (e.g. splits train,test)"
UNKNOWN_ELSEWHERE = {
    "dataset_splits": _SPLITS,
    "preprocessing_num_workers": "here it is dataset_num_proc", "lr": "here it is learning_rate",
    # TRL's SFTConfig: what shardtune does instead, so that no near spelling of another key is offered.
    "eval_dataset_name": "eval rows come from dataset_name's own eval split here (e.g. test.jsonl beside "
                         "train.jsonl; the splits key names them) or from eval_split_ratio",
    # TRL's ModelConfig and ScriptArguments
    **dict.fromkeys(("lora_target_parameters", "target_parameters"),
                    "here lora_target_modules adapts a mixture-of-experts model's expert tensors too (all-linear, or "
                    "their names, e.g. Mixtral's w1,w2,w3); give them there"),
    # PEFT's LoraConfig (a recipe written for get_peft_model): the key each is here
    "r": "PEFT's rank is lora_r here", "target_modules": "PEFT's target_modules is lora_target_modules here",
    "bias": "PEFT's bias (none, all, lora_only) is lora_bias here",
    "modules_to_save": "PEFT's modules_to_save is lora_modules_to_save here",
    "trainable_token_indices": "train trains the embedding rows of the tokens a chat template adds by itself (PEFT's "
                               "trainable_token_indices); leave it out",
    # TrainingArguments: spelling alone offered lr_scheduler_type, optim, dataset_name, save_total_limit, ...
    "optim_args": "the optimizer's settings are keys of their own here (adam_beta1, adam_beta2, adam_epsilon, "
                  "weight_decay); leave it out",
    "data_seed": "seed orders the data here (and seeds LoRA's initialisation and dropout); leave it out",
    "save_only_model": "checkpoints here always hold what an exact resume needs, and final/ the model alone; leave "
                       "it out",
    "eval_accumulation_steps": "evaluation here keeps no logits to accumulate (only the loss is summed); leave it out",
    "fsdp": "here FSDP is distributed_type FSDP, with fsdp_sharding_strategy (FULL_SHARD for full_shard) and "
            "fsdp_offload_params true for offload",
    "ddp_backend": "the backend here is NCCL on CUDA and gloo on CPUs; leave it out",
    "local_rank": "torchrun gives each process its rank (shardtune launch starts them); leave it out",
    "auto_find_batch_size": "shardtune estimate --find-batch-size finds the largest micro-batch that fits; set "
                            "per_device_train_batch_size",
    "label_smoothing_factor": "the loss here is plain cross-entropy, with no label smoothing; leave it out",
    "use_cache": "training runs without the KV cache here; leave it out",
    "fsdp_config": "it is read as a block of a recipe or Accelerate config file (its fsdp_* keys as top-level "
                   "keys); on the command line give those keys (fsdp_version, fsdp_sharding_strategy, ...)",
    "accelerator_config": "Accelerate's settings are keys of their own here, named as in its config file; leave it "
                          "out",
    "optim_target_modules": "GaLore-style optimizers are not run here (optim names those that are); leave it out",
    "do_predict": "shardtune train evaluates the loss (eval_strategy) and generates nothing; leave it out",
    "log_level_replica": "ranks other than 0 print errors, and warnings about themselves alone, here; leave it out "
                         "(log_level sets rank 0's)",
    # Accelerate's ZeRO stage outside its deepspeed_config block: spelling alone offered save_strategy
    "zero_stage": "Accelerate's zero_stage is read inside a deepspeed_config block (deepspeed_config: {zero_stage: 2}, "
                  "run as FSDP), or give a DeepSpeed JSON with deepspeed",
    # Transformers 4's TrainingArguments (recipes written before 5): spelling alone offered logging_first_step
    "trackio_space_id": "the Space report_to trackio sends to is the environment variable TRACKIO_SPACE_ID here "
                        "(trackio reads it); set it instead",
    "logging_dir": "TensorBoard's event files go to output_dir/tensorboard/RUN_NAME here (report_to tensorboard; "
                   "run_name names it); leave it out, or set the environment variable TENSORBOARD_LOGGING_DIR to "
                   "that folder, as with Transformers 5",
    # Transformers 4's half-precision keys (Colab T4 notebooks): spelling alone offered mixed_precision and log_level
    **dict.fromkeys(("half_precision_backend", "fp16_backend"),
                    "fp16 and bf16 run through torch.amp here (autocast, and a GradScaler for fp16: Transformers' "
                    "auto or cpu_amp); apex is not run; leave it out"),
    "fp16_opt_level": "apex's opt level is not run here: fp16 true is torch.amp's autocast over fp32 master weights "
                      "with a GradScaler (apex O1's recipe); leave it out",
    **dict.fromkeys(("fp16_full_eval", "bf16_full_eval"),
                    "evaluation here runs in the training's precision (its autocast over the fp32 weights), never "
                    "with the weights cast to half; leave it out"),
    # alignment-handbook's and TRL's scripts' inline template: spelling alone offered chat_template_format's names
    "chat_template": "put the template in the model folder as chat_template.jinja (chat_template_format none reads "
                     "the tokenizer's own), or name one with chat_template_format",
}
# Transformers' TrainingArguments and TRL's SFTConfig keys (transformers 5.24, TRL 1.16) that are neither keys here
# nor read through UNKNOWN_ELSEWHERE's advice: whatever key is spelled near them here means something else.
# tests/test_config.py checks the list against the installed TrainingArguments.
OTHER_TOOLS_KEYS = {
    **dict.fromkeys((
        "batch_eval_metrics", "dataloader_in_order",
        "dataloader_multiprocessing_context", "enable_jit_checkpoint", "eval_do_concat_batches",
        "eval_use_gather_object", "hub_always_push", "hub_revision", "ignore_data_skip",
        "include_for_metrics", "label_names", "length_column_name", "liger_kernel_config", "log_on_each_node",
        "restore_callback_states_from_checkpoint", "save_on_each_node",
        "skip_memory_metrics", "trackio_bucket_id", "trackio_static_space_id",
        "train_sampling_strategy"), "Transformers' TrainingArguments"),
    # PEFT 0.21's LoraConfig; tests/test_config.py walks the installed one
    **dict.fromkeys((
        "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode", "megatron_config",
        "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "velora_config",
        "alora_invocation_tokens", "use_qalora", "qalora_group_size", "monteclora_config", "layer_replication",
        "runtime_config", "use_bdlora", "arrow_config", "kasa_config", "ensure_weight_tying"), "PEFT's LoraConfig"),
}


def build_config(layers: Layers, *, training: bool = True) -> TrainConfig:
    """Apply ``layers`` (lowest precedence first) onto the defaults; report every problem together. With
    ``training`` False (``data inspect``), nothing will be written, so no output_dir is needed, and the data set is
    read next, so it must be real data; a max_seq_len train would refuse is refused too (the rows shown are the
    rows train would see)."""
    cfg, given, problems = _apply(layers, training=training)
    if not training:
        problems += input_problems(cfg, given) + context_problems(cfg, given)
    raise_problems(problems)
    return cfg


def without_idle_keys(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a flat config) less the keys whose setting they leave off, which a job's config leaves out (the
    estimator's LoRA rank on a full fine-tune); the rest is checked when the config is built."""
    idle = idle_keys(_apply([(values, {})], training=True)[0])
    return {name: value for name, value in values.items() if ALIASES.get(name, name) not in idle}


def raise_problems(problems: list[str]) -> None:
    """Every problem found, as one UsageError (exit 2); nothing when there is none."""
    if problems:
        raise UsageError(" | ".join(problems) if len(problems) > 1 else problems[0])


def _apply(layers: Layers, *, training: bool,
           notes: list[str] | None = None) -> tuple[TrainConfig, dict[str, Origin], list[str]]:
    """The config ``layers`` make, where each key's value came from, and every problem found; ``notes`` gets a
    line for each key a later layer's setting turned off and set back to its default, for an FSDP1 file run as
    FSDP2, for a mixed_precision the bf16/fp16 flags set aside, and for QLoRA's use_nested_quant left unset."""
    cfg = TrainConfig()
    given: dict[str, Origin] = {}
    layer_of: dict[str, int] = {}
    # TRL's assistant_only_loss / completion_only_loss given true or false (the last layer's word): read against
    # train_on_prompt once every layer is in, as false asks for what train_on_prompt true trains
    trained_tokens: dict[str, tuple[Origin, Any]] = {}
    declared = {d.name: d for d in all_keys()}
    problems: list[str] = []
    fp16_tuning: list[str] = []  # a DeepSpeed file's loss-scaler settings: refused if the run computes in fp16
    for layer, (values, sources) in enumerate(layers):
        problems += _alias_problems(values, sources)
        for name, value in values.items():
            if name == FP16_TUNING:
                fp16_tuning += value
                continue
            source, key = sources.get(name, Origin("config")), ALIASES.get(name, name)
            if name == "max_length" and UNSET(value):  # TRL's None: no truncation, which was dropped for 2048
                problems.append(f"{source}: max_length={value!r} asks for TRL's rows with no truncation; rows here are "
                                f"cut at max_seq_len, at most the model's positions: give max_length a number")
                continue
            if value is None and key != name:  # another tool's name left unset (an older config.yaml's dtype: null)
                continue
            if name.endswith("_token") and value == f"<{name.upper()}>":
                continue  # Transformers' to_json_string writes a *_token key so, hiding its value: it says none
            if (meant := _other_spelling(key, value)) is not None:  # other tools' spellings of keys declared here
                keys_meant, refused = meant
                if key == "fsdp_version" and notes is not None:
                    notes.append(f"fsdp_version={value} ({source}): {FSDP1_AS_FSDP2}")
                problems += [f"{source}: {problem}" for problem in refused]
                for meant_key, setting in keys_meant.items():
                    setattr(getattr(cfg, declared[meant_key].section), meant_key, setting)
                    given[meant_key], layer_of[meant_key] = source, layer
            elif key in TRL_SPLITS:  # TRL's name of one side of splits; unset (TRL's null test split), none
                if off(value):
                    pass
                elif problem := _trl_split(cfg.data, key, value, "splits" in values):
                    problems.append(f"{source}: {problem}")
                else:
                    given["splits"], layer_of["splits"] = source, layer
            elif key in NO_OPS:  # accepted from recipes and Accelerate files; a value that would act is refused
                if key in TRAINED_TOKEN_KEYS and (off(value) or no_op_problem(key, value) is None):
                    if UNSET(value):
                        trained_tokens.pop(key, None)
                    else:
                        trained_tokens[key] = (source, value)
                elif problem := no_op_problem(key, value):
                    problems.append(f"{source}: {problem}")
            elif key not in declared and at_transformers_default(key, value):
                pass  # a written-out TrainingArguments' key with no counterpart here, at Transformers' default
            elif key not in declared:
                problems.append(f"{source}: {_unknown_key_problem(key, list(declared))}")
            elif isinstance(value, BareFlag) and declared[key].base is not bool and not declared[key].meta.takes_true:
                problems.append(f"{source}: --{name} is given no value (a flag reads as true, which only a "
                                f"true/false key takes); give it one: --{name} VALUE")
            else:
                try:
                    setattr(getattr(cfg, declared[key].section), key, declared[key].coerce(value))
                    given[key], layer_of[key] = source, layer
                except ValueError as exc:
                    problems.append(f"{source}: {name}={value!r}: {exc}")
    problems += _trained_token_problems(trained_tokens, cfg.data.train_on_prompt)
    if cfg.precision_on(False) == "fp16":  # fp16 is only ever asked for, never the hardware's choice
        problems += fp16_tuning
    if notes is not None and (note := _precision_set_aside(cfg, given)):
        notes.append(note)
    cfg.run.report_to = resolve_report_to(cfg.run.report_to)
    normalise_compile(cfg.run, compile_set="torch_compile" in given)
    _reset_overruled(cfg, given, layer_of, notes)
    if notes is not None:  # QLoRA's keys as the reset left them
        notes += [note for note in (_nested_quant_default(cfg, given), _rank0_loading_idle(cfg, given)) if note]
    problems += [_located(problem, given) for problem in validate(cfg, training=training)]
    return cfg, given, problems


def _unknown_key_problem(key: str, declared: list[str]) -> str:
    """A key declared nowhere: what it is elsewhere and what to write instead, or the closest key here."""
    hint = closest(key, declared)
    did_you_mean = (f"; {UNKNOWN_ELSEWHERE[key]}" if key in UNKNOWN_ELSEWHERE
                    else f": {OTHER_TOOLS_KEYS[key]} key, which has no counterpart here; leave it out "
                         f"('shardtune train --help-keys' lists the keys)" if key in OTHER_TOOLS_KEYS
                    else f"; did you mean '{hint}'?" if hint else "; see 'shardtune train --help-keys'")
    return f"unknown key '{key}'{did_you_mean}"


def _reset_overruled(cfg: TrainConfig, given: dict[str, Origin], layer_of: dict[str, int],
                     notes: list[str] | None) -> None:
    """Each key set in a layer below the one that turned its setting off, back to its default, with a note; a
    reset setting can leave its own keys idle, so until none is left."""
    declared = {d.name: d for d in all_keys()}
    reset: set[str] = set()
    while overruled := overruled_keys(cfg, layer_of, reset):
        for name in sorted(overruled):
            section = getattr(cfg, declared[name].section)
            if notes is not None:
                notes.append(f"{name}={shown(getattr(section, name))} ({given[name]}) is set back to its default: it "
                             f"acts under {declared[name].meta.needs}, which a later setting turned off")
            setattr(section, name, getattr(type(section)(), name))
        reset |= overruled


# What an Accelerate file's fsdp_version 1 becomes, said at start (shardtune train's notes).
FSDP1_AS_FSDP2 = ("FSDP1 runs here as FSDP2 (fully_shard), the FSDP shardtune has: the fsdp_* keys keep their "
                  "meaning (the same units, sharded and gathered as the sharding strategy says); the parameters are "
                  "sharded one by one rather than as FSDP1's flat parameters")


def _precision_set_aside(cfg: TrainConfig, given: dict[str, Origin]) -> str | None:
    """Accelerate's ``mixed_precision`` where TrainingArguments' bf16/fp16 flag decides otherwise (an Accelerate
    file's ``no`` beside a recipe's ``bf16: true``): the flag wins, as in Transformers, and this line says so."""
    asked, precision = cfg.distributed.mixed_precision, cfg.precision_on(False)
    if asked is None or asked.lower() == precision:
        return None
    flag = "fp16" if cfg.run.fp16 and not cfg.run.bf16 else "bf16"
    return (f"mixed_precision={asked} ({given['mixed_precision']}) is set aside: {flag}="
            f"{shown(getattr(cfg.run, flag))} ({given.get(flag, Origin('config'))}) decides, as in Transformers, and "
            f"the run computes in {'fp32' if precision == 'no' else precision}")


def _nested_quant_default(cfg: TrainConfig, given: dict[str, Origin]) -> str | None:
    """QLoRA with use_nested_quant left unset: this default (true) is not the one of the tools a recipe comes
    from, so a recipe that leaves the key out would quantise its base otherwise than there without a word."""
    if not cfg.lora.use_4bit_quantization or "use_nested_quant" in given:
        return None
    return ("use_nested_quant is left out, and shardtune's default is true (double quantisation, as in the QLoRA "
            "paper): TRL's use_bnb_nested_quant, PEFT's use_nested_quant and Transformers' "
            "bnb_4bit_use_double_quant default to false; set use_nested_quant false to quantise the base as they do, "
            "or true to keep it")


def _rank0_loading_idle(cfg: TrainConfig, given: dict[str, Origin]) -> str | None:
    """fsdp_cpu_ram_efficient_loading true, as Accelerate's FSDP QLoRA configs set it, does not act under QLoRA
    (each rank loads and quantises its own copy of the base): said, not refused, so such a file still runs."""
    d = cfg.distributed
    if not (cfg.lora.use_4bit_quantization and d.distributed_type == "FSDP" and d.fsdp_cpu_ram_efficient_loading
            and "fsdp_cpu_ram_efficient_loading" in given):
        return None
    return (f"fsdp_cpu_ram_efficient_loading=true ({given['fsdp_cpu_ram_efficient_loading']}) does not act with "
            f"QLoRA (use_4bit_quantization): every rank loads and quantises its own copy of the base in CPU RAM, "
            f"rank 0 does not load it for the others")


def _trained_token_problems(given: dict[str, tuple[Origin, Any]], train_on_prompt: bool) -> list[str]:
    """TRL's assistant_only_loss / completion_only_loss (``given``: where each was set, and its value) against
    train_on_prompt: true asks for the assistant turns (completions) only, false for every token, as
    train_on_prompt true does."""
    problems = []
    for key, (source, value) in given.items():
        if train_on_prompt and not off(value):
            problems.append(f"{source}: {key}=true and train_on_prompt true ask for different tokens to train; "
                            f"keep one")
        elif not train_on_prompt and off(value):
            problems.append(f"{source}: {no_op_problem(key, value)}")
    return problems


RATIO_STEP_KEYS = ("warmup_steps", "logging_steps", "save_steps", "eval_steps")
# TRL's split keys, each naming one side of splits: the split that trains (True), the one that evaluates.
TRL_SPLITS = {"dataset_train_split": True, "dataset_test_split": False}


def _trl_split(data: DataConfig, key: str, value: Any, splits_beside: bool) -> str | None:
    """TRL's ``dataset_train_split`` / ``dataset_test_split``: ``data.splits`` with its side (the names that train,
    or those that evaluate) replaced by the split named, the other side kept; the problem as one line, or None.
    ``splits_beside``: the same file or command line gives splits too."""
    name, trains = str(value).strip(), TRL_SPLITS[key]
    if splits_beside:
        return f"{key}={value!r} beside splits: name the splits in one key (e.g. splits train_sft,test_sft)"
    if ("train" in name) != trains or "," in name:
        fix = ("write that split to a file (datasets' to_json) and give the file as dataset_name" if trains else
               "hold eval rows out of the training split with eval_split_ratio instead")
        return (f"{key}={value!r}: the splits that train here are those whose names contain 'train', so '{name}' "
                f"cannot be the one split that {'trains' if trains else 'evaluates'}; {fix}")
    kept = data.eval_split_names() if trains else data.train_split_names()
    data.splits = ",".join([name, *kept] if trains else [*kept, name])
    return None


def _other_spelling(key: str, value: Any) -> tuple[dict[str, Any], list[str]] | None:
    """Other tools' spellings that say what keys declared here say: the keys and values meant, and the problems of
    a value that has no meaning here; None for any other key or value.

    - Accelerate's dynamo keys are torch_compile, torch_compile_backend and torch_compile_mode (compile.py).
    - Accelerate's ``fsdp_version: 1`` (TRL's fsdp1.yaml) runs as FSDP2, the FSDP here (``FSDP1_AS_FSDP2``).
    - ``warmup_steps`` below 1 is Transformers 5's ratio of the run's steps (its warmup_ratio is gone): warmup_ratio.
      A ratio of logging_steps, save_steps or eval_steps is refused, naming the steps to give instead.
    - Transformers' argument mappings (``KWARGS``) set the keys their entries name: TRL recipes'
      ``gradient_checkpointing_kwargs: {use_reentrant: false}``, ``lr_scheduler_kwargs: {min_lr_rate: 0.1}`` and
      ``model_init_kwargs: {dtype: bfloat16}``."""
    if key in DYNAMO_KEYS:
        return dynamo_values(key, value)
    if key == "fsdp_version" and str(value).strip() == "1":
        return {"fsdp_version": 2}, []
    if key in RATIO_STEP_KEYS:
        try:
            ratio = float(value)
        except (TypeError, ValueError):
            return None
        if not 0 < ratio < 1 or isinstance(value, bool):
            return None
        if key == "warmup_steps":  # and no step count from an earlier layer, which would win over the ratio
            return {"warmup_ratio": ratio, "warmup_steps": 0}, []
        return {}, [f"{key}={value}: a fraction of the run's steps (as Transformers 5 reads a value below 1) is not "
                    f"read here; give a number of steps"]
    if key not in KWARGS:
        return None
    read, example = KWARGS[key]
    if isinstance(value, str):  # the command line's '{"use_reentrant": false}', as TRL's parser reads it
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if value is None:  # unset, as Transformers' own default writes it (lr_scheduler_kwargs: null): no entries
        return {}, []
    if not isinstance(value, dict):
        return {}, [f"{key}={value!r}: expected a mapping such as {example}"]
    declared = {d.name: d for d in all_keys()}
    meant, problems = {}, []
    for name, setting in value.items():
        if name not in read:
            problems.append(f"{key}: {name} is not read here (only {', '.join(read)} {'are' if read[1:] else 'is'}); "
                            f"{KWARGS_ELSEWHERE.get((key, name), 'remove it')}")
        elif setting is not None:
            target = kwargs_key(key, name)
            try:
                coerced = declared[target].coerce(setting)
            except ValueError as exc:
                problems.append(f"{key}: {name}={setting!r}: {exc}")
                continue
            if meant.setdefault(target, coerced) != coerced:  # dtype and torch_dtype both
                problems.append(f"{key}: {name}={setting!r} and another name of {target} disagree; give one")
    return meant, problems


# torch's ReduceLROnPlateau arguments that Transformers' lr_scheduler_kwargs hands on (min_lr: its own key; mode:
# greater_is_better's).
PLATEAU_ARGUMENTS = ("factor", "patience", "threshold", "threshold_mode", "cooldown", "eps")
# Transformers' and TRL's argument mappings read here: the entries each sets as the key of its name, and an example.
KWARGS = {**dict.fromkeys(("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),  # the latter:
                         (("use_reentrant",), "{use_reentrant: false}")),  # Transformers 5's name
          # each schedule's settings (a setting its schedule does not read is refused as the key it sets)
          "lr_scheduler_kwargs": (("min_lr_rate", "min_lr", "num_cycles", "warmup_lr_rate", "lr_end", "power",
                                   "timescale", "num_decay_steps", "num_stable_steps", "warmup_type", "decay_type",
                                   "min_lr_ratio", *PLATEAU_ARGUMENTS), "{min_lr_rate: 0.1}"),
          # TRL's from_pretrained arguments
          "model_init_kwargs": (("dtype", "torch_dtype", "attn_implementation", "trust_remote_code"),
                                "{dtype: bfloat16, attn_implementation: sdpa}")}
# Entries read as a key of another name: torch's ReduceLROnPlateau arguments are the plateau_ keys.
KWARGS_NAMES = {("lr_scheduler_kwargs", name): f"plateau_{name}" for name in PLATEAU_ARGUMENTS}


def kwargs_key(mapping: str, entry: str) -> str:
    """The key that ``mapping``'s ``entry`` sets: model_init_kwargs' dtype is torch_dtype, lr_scheduler_kwargs'
    patience plateau_patience, use_reentrant is use_reentrant."""
    return KWARGS_NAMES.get((mapping, entry)) or ALIASES.get(entry, entry)


# What to write instead of an entry not read here.
KWARGS_ELSEWHERE = {("lr_scheduler_kwargs", "mode"): "reduce_lr_on_plateau's direction follows greater_is_better "
                                                     "(min, unless greater_is_better is true): set that",
                    ("model_init_kwargs", "device_map"): "each process's device follows from the launch here "
                                                         "(distributed_type, mp_devices); remove it",
                    ("model_init_kwargs", "quantization_config"): "give load_in_4bit and the bnb_4bit_* keys",
                    ("model_init_kwargs", "use_cache"): "training runs without the KV cache here; remove it",
                    ("model_init_kwargs", "revision"): "give model_revision (see its note)"}


def _alias_problems(values: dict[str, Any], sources: dict[str, Origin]) -> list[str]:
    """Two names of one key in one layer (TRL's max_length beside max_seq_len) with different values: which one
    was meant cannot be told. Unset (null) is no value."""
    problems, named = [], {}
    for name, value in values.items():
        key = ALIASES.get(name, name)
        first = named.setdefault(key, name)
        if first != name and None not in (value, values[first]) and str(value) != str(values[first]):
            whose = next(d.meta.aliases for d in all_keys() if d.name == key)
            said = "; ".join(f"{n} is {whose[n]} name for {key}" for n in (first, name) if n != key)
            problems.append(f"{sources.get(name, Origin('config'))}: {first}={values[first]} and {name}={value} "
                            f"disagree ({said}); give one of them")
    return problems


def _located(problem: str, given: dict[str, Origin]) -> str:
    """``problem`` led by the file (and line) that set the first of its keys set in a file (the command line needs
    no pointer: the key is on it)."""
    origins = [given[key] for key in getattr(problem, "keys", ()) if key in given]
    # else a file without lines (a DeepSpeed JSON): bf16 from it and --fp16 would read as if only --fp16 were set
    lines = [o for o in origins if o.line] or [o for o in origins if not o.on_command_line]
    return f"{lines[0]}: {problem}" if lines else problem


def placed(error: UsageError, argv: list[str]) -> UsageError:
    """``error`` led by the file and line of ``argv``'s recipe that set its key, where its message is a ``Problem``
    found after the config was read (a LoRA target the model lacks); as it is otherwise."""
    problem = error.args[0] if error.args else None
    if not getattr(problem, "keys", None):
        return error
    return UsageError(_located(problem, key_origins(argv)))


def load_train_config(argv: list[str], *, training: bool = True) -> TrainConfig:
    """Resolve ``shardtune train`` arguments into a validated TrainConfig (see the module docstring); ``training``
    False reads them for a command that writes nothing (no output_dir needed)."""
    return build_config(_layers(argv), training=training)


def load_saved_config(path: str | Path, argv: list[str] | None = None) -> TrainConfig:
    """A run's saved config.yaml (``argv``: what the command sets over it), as export and resume read it: a key
    that did nothing in that run, saved before such keys were refused (lora_r of a full fine-tune), is left out
    rather than refused."""
    values, sources = read_yaml_recipe(path)
    return build_config([(without_idle_keys(values), sources), *_layers(argv or [])])


def load_run_config(argv: list[str]) -> TrainConfig:
    """``load_train_config`` for a job about to start: it also refuses, before any model is loaded, the
    --emit-config dataset placeholder, a model or data path that is not there, and a model folder that cannot load
    (no config.json, no weights, its own code not allowed). A dry run reads neither, so they are not checked.
    (Plain loads stay lenient: ``export`` reads a run's saved config.) The train and launch commands check the
    resume folder, and a key given two values on their command line, as well (``cli.common.load_job_config``)."""
    cfg, _, problems = run_config_problems(argv)
    raise_problems(problems)
    return cfg


def check_given_values(argv: list[str], hints: Mapping[str, str] | None = None) -> TrainConfig:
    """The training keys ``argv`` gives, checked as keys and values only, with the model, data and output_dir
    allowed to be left out: what a dry run of ``shardtune launch`` shows the command for. Nothing is read. A key
    given two values is refused as the real launch refuses it (``hints``: as for ``repeated_cli_keys``). Returns
    the config they make, for the launcher's own checks."""
    placeholders = ({"model_name_or_path": "MODEL", "dataset_name": "DATA"}, {})
    cfg, _, problems = _apply([placeholders, *_layers(argv)], training=False)
    raise_problems(repeated_cli_keys(argv, hints) + problems)
    return cfg


def load_planned_config(argv: list[str], notes: list[str] | None = None) -> TrainConfig:
    """The job ``argv`` describes, for a command that plans it and neither reads its data nor writes (``estimate
    --config``): every key checked as for ``train``, the data set and output_dir allowed to be left out (their
    placeholders lie below everything given, so a recipe's own are kept). ``notes``: as ``run_config_problems``'."""
    placeholders = ({"dataset_name": DATASET_PLACEHOLDER, "output_dir": "output"}, {})
    cfg, _, problems = _apply([placeholders, *_layers(argv)], training=True, notes=notes)
    raise_problems(problems)
    return cfg


def run_config_problems(argv: list[str], notes: list[str] | None = None) -> tuple[TrainConfig, dict[str, Origin],
                                                                                 list[str]]:
    """The config of a job about to start, where each key was set, and every problem ``load_run_config`` reports.
    ``notes`` gets a line for each key that a later layer's setting turned off and that is set back to its default
    rather than refused (a file's fsdp_* keys under --distributed_type DDP): what ``shardtune train`` prints at
    start, so that no value a user set is dropped without a word."""
    cfg, given, problems = _apply(_layers(argv), training=True, notes=notes)
    problems += [_located(problem, given) for problem in attention_problems(cfg)]  # a dry run builds the model too
    problems += stage_problems(cfg, given)  # a dry run traces the stages
    if not cfg.run.dry_run:
        folder = model_folder_problems(cfg, given)
        problems += (input_problems(cfg, given) + folder + (context_problems(cfg, given) if not folder else [])
                     + [_located(problem, given) for problem in device_problems(cfg)] + tracker_problems(cfg, given))
    return cfg, given, problems


def _data_file(path: str) -> bool:
    """Whether ``path`` is a file of rows: JSONL, Parquet, CSV (compressed or not), or JSON holding a list."""
    kind = data_file_kind(path)
    return kind not in (None, "json") or (path.endswith(".json") and isinstance(json_document(path), list))


def is_json_recipe(path: str) -> bool:
    """Whether ``path`` is a JSON recipe rather than a JSON data file (rows) or a DeepSpeed config: an object that
    names a model, a data set or an output_dir (a written-out TrainingArguments always holds output_dir)."""
    data = json_document(path)
    return isinstance(data, dict) and bool({"model_name_or_path", "dataset_name", "output_dir"} & set(data)) and \
        not is_deepspeed_json(path, data)


def _layers(argv: list[str]) -> Layers:
    """Every layer of the job ``argv`` describes, lowest first: ``_user_layers`` and, above the Accelerate file and
    below everything the user writes for shardtune, the DeepSpeed JSON that one of them names."""
    layers, above_accelerate_file = _user_layers(argv)
    deepspeed = deepspeed_layer(layers)
    if deepspeed is not None:
        layers.insert(above_accelerate_file, deepspeed)
    return layers


def _user_layers(argv: list[str]) -> tuple[Layers, int]:
    """The layers ``argv`` gives, lowest first: the Accelerate file (--config_file), the recipes, key=value and
    --key value; and where a DeepSpeed JSON's layer goes among them (just above the Accelerate file)."""
    files, overrides, flags, cli_sources = parse_cli_pairs(argv)
    layers: Layers = []
    accelerate_file = flags.pop("config_file", None) or overrides.pop("config_file", None)
    if accelerate_file:
        layers.append(read_accelerate_config(accelerate_file))
    for path in files:
        if not path.endswith((".yaml", ".yml")) and not (path.endswith(".json") and not is_deepspeed_json(path)):
            named = "/" in path or "." in path  # a path, not a stray word (a list's second value)
            what = ("a folder; " if Path(path).is_dir() else
                    "no such file; " if named and not Path(path).expanduser().exists() else
                    f"a data set goes in --dataset_name {path}; " if _data_file(path) else
                    f"a DeepSpeed config JSON goes in --deepspeed {path}; " if path.endswith(".json") else "")
            raise UsageError(f"unexpected argument '{path}': {what}give a recipe (CONFIG.yaml, or a JSON of its keys), "
                             f"key=value or --key value")
        layers.append(read_yaml_recipe(path))
    for given in (overrides, flags):
        _fsdp1_spellings(given, cli_sources)
    layers += [(overrides, cli_sources), (flags, cli_sources)]
    for at, (values, sources) in enumerate(layers):  # an Accelerate deepspeed_config block's values, set above it
        block = {key: values[key] for key, origin in sources.items() if origin.where.endswith(IN_BLOCK)}
        if block:
            raise_problems(_block_clashes(block, layers[at + 1:], sources[next(iter(block))].where[:-len(IN_BLOCK)]))
    return layers, 1 if accelerate_file else 0


def save_resolved(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as flat YAML, atomically (temp file then rename), marked as shardtune's own."""
    write_text(path, with_digest(f"# Written by shardtune: a 'shardtune train' recipe, every key resolved.\n"
                                 f"{yaml.safe_dump(cfg.to_flat(), sort_keys=False)}"))
