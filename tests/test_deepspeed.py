"""DeepSpeed configs (--deepspeed FILE, an Accelerate deepspeed_config block) mapped onto FSDP2, listed or refused."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.trainutil import losses, shardtune_env, write_chat_data

BASE = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
# A ZeRO-2 file as Transformers' docs write one: everything the trainer arguments decide is "auto".
ZERO2 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "overlap_comm": True,
                               "contiguous_gradients": True, "reduce_bucket_size": "auto"},
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
         "steps_per_print": 10}


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if isinstance(data, dict) else data)
    return path


def flat(argv: list[str]) -> dict:
    values = load_train_config(argv).to_flat()
    values.pop("deepspeed")
    return values


def test_zero2_with_auto_values_is_fsdp_shard_grad_op_and_leaves_the_rest_to_the_config(tmp_path):
    # WarmupLR, as Transformers' ZeRO-2 example has it: a scheduler other than the default linear, so that the
    # file's choice is seen to act
    ds = write(tmp_path / "ds.json", {**ZERO2, "scheduler": {**ZERO2["scheduler"], "type": "WarmupLR"}})
    extra = ["--learning_rate", "3e-4", "--gradient_accumulation_steps", "4", "--bf16", "true"]
    expected = flat([*BASE, *extra, "--distributed_type", "FSDP", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                     "--lr_scheduler_type", "constant_with_warmup"])
    assert flat([*BASE, *extra, "--deepspeed", str(ds)]) == expected


@pytest.mark.parametrize("stage, kind, sharding", [(1, "FSDP", "SHARD_GRAD_OP"), (2, "FSDP", "SHARD_GRAD_OP"),
                                                   (3, "FSDP", "FULL_SHARD")])
def test_each_zero_stage_and_the_values_a_file_sets(tmp_path, stage, kind, sharding):
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}},
                                      "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                      "gradient_clipping": 0.5, "bf16": {"enabled": True},
                                      "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.8, 0.95],
                                                                                "eps": 1e-6, "weight_decay": 0.1}},
                                      "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 7}}})
    cfg = load_train_config([*BASE, "--deepspeed", str(ds)])
    d, r, o = cfg.distributed, cfg.run, cfg.optim
    assert (d.distributed_type, d.fsdp_sharding_strategy, d.fsdp_offload_params) == (kind, sharding, True)
    assert (r.per_device_train_batch_size, r.gradient_accumulation_steps, r.bf16) == (2, 3, True)
    assert (o.max_grad_norm, o.learning_rate, o.adam_beta1, o.adam_beta2, o.adam_epsilon, o.weight_decay) == \
        (0.5, 2e-4, 0.8, 0.95, 1e-6, 0.1)
    assert (o.lr_scheduler_type, o.warmup_steps) == ("cosine", 7)


def test_zero_0_with_offload_is_refused_not_run_unoffloaded(tmp_path):
    """ZeRO-0 is DDP, which offloads nothing: its offload_param would be dropped without a word."""
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}})
    with pytest.raises(UsageError, match="fsdp_offload_params=true set without distributed_type FSDP"):
        load_train_config([*BASE, "--deepspeed", str(ds)])
    ds = write(tmp_path / "ds0.json", {"zero_optimization": {"stage": 0}})
    assert load_train_config([*BASE, "--deepspeed", str(ds)]).distributed.distributed_type == "DDP"


def test_train_batch_size_gives_the_accumulation_or_must_agree(tmp_path):
    ds = write(tmp_path / "ds.json", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    cfg = load_train_config([*BASE, "--deepspeed", str(ds), "--num_processes", "2"])
    assert cfg.run.gradient_accumulation_steps == 4  # 32 / (4 x 2 processes)
    with pytest.raises(UsageError, match=r"train_batch_size 32 is not per_device_train_batch_size 4 x "
                                         r"gradient_accumulation_steps 2 x 2 processes \(16\)"):
        load_train_config([*BASE, "--deepspeed", str(ds), "--num_processes", "2", "--gradient_accumulation_steps",
                           "2"])


def test_a_value_the_file_and_the_command_line_set_differently_is_refused(tmp_path):
    """Named as Transformers' mismatch check names it ("ds optimizer.params.lr=... vs hf learning_rate=..."): the
    entry of the file, and a fix that can be done. It said "the DeepSpeed config sets 'FSDP': ... write auto in
    ds.json", which named no entry, and zero_optimization.stage or scheduler.type cannot be auto."""
    ds = write(tmp_path / "ds.json", {"gradient_accumulation_steps": 4})
    with pytest.raises(UsageError) as refused:
        load_train_config([*BASE, "--deepspeed", str(ds), "--gradient_accumulation_steps", "3"])
    assert str(refused.value) == (f"command line (--gradient_accumulation_steps): gradient_accumulation_steps='3', "
                                  f"but gradient_accumulation_steps in the DeepSpeed config {ds} makes it 4: leave "
                                  f"gradient_accumulation_steps out there, or write auto for "
                                  f"gradient_accumulation_steps in {ds}")
    assert load_train_config([*BASE, "--deepspeed", str(ds), "--gradient_accumulation_steps", "4"])  # agree
    ds = write(tmp_path / "ds.json", {**ZERO2, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}})
    for flag, value, entry, fix in (
            ("--lr_scheduler_type", "cosine", "scheduler.type", "change scheduler.type"),
            ("--distributed_type", "DDP", "zero_optimization.stage", "change zero_optimization.stage"),
            ("--adam_beta2", "0.95", "optimizer.params.betas[1]", "write auto for optimizer.params.betas")):
        with pytest.raises(UsageError) as refused:
            load_train_config([*BASE, "--deepspeed", str(ds), flag, value])
        assert f"{value}', but {entry} in the DeepSpeed config {ds} makes it " in str(refused.value)
        assert str(refused.value).endswith(f": leave {flag[2:]} out there, or {fix} in {ds}")


