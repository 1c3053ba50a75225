"""DeepSpeed configs, mapped onto what shardtune runs: FSDP2, torch's AdamW and its schedules.

Read from ``--deepspeed FILE.json`` (the Transformers/TRL flag; also ``deepspeed: FILE`` in a recipe) and from an
Accelerate file's ``deepspeed_config`` block (its ``deepspeed_config_file``, or the block's own keys). Every key
of the file is mapped, listed as a DeepSpeed-engine tuning knob that FSDP2 does without (bucket sizes, overlap,
prefetch thresholds: they change speed, not results), or refused in one line naming it. ``auto`` takes the value
from the rest of the config, as with Transformers. The mapping is printed when training starts
(``mapping_lines``), e.g. "zero_optimization.stage 2 -> FSDP SHARD_GRAD_OP".

ZeRO-1 shards only the optimizer states; FSDP2 has no such mode. It becomes SHARD_GRAD_OP, which also shards the
gradients: less memory per GPU than ZeRO-1 (gradients / world size instead of whole), and the same traffic
(reduce-scatter + all-gather instead of all-reduce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.keys import parse_bool
from shardtune.config.schema import all_keys
from shardtune.config.yaml_keys import repeated_key_line, repeated_keys
from shardtune.errors import UsageError
from shardtune.strategies import ZERO_STAGES, zero_mapping

# DeepSpeed-engine tuning with no FSDP2 counterpart: speed and logging, never the math. Accepted and listed.
TUNING = {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
          "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
          "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
          "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "steps_per_print",
          "wall_clock_breakdown", "zero_allow_untested_optimizer", "memory_breakdown", "pin_memory", "buffer_count",
          "fast_init", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients",
          # DeepSpeed's former names, which it still reads (Transformers' examples before 4.6 and 4.16 wrote them)
          "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save"}
SCHEDULERS = {"warmuplr": "constant_with_warmup", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
# The entries that set a key to their value, as the keys declare them (shardtune/config/schema.py).
AS_IS = {path: d.name for d in all_keys() for path in d.meta.deepspeed}


FP16_TUNING = "DeepSpeed fp16 loss scaler"  # a layer's entry (no key has spaces): the settings' problems if fp16


@dataclass
class Mapped:
    """What a DeepSpeed config becomes: shardtune keys, one printed line per decision, and the problems."""

    where: str
    values: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    train_batch_size: int | None = None  # checked against micro-batch x accumulation x processes once known
    # fp16 loss-scaler settings (Transformers' example files carry them): unused unless the run computes in fp16,
    # where they are refused (loading._apply decides, once every layer is known: the layer carries them under
    # FP16_TUNING, as the problem each would be)
    fp16_tuning: list[str] = field(default_factory=list)
    set_by: dict[str, str] = field(default_factory=dict)  # key -> the entry that set it (two must agree)
    takes_auto: set[str] = field(default_factory=set)  # the entries of set_by that could be written auto
    defaulted: set[str] = field(default_factory=set)  # keys Accelerate's defaults set: a --deepspeed file overrides

    def carried(self) -> dict[str, Any]:
        """The mapped keys, and the loss-scaler settings under FP16_TUNING where there are any."""
        return {**self.values, **({FP16_TUNING: list(self.fp16_tuning)} if self.fp16_tuning else {})}

    def set(self, ds_key: str, value: Any, key: str, shown: Any = None) -> None:
        """``ds_key`` sets shardtune's ``key``; ``auto`` leaves it to the rest of the config."""
        if _is_auto(value):
            self.lines.append(f"{ds_key} auto -> {key} from the config")
            return
        # optimizer.params.lr and scheduler.params.warmup_max_lr both set learning_rate: the later entry in the
        # file would win without a word (DeepSpeed itself warms up to warmup_max_lr, whatever the optimizer's lr)
        if key in self.set_by and not same_value(self.values[key], value):
            self.refuse(ds_key, value, f"and '{self.set_by[key]}' = {_show(self.values[key])} both set {key}: "
                                       f"make them agree, or write auto in one")
            return
        self.decide(ds_key, key, value)
        self.takes_auto.add(ds_key)
        self.lines.append(f"{ds_key} {_show(value)} -> {key} {_show(shown if shown is not None else value)}")

    def decide(self, ds_key: str, key: str, value: Any) -> None:
        """``ds_key`` makes shardtune's ``key`` ``value`` (a ZeRO stage, an offload device, an optimizer type)."""
        self.values[key], self.set_by[key] = value, ds_key

    def clash(self, key: str, said: str, named: str | None = None, relation: str = "which decides over") -> str:
        """The problem of a value ``said`` ("recipe.yaml, line 3: lr=...") of ``named`` (``key``, or a key the
        file's ``key`` excludes, as ``relation`` says) other than what this file makes ``key``: which entry of the
        file made it, and how to settle it (as Transformers' mismatch check names "ds optimizer.params.lr=... vs hf
        learning_rate=..."). A ZeRO stage or an optimizer type cannot be auto."""
        named, entry = named or key, self.set_by.get(key, key)
        fix = (f"write auto for {entry.split('[')[0]}" if entry in self.takes_auto else f"change {entry}")
        made = (f"makes it {self.values[key]!r}" if named == key else
                f"makes {key} {self.values[key]!r}, {relation} {named}")
        return (f"{said}, but {entry} in the DeepSpeed config {self.where} {made}: leave {named} out there, or {fix} "
                f"in {self.where}")

    def refuse(self, ds_key: str, value: Any, why: str) -> None:
        # JSON's "true" or "3" is text: shown quoted, or "'bf16.enabled' = true must be true" reads as nonsense
        shown = json.dumps(value) if isinstance(value, str) else _show(value)
        self.problems.append(f"{self.where}: DeepSpeed key '{ds_key}' = {shown} {why}")


