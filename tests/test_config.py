"""The training config: precedence, Accelerate files read as they are, and one-line errors with exit code 2."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from collections.abc import Iterable

import pytest

from shardtune.cli import main
from shardtune.config import ModelConfig, TrainConfig, known_keys, load_train_config
from shardtune.config.schema import section_classes
from shardtune.errors import UsageError

BASE = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "out"]

ACCELERATE_FSDP = textwrap.dedent("""\
    compute_environment: LOCAL_MACHINE
    debug: false
    distributed_type: FSDP
    downcast_bf16: 'no'
    enable_cpu_affinity: false
    fsdp_config:
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_backward_prefetch: BACKWARD_PRE
      fsdp_cpu_ram_efficient_loading: true
      fsdp_forward_prefetch: false
      fsdp_offload_params: false
      fsdp_sharding_strategy: FULL_SHARD
      fsdp_state_dict_type: SHARDED_STATE_DICT
      fsdp_sync_module_states: true
      fsdp_use_orig_params: false
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 2
    rdzv_backend: static
    same_network: true
    tpu_env: []
    tpu_use_cluster: false
    tpu_use_sudo: false
    use_cpu: false
    """)


def test_defaults_follow_transformers():
    cfg = TrainConfig()
    assert (cfg.optim.learning_rate, cfg.optim.lr_scheduler_type, cfg.run.per_device_train_batch_size,
            cfg.run.seed, cfg.optim.max_grad_norm) == (5e-5, "linear", 8, 42, 1.0)
    # Precision is not Transformers' fp32: left to the hardware (tests/test_precision_default.py).
    assert cfg.precision_left_to_hardware and cfg.precision_on(False) == "no" and cfg.precision_on(True) == "bf16"


def test_precedence_defaults_file_yaml_override_flag(tmp_path):
    acc = tmp_path / "fsdp.yaml"
    acc.write_text(ACCELERATE_FSDP)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.001\nuse_peft_lora: true\nlora_r: 4\nseed: 3\n"
                      "fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    cfg = load_train_config([str(recipe), "lora_r=16", "seed=5", "--seed", "9", "--config_file", str(acc), *BASE])
    assert cfg.optim.learning_rate == 0.001  # YAML over default
    assert cfg.lora.lora_r == 16  # key=value over YAML
    assert cfg.run.seed == 9  # --flag over key=value over YAML
    # Flags win over key=value whatever their order on the line.
    assert load_train_config([*BASE, "--learning_rate", "1", "learning_rate=2"]).optim.learning_rate == 1.0
    assert cfg.distributed.fsdp_sharding_strategy == "SHARD_GRAD_OP"  # YAML over the Accelerate file
    assert cfg.distributed.distributed_type == "FSDP" and cfg.distributed.num_processes == 2
    assert cfg.mixed_precision == "bf16"  # Accelerate's mixed_precision when no bf16/fp16 flag


def test_accelerate_aliases_and_fsdp1_numbers(tmp_path):
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")
    assert load_train_config(["--config_file", str(acc), *BASE]).distributed.distributed_type == "DDP"
    acc.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 4\nnum_processes: 4\n")
    assert load_train_config(["--config_file", str(acc), *BASE]).distributed.fsdp_sharding_strategy == "HYBRID_SHARD"
    # FSDP1's HYBRID_SHARD_ZERO2 (5) keeps the gathered parameters in the node: HYBRID_SHARD without resharding.
    for spelled in ("5", "HYBRID_SHARD_ZERO2"):
        acc.write_text(f"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: {spelled}\nnum_processes: 4\n")
        d = load_train_config(["--config_file", str(acc), *BASE]).distributed
        assert (d.fsdp_sharding_strategy, d.fsdp_reshard_after_forward) == ("HYBRID_SHARD", False)
    # The same from the command line, as key=value or --key (where a number is read as one).
    for given in (["fsdp_sharding_strategy=5"], ["--fsdp_sharding_strategy", "5"],
                  ["--fsdp_sharding_strategy", "HYBRID_SHARD_ZERO2"]):
        d = load_train_config(["--distributed_type", "FSDP", *given, *BASE]).distributed
        assert (d.fsdp_sharding_strategy, d.fsdp_reshard_after_forward) == ("HYBRID_SHARD", False), given
    # ... unless the same layer says otherwise; plain HYBRID_SHARD reshards.
    d = load_train_config(["--distributed_type", "FSDP", "--fsdp_sharding_strategy", "5",
                           "--fsdp_reshard_after_forward", "true", *BASE]).distributed
    assert d.fsdp_reshard_after_forward is True
    d = load_train_config(["--distributed_type", "FSDP", "--fsdp_sharding_strategy", "4", *BASE]).distributed
    assert d.reshards_after_forward and d.fsdp_reshard_after_forward is None
    # An fsdp_config beside MULTI_GPU would be dropped: refused, naming the file and line.
    acc.write_text("distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_sharding_strategy: 4\nnum_processes: 4\n")
    with pytest.raises(UsageError, match="acc.yaml, line 3: fsdp_sharding_strategy=HYBRID_SHARD set without "
                                         "distributed_type FSDP"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_the_accelerate_docs_fsdp_file_with_its_backward_prefetch_policy_loads(tmp_path):
    """Accelerate's and Transformers' FSDP docs write fsdp_backward_prefetch_policy (Accelerate's former name): it was
    refused as an unknown key, so the docs' file could not be run as it is."""
    acc = tmp_path / "fsdp_config.yaml"
    acc.write_text(textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config:
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_backward_prefetch_policy: BACKWARD_PRE
          fsdp_forward_prefetch: false
          fsdp_offload_params: true
          fsdp_sharding_strategy: 1
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_use_orig_params: true
        mixed_precision: bf16
        num_processes: 2
        """))
    d = load_train_config(["--config_file", str(acc), *BASE]).distributed
    assert (d.fsdp_backward_prefetch, d.fsdp_sharding_strategy, d.fsdp_offload_params) == \
        ("BACKWARD_PRE", "FULL_SHARD", True)
    acc.write_text(acc.read_text().replace("BACKWARD_PRE", "BACKWARD_POST"))  # what FSDP2 cannot do: refused
    with pytest.raises(UsageError, match=r"fsdp_config.yaml, line 5: fsdp_backward_prefetch='BACKWARD_POST' is not "
                                         r"accepted"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_a_wrap_class_the_model_lacks_is_refused_at_the_line_of_the_file_that_set_it(tmp_path):
    """The Accelerate docs' fsdp_transformer_layer_cls_to_wrap: BertLayer, copied for a Llama, was refused only as
    "fsdp_transformer_layer_cls_to_wrap=BertLayer: ...", with no word of which file set it."""
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import run_shardtune, write_chat_data

    model = make_model_folder(tmp_path / "model")
    data = write_chat_data(tmp_path / "chat.jsonl", rows=20)
    acc = tmp_path / "fsdp_config.yaml"
    acc.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: BertLayer\n")
    args = ["train", "--config_file", str(acc), "--model_name_or_path", str(model), "--dataset_name", str(data),
            "--splits", "train", "--max_seq_len", "32", "--max_steps", "1", "--output_dir", str(tmp_path / "o"),
            "--predict_memory", "false"]
    said = (f"shardtune train: error: {acc}, line 3: fsdp_transformer_layer_cls_to_wrap=BertLayer: no module of this "
            f"model has that class; its decoder layers are LlamaDecoderLayer")
    for extra in (["--dry_run", "true"], []):  # the dry run's trace builds the wrap units as the run does
        proc = run_shardtune([*args, *extra], tmp_path)
        assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, said), proc.stderr[-2000:]


def test_deepspeed_zero_stage_maps_to_fsdp(tmp_path):
    acc = tmp_path / "ds.yaml"
    acc.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    cfg = load_train_config(["--config_file", str(acc), *BASE])
    assert (cfg.distributed.distributed_type, cfg.distributed.fsdp_sharding_strategy) == ("FSDP", "SHARD_GRAD_OP")


def test_bare_flag_is_true_and_hub_flags_accepted():
    cfg = load_train_config([*BASE, "--packing", "--push_to_hub", "--hub_model_id", "me/x"])
    assert cfg.data.packing is True and cfg.run.push_to_hub is True and cfg.run.hub_model_id == "me/x"



@pytest.mark.parametrize("flag", ["--max_steps", "--learning_rate", "--output_dir", "--lr_scheduler_type",
                                  "--lora_target_modules", "--max_length"])
def test_a_flag_given_no_value_is_refused_unless_the_key_takes_true(flag):
    """'--max_steps --learning_rate 1e-4' (a value forgotten) was refused as "max_steps='true': expected an integer",
    and '--output_dir --max_steps 5' trained into a folder called 'true'. A bare --key means true for the keys that
    take it (booleans, resume_from_checkpoint, init_lora_weights); for any other it is refused, naming the flag."""
    given = BASE[:4] if flag == "--output_dir" else BASE  # BASE ends with --output_dir out
    with pytest.raises(UsageError) as refused:
        load_train_config([*given, flag, "--seed", "3"])
    assert (f"command line ({flag}): {flag} is given no value (a flag reads as true, which only a true/false key "
            f"takes); give it one: {flag} VALUE") in str(refused.value)
    cfg = load_train_config([*BASE, "--resume_from_checkpoint", "--use_peft_lora", "--init_lora_weights"])
    assert cfg.checkpoint.resume_from_checkpoint == "true" and cfg.lora.init_lora_weights == "true"

def sections_of_each_key(sections: dict[str, type]) -> dict[str, list[str]]:
    """Every field of every section and the sections that declare it, read off the dataclasses themselves."""
    where: dict[str, list[str]] = {}
    for name, cls in sections.items():
        for f in dataclasses.fields(cls):
            where.setdefault(f.name, []).append(name)
    return where


def test_every_key_has_one_section():
    """known_keys() is a dict, so a key declared in two sections would collapse into one entry there: count the
    declarations on the dataclasses instead."""
    where = sections_of_each_key(section_classes())
    assert {key: names for key, names in where.items() if len(names) > 1} == {}
    assert known_keys() == {key: names[0] for key, names in where.items()}


def test_a_key_declared_in_two_sections_is_found():
    @dataclasses.dataclass
    class ModelConfigWithSeed(ModelConfig):
        seed: int = 0  # also RunConfig's

    planted = {**section_classes(), "model": ModelConfigWithSeed}
    assert {key: names for key, names in sections_of_each_key(planted).items() if len(names) > 1} == {
        "seed": ["model", "run"]}


@pytest.mark.parametrize("argv,needle", [
    (["--learning_rte", "1e-4"], "unknown key 'learning_rte'; did you mean 'learning_rate'?"),
    (["--lr_scheduler_type", "cosin"], "use one of linear, cosine"),
    (["--per_device_train_batch_size", "-2"], "per_device_train_batch_size=-2 must be at least 1"),
    (["--bf16", "maybe"], "expected true or false"),
    (["--fsdp_sharding_strategy", "FULL"], "use one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD"),
    (["--save_total_limit", "-1"], "save_total_limit=-1 must be at least 1"),
    (["--learning_rate", "inf"], "expected a finite number"),
    (["--weight_decay", "-0.1"], "weight_decay=-0.1 must not be negative"),
])
def test_bad_values_are_one_line_errors(argv, needle, capsys):
    assert main(["train", *BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["--optim", "adamw_apex_fused"], "optim='adamw_apex_fused' is not accepted; use one of adamw_torch, "
                                      "adamw_torch_fused, adamw_8bit"),
    (["--optim", "adafactor", "--distributed_type", "FSDP"], "optim adafactor with distributed_type FSDP: "
                                                             "Adafactor's factored state needs whole rows"),
    (["--push_to_hub", "true", "--hub_strategy", "every_save"],
     "hub_strategy='every_save' is not accepted: push_to_hub uploads the final model once, at the end of training; "
     "use hub_strategy end"),
    # Transformers' default does nothing without push_to_hub there either: accepted only where it is idle
    (["--hub_strategy", "checkpoint"], "hub_strategy='checkpoint' is not accepted"),
    (["--mixed_precision", "FP8"], "mixed_precision=fp8: Accelerate's FP8 training (Transformer Engine, torchao or "
                                   "MS-AMP) is not run here; use bf16"),  # it was 'did you mean fp16?'
    (["--fsdp_version", "3"], "fsdp_version=3 is not accepted: shardtune runs FSDP2 (fully_shard), and FSDP1 files "
                              "(fsdp_version 1) as FSDP2; set fsdp_version 2 or leave it out"),
    (["--fsdp_backward_prefetch", "BACKWARD_POST"], "fsdp_backward_prefetch='BACKWARD_POST' is not accepted: FSDP2 "
                                                    "always prefetches"),
    (["--fsdp_backward_prefetch", "NO_PREFETCH"], "set fsdp_backward_prefetch BACKWARD_PRE or leave it out"),
    (["--fsdp_offload_params", "true", "--distributed_type", "MULTI_GPU"],
     "fsdp_offload_params=true set without distributed_type FSDP"),
    (["--fsdp_forward_prefetch", "true", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"],
     "fsdp_forward_prefetch=true prefetches the next decoder layer, which needs fsdp_auto_wrap_policy "
     "TRANSFORMER_BASED_WRAP (not SIZE_BASED_WRAP)"),
])
def test_keys_for_what_the_trainer_does_not_run_are_refused(argv, needle, capsys):
    assert main(["train", *BASE, *argv]) == 2
    assert needle in capsys.readouterr().err


# Each key that acts only under a setting: a value other than its default, the setting's name, the flags that turn
# it on, and those that turn it off where it is on by default.
SWITCHED = {
    "lora_r": "4", "lora_alpha": "8", "lora_dropout": "0.1", "lora_target_modules": "q_proj", "use_dora": "true",
    "use_rslora": "true", "lora_modules_to_save": "lm_head", "init_lora_weights": "gaussian", "lora_bias": "all",
    "bnb_4bit_quant_type": "fp4", "use_nested_quant": "false", "bnb_4bit_compute_dtype": "float32",
    "bnb_4bit_quant_storage_dtype": "float32", "append_concat_token": "true", "use_reentrant": "true",
    "ddp_find_unused_parameters": "true", "ddp_bucket_cap_mb": "5", "ddp_broadcast_buffers": "false",
    "ddp_static_graph": "true", "pipeline_schedule": "GPipe", "pipeline_microbatches": "4",
    "mp_devices": "cpu,cpu", "eval_steps": "5", "per_device_eval_batch_size": "2", "eval_packing": "true",
    "eval_delay": "2.5", "save_steps": "10",
    "hub_model_id": "me/x",
    "hub_private_repo": "true", "hub_token": "hf_secret", "run_name": "first", "hub_strategy": "checkpoint",
    "project": "sweep-7",
    "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": "true", "fsdp_auto_wrap_policy": "NO_WRAP",
    "fsdp_min_num_params": "1000",
    "fsdp_cpu_ram_efficient_loading": "false", "fsdp_sync_module_states": "false",
    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_reshard_after_forward": "false", "fsdp_forward_prefetch": "true",
    "warmup_steps": "5", "warmup_ratio": "0.1", "min_lr_rate": "0.1", "num_cycles": "2.0", "lr_end": "1e-06",
    "power": "2.0", "timescale": "4", "logging_steps": "5", "num_decay_steps": "3", "num_stable_steps": "2",
    "warmup_type": "cosine", "decay_type": "1-sqrt", "min_lr_ratio": "0.1", "warmup_lr_rate": "0.2",
    "early_stopping_threshold": "0.5", "min_lr": "1e-06", "plateau_factor": "0.5", "plateau_patience": "3",
    "plateau_threshold": "0.01", "plateau_threshold_mode": "abs", "plateau_cooldown": "1", "plateau_eps": "1e-09",
    "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
SWITCH_FLAGS = {"use_peft_lora true": (["--use_peft_lora", "true"], []),
                "use_4bit_quantization true": (["--use_peft_lora", "true", "--use_4bit_quantization", "true"], []),
                "packing true": (["--packing", "true"], []),
                "gradient_checkpointing true": ([], ["--gradient_checkpointing", "false"]),
                "distributed_type PP": (["--distributed_type", "PP"], []),
                "distributed_type MP": (["--distributed_type", "MP"], []),
                "distributed_type DDP": (["--distributed_type", "DDP"], ["--num_processes", "1"]),
                "eval_strategy steps": (["--eval_strategy", "steps"], []),
                "eval_strategy steps or epoch": (["--eval_strategy", "epoch"], []),
                "eval_strategy steps or epoch, or eval_on_start true": (["--eval_on_start", "true"], []),
                "save_strategy steps": ([], ["--save_strategy", "no"]),
                "push_to_hub true": (["--push_to_hub", "true"], []),
                "report_to naming a tracker": (["--report_to", "tensorboard"], []),
                "report_to trackio": (["--report_to", "trackio"], []),
                "lr_scheduler_type linear, cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, "
                "cosine_with_restarts, polynomial, inverse_sqrt, warmup_stable_decay or constant_with_warmup": (
                    [], ["--lr_scheduler_type", "constant"]),
                "lr_scheduler_type cosine_with_min_lr or cosine_warmup_with_min_lr": (
                    ["--lr_scheduler_type", "cosine_with_min_lr"], []),
                "lr_scheduler_type cosine_warmup_with_min_lr": (["--lr_scheduler_type", "cosine_warmup_with_min_lr",
                                                                 "--min_lr_rate", "0.1"], []),
                "lr_scheduler_type cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts or "
                "warmup_stable_decay": (
                    ["--lr_scheduler_type", "cosine_with_restarts"], []),
                "lr_scheduler_type warmup_stable_decay": (["--lr_scheduler_type", "warmup_stable_decay",
                                                           "--num_decay_steps", "1"], []),
                "lr_scheduler_type polynomial": (["--lr_scheduler_type", "polynomial"], []),
                **dict.fromkeys(("lr_scheduler_type cosine_with_min_lr, cosine_warmup_with_min_lr or "
                                 "reduce_lr_on_plateau", "lr_scheduler_type reduce_lr_on_plateau"),
                                (["--lr_scheduler_type", "reduce_lr_on_plateau", "--eval_strategy", "steps",
                                  "--eval_split_ratio", "0.1"], [])),
                "lr_scheduler_type inverse_sqrt": (["--lr_scheduler_type", "inverse_sqrt"], []),
                "distributed_type FSDP": (["--distributed_type", "FSDP"], []),
                "fsdp_auto_wrap_policy SIZE_BASED_WRAP": (["--distributed_type", "FSDP", "--fsdp_auto_wrap_policy",
                                                           "SIZE_BASED_WRAP"], []),
                "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP under distributed_type FSDP": (
                    ["--distributed_type", "FSDP"], []),
                "logging_strategy steps (or eval_strategy steps without eval_steps)": (
                    [], ["--logging_strategy", "no"]),
                "early_stopping_patience": (["--early_stopping_patience", "2", "--eval_strategy", "steps",
                                             "--eval_split_ratio", "0.1"], [])}

# The setting each key acts under, stated here rather than read from the schema: a key declared to need the wrong
# setting would be refused where it acts and dropped where it does not, and a test reading the declaration passes.
ACTS_UNDER = {
    "use_peft_lora true": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora", "use_rslora",
                           "lora_modules_to_save", "init_lora_weights", "lora_bias"),
    "use_4bit_quantization true": ("bnb_4bit_quant_type", "use_nested_quant", "bnb_4bit_compute_dtype",
                                   "bnb_4bit_quant_storage_dtype"),
    "packing true": ("append_concat_token",),
    "gradient_checkpointing true": ("use_reentrant",),
    "lr_scheduler_type cosine_with_min_lr or cosine_warmup_with_min_lr": ("min_lr_rate",),
    "lr_scheduler_type cosine_with_min_lr, cosine_warmup_with_min_lr or reduce_lr_on_plateau": ("min_lr",),
    "lr_scheduler_type reduce_lr_on_plateau": ("plateau_factor", "plateau_patience", "plateau_threshold",
                                               "plateau_threshold_mode", "plateau_cooldown", "plateau_eps"),
    "lr_scheduler_type cosine_warmup_with_min_lr": ("warmup_lr_rate",),
    "lr_scheduler_type cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts or "
    "warmup_stable_decay": ("num_cycles",),
    "lr_scheduler_type polynomial": ("lr_end", "power"),
    "lr_scheduler_type inverse_sqrt": ("timescale",),
    "lr_scheduler_type warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type",
                                              "min_lr_ratio"),
    "lr_scheduler_type linear, cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts, "
    "polynomial, inverse_sqrt, warmup_stable_decay or constant_with_warmup": ("warmup_ratio", "warmup_steps"),
    "eval_strategy steps or epoch, or eval_on_start true": ("per_device_eval_batch_size", "eval_packing"),
    "eval_strategy steps": ("eval_steps",),
    "eval_strategy steps or epoch": ("eval_delay",),
    "early_stopping_patience": ("early_stopping_threshold",),
    "logging_strategy steps (or eval_strategy steps without eval_steps)": ("logging_steps",),
    "save_strategy steps": ("save_steps",),
    "report_to naming a tracker": ("run_name",),
    "report_to trackio": ("project",),
    "push_to_hub true": ("hub_model_id", "hub_token", "hub_private_repo", "hub_strategy"),
    "distributed_type FSDP": ("fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_auto_wrap_policy",
                              "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_state_dict_type",
                              "fsdp_reshard_after_forward", "fsdp_backward_prefetch", "fsdp_forward_prefetch"),
    "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP under distributed_type FSDP": ("fsdp_transformer_layer_cls_to_wrap",),
    "fsdp_auto_wrap_policy SIZE_BASED_WRAP": ("fsdp_min_num_params",),
    "distributed_type DDP": ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
                             "ddp_static_graph"),
    "distributed_type PP": ("pipeline_schedule", "pipeline_microbatches"),
    "distributed_type MP": ("mp_devices",),
}
NEEDS = {name: setting for setting, names in ACTS_UNDER.items() for name in names}


def test_every_key_that_needs_a_setting_is_listed_here():
    from shardtune.config.schema import all_keys

    assert NEEDS.keys() == SWITCHED.keys() and ACTS_UNDER.keys() == SWITCH_FLAGS.keys()
    assert {d.name: d.meta.needs for d in all_keys() if d.meta.needs} == NEEDS


@pytest.mark.parametrize("name", sorted(SWITCHED))
def test_a_key_set_without_the_setting_it_acts_under_is_refused(name, capsys):
    """Nothing a user sets is dropped: lora_r on a full fine-tune, GPipe off PP, fp4 without 4-bit loading are
    refused in one line naming the key, its value and the setting; with the setting on, the value is taken."""
    needs = NEEDS[name]
    on, off = SWITCH_FLAGS[needs]
    if name == "use_nested_quant":  # its one value besides the default, false, is TRL's default: idle without it
        assert load_train_config([*BASE, *off, f"--{name}", SWITCHED[name]]).lora.method != "qlora"
        assert load_train_config([*BASE, *on, f"--{name}", SWITCHED[name]]).lora.use_nested_quant is False
        return
    assert main(["train", *BASE, *off, f"--{name}", SWITCHED[name]]) == 2
    err = capsys.readouterr().err
    shown = "(given)" if name == "hub_token" else SWITCHED[name]  # a secret is not echoed
    assert f"{name}={shown} set without {needs}: it acts only with it; set {needs}, or leave it out" in err
    assert name != "hub_token" or SWITCHED[name] not in err
    if name == "hub_strategy":  # the one value that acts is its default: any other is refused with the setting on
        with pytest.raises(UsageError, match="hub_strategy='checkpoint' is not accepted: push_to_hub uploads"):
            load_train_config([*BASE, *on, f"--{name}", SWITCHED[name]])
        return
    cfg = load_train_config([*BASE, *on, f"--{name}", SWITCHED[name]])
    section = next(getattr(cfg, f.name) for f in dataclasses.fields(cfg) if hasattr(getattr(cfg, f.name), name))
    assert str(getattr(section, name)).lower() in (SWITCHED[name].lower(), f"['{SWITCHED[name]}']")


def test_a_later_layer_that_turns_a_setting_off_resets_its_keys(tmp_path, capsys):
    """A recipe's save_steps and fsdp_* keys under --save_strategy no --distributed_type DDP (as bench strategies
    runs a recipe): the command line overrides the setting as a whole, so they go back to their defaults (and
    config.yaml records those) rather than being refused; in the same layer as the setting they are refused."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("distributed_type: FSDP\nfsdp_sharding_strategy: SHARD_GRAD_OP\nsave_steps: 10\n")
    cfg = load_train_config([str(recipe), *BASE, "--save_strategy", "no", "--distributed_type", "DDP"])
    assert (cfg.checkpoint.save_steps, cfg.distributed.fsdp_sharding_strategy) == (500, "FULL_SHARD")
    cfg = load_train_config([str(recipe), *BASE, "save_strategy=no"])
    assert (cfg.checkpoint.save_steps, cfg.distributed.fsdp_sharding_strategy) == (500, "SHARD_GRAD_OP")
    recipe.write_text("save_strategy: no\nsave_steps: 10\n")
    assert main(["train", str(recipe), *BASE]) == 2
    assert "save_steps=10 set without save_strategy steps" in capsys.readouterr().err


def test_a_setting_turned_off_by_another_of_its_keys_resets_its_keys(tmp_path, monkeypatch):
    """Two processes with no distributed_type run DDP, so --num_processes 1 turns a recipe's DDP off as
    --distributed_type NO would; checkpointing is gradient_checkpointing's or fsdp_activation_checkpointing's."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num_processes: 2\nddp_find_unused_parameters: true\n")
    cfg = load_train_config([str(recipe), *BASE, "--num_processes", "1"])
    assert (cfg.distributed.num_processes, cfg.distributed.ddp_find_unused_parameters) == (1, False)
    recipe.write_text("num_processes: 1\nddp_find_unused_parameters: true\n")
    with pytest.raises(UsageError, match="ddp_find_unused_parameters=true set without distributed_type DDP"):
        load_train_config([str(recipe), *BASE])
    recipe.write_text("gradient_checkpointing: false\ndistributed_type: FSDP\nfsdp_activation_checkpointing: true\n"
                      "use_reentrant: true\n")
    cfg = load_train_config([str(recipe), *BASE, "--fsdp_activation_checkpointing", "false"])
    assert (cfg.distributed.fsdp_activation_checkpointing, cfg.run.use_reentrant) == (False, False)


def test_what_acts_as_the_default_or_acts_anyway_is_accepted(tmp_path, capsys, monkeypatch):
    """An unset boolean reads as false (ddp_find_unused_parameters false, common in TRL recipes, is the default's
    behaviour); save_total_limit acts under save_strategy no too, on the checkpoints a SIGTERM or a callback saves;
    a reset setting takes its own keys along (a recipe's SIZE_BASED_WRAP and fsdp_min_num_params under
    --distributed_type DDP, as bench strategies runs it)."""
    cfg = load_train_config([*BASE, "--ddp_find_unused_parameters", "false", "--hub_private_repo", "false",
                             "--save_strategy", "no", "--save_total_limit", "1"])
    assert (cfg.distributed.ddp_find_unused_parameters, cfg.checkpoint.save_total_limit) == (False, 1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("distributed_type: FSDP\nfsdp_auto_wrap_policy: SIZE_BASED_WRAP\nfsdp_min_num_params: 5000\n")
    d = load_train_config([str(recipe), *BASE, "--distributed_type", "DDP"]).distributed
    assert (d.fsdp_auto_wrap_policy, d.fsdp_min_num_params) == ("TRANSFORMER_BASED_WRAP", 100_000_000)
    # and each reset is said, naming where the value was set: train prints these at start
    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder

    acts = "it acts under distributed_type FSDP, which a later setting turned off"
    model = make_model_folder(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(recipe), "--model_name_or_path", str(model), "--dataset_name", "d.jsonl", "--output_dir",
                 "out", "--distributed_type", "DDP", "--dry_run", "true"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "is set back to its default" in line]
    assert notes == [
        f"note: fsdp_auto_wrap_policy=SIZE_BASED_WRAP ({recipe}, line 2) is set back to its default: {acts}",
        f"note: fsdp_min_num_params=5000 ({recipe}, line 3) is set back to its default: it acts under "
        f"fsdp_auto_wrap_policy SIZE_BASED_WRAP, which a later setting turned off"]


def test_ddp_keys_act_under_torchrun_started_by_hand(monkeypatch):
    """torchrun --nproc_per_node 2 -m shardtune train, with no distributed_type, runs DDP whatever num_processes
    says: its DDP keys act there, and stay refused in one process."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match="ddp_find_unused_parameters=true set without distributed_type DDP"):
        load_train_config([*BASE, "--ddp_find_unused_parameters", "true"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_train_config([*BASE, "--ddp_find_unused_parameters", "true"]).distributed.ddp_find_unused_parameters


def test_a_saved_config_with_keys_that_did_nothing_still_loads(tmp_path):
    """export and resume read a run's config.yaml: one saved before idle keys were refused (lora_r of a full
    fine-tune) loads with them left out, where a recipe would be refused."""
    from shardtune.config.loading import load_saved_config

    saved = tmp_path / "config.yaml"
    saved.write_text("model_name_or_path: m\ndataset_name: d.jsonl\noutput_dir: out\nlora_r: 16\nsave_strategy: no\n"
                     "save_steps: 20\nlr_scheduler_type: constant\nwarmup_steps: 10\n")
    with pytest.raises(UsageError, match="lora_r=16 set without use_peft_lora true"):
        load_train_config([str(saved)])
    cfg = load_saved_config(saved, ["--output_dir", "elsewhere"])
    assert (cfg.lora.lora_r, cfg.checkpoint.save_steps, cfg.run.output_dir) == (8, 500, "elsewhere")
    assert (cfg.optim.lr_scheduler_type, cfg.optim.warmup_steps) == ("constant", 0)  # a warm-up that never ran


def test_keys_set_without_their_setting_are_named_together_with_their_file_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1e-4\nlora_r: 32\nlora_alpha: 64\n")
    assert main(["train", str(recipe), *BASE]) == 2
    assert (f"{recipe}, line 2: lora_r=32, lora_alpha=64 set without use_peft_lora true: they act only with it; "
            f"set use_peft_lora true, or leave them out") in capsys.readouterr().err
    # A value equal to the default changes nothing, so nothing is dropped: a copied recipe keeps it.
    recipe.write_text("lora_r: 8\nuse_reentrant: false\n")
    assert load_train_config([str(recipe), *BASE]).lora.lora_r == 8


def test_keys_for_what_the_trainer_runs_are_accepted(tmp_path):
    cfg = load_train_config([*BASE, "--optim", "ADAMW_TORCH_FUSED", "--hub_strategy", "End", "--fsdp_version", "2"])
    assert (cfg.optim.optim, cfg.run.hub_strategy, cfg.distributed.fsdp_version) == ("adamw_torch_fused", "end", 2)
    # Transformers' hub_strategy default, in any case, where push_to_hub is off (it uploads nothing there)
    assert load_train_config([*BASE, "--hub_strategy", "EVERY_SAVE"]).run.hub_strategy == "every_save"
    acc = tmp_path / "fsdp3.yaml"
    acc.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n")
    with pytest.raises(UsageError, match=rf"{acc}, line 3: fsdp_version=3 is not accepted"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_callbacks_from_a_yaml_list_or_a_comma_separated_flag(tmp_path):
    assert TrainConfig().run.callbacks == []
    recipe = tmp_path / "r.yaml"
    recipe.write_text("callbacks:\n  - pkg.hooks:Stop\n  - other.mod:Log\n")
    assert load_train_config([str(recipe), *BASE]).run.callbacks == ["pkg.hooks:Stop", "other.mod:Log"]
    recipe.write_text("callbacks: pkg.hooks:Stop\n")
    assert load_train_config([str(recipe), *BASE]).run.callbacks == ["pkg.hooks:Stop"]
    cfg = load_train_config([*BASE, "--callbacks", "a.b:C, d.e:F"])
    assert cfg.run.callbacks == ["a.b:C", "d.e:F"]
    from shardtune.config import save_resolved

    save_resolved(cfg, tmp_path / "config.yaml")  # read back as a list
    assert load_train_config([str(tmp_path / "config.yaml")]).run.callbacks == ["a.b:C", "d.e:F"]


def test_yaml_error_names_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\nlora_rank: 8\n")
    assert main(["train", str(recipe), *BASE]) == 2
    err = capsys.readouterr().err
    # "lora_r" alone is in the echoed "lora_rank": the suggestion is checked whole.
    assert f"{recipe}, line 2: unknown key 'lora_rank'; did you mean 'lora_r'?" in err


def test_all_problems_reported_together():
    with pytest.raises(UsageError) as info:
        load_train_config(["--num_processes", "0", "--learning_rate", "-1"])
    message = str(info.value)
    for needle in ("model_name_or_path is required", "output_dir is required", "num_processes=0",
                   "learning_rate=-1.0"):
        assert needle in message


def test_resolved_config_round_trips(tmp_path):
    from shardtune.config import save_resolved

    cfg = load_train_config([*BASE, "--use_peft_lora", "true", "--lora_r", "12", "--bf16", "true", "--packing", "true"])
    save_resolved(cfg, tmp_path / "config.yaml")
    again = load_train_config([str(tmp_path / "config.yaml")])
    assert again == cfg


def test_launch_builds_multinode_torchrun_command(capsys):
    assert main(["launch", "--num_processes", "16", "--num_machines", "2", "--machine_rank", "1",
                 "--main_process_ip", "10.0.0.1", "--main_process_port", "29555", "--dry_run", "train",
                 "--seed", "1"]) == 0
    cmd = capsys.readouterr().out.split()
    i = cmd.index("torch.distributed.run")
    assert cmd[i + 1:i + 5] == ["--nnodes", "2", "--nproc_per_node", "8"]
    joined = " ".join(cmd)
    assert "--node_rank 1 --master_addr 10.0.0.1 --master_port 29555" in joined
    assert joined.endswith("-m shardtune train --num_processes 16 --num_machines 2 --seed 1")


def test_launch_reads_accelerate_file(tmp_path, capsys):
    acc = tmp_path / "fsdp.yaml"
    acc.write_text(ACCELERATE_FSDP)
    assert main(["launch", "--config_file", str(acc), "--dry_run", "train", "--seed", "1"]) == 0
    joined = capsys.readouterr().out
    assert "--nproc_per_node 2" in joined and f"--config_file {acc}" in joined
    # train's spelling (--dry_run True) works here too; a word that is no boolean is refused
    assert main(["launch", "--config_file", str(acc), "--dry_run", "True", "train", "--seed", "1"]) == 0
    assert capsys.readouterr().out == joined
    with pytest.raises(SystemExit):
        main(["launch", "--dry_run", "maybe", "train", "--seed", "1"])
    assert "--dry_run/--dry-run: expected true or false, got 'maybe'" in capsys.readouterr().err


# TRL's examples/accelerate_configs/fsdp1.yaml (TRL 1.16), as users pass it to accelerate launch
TRL_FSDP1 = textwrap.dedent("""\
    compute_environment: LOCAL_MACHINE
    debug: false
    distributed_type: FSDP
    downcast_bf16: 'no'
    enable_cpu_affinity: false
    fsdp_config:
      fsdp_activation_checkpointing: false
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_backward_prefetch: BACKWARD_PRE
      fsdp_cpu_ram_efficient_loading: true
      fsdp_forward_prefetch: true
      fsdp_offload_params: false
      fsdp_reshard_after_forward: FULL_SHARD
      fsdp_state_dict_type: FULL_STATE_DICT
      fsdp_sync_module_states: true
      fsdp_use_orig_params: true
      fsdp_version: 1
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 8
    rdzv_backend: static
    same_network: true
    tpu_env: []
    tpu_use_cluster: false
    tpu_use_sudo: false
    use_cpu: false
    """)


def test_an_accelerate_fsdp1_file_runs_as_fsdp2_and_says_so(tmp_path, capsys, monkeypatch):
    """TRL's fsdp1.yaml runs unchanged: Accelerate's FSDP1 files (1.6 on) write the sharding strategy under
    fsdp_reshard_after_forward, which is read as fsdp_sharding_strategy there, and fsdp_version 1 runs as FSDP2,
    which train says at start naming the file and line. Beside fsdp_version 2 (Accelerate refuses it too), or beside
    an fsdp_sharding_strategy that says otherwise, the strategy name is refused in one line naming its place."""
    from shardtune.config.loading import FSDP1_AS_FSDP2
    from shardtune.testing.tiny import make_model_folder

    acc = tmp_path / "fsdp1.yaml"
    acc.write_text(TRL_FSDP1)
    d = load_train_config(["--config_file", str(acc), *BASE]).distributed
    assert (d.fsdp_version, d.fsdp_sharding_strategy, d.reshards_after_forward, d.fsdp_forward_prefetch,
            d.fsdp_state_dict_type) == (2, "FULL_SHARD", True, True, "FULL_STATE_DICT")
    for name, sharding, reshards in (("SHARD_GRAD_OP", "SHARD_GRAD_OP", False), ("NO_SHARD", "NO_SHARD", True),
                                     ("HYBRID_SHARD_ZERO2", "HYBRID_SHARD", False)):
        acc.write_text(TRL_FSDP1.replace("reshard_after_forward: FULL_SHARD", f"reshard_after_forward: {name}"))
        d = load_train_config(["--config_file", str(acc), *BASE]).distributed
        assert (d.fsdp_sharding_strategy, d.reshards_after_forward) == (sharding, reshards), name
    assert load_train_config([*BASE, "--fsdp_version", "1", "--fsdp_reshard_after_forward", "shard_grad_op",
                              "--distributed_type", "FSDP"]).distributed.fsdp_sharding_strategy == "SHARD_GRAD_OP"
    # said at start, where the value was written
    acc.write_text(TRL_FSDP1)
    monkeypatch.chdir(tmp_path)
    model = make_model_folder(tmp_path / "model")
    assert main(["train", "--config_file", str(acc), "--model_name_or_path", str(model), "--dataset_name", "d.jsonl",
                 "--output_dir", "out", "--dry_run", "true"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: fsdp_version=1 ({acc}, line 17): {FSDP1_AS_FSDP2}"]
    # and the estimate of the same files says it too, beside a --json document that stays whole
    assert main(["estimate", "llama-3.2-1b", "--config", str(acc), "--gpu", "h100-80gb", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["setup"]["sharding_strategy"] == "FULL_SHARD"
    assert out.err.splitlines() == [f"note: fsdp_version=1 ({acc}, line 17): {FSDP1_AS_FSDP2}"]
    # refused where the file is FSDP2's, or says its strategy twice, otherwise
    for text, line, words in (
            (TRL_FSDP1.replace("fsdp_version: 1", "fsdp_version: 2"), 13,
             "fsdp_reshard_after_forward='FULL_SHARD': a sharding strategy, as Accelerate's FSDP1 files write it; "
             "here (FSDP2) fsdp_reshard_after_forward is true or false: write fsdp_sharding_strategy: FULL_SHARD "
             "(or fsdp_reshard_after_forward: true)"),
            (TRL_FSDP1.replace("  fsdp_version: 1", "  fsdp_sharding_strategy: SHARD_GRAD_OP"), 13,
             f"fsdp_reshard_after_forward='FULL_SHARD' is FSDP1's sharding strategy, and {acc}, line 17 says "
             f"fsdp_sharding_strategy='SHARD_GRAD_OP': keep one of them")):
        acc.write_text(text)
        for argv in (["train", "--config_file", str(acc), *BASE],
                     ["launch", "--config_file", str(acc), "--dry_run", "train", *BASE]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{acc}, line {line}: {words}" in err, err
    # what the old refusal named still loads as it said
    for fixed, sharding in (("fsdp_sharding_strategy: SHARD_GRAD_OP", "SHARD_GRAD_OP"),
                            ("fsdp_reshard_after_forward: false", "FULL_SHARD")):
        acc.write_text(ACCELERATE_FSDP.replace("fsdp_sharding_strategy: FULL_SHARD", fixed))
        d = load_train_config(["--config_file", str(acc), *BASE]).distributed
        assert (d.fsdp_sharding_strategy, d.reshards_after_forward) == (sharding, False)


def test_launch_errors(capsys):
    assert main(["launch", "--num_processes", "3", "--num_machines", "2", "train"]) == 2
    assert "multiple of --num_machines 2" in capsys.readouterr().err
    assert main(["launch", "--num_processes", "2"]) == 2
    assert "nothing to launch" in capsys.readouterr().err


def test_hub_token_is_never_written_beside_checkpoints(tmp_path):
    from shardtune.config import save_resolved

    cfg = load_train_config([*BASE, "--push_to_hub", "--hub_token", "hf_secret"])
    assert cfg.run.hub_token == "hf_secret"
    save_resolved(cfg, tmp_path / "config.yaml")
    assert "hf_secret" not in (tmp_path / "config.yaml").read_text()


def test_a_bad_value_in_a_recipe_names_its_file_and_line(tmp_path):
    """Wrong types named their line already; wrong values (a choice, a range, a conflict) now do too."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: out\nlr_scheduler_type: cosin\nper_device_train_batch_size: -1\nbf16: true\n"
                      "fp16: true\n")
    with pytest.raises(UsageError) as err:
        load_train_config([str(recipe), "--model_name_or_path", "m"])
    message = str(err.value)
    assert f"{recipe}, line 2: lr_scheduler_type='cosin' is not accepted" in message
    assert f"{recipe}, line 3: per_device_train_batch_size=-1 must be at least 1" in message
    assert f"{recipe}, line 4: bf16 and fp16 are both true" in message


def test_transformers_5_and_trl_spellings_of_keys_declared_here(tmp_path):
    """A TRL recipe's gradient_checkpointing_kwargs {use_reentrant: ...} and Transformers 5's warmup_steps below 1
    (a fraction of the steps; its warmup_ratio is gone) were refused as unknown or not an integer; they now set
    use_reentrant and warmup_ratio. A fraction for the logging, saving or evaluation interval is refused naming what
    to give, and a gradient_checkpointing_kwargs entry with no meaning here is named."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: true\n"
                      "warmup_steps: 0.03\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.run.use_reentrant, cfg.optim.warmup_ratio, cfg.optim.warmup_steps) == (True, 0.03, 0)
    cfg = load_train_config([*BASE, "--gradient_checkpointing_kwargs", '{"use_reentrant": false}', "--warmup_steps",
                             "5"])
    assert (cfg.run.use_reentrant, cfg.optim.warmup_ratio, cfg.optim.warmup_steps) == (False, 0.0, 5)
    with pytest.raises(UsageError, match=r"logging_steps=0.1: a fraction of the run's steps \(as Transformers 5 reads "
                                         r"a value below 1\) is not read here; give a number of steps"):
        load_train_config([*BASE, "--logging_steps", "0.1"])
    recipe.write_text("warmup_steps: 10\ngradient_checkpointing_kwargs:\n  use_reentrant: 'false'\n")
    cfg = load_train_config([str(recipe), *BASE, "--warmup_steps", "0.1"])  # the later layer's ratio wins
    assert (cfg.optim.warmup_steps, cfg.optim.warmup_ratio, cfg.run.use_reentrant) == (0, 0.1, False)
    with pytest.raises(UsageError, match="gradient_checkpointing_kwargs: preserve_rng_state is not read here"):
        load_train_config([*BASE, "--gradient_checkpointing_kwargs", "{use_reentrant: false, preserve_rng_state: 1}"])


def test_trl_cosine_with_min_lr_and_its_kwargs_are_read_and_what_they_cannot_say_is_refused(tmp_path):
    """TRL recipes' lr_scheduler_type cosine_with_min_lr with lr_scheduler_kwargs {min_lr_rate: ...} (or {min_lr:
    ...}) set the schedule and min_lr_rate (or min_lr; both were refused); the schedule without its floor, the
    floor under another schedule, and kwargs entries with no meaning here are refused in one line each, naming what
    to write."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr_rate: 0.05\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.optim.lr_scheduler_type, cfg.optim.min_lr_rate) == ("cosine_with_min_lr", 0.05)
    recipe.write_text("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr: 1.0e-6\n")
    assert load_train_config([str(recipe), *BASE]).optim.min_lr == 1e-6  # Transformers reads this floor too
    for given, refused in (
            ([], "lr_scheduler_type cosine_with_min_lr needs min_lr_rate"),
            (["--lr_scheduler_kwargs", "{min_lr: 1e-5, mode: max}"],
             "lr_scheduler_kwargs: mode is not read here (only min_lr_rate, min_lr, num_cycles, warmup_lr_rate, "
             "lr_end, power, timescale, num_decay_steps, num_stable_steps, warmup_type, decay_type, min_lr_ratio, "
             "factor, patience, threshold, threshold_mode, cooldown, eps are); reduce_lr_on_plateau's direction "
             "follows greater_is_better"),
            (["--lr_scheduler_kwargs", "{min_lr: 1e-3}"], "min_lr=0.001 is above learning_rate 5e-05"),
            (["--lr_scheduler_kwargs", "0.1"], "lr_scheduler_kwargs=0.1: expected a mapping such as "
                                                "{min_lr_rate: 0.1}"),
            (["--min_lr_rate", "1.5"], "min_lr_rate=1.5 must be")):
        with pytest.raises(UsageError, match=re.escape(refused)):
            load_train_config([*BASE, "--lr_scheduler_type", "cosine_with_min_lr", *given])
    with pytest.raises(UsageError, match=r"min_lr_rate.*lr_scheduler_type cosine_with_min_lr"):
        load_train_config([*BASE, "--lr_scheduler_type", "cosine", "--min_lr_rate", "0.1"])


def test_lr_scheduler_kwargs_set_each_schedules_settings_and_one_its_schedule_does_not_read_exits_2(tmp_path, capsys):
    """Transformers' lr_scheduler_kwargs for cosine_with_restarts (num_cycles), polynomial (lr_end, power),
    inverse_sqrt (timescale) and warmup_stable_decay (its five), schedules that were refused, set those keys, and
    so does the cosines' num_cycles (it was refused: "the cosine here is half a wave"). Under a schedule that does
    not read them they exit 2 naming the key, its value and the schedules it acts with, at the recipe's line; so
    does a polynomial lr_end not below learning_rate, which Transformers refuses, and warmup_stable_decay without
    num_decay_steps, which it needs."""
    recipe = tmp_path / "trl.yaml"
    for schedule, kwargs, meant in (("cosine_with_restarts", "{num_cycles: 3}", (3, 1e-7, 1.0, None)),
                                    ("cosine", "{num_cycles: 1}", (1, 1e-7, 1.0, None)),
                                    ("cosine_with_min_lr", "{min_lr_rate: 0.1, num_cycles: 1.5}",
                                     (1.5, 1e-7, 1.0, None)),
                                    ("polynomial", "{lr_end: 1.0e-6, power: 2}", (None, 1e-6, 2.0, None)),
                                    ("inverse_sqrt", "{timescale: 8}", (None, 1e-7, 1.0, 8))):
        recipe.write_text(f"lr_scheduler_type: {schedule}\nlr_scheduler_kwargs: {kwargs}\n")
        o = load_train_config([str(recipe), *BASE]).optim
        assert (o.lr_scheduler_type, o.num_cycles, o.lr_end, o.power, o.timescale) == (schedule, *meant)
    recipe.write_text("lr_scheduler_type: warmup_stable_decay\nlr_scheduler_kwargs: {num_decay_steps: 10, "
                      "num_stable_steps: 20, warmup_type: 1-sqrt, decay_type: linear, min_lr_ratio: 0.05}\n")
    o = load_train_config([str(recipe), *BASE]).optim
    assert (o.num_decay_steps, o.num_stable_steps, o.warmup_type, o.decay_type, o.min_lr_ratio, o.num_cycles) == \
        (10, 20, "1-sqrt", "linear", 0.05, None)
    recipe.write_text("lr_scheduler_type: warmup_stable_decay\n")  # Transformers' get_wsd_schedule needs it too
    assert main(["train", str(recipe), *BASE]) == 2
    assert (f"{recipe}, line 1: lr_scheduler_type warmup_stable_decay needs num_decay_steps, the steps of its final "
            f"decay") in capsys.readouterr().err
    for schedule, kwargs, says in (
            ("linear", "{num_cycles: 1}", "num_cycles=1.0 set without lr_scheduler_type cosine, cosine_with_min_lr, "
                                          "cosine_warmup_with_min_lr, cosine_with_restarts or warmup_stable_decay: "
                                          "it acts only with it"),
            ("cosine_with_min_lr", "{min_lr_rate: 0.1, warmup_lr_rate: 0.5}",
             "warmup_lr_rate=0.5 set without lr_scheduler_type cosine_warmup_with_min_lr: it acts only with it"),
            ("cosine", "{lr_end: 1.0e-6, power: 2}", "lr_end=1e-06, power=2.0 set without lr_scheduler_type "
                                                     "polynomial: they act only with it"),
            ("constant_with_warmup", "{timescale: 8}", "timescale=8 set without lr_scheduler_type inverse_sqrt"),
            ("polynomial", "{lr_end: 1.0e-4}", "lr_end=0.0001 with learning_rate 5e-05: the polynomial decay runs "
                                               "from learning_rate down to lr_end"),
            ("cosine_with_restarts", "{num_cycles: 0}", "num_cycles=0.0 must be positive"),
            ("inverse_sqrt", "{timescale: 0}", "timescale=0 must be at least 1"),
            ("cosine", "{num_decay_steps: 10}", "num_decay_steps=10 set without lr_scheduler_type "
                                                "warmup_stable_decay: it acts only with it"),
            ("warmup_stable_decay", "{num_decay_steps: 10, num_cycles: 2, decay_type: linear}",
             "num_cycles=2.0 with decay_type linear: warmup_stable_decay reads it for a cosine decay only"),
            ("warmup_stable_decay", "{num_decay_steps: 10, decay_type: exponential}",
             "decay_type='exponential' is not accepted; use one of linear, cosine, 1-sqrt")):
        recipe.write_text(f"lr_scheduler_type: {schedule}\nlr_scheduler_kwargs: {kwargs}\n")
        assert main(["train", str(recipe), *BASE]) == 2
        err = capsys.readouterr().err
        assert f"{recipe}, line 2: {says}" in err and len(err.strip().splitlines()) == 1, err


def test_trl_model_init_kwargs_set_the_model_keys_they_name(tmp_path):
    """TRL's model_init_kwargs (from_pretrained's arguments) was an unknown key ("did you mean
    'model_name_or_path'?"): its dtype, attn_implementation and trust_remote_code set those keys; what it cannot say
    here is refused naming what to write."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("model_init_kwargs:\n  dtype: bfloat16\n  attn_implementation: eager\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.model.torch_dtype, cfg.model.attn_implementation, cfg.model.trust_remote_code) == \
        ("bfloat16", "eager", False)
    cfg = load_train_config([*BASE, "--model_init_kwargs", '{"torch_dtype": "float32", "trust_remote_code": true}'])
    assert (cfg.model.torch_dtype, cfg.model.trust_remote_code) == ("float32", True)
    for given, refused in (
            ("{device_map: auto}", "model_init_kwargs: device_map is not read here (only dtype, torch_dtype, "
                                   "attn_implementation, trust_remote_code are); each process's device follows"),
            ("{quantization_config: {load_in_4bit: true}}", "give load_in_4bit and the bnb_4bit_* keys"),
            ("{dtype: bfloat16, torch_dtype: float32}", "torch_dtype='float32' and another name of torch_dtype "
                                                        "disagree"),
            ("{dtype: float16}", "torch_dtype=float16: pure fp16 training diverges")):
        with pytest.raises(UsageError, match=re.escape(refused)):
            load_train_config([*BASE, "--model_init_kwargs", given])


def test_an_unset_argument_mapping_is_no_entries(tmp_path):
    """lr_scheduler_kwargs: null (Transformers' own default, as a dump of TrainingArguments writes it) was refused
    as 'expected a mapping'; unset, it sets nothing, and a schedule's own setting still comes from its key."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr_scheduler_kwargs: null\ngradient_checkpointing_kwargs: null\nmodel_init_kwargs: null\n"
                      "lr_scheduler_type: cosine_with_min_lr\nmin_lr_rate: 0.2\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.optim.min_lr_rate, cfg.run.use_reentrant, cfg.model.torch_dtype) == (0.2, False, None)
    with pytest.raises(UsageError, match=re.escape("lr_scheduler_kwargs=3: expected a mapping")):
        load_train_config([*BASE, "--lr_scheduler_kwargs", "3"])


@pytest.mark.parametrize("key, whose", [("ignore_data_skip", "Transformers' TrainingArguments"),
                                        ("label_names", "Transformers' TrainingArguments")])
def test_another_tools_key_is_not_offered_a_key_spelled_like_it(key, whose, capsys):
    """ignore_data_skip was answered 'see --help-keys', label_names the same: a key of Transformers or TRL with
    no counterpart here says so instead (TRL's truncation_mode, offered trust_remote_code once, is a no-op at its
    keep_start now)."""
    assert main(["train", *BASE, f"--{key}", "1"]) == 2
    assert f"unknown key '{key}': {whose} key, which has no counterpart here; leave it out" in \
        capsys.readouterr().err


def offered_other_spellings(names: Iterable[str], *argv: str) -> dict[str, str]:
    """Each of ``names`` that ``--NAME 1`` (beside ``argv``) refuses offering a near spelling of an unrelated key
    here, with that refusal; a refusal naming what to write, or saying the key has no counterpart, is not one."""
    offered = {}
    for name in names:
        try:
            load_train_config([*BASE, *argv, f"--{name}", "1"])
        except UsageError as exc:
            if "did you mean" in str(exc) or "--help-keys" in str(exc) and "no counterpart" not in str(exc):
                offered[name] = str(exc)
    return offered


def test_no_training_arguments_key_is_offered_another_keys_spelling():
    """Every key of the installed Transformers' TrainingArguments is a key here, another name of one, read as
    a no-op or a mapping, or refused with what to write instead: never with a near spelling of an unrelated key (a
    new Transformers key shows up here)."""
    from transformers import TrainingArguments

    assert offered_other_spellings(f.name for f in dataclasses.fields(TrainingArguments)
                                   if not f.name.startswith("_")) == {}


# TRL 1.16's ModelConfig and ScriptArguments, the other half of a `trl sft --config` recipe (TRL is not installed
# with shardtune, so its fields are named here).
TRL_MODEL_AND_SCRIPT_KEYS = (
    "model_name_or_path", "model_revision", "dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "lora_task_type",
    "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "bnb_4bit_quant_storage", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
    "dataset_streaming", "ignore_bias_buffers")


def test_no_trl_model_or_script_key_is_offered_another_keys_spelling():
    """lora_task_type was offered lora_bias, dataset_streaming dataset_name, ignore_bias_buffers
    ddp_broadcast_buffers and bnb_4bit_quant_storage its dtype-suffixed name: each TRL key is a key here, another
    name of one, a no-op, or refused saying what to write instead."""
    assert offered_other_spellings(TRL_MODEL_AND_SCRIPT_KEYS, "--use_peft", "true") == {}
    # the accepted ones act as TRL's: the quantisation storage dtype, CAUSAL_LM (what runs here), no streaming
    cfg = load_train_config([*BASE, "--load_in_4bit", "true", "--use_peft", "true", "--bnb_4bit_quant_storage",
                             "float32", "--lora_task_type", "CAUSAL_LM", "--dataset_streaming", "false",
                             "--dataset_train_split", "train", "--dataset_test_split", "test"])
    assert cfg.lora.bnb_4bit_quant_storage_dtype == "float32"
    with pytest.raises(UsageError, match="lora_task_type='SEQ_CLS' would change what runs"):
        load_train_config([*BASE, "--use_peft", "true", "--lora_task_type", "SEQ_CLS"])


def test_a_qlora_recipe_that_leaves_nested_quant_out_is_told_it_differs_from_trls_default():
    """A TRL QLoRA recipe (load_in_4bit true, no use_bnb_nested_quant) double-quantised its base here, where TRL,
    PEFT's script and BitsAndBytesConfig default to false, and nothing said so. Now a note does; a recipe that sets
    the key under any of its names gets its value and no note, and plain LoRA none either."""
    from shardtune.config.loading import run_config_problems

    def run(*extra: str) -> tuple[bool, list[str]]:
        said: list[str] = []
        cfg = run_config_problems([*BASE, "--use_peft", "true", *extra], said)[0]
        return cfg.lora.use_nested_quant, [note for note in said if "use_nested_quant" in note]

    nested, notes = run("--load_in_4bit", "true")
    assert nested is True and len(notes) == 1
    assert notes[0].startswith("use_nested_quant is left out, and shardtune's default is true") and \
        "TRL's use_bnb_nested_quant, PEFT's use_nested_quant and Transformers' bnb_4bit_use_double_quant default " \
        "to false; set use_nested_quant false" in notes[0]
    for name in ("use_bnb_nested_quant", "bnb_4bit_use_double_quant", "use_nested_quant"):
        assert run("--load_in_4bit", "true", f"--{name}", "false") == (False, [])
    assert run("--load_in_4bit", "true", "--use_bnb_nested_quant", "true") == (True, [])
    assert run() == (True, [])


def test_an_accelerate_fsdp_files_rank0_loading_under_qlora_is_said_not_to_act(tmp_path):
    """Accelerate's FSDP QLoRA configs set fsdp_cpu_ram_efficient_loading true; under QLoRA every rank loads and
    quantises its own base (train/build.py), and the key was dropped without a word. A note names the file line;
    without QLoRA, or with the key left to its default, nothing is said."""
    from shardtune.config.loading import run_config_problems

    acc = tmp_path / "fsdp.yaml"
    acc.write_text(ACCELERATE_FSDP)

    def notes(*extra: str) -> list[str]:
        said: list[str] = []
        run_config_problems([*BASE, *extra], said)
        return [note for note in said if "fsdp_cpu_ram_efficient_loading" in note]

    qlora = ("--use_peft_lora", "true", "--use_4bit_quantization", "true", "--use_nested_quant", "true")
    assert notes("--config_file", str(acc), *qlora) == [
        f"fsdp_cpu_ram_efficient_loading=true ({acc}, line 9) does not act with QLoRA (use_4bit_quantization): every "
        f"rank loads and quantises its own copy of the base in CPU RAM, rank 0 does not load it for the others"]
    assert notes("--config_file", str(acc), "--use_peft_lora", "true") == []
    assert notes("--distributed_type", "FSDP", *qlora) == []


def test_an_8bit_switch_left_off_loads_and_turned_on_is_refused_naming_4bit(tmp_path, capsys):
    """A written-out TRL ModelConfig holds load_in_8bit: false, and PEFT's examples/sft recipes
    use_8bit_quantization: false: both were refused, the second offered use_4bit_quantization for it. Off is what
    runs here (LoRA on the unquantised base); on is refused, in one line naming the key and load_in_4bit."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("use_peft: true\nload_in_8bit: false\nuse_8bit_quantization: false\n")
    assert load_train_config([str(recipe), *BASE]).lora.method == "lora"
    for key in ("load_in_8bit", "use_8bit_quantization"):
        assert main(["train", *BASE, "--use_peft", "true", f"--{key}", "true"]) == 2
        err = capsys.readouterr().err
        assert f"{key}='true' would change what runs (8-bit loading of the frozen base" in err
        assert "remove it: the quantised base here is 4-bit (load_in_4bit true, QLoRA)" in err
        assert "did you mean" not in err



def test_trls_nested_quant_default_loads_beside_plain_lora_and_acts_with_qlora(tmp_path):
    """TRL's ModelConfig writes use_bnb_nested_quant: false (its default) into every recipe, QLoRA or not; beside
    plain LoRA it was refused as set without use_4bit_quantization (shardtune's default is true, so false counted as
    asked for). False does nothing without 4-bit there either: it now loads; with load_in_4bit it is read."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("use_peft: true\nload_in_4bit: false\nuse_bnb_nested_quant: false\n")
    assert load_train_config([str(recipe), *BASE]).lora.method == "lora"
    recipe.write_text("use_peft: true\nload_in_4bit: true\nuse_bnb_nested_quant: false\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert cfg.lora.method == "qlora" and cfg.lora.use_nested_quant is False
    with pytest.raises(UsageError, match="use_bnb_nested_quant='maybe': expected true or false"):
        load_train_config([*BASE, "--use_peft_lora", "true", "--use_bnb_nested_quant", "maybe"])

# PEFT's examples/sft/train.py ModelArguments and DataTrainingArguments (its README's QLoRA and FSDP recipes), not
# installed with shardtune, so named here.
PEFT_SFT_EXAMPLE_KEYS = (
    "model_name_or_path", "chat_template_format", "lora_alpha", "lora_dropout", "lora_r", "lora_target_modules",
    "use_nested_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage_dtype", "bnb_4bit_quant_type",
    "use_flash_attn", "use_peft_lora", "use_8bit_quantization", "use_4bit_quantization", "use_reentrant",
    "use_unsloth", "use_loftq", "use_loftq_callback", "dataset_name", "append_concat_token", "add_special_tokens",
    "splits", "tokenizer_name_or_path", "packing", "dataset_text_field", "max_seq_length")


def test_no_peft_sft_example_key_is_offered_another_keys_spelling():
    """PEFT's own SFT example: use_loftq and use_unsloth were offered use_rslora, use_loftq_callback callbacks and
    tokenizer_name_or_path model_name_or_path. Each is a key here, a no-op at the example's default, or refused
    naming what runs here."""
    assert offered_other_spellings(PEFT_SFT_EXAMPLE_KEYS, "--use_peft_lora", "true") == {}
    assert load_train_config([*BASE, "--use_peft_lora", "true", "--use_loftq", "false", "--use_loftq_callback",
                              "false", "--use_unsloth", "false", "--tokenizer_name_or_path", "null"])
    with pytest.raises(UsageError, match="use_loftq='true' would change what runs .* init_lora_weights names"):
        load_train_config([*BASE, "--use_peft_lora", "true", "--use_loftq", "true"])


def test_trls_split_keys_name_the_splits_they_train_and_evaluate(tmp_path, capsys):
    """TRL's dataset_train_split and dataset_test_split (UltraChat's train_sft, test_sft) were refused unless they
    named splits' own defaults: each now names its side of splits, the other side kept. A name that this side's
    rule (a split trains when its name contains 'train') would put on the other side exits 2, and so does either
    key beside splits in one file, naming the line."""
    def splits(*argv: str) -> str:
        return load_train_config([*BASE, *argv]).data.splits

    assert splits("--dataset_train_split", "train_sft", "--dataset_test_split", "test_sft") == "train_sft,test_sft"
    assert splits("--dataset_test_split", "validation") == "train,validation"
    with pytest.raises(UsageError, match="dataset_train_split='train_gen' beside splits"):  # in one layer
        splits("--splits", "train,dev", "--dataset_train_split", "train_gen")
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("splits: train,dev\n")
    assert load_train_config([str(recipe), *BASE, "--dataset_train_split", "train_gen"]).data.splits == \
        "train_gen,dev"  # a later layer replaces one side of what the recipe named
    for text, says in (("dataset_train_split: sft\n", "line 1: dataset_train_split='sft': the splits that train here "
                                                      "are those whose names contain 'train'"),
                       ("dataset_test_split: train_eval\n", "line 1: dataset_test_split='train_eval': the splits that "
                                                            "train here"),
                       ("splits: train,dev\ndataset_test_split: test_sft\n",
                        "line 2: dataset_test_split='test_sft' beside splits: name the splits in one key")):
        recipe.write_text(text)
        assert main(["train", str(recipe), *BASE]) == 2
        assert f"{recipe}, {says}" in capsys.readouterr().err


def test_no_peft_lora_config_key_is_offered_another_keys_spelling():
    """A recipe written for PEFT's get_peft_model: task_type was offered torch_dtype, layers_to_transform
    max_grad_norm, fan_in_fan_out train_on_prompt, r nothing. Every field of the installed LoraConfig is a key
    here, a no-op, or refused naming the key to write or saying it has no counterpart (a new PEFT field shows up)."""
    import peft

    assert offered_other_spellings((f.name for f in dataclasses.fields(peft.LoraConfig)), "--use_peft", "true") == {}
    with pytest.raises(UsageError, match="unknown key 'r'; PEFT's rank is lora_r here"):
        load_train_config([*BASE, "--use_peft", "true", "--r", "8"])
    assert load_train_config([*BASE, "--use_peft", "true", "--task_type", "CAUSAL_LM", "--peft_type", "LORA"])


def test_a_written_out_peft_lora_config_loads_and_a_layer_choice_is_refused_with_the_regex_that_makes_it(
        tmp_path, capsys):
    """layers_to_transform, layers_pattern, exclude_modules, rank_pattern, alpha_pattern and fan_in_fan_out were
    refused at any value, PEFT's empty defaults too, saying "leave it out": followed, a run asked for layers 0 and 1
    adapted every layer. Their unset or empty values (a written-out LoraConfig's) load; a value that picks layers
    or ranks is refused naming what does it here, and the regex offered for layers_to_transform adapts exactly the
    modules PEFT's layers_to_transform does."""
    import transformers
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from shardtune.config.no_ops import NO_OPS
    from shardtune.config.schema import LoraConfig
    from shardtune.testing.tiny import make_tokenizer, tiny_llama_config
    from shardtune.train.model import apply_lora

    recipe = tmp_path / "peft.yaml"
    recipe.write_text("use_peft: true\nlayers_to_transform: null\nlayers_pattern: null\nexclude_modules: null\n"
                      "rank_pattern: {}\nalpha_pattern: {}\nfan_in_fan_out: false\n")
    assert load_train_config([str(recipe), *BASE]).lora.method == "lora"
    for key, value, says in (("layers_to_transform", "0,1", "adapt those layers with a lora_target_modules regex"),
                             ("layers_pattern", "layers", "name the layers in a lora_target_modules regex"),
                             ("exclude_modules", "k_proj", "give a regex that leaves the others out"),
                             ("rank_pattern", "{q_proj: 4}", "every adapted module here has lora_r"),
                             ("alpha_pattern", "{q_proj: 4}", "every adapted module here has lora_alpha"),
                             ("fan_in_fan_out", "true", "PEFT sets it where a layer needs it")):
        assert main(["train", *BASE, "--use_peft", "true", f"--{key}", value]) == 2
        err = capsys.readouterr().err
        assert f"{key}={value!r} would change what runs" in err and says in err, err
    offered = re.search(r"e\.g\. (re:\S+)", NO_OPS["layers_to_transform"].instead).group(1)
    config = tiny_llama_config(len(make_tokenizer()), num_layers=3)

    def adapted(model) -> set[str]:
        return {name for name, param in model.named_parameters() if param.requires_grad}

    fresh = transformers.AutoModelForCausalLM.from_config
    ours = adapted(apply_lora(fresh(config), LoraConfig(lora_target_modules=offered, lora_r=4), seed=0))
    peft = adapted(get_peft_model(fresh(config), PeftLoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                layers_to_transform=[0, 1])))
    assert ours == peft and len(ours) == 8 and not any(".layers.2." in name for name in ours)


@pytest.mark.parametrize("given, says", [
    # PEFT reads a target_modules string as a regex: copied without re:, it was taken for a module name, and the run
    # stopped only after loading the model, offering v_proj alone for .*\\.(q_proj|v_proj)
    (".*\\.(q_proj|v_proj)", "lora_target_modules='.*\\\\.(q_proj|v_proj)' is a regular expression (PEFT's "
                            "target_modules string), which is written with re: in front here: re:.*\\.(q_proj|v_proj)"),
    # a written-out TRL ModelConfig's null (PEFT's own targets for the model type) said "a value is required"
    ("null", "lora_target_modules=None: unset (TRL's default) asks PEFT for its own targets for the model type, "
             "q_proj,v_proj on Llama; name the modules (e.g. q_proj,v_proj) or give all-linear"),
    # TRL's command-line words written into YAML were one module name, refused only after the model loaded
    ("q_proj v_proj, o_proj", "lora_target_modules='q_proj v_proj, o_proj': a module name holds no spaces; separate "
                              "the names with commas: q_proj,v_proj,o_proj (or write them as a YAML list)")])
def test_a_target_string_copied_from_peft_or_trl_is_refused_with_the_config_saying_what_to_write(tmp_path, given,
                                                                                                  says):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"use_peft: true\nlora_target_modules: {given}\n")
    with pytest.raises(UsageError, match=re.escape(f"line 2: {says}")):
        load_train_config([str(recipe), *BASE])
    for written in ("re:.*\\.(q_proj|v_proj)", "self_attn.q_proj,v_proj"):  # the re: form, and dotted names, load
        assert load_train_config([*BASE, "--use_peft", "true", "--lora_target_modules",
                                  written]).lora.lora_target_modules == written


def test_a_recipe_whose_path_holds_an_equals_sign_is_read_as_a_recipe(tmp_path, monkeypatch):
    """sweep/lr=1e-3/recipe.yaml was read as the key 'sweep/lr' ("did you mean 'seed'?"); an existing .yaml file is
    the recipe, and key=value still sets a key."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep" / "lr=1e-3").mkdir(parents=True)
    (tmp_path / "sweep" / "lr=1e-3" / "recipe.yaml").write_text("learning_rate: 0.001\n")
    cfg = load_train_config(["sweep/lr=1e-3/recipe.yaml", *BASE, "seed=7"])
    assert (cfg.optim.learning_rate, cfg.run.seed) == (0.001, 7)


def test_an_unquoted_no_in_yaml_is_distributed_type_no(tmp_path):
    """YAML reads distributed_type: NO, unquoted, as false: it was refused as distributed_type='False'."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("distributed_type: NO\n")
    assert load_train_config([str(recipe), *BASE]).distributed.distributed_type == "NO"


def test_trls_trained_token_keys_are_read_against_train_on_prompt():
    """assistant_only_loss / completion_only_loss true is what shardtune trains; beside train_on_prompt true they
    ask for the opposite (it loaded and trained the prompts), and false is refused naming the key that decides."""
    cfg = load_train_config([*BASE, "--assistant_only_loss", "true", "--completion_only_loss", "true"])
    assert cfg.data.train_on_prompt is False
    with pytest.raises(UsageError, match="assistant_only_loss=true and train_on_prompt true ask for different tokens "
                                         "to train; keep one"):
        load_train_config([*BASE, "--assistant_only_loss", "true", "--train_on_prompt", "true"])
    # It said "shardtune does not do it ... or every token with train_on_prompt true": it does, under that key.
    for key, asks in (("completion_only_loss", "TRL's loss on the prompt too"),
                      ("assistant_only_loss", "TRL's loss on every token of a conversation")):
        with pytest.raises(UsageError, match=re.escape(
                f"{key}='false' asks for {asks}, which shardtune trains with train_on_prompt true (it trains the "
                f"assistant turns and completions unless that is set): set that instead")):
            load_train_config([*BASE, f"--{key}", "false"])


def test_trls_trained_token_key_false_loads_beside_train_on_prompt(tmp_path):
    """A written-out SFTConfig holds assistant_only_loss: false (TRL's default: every token of a conversation).
    The refusal said to set train_on_prompt true instead; set, the recipe was still refused with the same line, and
    a command-line --assistant_only_loss true over the file's false was refused too. false beside train_on_prompt
    true asks for the same tokens, and the last layer's word counts."""
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("assistant_only_loss: false\ncompletion_only_loss: null\n")
    with pytest.raises(UsageError, match="line 1: assistant_only_loss=False asks for TRL's loss on every token"):
        load_train_config([str(recipe), *BASE])
    assert load_train_config([str(recipe), *BASE, "--train_on_prompt", "true"]).data.train_on_prompt is True
    assert load_train_config([str(recipe), *BASE, "--assistant_only_loss", "true"]).data.train_on_prompt is False
    assert load_train_config([str(recipe), *BASE, "--assistant_only_loss", "null"]).data.train_on_prompt is False
    with pytest.raises(UsageError, match="command line .*assistant_only_loss=true and train_on_prompt true ask for "
                                         "different tokens"):
        load_train_config([str(recipe), *BASE, "--assistant_only_loss", "true", "--train_on_prompt", "true"])


def test_a_hub_subset_of_local_data_is_refused(tmp_path, capsys):
    """dataset_config_name picks a hub data set's configuration; on a local file it did nothing, silently."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    argv = ["train", "--model_name_or_path", "m", "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    assert main([*argv, "--dataset_config_name", "subset"]) == 2
    assert f"dataset_config_name picks a configuration (subset) of a hub data set, and {data} is local; leave it " \
           f"out" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "org/name", "--dataset_config_name",
                             "subset", "--output_dir", "o"])
    assert cfg.data.dataset_config_name == "subset"


@pytest.mark.parametrize("key, hint", [
    ("dataset_splits", "here the split names go in one key: splits"), ("lr", "here it is learning_rate"),
    ("preprocessing_num_workers", "here it is dataset_num_proc"),
    # (TRL's SFTConfig keys at their defaults are no-ops: tests/test_key_vocabulary.py)
    ("eval_dataset_name", "eval rows come from dataset_name's own eval split"),
    # TrainingArguments keys: offered lr_scheduler_type, optim, dataset_name, save_total_limit, ..., fsdp_version
    ("optim_args", "the optimizer's settings are keys of their own here"), ("data_seed", "seed orders the data here"),
    ("save_only_model", "checkpoints here always hold what an exact resume needs"),
    ("eval_accumulation_steps", "evaluation here keeps no logits"),
    ("fsdp", "here FSDP is distributed_type FSDP"), ("ddp_backend", "the backend here is NCCL on CUDA"),
    ("local_rank", "torchrun gives each process its rank"), ("auto_find_batch_size", "shardtune estimate "
     "--find-batch-size")])
def test_another_tools_key_without_a_counterpart_names_what_to_write(key, hint, capsys):
    """Spelling alone offered dataset_num_proc for dataset_splits and lora_r for lr."""
    assert main(["train", *BASE, f"--{key}", "1"]) == 2
    assert f"unknown key '{key}'; {hint}" in capsys.readouterr().err


def test_trls_config_option_reads_the_recipe(tmp_path, monkeypatch):
    """`trl sft --config recipe.yaml` is how TRL users run a recipe: `shardtune train --config recipe.yaml` was
    refused as the unknown key 'config'. It is the recipe, below key=value and --key value as the positional one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text("learning_rate: 0.001\nseed: 3\n")
    cfg = load_train_config(["--config", "recipe.yaml", *BASE, "seed=7"])
    assert (cfg.optim.learning_rate, cfg.run.seed) == (0.001, 7)
    assert load_train_config([*BASE, "--config=recipe.yaml"]).run.seed == 3


def test_trls_space_separated_lora_lists_are_read_on_the_command_line(tmp_path):
    """TRL's parser takes lora_target_modules and lora_modules_to_save as several words (nargs +): a TRL command
    line's --lora_target_modules q_proj v_proj was refused as "unexpected argument 'v_proj'", naming no key. The
    words are one comma-separated value; a flag, key=value or recipe after them ends them."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("use_peft_lora: true\nmax_steps: 3\n")
    cfg = load_train_config([*BASE, "--lora_target_modules", "q_proj", "k_proj", "v_proj", str(recipe),
                             "--lora-modules-to-save", "lm_head", "embed_tokens", "seed=7"])
    assert cfg.lora.lora_target_modules == "q_proj,k_proj,v_proj"
    assert cfg.lora.lora_modules_to_save == ["lm_head", "embed_tokens"]
    assert (cfg.run.max_steps, cfg.run.seed, cfg.lora.use_peft_lora) == (3, 7, True)
    with pytest.raises(UsageError, match="unexpected argument 'mlflow'"):  # one word elsewhere, as in TRL
        load_train_config([*BASE, "--report_to", "tensorboard", "mlflow"])


def test_a_json_recipe_is_read_as_transformers_example_scripts_read_one(tmp_path):
    """Transformers' example scripts take their arguments as one JSON file (run_clm.py args.json, a written-out
    TrainingArguments); shardtune train args.json was refused as "a DeepSpeed config JSON goes in --deepspeed". A
    .json holding no DeepSpeed block is a recipe, with its lines; a DeepSpeed one keeps its pointer, and estimate
    --config tells the two apart the same way."""
    from shardtune.cli.estimate import config_argv

    recipe = tmp_path / "args.json"
    recipe.write_text(json.dumps({"model_name_or_path": "m", "dataset_name": "d", "output_dir": "o", "bf16": False,
                                  "learning_rate": 0.0002, "gradient_accumulation_steps": 4, "max_steps": 7,
                                  "lora_target_modules": ["q_proj", "v_proj"], "use_peft": True}, indent=1))
    cfg = load_train_config([str(recipe), "--max_steps", "9"])
    assert (cfg.optim.learning_rate, cfg.run.gradient_accumulation_steps, cfg.run.max_steps, cfg.run.bf16) == \
        (0.0002, 4, 9, False)
    assert cfg.lora.lora_target_modules == "q_proj,v_proj" and cfg.lora.use_peft_lora
    assert load_train_config(["--config", str(recipe)]).run.max_steps == 7  # TRL's --config
    recipe.write_text('{\n "model_name_or_path": "m",\n "seed": -1\n}\n')
    with pytest.raises(UsageError, match=re.escape(f"{recipe}, line 3: seed=-1 must be from 0 to")):
        load_train_config([str(recipe), *BASE])
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text('{"bf16": {"enabled": true}, "gradient_accumulation_steps": "auto"}')
    with pytest.raises(UsageError, match=re.escape(f"a DeepSpeed config JSON goes in --deepspeed {deepspeed}")):
        load_train_config([str(deepspeed), *BASE])
    assert config_argv([str(recipe), str(deepspeed)]) == [str(recipe), "--deepspeed", str(deepspeed)]


def test_transformers_4s_logging_dir_and_an_inline_chat_template_name_what_to_do():
    """A recipe from Transformers 4 holds logging_dir, and alignment-handbook's an inline chat_template: each was
    refused offering a key that means something else (logging_first_step; chat_template_format, which takes a
    template's name)."""
    for key, said in (("logging_dir", "unknown key 'logging_dir'; TensorBoard's event files go to "
                                      "output_dir/tensorboard/RUN_NAME here"),
                      ("chat_template", "unknown key 'chat_template'; put the template in the model folder as "
                                        "chat_template.jinja"),
                      ("zero_stage", "unknown key 'zero_stage'; Accelerate's zero_stage is read inside a "
                                     "deepspeed_config block"),
                      # A T4 notebook's: offered mixed_precision, log_level, or nothing of what runs instead
                      ("half_precision_backend", "unknown key 'half_precision_backend'; fp16 and bf16 run through "
                                                 "torch.amp here"),
                      ("fp16_opt_level", "unknown key 'fp16_opt_level'; apex's opt level is not run here"),
                      ("fp16_full_eval", "unknown key 'fp16_full_eval'; evaluation here runs in the training's "
                                         "precision")):
        with pytest.raises(UsageError, match=re.escape(said)):
            load_train_config([*BASE, f"--{key}", "x"])


def test_trls_max_length_none_is_refused_not_dropped(tmp_path):
    """TRL's max_length: null keeps every row whole; it was dropped without a word and rows were cut at the default
    2048. TRL's former max_seq_length: null (its default then, a length of its choosing) still means the default."""
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("max_length: null\n")
    with pytest.raises(UsageError, match=re.escape(f"{recipe}, line 1: max_length=None asks for TRL's rows with no "
                                                   f"truncation; rows here are cut at max_seq_len")):
        load_train_config([str(recipe), *BASE])
    recipe.write_text("max_seq_length: null\n")
    assert load_train_config([str(recipe), *BASE]).data.max_seq_len == 2048
    assert load_train_config([str(recipe), *BASE, "--max_length", "512"]).data.max_seq_len == 512


def test_a_data_file_or_a_missing_file_given_as_the_recipe_is_named_so(tmp_path):
    """shardtune train rows.jsonl (as data inspect takes its data) was told to give a YAML recipe, and a JSON file of
    rows, or one that is not there, was called a DeepSpeed config for --deepspeed."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"text": "a"}]))
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    for path, says in ((rows, f"a data set goes in --dataset_name {rows}"),
                       (tmp_path / "rows.jsonl", f"a data set goes in --dataset_name {tmp_path / 'rows.jsonl'}"),
                       (tmp_path / "nothere.json", "no such file")):
        with pytest.raises(UsageError, match=re.escape(f"unexpected argument '{path}': {says}; give a recipe")):
            load_train_config([str(path), *BASE])


def test_a_list_written_inline_on_the_command_line_is_read_as_its_items():
    """'--lora_modules_to_save ["lm_head", "embed_tokens"]' (a JSON list, as a Python launcher or a notebook writes
    one) was stored as the one name '["lm_head"', ...; --callbacks and the comma keys (splits,
    lora_target_modules) took it literally too. An inline list is its items, as a YAML recipe's list is."""
    cfg = load_train_config([*BASE, "--use_peft_lora", "true", "--lora_modules_to_save", '["lm_head", "embed_tokens"]',
                             "--callbacks", "[pkg.hooks:Stop]", "--splits", "[train_sft, test_sft]",
                             "--lora_target_modules", '["q_proj","v_proj"]'])
    assert (cfg.lora.lora_modules_to_save, cfg.run.callbacks, cfg.data.splits, cfg.lora.lora_target_modules) == (
        ["lm_head", "embed_tokens"], ["pkg.hooks:Stop"], "train_sft,test_sft", "q_proj,v_proj")
    # a text that is not one whole inline list stays the text it is (the model's modules are checked when built)
    assert load_train_config([*BASE, "--use_peft_lora", "true", "--lora_modules_to_save", "[lm_head"]
                             ).lora.lora_modules_to_save == ["[lm_head"]