def test_a_warmup_ratio_the_file_s_warmup_steps_would_drop_is_refused(tmp_path):
    """A TRL recipe's warmup_ratio 0.1 beside a file's warmup_num_steps 10 trained with 10 warm-up steps, the ratio
    dropped without a word (a step count wins over the ratio); Transformers' mismatch check refuses it."""
    ds = write(tmp_path / "ds.json", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("warmup_ratio: 0.1\n")
    with pytest.raises(UsageError) as refused:
        load_train_config([str(recipe), *BASE, "--deepspeed", str(ds)])
    assert str(refused.value) == (f"{recipe}, line 1: warmup_ratio=0.1, but scheduler.params.warmup_num_steps in the "
                                  f"DeepSpeed config {ds} makes warmup_steps 10, which decides over warmup_ratio: "
                                  f"leave warmup_ratio out there, or write auto for scheduler.params.warmup_num_steps "
                                  f"in {ds}")
    cfg = load_train_config([*BASE, "--deepspeed", str(ds), "--warmup_ratio", "0"])  # no ratio to drop
    assert (cfg.optim.warmup_steps, cfg.optim.warmup_ratio) == (10, 0.0)
    ds = write(tmp_path / "ds.json", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}})
    assert load_train_config([str(recipe), *BASE, "--deepspeed", str(ds)]).optim.warmup_ratio == 0.1


def test_a_zero_stage_written_as_text_is_refused_saying_so(tmp_path):
    """It read "DeepSpeed key 'zero_optimization.stage' = 3 must be 0, 1, 2 or 3"."""
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": "3"}})
    with pytest.raises(UsageError) as refused:
        load_train_config([*BASE, "--deepspeed", str(ds)])
    assert str(refused.value) == (f"{ds}: DeepSpeed key 'zero_optimization.stage' = \"3\" must be 0, 1, 2 or 3, a "
                                  f"number (without quotes)")


def test_a_precision_flag_written_as_text_is_refused_showing_the_quotes(tmp_path):
    """It read "DeepSpeed key 'bf16.enabled' = true must be true, false or auto"."""
    ds = write(tmp_path / "ds.json", {"bf16": {"enabled": "true"}})
    with pytest.raises(UsageError) as refused:
        load_train_config([*BASE, "--deepspeed", str(ds)])
    assert str(refused.value) == f"{ds}: DeepSpeed key 'bf16.enabled' = \"true\" must be true, false or auto"


def test_bf16_enabled_false_trains_without_bf16_on_hardware_that_has_it(tmp_path):
    """A file with bf16 and fp16 both enabled false (DeepSpeed's fp32) was printed 'bf16.enabled false -> bf16
    from the config', and the unset bf16 became bf16 on a GPU or CPU that computes it: the file's false dropped."""
    ds = write(tmp_path / "ds.json", {"bf16": {"enabled": False}, "fp16": {"enabled": False}})
    cfg = load_train_config([*BASE, "--deepspeed", str(ds)])
    assert (cfg.run.bf16, cfg.run.fp16, cfg.precision_on(True)) == (False, False, "no")
    with pytest.raises(UsageError, match=r"bf16='true', but bf16.enabled in the DeepSpeed config .* makes it False"):
        load_train_config([*BASE, "--deepspeed", str(ds), "--bf16", "true"])