def same_value(a: Any, b: Any) -> bool:
    """Whether two settings of one key agree (1e-4 and 0.0001 do)."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


# Top-level keys only a DeepSpeed config holds (bf16 and fp16 are DeepSpeed's when they hold a block).
DEEPSPEED_ONLY = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping",
                  "optimizer", "scheduler", *TUNING}


UNREADABLE = object()  # json_document's answer for a file that holds no JSON


def json_document(path: str | Path) -> Any:
    """The JSON value the file ``path`` holds; ``UNREADABLE`` where it holds none (missing, not UTF-8, not JSON).
    What tells a .json recipe, a DeepSpeed config and a data file of rows apart reads it once here."""
    try:
        return json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return UNREADABLE


def is_deepspeed_json(path: str | Path, document: Any = None) -> bool:
    """Whether the .json file ``path`` (its ``document`` where already read) is a DeepSpeed config rather than a
    recipe (Transformers' example scripts take their arguments as one JSON file, ``run_clm.py args.json``): one
    that is no JSON object is taken for DeepSpeed's, whose reader says what is wrong."""
    data = json_document(path) if document is None else document
    return not isinstance(data, dict) or bool(DEEPSPEED_ONLY & set(data)) or \
        any(isinstance(data.get(name), dict) for name in ("bf16", "fp16"))


def read_deepspeed_file(path: str | Path) -> Mapped:
    """A DeepSpeed JSON file, mapped; an unreadable one is one line naming it."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
        data = json.loads(text, object_pairs_hook=_refuse_repeats(path, text))
    except OSError as exc:
        raise UsageError(f"deepspeed {path}: cannot be read ({exc.strerror}); give the DeepSpeed config JSON") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"deepspeed {path}: not valid JSON ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"deepspeed {path}: expected a JSON object of DeepSpeed settings")
    return map_deepspeed(data, str(path))


def _refuse_repeats(path: Path, text: str):
    """json.loads's hook that refuses a key set twice in one object (json keeps the last one without a word)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        repeated = next((key for key in keys if keys.count(key) > 1), None)
        if repeated is None:
            return dict(items)
        try:  # JSON is YAML: its parser knows each key's line
            lines = dict(repeated_keys(yaml.compose(text))).get(repeated)
        except yaml.YAMLError:
            lines = None
        if lines:
            raise UsageError(f"deepspeed {repeated_key_line(path, repeated, lines)}")
        raise UsageError(f"deepspeed {path}: key '{repeated}' is set {keys.count(repeated)} times in one object; "
                         f"keep one")
    return pairs


def map_deepspeed(data: dict[str, Any], where: str) -> Mapped:
    """Every key of a DeepSpeed config as shardtune keys (``Mapped.values``), listed or refused."""
    out = Mapped(where)
    handlers = {**{path: lambda v, path=path: out.set(path, v, AS_IS[path]) for path in AS_IS if "." not in path},
                "train_batch_size": lambda v: _train_batch_size(out, v),
                "bf16": lambda v: _precision(out, "bf16", v), "fp16": lambda v: _precision(out, "fp16", v),
                "zero_optimization": lambda v: _zero(out, v),
                "optimizer": lambda v: _optimizer(out, v), "scheduler": lambda v: _scheduler(out, v)}
    for key, value in data.items():
        if key in handlers:
            handlers[key](value)
        elif key in TUNING:
            _listed(out, key, value)
        else:
            out.refuse(key, value, "has no counterpart in shardtune's FSDP2 trainer: remove it (docs/deepspeed.md "
                                   "lists what maps)")
    return out


SAVED_WHOLE = ("stage3_gather_16bit_weights_on_model_save",  # Accelerate's zero3_save_16bit_model
               "stage3_gather_fp16_weights_on_model_save")  # its former name


def _listed(out: Mapped, ds_key: str, value: Any) -> None:
    """A TUNING entry's printed line: engine tuning, or, for ZeRO-3's save option, what final/ holds instead."""
    if ds_key.endswith(SAVED_WHOLE):  # not tuning: with false, DeepSpeed saves no whole model at all
        out.lines.append(f"{ds_key} {_show(value)}: final/ is always the whole model, gathered from the shards, in "
                         f"the dtype its weights trained in (fp32 master weights under mixed precision)")
    else:
        out.lines.append(f"{ds_key} {_show(value)}: DeepSpeed-engine tuning, not used"
                         + ("" if "." in ds_key else " (FSDP2 tunes itself)"))


def _train_batch_size(out: Mapped, value: Any) -> None:
    if _is_auto(value):
        out.lines.append("train_batch_size auto -> per_device_train_batch_size x gradient_accumulation_steps x "
                         "processes")
    elif isinstance(value, int) and value >= 1:
        out.train_batch_size = value
        out.lines.append(f"train_batch_size {value} -> per_device_train_batch_size x gradient_accumulation_steps x "
                         f"processes must make {value} (accumulation is derived from it where nothing sets it)")
    else:
        out.refuse("train_batch_size", value, "must be a whole number of rows or auto")


def _precision(out: Mapped, name: str, block: Any) -> None:
    if not isinstance(block, dict):
        out.refuse(name, block, 'must be an object such as {"enabled": true}')
        return
    for key, value in block.items():
        if key == "enabled":
            if not _is_auto(value) and not isinstance(value, bool):
                out.refuse(f"{name}.enabled", value, "must be true, false or auto")
            elif value is True:
                out.set(f"{name}.enabled", True, name, shown="true (autocast, fp32 master weights)")
            elif value is False:  # not "the config decides": unset bf16 is bf16 on hardware that computes it
                out.set(f"{name}.enabled", False, name)
            else:
                out.lines.append(f"{name}.enabled {_show(value)} -> {name} from the config")
        elif name == "fp16" and key == "loss_scale" and value == 0:
            out.lines.append("fp16.loss_scale 0 -> dynamic loss scaling (torch's GradScaler)")
        elif name == "fp16" and not _is_auto(value):
            out.fp16_tuning.append(f"{out.where}: DeepSpeed key '{name}.{key}' = {_show(value)} tunes DeepSpeed's "
                                   f"loss scaler, and this run computes in fp16 with torch's GradScaler at its "
                                   f"defaults: remove it or set it to auto")
            out.lines.append(f"{name}.{key} {_show(value)} -> unused: it tunes DeepSpeed's fp16 loss scaler, and a "
                             f"run in fp16 (where it is refused) scales with torch's GradScaler defaults")
        elif not _is_auto(value):  # bf16 has no loss scaler: its other keys tune DeepSpeed's bf16 optimizer
            out.refuse(f"{name}.{key}", value, "tunes DeepSpeed's bf16 optimizer; shardtune's bf16 is torch's "
                                               "autocast with fp32 master weights: remove it or set it to auto")


def _zero(out: Mapped, block: Any) -> None:
    if not isinstance(block, dict):
        out.refuse("zero_optimization", block, 'must be an object such as {"stage": 2}')
        return
    stage = block.get("stage", 0)
    if stage not in ZERO_STAGES:
        out.refuse("zero_optimization.stage", stage,
                   "must be 0, 1, 2 or 3" + (", a number (without quotes)" if isinstance(stage, str) else ""))
    else:
        strategy, sharding = ZERO_STAGES[stage]
        out.decide("zero_optimization.stage", "distributed_type", strategy.name)
        if sharding:
            out.decide("zero_optimization.stage", "fsdp_sharding_strategy", sharding)
        out.lines.append(f"zero_optimization.stage {stage}: {zero_mapping(stage)}")
    for key, value in block.items():
        if key == "stage":
            continue
        if key in ("offload_param", "offload_optimizer"):
            _offload(out, f"zero_optimization.{key}", value)
        elif key in FORMER_OFFLOAD:
            _former_offload(out, key, value)
        elif key in TUNING:
            _listed(out, f"zero_optimization.{key}", value)
        else:
            out.refuse(f"zero_optimization.{key}", value, "has no counterpart in FSDP2: remove it")


# DeepSpeed's former offload switches, which it still reads as the blocks named, with device cpu (Transformers'
# ZeRO-2 example wrote "cpu_offload": true before 4.6): refused as unknown, the fix "remove it" dropped the offload.
FORMER_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _former_offload(out: Mapped, key: str, value: Any) -> None:
    ds_key = f"zero_optimization.{key}"
    if not isinstance(value, bool):
        out.refuse(ds_key, value, "must be true or false")
    elif value:
        out.decide(ds_key, "fsdp_offload_params", True)
        out.lines.append(f"{ds_key} true (DeepSpeed's former {FORMER_OFFLOAD[key]} to cpu) -> fsdp_offload_params true")
    else:
        out.lines.append(f"{ds_key} false: not offloaded")


def _offload(out: Mapped, ds_key: str, block: Any) -> None:
    device = str(block.get("device", "none")).lower() if isinstance(block, dict) else None
    if device not in ("cpu", "none"):
        out.refuse(ds_key, block, 'must be {"device": "cpu"} or {"device": "none"} (NVMe offload is not run)')
        return
    if device == "cpu":
        out.decide(f"{ds_key}.device", "fsdp_offload_params", True)
        extra = "" if ds_key.endswith("param") else " (FSDP2 offloads parameters, gradients and optimizer together)"
        out.lines.append(f"{ds_key}.device cpu -> fsdp_offload_params true{extra}")
    else:
        out.lines.append(f"{ds_key}.device none: not offloaded")
    for key, value in block.items():
        if key in TUNING:
            _listed(out, f"{ds_key}.{key}", value)
        elif key != "device":
            out.refuse(f"{ds_key}.{key}", value, "has no counterpart in FSDP2's CPU offload: remove it")


def _optimizer(out: Mapped, block: Any) -> None:
    kind = str(block.get("type", "")).lower() if isinstance(block, dict) else ""
    if kind not in ("adam", "adamw"):
        out.refuse("optimizer", block, "is not run: shardtune maps DeepSpeed's Adam/AdamW (to optim adamw_torch); "
                                       "for others remove the block and set optim")
        return
    out.decide("optimizer.type", "optim", "adamw_torch")
    out.lines.append(f"optimizer.type {block['type']} -> optim adamw_torch")
    for key, value in block.get("params", {}).items():
        path = f"optimizer.params.{key}"
        if path in AS_IS:
            out.set(path, value, AS_IS[path])
        elif key == "betas" and _is_auto(value):
            out.lines.append("optimizer.params.betas auto -> adam_beta1, adam_beta2 from the config")
        elif key == "betas" and isinstance(value, list) and len(value) == 2:
            for i, beta in enumerate(value):
                out.set(f"{path}[{i}]", beta, AS_IS[f"{path}[{i}]"])
        elif key in ("torch_adam", "adam_w_mode") and value in (True, "auto"):
            out.lines.append(f"optimizer.params.{key} {_show(value)}: torch's AdamW (decoupled weight decay)")
        else:
            out.refuse(f"optimizer.params.{key}", value, "is not a setting of torch's AdamW: remove it")


def _scheduler(out: Mapped, block: Any) -> None:
    kind = str(block.get("type", "")).lower() if isinstance(block, dict) else ""
    if kind not in SCHEDULERS:
        out.refuse("scheduler", block, "is not run: the types shardtune maps are WarmupLR, WarmupDecayLR and "
                                       "WarmupCosineLR; otherwise remove the block and set lr_scheduler_type")
        return
    floor = block.get("params", {}).get("cos_min_ratio", 0) if kind == "warmupcosinelr" else 0
    schedule = SCHEDULERS[kind] if _is_auto(floor) or floor == 0 else "cosine_with_min_lr"  # decays to the floor
    out.decide("scheduler.type", "lr_scheduler_type", schedule)
    out.lines.append(f"scheduler.type {block['type']} -> lr_scheduler_type {schedule}")
    if "warmup_type" not in block.get("params", {}):  # as in Transformers' example files, which then warm up so
        out.lines.append("scheduler.params.warmup_type not set: DeepSpeed's default warm-up is logarithmic, "
                         "shardtune's linear (write \"warmup_type\": \"linear\" to say so)")
    for key, value in block.get("params", {}).items():
        if f"scheduler.params.{key}" in AS_IS:
            out.set(f"scheduler.params.{key}", value, AS_IS[f"scheduler.params.{key}"])
        elif key == "warmup_type" and value == "linear":
            out.lines.append("scheduler.params.warmup_type linear: the warm-up shardtune runs")
        elif key in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio") and (_is_auto(value) or value == 0):
            out.lines.append(f"scheduler.params.{key} {_show(value)}: warm-up starts, and decay ends, at 0")
        elif key == "cos_min_ratio" and kind == "warmupcosinelr":  # the cosine's floor, a share of the peak rate
            out.set("scheduler.params.cos_min_ratio", value, "min_lr_rate")
        elif key == "total_num_steps" and _is_auto(value):
            out.lines.append("scheduler.params.total_num_steps auto -> the run's max_steps")
        else:
            out.refuse(f"scheduler.params.{key}", value, "is not what shardtune's schedules do (linear warm-up "
                                                         "from 0, decay to 0 over max_steps): remove it or use auto")


# Keys of Accelerate's deepspeed_config block (accelerate config writes them), as DeepSpeed JSON paths.
ACCELERATE_BLOCK = {"zero_stage": ("zero_optimization", "stage"),
                    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
                    "offload_param_device": ("zero_optimization", "offload_param", "device"),
                    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
                    "gradient_clipping": ("gradient_clipping",),
                    "zero3_save_16bit_model": ("stage3_gather_16bit_weights_on_model_save",)}


ACCELERATE_ZERO_STAGE = 2  # what Accelerate runs for distributed_type DEEPSPEED when its file names no zero_stage


def accelerate_block(data: dict[str, Any]) -> dict[str, Any] | None:
    """The ``deepspeed_config`` block of an Accelerate file's (or a recipe's) ``data`` to map: its own, an empty one
    where ``distributed_type: DEEPSPEED`` comes without one (Accelerate's defaults), None where there is none."""
    block = data.get("deepspeed_config")
    if block is None and str(data.get("distributed_type", "")).upper() == "DEEPSPEED":
        return {}
    return block if isinstance(block, dict) else None


def map_accelerate_block(block: dict[str, Any], where: str) -> Mapped:
    """Accelerate's ``deepspeed_config`` block: its ``deepspeed_config_file``, or its own keys."""
    if block.get("deepspeed_config_file"):
        others = sorted(set(block) - {"deepspeed_config_file", "deepspeed_multinode_launcher", "zero3_init_flag"})
        if others:
            raise UsageError(f"{where}: deepspeed_config sets deepspeed_config_file and {', '.join(others)}; the "
                             f"file decides those: keep one place")
        mapped = read_deepspeed_file(Path(where).parent / Path(block["deepspeed_config_file"]).expanduser()
                                     if not Path(block["deepspeed_config_file"]).is_absolute()
                                     else block["deepspeed_config_file"])
        if "distributed_type" not in mapped.values:  # as Accelerate refuses it, rather than guess a stage
            mapped.problems.append(f"{mapped.where}: no zero_optimization block (this deepspeed_config_file of "
                                   f"{where} needs one, as Accelerate says): add \"zero_optimization\": {{\"stage\": "
                                   f"2}} with the stage meant")
    else:
        given = block  # Accelerate's DeepSpeedPlugin runs ZeRO-2 when the file gives no stage
        data: dict[str, Any] = {}
        for key, value in {"zero_stage": ACCELERATE_ZERO_STAGE, **given}.items():
            if key in ACCELERATE_BLOCK:
                *parents, leaf = ACCELERATE_BLOCK[key]
                node = data
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = value
        mapped = map_deepspeed(data, where)
        if "zero_stage" not in given:
            mapped.lines.insert(0, f"zero_stage not set: Accelerate's default, {ACCELERATE_ZERO_STAGE} (a --deepspeed "
                                   f"file's stage decides over it)")
            mapped.defaulted = {"distributed_type", "fsdp_sharding_strategy"}
        extra = sorted(set(block) - set(ACCELERATE_BLOCK) - {"deepspeed_multinode_launcher", "zero3_init_flag"})
        mapped.problems += [f"{where}: deepspeed_config.{key} has no counterpart in FSDP2: remove it" for key in extra]
    if block.get("zero3_init_flag") is not None:
        try:
            mapped.decide("zero3_init_flag", "fsdp_cpu_ram_efficient_loading", parse_bool(block["zero3_init_flag"]))
        except ValueError:
            mapped.problems.append(f"{where}: deepspeed_config.zero3_init_flag = {_show(block['zero3_init_flag'])} "
                                   f"must be true or false")
        loads = mapped.values.get("fsdp_cpu_ram_efficient_loading")  # unset where refused just above
        mapped.lines.append(f"zero3_init_flag {_show(block['zero3_init_flag'])} -> fsdp_cpu_ram_efficient_loading"
                            + ("" if loads is None else f" {_show(loads)}"))
    launcher = str(block.get("deepspeed_multinode_launcher", "standard")).lower()
    if launcher != "standard":
        mapped.problems.append(f"{where}: deepspeed_multinode_launcher {launcher}: shardtune launches through "
                               f"torchrun (shardtune launch, or --slurm): remove it")
    return mapped