def test_a_bf16_block_setting_is_not_called_a_loss_scaler_setting(tmp_path):
    """bf16.immediate_grad_update was refused as 'tunes DeepSpeed's loss scaler': bf16 has none."""
    ds = write(tmp_path / "ds.json", {"bf16": {"enabled": True, "immediate_grad_update": False}})
    with pytest.raises(UsageError) as refused:
        load_train_config([*BASE, "--deepspeed", str(ds)])
    assert "loss scaler" not in str(refused.value)
    assert "'bf16.immediate_grad_update' = false tunes DeepSpeed's bf16 optimizer" in str(refused.value)


def test_two_entries_of_the_file_that_set_one_key_must_agree(tmp_path):
    """optimizer.params.lr and the scheduler's warmup_max_lr are both learning_rate: the later one in the file
    won without a word (scheduler first: the optimizer's 3e-4 trained, where DeepSpeed warms up to 1e-4)."""
    optimizer = {"type": "AdamW", "params": {"lr": 3e-4}}
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4, "warmup_num_steps": 10}}
    for data in ({"scheduler": scheduler, "optimizer": optimizer}, {"optimizer": optimizer, "scheduler": scheduler}):
        ds = write(tmp_path / "ds.json", data)
        with pytest.raises(UsageError, match=r"'(optimizer.params.lr|scheduler.params.warmup_max_lr)' = "
                                             r"0.000[13] and '(optimizer.params.lr|scheduler.params.warmup_max_lr)' "
                                             r"= 0.000[13] both set learning_rate: make them agree"):
            load_train_config([*BASE, "--deepspeed", str(ds)])
    scheduler["params"]["warmup_max_lr"] = "3e-4"  # the same rate, written otherwise
    ds = write(tmp_path / "ds.json", {"scheduler": scheduler, "optimizer": optimizer})
    assert load_train_config([*BASE, "--deepspeed", str(ds)]).optim.learning_rate == 3e-4


@pytest.mark.parametrize("data, named", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     "zero_optimization.offload_param"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer"),
    ({"fp16": {"enabled": True, "loss_scale_window": 500}}, "fp16.loss_scale_window"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "log"}}}, "scheduler.params.warmup_type"),
    ({"zero_optimization": {"stage": 2, "elastic_checkpoint": True}}, "zero_optimization.elastic_checkpoint"),
])
def test_what_cannot_be_mapped_exits_2_naming_the_key(tmp_path, capsys, data, named):
    from shardtune.cli import main

    ds = write(tmp_path / "ds.json", data)
    assert main(["train", *BASE, "--deepspeed", str(ds)]) == 2
    err = capsys.readouterr().err
    assert f"{ds}: DeepSpeed key '{named}'" in err and len(err.strip().splitlines()) == 1


def test_transformers_fp16_loss_scaler_block_loads_unless_the_run_computes_in_fp16(tmp_path):
    """Transformers' example ZeRO files carry an fp16 block with the loss scaler's settings under enabled auto: every
    one of them was refused, though the run trains in bf16. They are unused (and said so) there, and refused where
    the run computes in fp16 (asked on the command line, in a recipe or in an Accelerate file over the same file)."""
    scaler = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
              "hysteresis": 2, "min_loss_scale": 1}
    ds = write(tmp_path / "ds.json", {**ZERO2, "fp16": scaler})
    from shardtune.config.deepspeed import read_deepspeed_file

    assert ("fp16.hysteresis 2 -> unused: it tunes DeepSpeed's fp16 loss scaler, and a run in fp16 (where it is "
            "refused) scales with torch's GradScaler defaults") in read_deepspeed_file(ds).lines
    assert load_train_config([*BASE, "--deepspeed", str(ds), "--bf16", "true"]).run.bf16
    assert load_train_config([*BASE, "--deepspeed", str(ds)])  # no precision asked: bf16 or fp32, never fp16
    for fp16 in (["--fp16", "true"], ["--mixed_precision", "fp16"]):
        with pytest.raises(UsageError) as refused:
            load_train_config([*BASE, "--deepspeed", str(ds), *fp16])
        assert str(refused.value).count("tunes DeepSpeed's loss scaler, and this run computes in fp16") == 4
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(f"distributed_type: DEEPSPEED\nmixed_precision: fp16\ndeepspeed_config:\n"
                          f"  deepspeed_config_file: {ds}\n")
    with pytest.raises(UsageError, match="fp16.loss_scale_window' = 1000 tunes DeepSpeed's loss scaler"):
        load_train_config(["--config_file", str(accelerate), *BASE])
    accelerate.write_text(accelerate.read_text().replace("mixed_precision: fp16", "mixed_precision: bf16"))
    assert load_train_config(["--config_file", str(accelerate), *BASE]).precision_on(True) == "bf16"


def test_a_deepspeed_file_given_as_the_accelerate_config_names_the_option_to_use(tmp_path):
    """It was eleven joined lines of unknown keys."""
    ds = write(tmp_path / "ds.json", ZERO2)
    with pytest.raises(UsageError) as refused:
        load_train_config(["--config_file", str(ds), *BASE])
    assert str(refused.value) == (f"--config_file {ds}: a DeepSpeed config, not an Accelerate one (it has "
                                  f"train_micro_batch_size_per_gpu and zero_optimization): pass it as --deepspeed {ds}")


def test_accelerates_deepspeed_type_given_as_a_key_names_the_option_to_use(tmp_path):
    """--distributed_type DEEPSPEED (Accelerate's value, which an Accelerate file with a deepspeed_config block
    runs as FSDP2) was refused listing NO, DDP, FSDP, MP, PP, without a word of where a DeepSpeed job goes."""
    for value in ("DEEPSPEED", "deepspeed"):
        with pytest.raises(UsageError) as refused:
            load_train_config([*BASE, "--distributed_type", value])
        assert "distributed_type=DEEPSPEED: Accelerate's DeepSpeed runs as FSDP2 here: give its DeepSpeed config as " \
               "--deepspeed ds_config.json (its ZeRO stage picks the sharding), or set distributed_type FSDP with " \
               "fsdp_sharding_strategy SHARD_GRAD_OP (ZeRO-1/2) or FULL_SHARD (ZeRO-3)" in str(refused.value)
    accelerate = tmp_path / "accelerate.yaml"  # the file form is mapped as it was
    accelerate.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\n")
    assert load_train_config(["--config_file", str(accelerate), *BASE]).distributed.distributed_type == "FSDP"


def test_an_accelerate_deepspeed_file_without_a_stage_runs_accelerates_zero2(tmp_path):
    """Accelerate runs ZeRO-2 for distributed_type DEEPSPEED when its file names no zero_stage (DeepSpeedPlugin's
    default); shardtune ran FULL_SHARD (ZeRO-3) without a word. A deepspeed_config_file without zero_optimization,
    which Accelerate refuses, ran FULL_SHARD too."""
    from shardtune.config.loading import deepspeed_mappings

    acc = tmp_path / "accelerate.yaml"
    for text in ("distributed_type: DEEPSPEED\nnum_processes: 2\n",
                 "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_optimizer_device: none\n"):
        acc.write_text(text)
        argv = ["--config_file", str(acc), *BASE]
        d = load_train_config(argv).distributed
        assert (d.distributed_type, d.fsdp_sharding_strategy) == ("FSDP", "SHARD_GRAD_OP"), text
        [(_, lines)] = deepspeed_mappings(argv)
        assert lines[:2] == ["zero_stage not set: Accelerate's default, 2 (a --deepspeed file's stage decides over it)",
                             "zero_optimization.stage 2: ZeRO-2 -> FSDP SHARD_GRAD_OP"]
    # Transformers' way, accelerate launch --config_file accelerate.yaml train.py --deepspeed ds.json: the file's stage
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}})
    assert load_train_config([*argv, "--deepspeed", str(ds)]).distributed.fsdp_sharding_strategy == "FULL_SHARD"
    write(tmp_path / "ds.json", {"bf16": {"enabled": True}})
    acc.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    with pytest.raises(UsageError, match=r"ds.json: no zero_optimization block \(this deepspeed_config_file of .*"
                                         r"accelerate.yaml needs one, as Accelerate says\): add"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_every_deepspeed_block_that_acts_is_printed(tmp_path):
    """A recipe's deepspeed_config block and an Accelerate file's both apply (layered): both are printed at start,
    where only the highest one was."""
    from shardtune.config.loading import deepspeed_mappings

    accelerate, recipe = tmp_path / "accelerate.yaml", tmp_path / "recipe.yaml"
    accelerate.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
                          "  offload_param_device: cpu\n")
    recipe.write_text("deepspeed_config:\n  zero_stage: 2\n")
    argv = ["--config_file", str(accelerate), str(recipe), *BASE]
    printed = deepspeed_mappings(argv)
    assert [source for source, _ in printed] == [f"{accelerate} (deepspeed_config)", f"{recipe} (deepspeed_config)"]
    assert "zero_optimization.offload_param.device cpu -> fsdp_offload_params true" in printed[0][1]
    assert load_train_config(argv).distributed.fsdp_offload_params  # the lower block's key applies


def test_the_file_a_json_recipe_names_is_printed_with_the_accumulation_derived_from_train_batch_size(tmp_path):
    """A Transformers args.json naming its DeepSpeed file ran ZeRO-2 as FSDP SHARD_GRAD_OP without a line printed
    (only YAML recipes were looked in), and the accumulation derived from train_batch_size was never said."""
    from shardtune.config.loading import deepspeed_mappings

    ds = write(tmp_path / "ds.json", {**ZERO2, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2})
    args = write(tmp_path / "args.json", {"model_name_or_path": "m", "dataset_name": "d", "output_dir": "o",
                                          "deepspeed": str(ds)})
    argv = [str(args), "--num_processes", "2"]
    assert load_train_config(argv).run.gradient_accumulation_steps == 4
    [(source, lines)] = deepspeed_mappings(argv)
    assert source == str(ds)
    assert "zero_optimization.stage 2: ZeRO-2 -> FSDP SHARD_GRAD_OP" in lines
    assert "train_batch_size 16 -> gradient_accumulation_steps 4 (= 16 / (2 x 2 processes))" in lines


def test_the_zero3_save_option_says_what_final_holds_rather_than_engine_tuning():
    """stage3_gather_16bit_weights_on_model_save (Accelerate's zero3_save_16bit_model) was printed as "DeepSpeed-engine
    tuning, not used": it is what ZeRO-3 saves (false: no whole model at all), and final/ here is always whole."""
    from shardtune.config.deepspeed import map_accelerate_block, map_deepspeed

    said = ("final/ is always the whole model, gathered from the shards, in the dtype its weights trained in (fp32 "
            "master weights under mixed precision)")
    lines = map_deepspeed({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                                                 "overlap_comm": True}}, "ds.json").lines
    assert f"zero_optimization.stage3_gather_16bit_weights_on_model_save false: {said}" in lines
    assert "zero_optimization.overlap_comm true: DeepSpeed-engine tuning, not used" in lines
    lines = map_accelerate_block({"zero_stage": 3, "zero3_save_16bit_model": True}, "acc.yaml").lines
    assert f"stage3_gather_16bit_weights_on_model_save true: {said}" in lines


def test_deepspeeds_former_offload_names_offload_as_the_blocks_they_stand_for(tmp_path):
    """Transformers' older ZeRO examples wrote "cpu_offload": true (and stage3_gather_fp16_weights_on_model_save),
    which DeepSpeed still reads; they were refused with "has no counterpart in FSDP2: remove it", and following
    that fix dropped the offload the file asked for."""
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 2, "cpu_offload": True,
                                                            "cpu_offload_use_pin_memory": True}})
    assert load_train_config([*BASE, "--deepspeed", str(ds)]).distributed.fsdp_offload_params is True
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "cpu_offload_param": True,
                                                            "stage3_gather_fp16_weights_on_model_save": True}})
    d = load_train_config([*BASE, "--deepspeed", str(ds)]).distributed
    assert (d.fsdp_sharding_strategy, d.fsdp_offload_params) == ("FULL_SHARD", True)
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "cpu_offload": False}})
    assert load_train_config([*BASE, "--deepspeed", str(ds)]).distributed.fsdp_offload_params is False
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "cpu_offload": "yes"}})
    with pytest.raises(UsageError, match=r"DeepSpeed key 'zero_optimization.cpu_offload' = \"yes\" must be true or "
                                         r"false"):
        load_train_config([*BASE, "--deepspeed", str(ds)])


def test_a_scheduler_without_warmup_type_says_its_warm_up_is_linear_not_deepspeeds_log():
    """DeepSpeed's WarmupLR/WarmupDecayLR/WarmupCosineLR warm up logarithmically unless warmup_type says linear;
    Transformers' example files leave it out, and the mapping said nothing of the linear warm-up that ran instead."""
    from shardtune.config.deepspeed import map_deepspeed

    said = ("scheduler.params.warmup_type not set: DeepSpeed's default warm-up is logarithmic, shardtune's linear "
            "(write \"warmup_type\": \"linear\" to say so)")
    assert said in map_deepspeed(ZERO2, "ds.json").lines
    linear = {**ZERO2, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}}
    assert said not in map_deepspeed(linear, "ds.json").lines


def test_zero3_init_flag_written_as_text_and_a_numeric_train_batch_size_are_read_and_said():
    """zero3_init_flag 'false' (text) turned rank-0 loading on (bool('false') is true); a numeric train_batch_size
    was checked but not printed."""
    from shardtune.config.deepspeed import map_accelerate_block, map_deepspeed

    mapped = map_accelerate_block({"zero_stage": 3, "zero3_init_flag": "false"}, "acc.yaml")
    assert mapped.values["fsdp_cpu_ram_efficient_loading"] is False
    # the value it became is said (the line ended at the key, and shardtune's default for it is true)
    assert "zero3_init_flag false -> fsdp_cpu_ram_efficient_loading false" in mapped.lines
    assert ("train_batch_size 32 -> per_device_train_batch_size x gradient_accumulation_steps x processes must "
            "make 32 (accumulation is derived from it where nothing sets it)") in map_deepspeed(
                {"train_batch_size": 32}, "ds.json").lines


def test_an_offload_block_that_offloads_nothing_is_printed_too():
    """Transformers' ZeRO-2 example's offload_optimizer {"device": "none", "pin_memory": true} printed no line at
    all, where every other key of the file says what it became."""
    from shardtune.config.deepspeed import map_deepspeed

    mapped = map_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none",
                                                                                     "pin_memory": True}}},
                           "ds.json")
    lines = mapped.lines
    assert "zero_optimization.offload_optimizer.device none: not offloaded" in lines
    assert "zero_optimization.offload_optimizer.pin_memory true: DeepSpeed-engine tuning, not used" in lines
    # and it offloads nothing: the keys are those of the same file without the block
    without = map_deepspeed({"zero_optimization": {"stage": 2}}, "ds.json")
    assert (mapped.values, mapped.problems) == (without.values, [])


def test_a_deepspeed_file_or_a_folder_given_as_the_recipe_says_what_to_do(tmp_path):
    """'shardtune train ds.json' (and a folder) read 'unexpected argument ...: give a YAML recipe', with no word of
    --deepspeed, the option a DeepSpeed file goes in."""
    ds = write(tmp_path / "ds.json", ZERO2)
    with pytest.raises(UsageError) as err:
        load_train_config([str(ds), *BASE])
    assert str(err.value) == (f"unexpected argument '{ds}': a DeepSpeed config JSON goes in --deepspeed {ds}; give a "
                              f"recipe (CONFIG.yaml, or a JSON of its keys), key=value or --key value")
    with pytest.raises(UsageError, match=rf"unexpected argument '{re.escape(str(tmp_path))}': a folder; give a recipe"):
        load_train_config([str(tmp_path), *BASE])


def test_an_unreadable_file_is_one_line(tmp_path):
    """One line naming the file, what is wrong with it (json's own words, with its line and column) and the fix."""
    bad, missing = write(tmp_path / "ds.json", "{oops"), tmp_path / "missing.json"
    with pytest.raises(json.JSONDecodeError) as cause:
        json.loads(bad.read_text())
    with pytest.raises(UsageError) as err:
        load_train_config([*BASE, "--deepspeed", str(bad)])
    assert str(err.value) == f"deepspeed {bad}: not valid JSON ({cause.value}); fix the file"
    with pytest.raises(UsageError) as err:
        load_train_config([*BASE, "--deepspeed", str(missing)])
    assert str(err.value) == (f"deepspeed {missing}: cannot be read ({os.strerror(errno.ENOENT)}); give the "
                              f"DeepSpeed config JSON")


def test_a_key_set_twice_in_the_file_is_refused_naming_it_and_its_lines(tmp_path):
    """json.loads kept the last of two zero_optimization blocks without a word (stage 3 ran where the file's first
    block said 2); a recipe's YAML with a key set twice is refused, so is the DeepSpeed file."""
    ds = write(tmp_path / "ds.json", '{\n  "zero_optimization": {"stage": 2},\n  "bf16": {"enabled": true},\n'
                                     '  "zero_optimization": {"stage": 3}\n}\n')
    with pytest.raises(UsageError) as err:
        load_train_config([*BASE, "--deepspeed", str(ds)])
    assert str(err.value) == f"deepspeed {ds}: key 'zero_optimization' is set twice (lines 2 and 4); keep one"


def test_bf16_from_the_file_and_fp16_from_the_command_line_names_the_file(tmp_path):
    """It read "bf16 and fp16 are both true; choose one", to a user who had set only --fp16: the bf16 was the
    DeepSpeed file's. Then "ds.json (DeepSpeed, ...): bf16 and fp16 are both true; choose one", which named
    neither the file's entry nor where fp16 was set; now both, as Transformers' mismatch check does."""
    ds = write(tmp_path / "ds.json", {"bf16": {"enabled": True}})
    with pytest.raises(UsageError) as err:
        load_train_config([*BASE, "--deepspeed", str(ds), "--fp16", "true"])
    assert str(err.value) == (f"command line (--fp16): fp16='true', but bf16.enabled in the DeepSpeed config {ds} "
                              f"makes bf16 True, which cannot run with fp16: leave fp16 out there, or write auto for "
                              f"bf16.enabled in {ds}")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("fp16: false\nbf16: true\n")  # agree with the file: no problem
    assert load_train_config([str(recipe), *BASE, "--deepspeed", str(ds)]).run.bf16 is True
    ds = write(tmp_path / "ds.json", {"fp16": {"enabled": True}})
    with pytest.raises(UsageError, match=rf"{recipe}, line 2: bf16=True, but fp16.enabled in the DeepSpeed config "):
        load_train_config([str(recipe), *BASE, "--deepspeed", str(ds)])


def test_a_deepspeed_file_a_recipe_names_but_cannot_be_read_names_the_recipe(tmp_path, monkeypatch):
    """A recipe's 'deepspeed: ds.json', run from another folder, read only 'deepspeed ds.json: cannot be read',
    without the recipe and line that named it or the folder the relative path was read from."""
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "ds.json", ZERO2)
    recipe = tmp_path / "sub" / "recipe.yaml"
    recipe.write_text("deepspeed: ds.json\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as err:
        load_train_config([str(recipe), *BASE])
    assert str(err.value).startswith(f"{recipe}, line 1: deepspeed ds.json: cannot be read")
    assert str(err.value).endswith(f"(a relative path is read from the working directory, {tmp_path})")


def test_an_accelerate_file_with_a_deepspeed_config_file(tmp_path):
    """The case that used to become FULL_SHARD with mixed precision 'no', dropping accumulation, clipping and
    offload: ZeRO-1, bf16, accumulation 4, clipping 0.7, optimizer offload."""
    write(tmp_path / "ds.json", {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                                 "bf16": {"enabled": True}, "gradient_accumulation_steps": 4,
                                 "gradient_clipping": 0.7})
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\n"
                   "deepspeed_config:\n  deepspeed_config_file: ds.json\n  zero3_init_flag: false\n")
    cfg = load_train_config(["--config_file", str(acc), *BASE])
    d, r = cfg.distributed, cfg.run
    assert (d.distributed_type, d.fsdp_sharding_strategy, d.fsdp_offload_params) == ("FSDP", "SHARD_GRAD_OP", True)
    assert (cfg.mixed_precision, r.gradient_accumulation_steps, cfg.optim.max_grad_norm) == ("bf16", 4, 0.7)
    assert d.fsdp_cpu_ram_efficient_loading is False
    inline = tmp_path / "inline.yaml"
    inline.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  gradient_clipping: 1.5\n"
                      "  offload_param_device: none\n  deepspeed_moe_layer_cls_names: X\n")
    with pytest.raises(UsageError, match=r"deepspeed_config.deepspeed_moe_layer_cls_names has no counterpart"):
        load_train_config(["--config_file", str(inline), *BASE])


def test_an_accelerate_deepspeed_block_and_a_key_set_otherwise_must_agree(tmp_path):
    """An Accelerate file's deepspeed_config block set gradient_clipping 1.0 and the recipe max_grad_norm 0.3: the
    recipe's 0.3 ran while train printed 'gradient_clipping 1.0 -> max_grad_norm 1.0'; in one recipe, the block's
    1.0 replaced the recipe's own 0.3 without a word. Refused as a --deepspeed file's clash is (and Transformers');
    agreeing values, auto, and a later --distributed_type (the launch's) load."""
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
                   "  gradient_clipping: 1.0\n  gradient_accumulation_steps: 2\n")
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("max_grad_norm: 0.3\n")
    with pytest.raises(UsageError, match=re.escape(f"{recipe}, line 1: max_grad_norm=0.3, but the deepspeed_config "
                                                   f"block of {acc} sets 1.0: make them agree, or write auto there")):
        load_train_config(["--config_file", str(acc), str(recipe), *BASE])
    with pytest.raises(UsageError, match="command line .*gradient_accumulation_steps='4', but the deepspeed_config"):
        load_train_config(["--config_file", str(acc), *BASE, "--gradient_accumulation_steps", "4"])
    both = tmp_path / "both.yaml"
    both.write_text("max_grad_norm: 0.3\ndeepspeed_config:\n  gradient_clipping: 1.0\n")
    with pytest.raises(UsageError, match=re.escape(f"{both}, line 1: max_grad_norm=0.3, but the deepspeed_config "
                                                   f"block of {both} sets 1.0")):
        load_train_config([str(both), *BASE])
    cfg = load_train_config(["--config_file", str(acc), *BASE, "--max_grad_norm", "1", "--distributed_type", "DDP"])
    assert (cfg.optim.max_grad_norm, cfg.run.gradient_accumulation_steps, cfg.distributed.distributed_type) == \
        (1.0, 2, "DDP")
    acc.write_text(acc.read_text().replace("gradient_clipping: 1.0", "gradient_clipping: auto"))
    assert load_train_config(["--config_file", str(acc), str(recipe), *BASE]).optim.max_grad_norm == 0.3


def test_a_zero2_run_prints_its_mapping_and_trains_like_the_keys_it_maps_to(tmp_path):
    """One process, FSDP on it: the --deepspeed run prints the mapping and has the losses of the run given the
    same keys directly."""
    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(tmp_path / "model")
    data = write_chat_data(tmp_path / "chat.jsonl", rows=300)
    ds = write(tmp_path / "ds.json", ZERO2)
    common = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
              "--max_seq_len", "64", "--packing", "true", "--max_steps", "3", "--save_strategy", "no",
              "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
              "--learning_rate", "1e-3", "--use_peft_lora", "true"]
    runs = {}
    for name, extra in (("deepspeed", ["--deepspeed", str(ds)]),
                        ("direct", ["--distributed_type", "FSDP", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                                    "--lr_scheduler_type", "linear"])):
        proc = subprocess.run([sys.executable, "-m", "shardtune", "train", *common, *extra, "--output_dir",
                               str(tmp_path / name)], cwd=tmp_path, env=shardtune_env(tmp_path), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (proc.stderr, losses(tmp_path / name))
    assert f"DeepSpeed config {ds}, as shardtune runs it:" in runs["deepspeed"][0]
    assert "zero_optimization.stage 2: ZeRO-2 -> FSDP SHARD_GRAD_OP" in runs["deepspeed"][0]
    assert runs["deepspeed"][1] == runs["direct"][1] and len(runs["direct"][1]) == 3


def test_a_zero3_offload_run_says_it_offloads_and_estimate_plans_the_same_setup(tmp_path):
    """Transformers' ZeRO-3 example with CPU offload: the start-up log and summary.json say FSDP FULL_SHARD with CPU
    offload (the log used to say "FSDP FULL_SHARD" alone), as `shardtune estimate` of the same files plans it."""
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import run_shardtune

    model = make_model_folder(tmp_path / "model")
    data = write_chat_data(tmp_path / "chat.jsonl", rows=60)
    zero3 = {**ZERO2, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                            "offload_param": {"device": "cpu", "pin_memory": True},
                                            "stage3_gather_16bit_weights_on_model_save": True}}
    ds = write(tmp_path / "ds.json", zero3)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\nsplits: train\nmax_seq_len: 32\n"
                      f"max_steps: 1\nper_device_train_batch_size: 2\nsave_strategy: 'no'\noutput_dir: out\n"
                      f"predict_memory: false\n")
    proc = run_shardtune(["train", str(recipe), "--deepspeed", str(ds)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "strategy: FSDP FULL_SHARD + CPU offload (parameters, gradients, optimizer step) on 1 process(es)"
    assert said in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    ran = {key: summary[key] for key in ("strategy", "sharding_strategy", "offload_params")}
    assert ran == {"strategy": "FSDP", "sharding_strategy": "FULL_SHARD", "offload_params": True}
    planned = run_shardtune(["estimate", "--config", str(recipe), "--config", str(ds), "--json"], tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    setup = json.loads(planned.stdout)["setup"]
    assert {key: setup[key] for key in ran} == ran
