"""The fake-tensor trace of the training step: against a real CPU step, against independent counts, and wired in.

The real step runs the same code (``trace_training_step(..., fake=False)``) on real CPU tensors with the same
tracker, so the comparison isolates what fake tensors change. Every traced number a test checks is compared
with a count made another way (parameter numels, AdamW's state layout) or with the real run.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.config import build_config
from shardtune.memory.trace import TraceUnsupported, trace_training_step
from tests.setups import CHECKED_AT_ARGS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny (2 layers, width 64) and a small (4 layers, width 256) Llama with the shared byte-level tokenizer."""
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    root = tmp_path_factory.mktemp("trace_models")
    tokenizer = make_tokenizer()
    return {"tiny": str(make_model_folder(root / "tiny", tokenizer=tokenizer)),
            "small": str(make_model_folder(root / "small", tokenizer=tokenizer, hidden_size=256,
                                           intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4))}


def config(model: str, **values):
    base = {"model_name_or_path": model, "output_dir": "unused", "dataset_name": "unused", "max_seq_len": 64,
            "per_device_train_batch_size": 2}
    return build_config([(base | values, {})])


GRID = [  # (model, world size, config values)
    ("tiny", 1, {}),
    ("small", 1, {"use_peft_lora": True, "bf16": True}),
    ("tiny", 1, {"bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2}),
    ("tiny", 2, {"distributed_type": "FSDP"}),
    ("small", 4, {"distributed_type": "FSDP", "bf16": True, "gradient_checkpointing": True}),
    ("small", 2, {"distributed_type": "FSDP", "fsdp_sharding_strategy": "SHARD_GRAD_OP", "use_peft_lora": True,
                  "bf16": True}),
    ("tiny", 2, {"distributed_type": "DDP"}),
    ("tiny", 2, {"distributed_type": "FSDP", "fp16": True}),
    ("tiny", 1, {"use_peft_lora": True, "use_4bit_quantization": True, "bf16": True,
                 "gradient_checkpointing": True}),
    # the template's tokens grow the embeddings (resized without the mean of fake values)
    ("tiny", 1, {"chat_template_format": "llama-3", "add_special_tokens": True}),
    ("tiny", 1, {"chat_template_format": "llama-3", "add_special_tokens": True, "use_peft_lora": True}),
    # PEFT deep-copies each module to save: the copies were made in a fake mode of their own, which the step refused
    ("tiny", 1, {"use_peft_lora": True, "lora_modules_to_save": ["lm_head"]}),
]


@pytest.mark.parametrize("model, world_size, values", GRID, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={x}" for k, x in v.items()) or "full-fp32")
def test_fake_trace_matches_the_real_cpu_step_within_5_percent(models, model, world_size, values):
    cfg = config(models[model], **values)
    fake = trace_training_step(cfg, world_size, target_device="cpu")
    real = trace_training_step(cfg, world_size, fake=False, target_device="cpu")
    assert real.peak_bytes > 0
    assert abs(fake.peak_bytes / real.peak_bytes - 1) <= 0.05, (fake.categories, real.categories)
    assert sum(fake.categories.values()) == fake.peak_bytes
    # A CPU job has no caching allocator to model (checked here, on every path of the grid, rather than by a
    # third trace in test_allocation_log_sees_every_tensor_the_tracker_counts_and_fake_replays_as_real)
    assert fake.reserved_bytes is None
    # QLoRA is traced with a formula stand-in for the NF4 weights: the trace says so.
    assert any("Params4bit" in n for n in fake.notes) == bool(values.get("use_4bit_quantization"))


def _param_bytes(model: str, dtype_bytes: int = 4) -> tuple[int, int]:
    """Bytes and number of the parameter tensors of ``model``, counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    params = list(net.parameters())
    return sum(p.numel() for p in params) * dtype_bytes, len(params)


def test_fsdp_shards_parameters_and_adamw_keeps_two_states_per_shard(models):
    total_bytes, num_tensors = _param_bytes(models["small"])
    results = {ws: trace_training_step(config(models["small"], distributed_type="FSDP"), ws) for ws in (2, 4)}
    for ws, result in results.items():
        sharded = result.categories["params_sharded"]
        # Each rank holds 1/ws of every parameter (FSDP pads dim 0 to a multiple of ws: at most a row each).
        assert total_bytes / ws <= sharded <= total_bytes / ws * 1.01
        # AdamW: exp_avg and exp_avg_sq per shard, plus one fp32 step counter per parameter tensor.
        assert result.categories["optimizer"] == 2 * sharded + 4 * num_tensors
    assert results[4].peak_bytes < results[2].peak_bytes


def test_hybrid_shard_shards_inside_a_node_only(models):
    total_bytes, _ = _param_bytes(models["tiny"])
    cfg = config(models["tiny"], distributed_type="FSDP", fsdp_sharding_strategy="HYBRID_SHARD")
    result = trace_training_step(cfg, 4, num_nodes=2)
    assert total_bytes / 2 <= result.categories["params_sharded"] <= total_bytes / 2 * 1.01


def test_fp16_traces_the_optimizer_states_the_loss_scaler_steps_into(models):
    # The CPU job (foreach AdamW): fused AdamW with FSDP's loss scaler fails a shape check under fake tensors.
    result = trace_training_step(config(models["tiny"], distributed_type="FSDP", fp16=True), 2, target_device="cpu")
    _, num_tensors = _param_bytes(models["tiny"])
    assert result.categories["optimizer"] == 2 * result.categories["params_sharded"] + 4 * num_tensors


def test_ddp_adds_one_bucket_copy_of_the_trainable_gradients(models):
    total_bytes, _ = _param_bytes(models["tiny"])
    single = trace_training_step(config(models["tiny"]), 1)
    ddp = trace_training_step(config(models["tiny"], distributed_type="DDP"), 2)
    assert ddp.categories["ddp_gradient_buckets"] == total_bytes
    assert ddp.peak_bytes == single.peak_bytes + total_bytes
    assert any("reducer" in n for n in ddp.notes)
    # LoRA: the buckets hold the adapters' gradients (fp32), not the frozen weights', counted here by PEFT itself
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        net = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models["tiny"])),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for p in net.parameters() if p.requires_grad) * 4
    lora = trace_training_step(config(models["tiny"], distributed_type="DDP", use_peft_lora=True, lora_r=4,
                                      lora_target_modules="q_proj,v_proj"), 2)
    assert 0 < lora.categories["ddp_gradient_buckets"] == adapters < total_bytes


def test_modules_report_each_decoder_layer_under_fsdp(models):
    result = trace_training_step(config(models["small"], distributed_type="FSDP", bf16=True), 2)
    layers = [m for m, _ in result.modules if m.split(".")[-1].isdigit()]
    assert len(layers) == 4
    assert all(0 < b <= result.peak_bytes for _, b in result.modules)


def test_model_parallel_cannot_be_traced_and_estimate_falls_back_saying_why(models):
    from shardtune.memory.trace_setup import trace_or_formula

    cfg = config(models["tiny"], distributed_type="MP", mp_devices="cpu,cpu")
    with pytest.raises(TraceUnsupported, match="model parallel"):
        trace_training_step(cfg, 2)
    out = trace_or_formula(cfg, 2)
    assert out["source"] == "formula" and "model parallel" in out["fallback_reason"]
    assert out["peak_bytes"] > 0
    offload = config(models["tiny"], distributed_type="FSDP", fsdp_offload_params=True)
    out = trace_or_formula(offload, 2)
    assert out["source"] == "formula" and "CPU offload" in out["fallback_reason"]


@pytest.fixture
def traced_once(monkeypatch) -> dict:
    """``trace_or_formula`` run once per job: CLI calls that differ only in what they do with the trace (--json or
    text, the GPU's size) share one trace of the same step. That two traces of one job agree is
    test_train_dry_run_traces_the_configured_job's check (the CLI's trace against ``trace_training_step``)."""
    import copy

    from shardtune.memory import trace_setup

    done, real = {}, trace_setup.trace_or_formula

    def once(cfg, world_size: int, *, num_nodes: int = 1) -> dict:
        key = (repr(cfg), world_size, num_nodes)
        if key not in done:
            done[key] = real(cfg, world_size, num_nodes=num_nodes)
        return copy.deepcopy(done[key])  # the caller adds its own keys to the dict

    monkeypatch.setattr(trace_setup, "trace_or_formula", once)
    return done


def test_estimate_trace_json_and_text(models, capsys, traced_once):
    from shardtune.cli import main

    args = ["estimate", models["tiny"], *CHECKED_AT_ARGS, "--method", "lora", "--num-gpus", "2", "--strategy", "fsdp",
            "--seq-len", "64", "--batch-size", "2", "--trace"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    traced = data["trace"]
    assert traced["source"] == "trace" and traced["world_size"] == 2 and traced["strategy"] == "FSDP FULL_SHARD"
    assert traced["trainable_parameters"] == data["trainable_parameters"]
    assert sum(traced["categories"].values()) == traced["peak_bytes"]
    assert traced["reserved_bytes"] > traced["peak_bytes"]  # an estimate is for a GPU: the allocator's view too
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"traced peak per GPU: {traced['peak_bytes'] / 2**30:.3f} GiB of tensors  (FSDP FULL_SHARD, world size 2" \
        in out
    assert f"reserved from the GPU: {traced['reserved_bytes'] / 2**30:.3f} GiB" in out
    assert len(traced_once) == 1  # both printed the one job


def test_estimate_trace_rejects_setups_the_trainer_cannot_run(models, capsys):
    from shardtune.cli import main

    # Pure bf16 runs AdamW only (its updates are stochastically rounded); 8-bit AdamW would round them away.
    assert main(["estimate", models["tiny"], "--pure-bf16", "--optimizer", "adamw-8bit", "--trace"]) == 2
    assert "--pure-bf16 with --optimizer adamw_8bit" in capsys.readouterr().err


def test_train_dry_run_traces_the_configured_job(models, tmp_path, capsys, monkeypatch):
    from shardtune.cli.train import run
    from shardtune.memory import trace_setup

    # The printed peak has 1 MiB steps, coarser than this job's parts (a 96-token trace of it printed the same
    # 0.002 GiB): the traced bytes themselves are compared.
    traced, real = [], trace_setup.trace_or_formula

    def keep(*args, **kwargs):
        traced.append(real(*args, **kwargs))
        return traced[-1]

    monkeypatch.setattr(trace_setup, "trace_or_formula", keep)
    argv = ["--model_name_or_path", models["tiny"], "--output_dir", str(tmp_path / "out"), "--dataset_name", "x",
            "--max_seq_len", "64", "--per_device_train_batch_size", "2", "--distributed_type", "FSDP",
            "--num_processes", "2", "--dry_run", "True"]
    assert run(argv) == 0
    out = capsys.readouterr().out
    expected = trace_training_step(config(models["tiny"], distributed_type="FSDP", num_processes=2), 2)
    [result] = traced
    assert (result["source"], result["world_size"], result["strategy"]) == ("trace", 2, "FSDP FULL_SHARD")
    assert (result["peak_bytes"], result["categories"]) == (expected.peak_bytes, expected.to_dict()["categories"])
    assert f"traced peak per GPU: {expected.peak_bytes / 2**30:.3f} GiB" in out
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_predict_peak_bytes_is_the_trace_for_this_machine(models):
    from shardtune.memory.trace import predict_peak_bytes

    cfg = config(models["tiny"], use_peft_lora=True)
    target = "cuda" if torch.cuda.is_available() else "cpu"
    traced = trace_training_step(cfg, 1, target_device=target)
    # On a GPU the check compares with torch.cuda.max_memory_reserved: the modelled reserved memory.
    assert predict_peak_bytes(cfg, 1) == (traced.reserved_bytes if target == "cuda" else traced.peak_bytes)


def test_batch_plan_keeps_the_requested_global_batch():
    from shardtune.memory.batch_plan import plan_batch
    from tests.setups import checked_setup

    asked = checked_setup(num_gpus=2, distributed_type="DDP", per_device_train_batch_size=4,
                          gradient_accumulation_steps=8)  # global 64
    for fits in (1, 3, 5, 16, 17, 100):
        plan = plan_batch(fits, asked)
        assert plan.micro_batch_size <= fits
        assert plan.global_batch_size == 64  # 32 per GPU has divisors 1, 2, 4, 8, 16, 32
        assert plan.micro_batch_size * 2 > min(fits, 32)  # never less than half of what fits
    # 7 per GPU, 5 fit, 7 is prime: two micro-batches, spread evenly (4 x 2 = 8, not 5 x 2 = 10).
    odd = plan_batch(5, checked_setup(num_gpus=1, per_device_train_batch_size=7))
    assert (odd.micro_batch_size, odd.gradient_accumulation_steps, odd.global_batch_size) == (4, 2, 8)
    prime = plan_batch(29, checked_setup(num_gpus=1, per_device_train_batch_size=37))
    assert (prime.micro_batch_size, prime.gradient_accumulation_steps, prime.global_batch_size) == (19, 2, 38)
    # PP with 4 pipeline micro-batches given: micro-batches stay multiples of 4 (train refuses 11); MP and PP
    # send one batch through all their GPUs, so the global batch is not multiplied by them.
    pp = plan_batch(11, checked_setup(num_gpus=2, distributed_type="PP", per_device_train_batch_size=44)
                    .with_(pipeline_microbatches=4))
    assert pp.micro_batch_size % 4 == 0 and pp.micro_batch_size <= 11 and pp.global_batch_size >= 44
    assert (pp.micro_batch_size, pp.gradient_accumulation_steps, pp.requested_global_batch_size) == (8, 6, 44)
    mp = plan_batch(17, checked_setup(num_gpus=4, distributed_type="MP", per_device_train_batch_size=8))
    assert (mp.micro_batch_size, mp.global_batch_size, mp.requested_global_batch_size) == (8, 8, 8)


def test_find_batch_size_and_emit_config_write_a_recipe_the_trainer_reads(tmp_path, capsys):
    from shardtune.cli import main
    from shardtune.config import load_train_config

    path = tmp_path / "recipe.yaml"
    assert main(["estimate", "llama-3.1-8b", *CHECKED_AT_ARGS, "--method", "lora", "--num-gpus", "2", "--strategy",
                 "ddp", "--batch-size", "4", "--gradient-accumulation-steps", "8", "--find-batch-size",
                 "--emit-config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = data["batch_plan"]
    assert plan["largest_fitting_micro_batch"] == data["recommendation"]["max_batch_size"]
    cfg = load_train_config([str(path)])
    assert cfg.model.model_name_or_path == "meta-llama/Llama-3.1-8B"
    assert (cfg.run.per_device_train_batch_size, cfg.run.gradient_accumulation_steps) == (
        plan["micro_batch_size"], plan["gradient_accumulation_steps"])
    assert cfg.distributed.distributed_type == "DDP" and cfg.lora.use_peft_lora


def test_find_batch_size_with_the_setup_left_open_picks_the_setup_for_the_micro_batch_it_finds(tmp_path, capsys):
    """A global batch only CPU offload holds as one micro-batch: the search splits it into micro-batches one GPU
    holds, and the report and the recipe name that setup, not offload (the walkthrough found both disagreeing).
    The recommendation without the search does the same now (a smaller micro-batch before offload)."""
    from shardtune.cli import main
    from shardtune.config import load_train_config

    path = tmp_path / "recipe.yaml"
    common = ["estimate", "llama-3.1-8b", *CHECKED_AT_ARGS, "--method", "lora", "--gpu", "a100-80gb", "--json"]
    assert main([*common, "--batch-size", "64"]) == 0
    as_one = json.loads(capsys.readouterr().out)["recommendation"]
    # 64 sequences at once need offload; the recommendation splits them into micro-batches one GPU holds.
    assert "at micro-batch 64 only FSDP FULL_SHARD + CPU offload holds it" in as_one["reason"]
    assert not as_one["offload_params"] and as_one["strategy"] == "NO" and 64 % as_one["batch_size"] == 0
    assert main([*common, "--batch-size", "64", "--find-batch-size", "--emit-config", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    rec, plan = data["recommendation"], data["batch_plan"]
    assert not rec["offload_params"] and rec["strategy"] == "NO"
    assert plan["global_batch_size"] == 64 and plan["micro_batch_size"] == rec["batch_size"] <= rec["max_batch_size"]
    assert plan["largest_fitting_micro_batch"] == rec["max_batch_size"]
    cfg = load_train_config([str(path)])
    assert not cfg.distributed.fsdp_offload_params and cfg.distributed.distributed_type == "NO"
    assert cfg.run.per_device_train_batch_size * cfg.run.gradient_accumulation_steps == 64


def test_find_batch_size_reports_the_batch_it_found_with_the_strategy_named(capsys):
    """With the strategy named, --find-batch-size's tables and JSON are of the micro-batch found, which fits (they
    said "nothing fits" at the asked one, beside the plan that did); the plan names the global batch asked."""
    from shardtune.cli import main

    assert main(["estimate", "llama-3.1-8b", *CHECKED_AT_ARGS, "--method", "full", "--num-gpus", "8", "--strategy",
                 "FSDP", "--batch-size", "128", "--find-batch-size", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = data["batch_plan"]
    assert data["fits"] and data["setup"]["batch_size"] == plan["micro_batch_size"] < 128
    assert plan["requested_global_batch_size"] == 128 * 8 == plan["global_batch_size"]
    assert plan["micro_batch_size"] <= plan["largest_fitting_micro_batch"]
    assert main(["estimate", "llama-3.2-1b", *CHECKED_AT_ARGS, "--method", "lora", "--gpu", "rtx4090",
                 "--batch-size", "37", "--find-batch-size", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_plan"]["requested_global_batch_size"] == 37


def test_find_batch_size_plans_from_what_fits_while_it_accumulates(tmp_path, capsys):
    """A global batch that needs accumulation: the micro-batch found fits at the accumulation it comes with. It was
    searched without accumulation (45 for Mistral-7B under SHARD_GRAD_OP on 8 H100s), so 88 per GPU became 44 x 2,
    which the report beside it said does not fit (accumulating keeps the gradients between micro-batches), and
    --emit-config refused the plan --find-batch-size had just made."""
    from shardtune.cli import main

    path = tmp_path / "recipe.yaml"
    common = ["estimate", "mistral-7b", "--num-gpus", "8", "--gpu", "h100-80gb", "--json", "--find-batch-size"]
    for setup in (["--strategy", "FSDP", "--sharding-strategy", "SHARD_GRAD_OP"], []):
        assert main([*common, *setup, "--batch-size", "88", "--emit-config", str(path)]) == 0
        data = json.loads(capsys.readouterr().out)
        plan = data["batch_plan"]
        assert plan["gradient_accumulation_steps"] > 1 and plan["global_batch_size"] == 88 * 8
        assert data["fits"] and data["setup"]["batch_size"] == plan["micro_batch_size"]
        # "at most N fits" is what the table and the recommendation say fits at this accumulation.
        row = next(s for s in data["strategies"] if s["fits"] and s["strategy"] == data["setup"]["strategy"]
                   and s["sharding_strategy"] == data["setup"]["sharding_strategy"]
                   and s["offload_params"] == data["setup"]["offload_params"])
        assert plan["largest_fitting_micro_batch"] == row["max_batch_size"] == data["recommendation"]["max_batch_size"]
        assert plan["micro_batch_size"] <= plan["largest_fitting_micro_batch"]
        path.unlink()


def test_find_batch_size_leaves_the_estimates_error_to_spare_where_a_smaller_micro_batch_can(capsys):
    """LoRA of Llama-3.1-8B on an RTX 4090 at 8 x 4096 tokens: --find-batch-size took micro-batch 2, the largest
    that fits, and the report beside it said "tight" (0.23 GiB to spare of 24, within the estimate's 8.6% error)
    and advised micro-batch 1. The plan now takes the largest micro-batch with more to spare than that error, and
    the tightest fit only where nothing leaves more."""
    from shardtune.cli import main
    from shardtune.memory.formula import MEASURED_ERROR

    common = ["estimate", "llama-3.1-8b", "--method", "lora", "--seq-len", "4096", "--batch-size", "8",
              "--find-batch-size", "--json"]
    plans = {}
    for card in (["--gpu", "RTX 4090"], ["--gpu-memory", "21"]):
        assert main([*common, *card]) == 0
        data = json.loads(capsys.readouterr().out)
        plan, spare = data["batch_plan"], data["spare_bytes"]
        plans[card[1]] = (plan["micro_batch_size"], plan["gradient_accumulation_steps"],
                          plan["largest_fitting_micro_batch"], plan["roomy_micro_batch"], data["tight"])
        # the report's verdict is the estimate's own: tight exactly when less than its error is left
        assert data["tight"] == (spare < MEASURED_ERROR * data["per_gpu"]["total"])
    assert plans == {"RTX 4090": (1, 8, 2, 1, False), "21": (1, 8, 1, 0, True)}
    assert main([*common[:-1], "--gpu", "RTX 4090"]) == 0
    assert "(asked 8; at most 2 fits per GPU, 1 with more to spare than the estimate's error (8.6%))" in \
        capsys.readouterr().out.replace("\n", " ")


RESERVED_GRID = [("small", 1, {"bf16": True, "gradient_checkpointing": True}),
                 ("small", 1, {"use_peft_lora": True, "bf16": True, "gradient_accumulation_steps": 2}),
                 ("small", 2, {"distributed_type": "FSDP", "bf16": True})]


@pytest.mark.parametrize("model, world_size, values", RESERVED_GRID,
                         ids=lambda v: str(v) if not isinstance(v, dict)
                         else ",".join(f"{k}={x}" for k, x in v.items()))
def test_allocation_log_sees_every_tensor_the_tracker_counts_and_fake_replays_as_real(models, model, world_size,
                                                                                      values, monkeypatch):
    """The allocator model is fed a complete stream: its live bytes peak where the tracker's peak is, and the
    fake trace's stream reserves what the real step's stream reserves."""
    import shardtune.memory.trace as trace
    from shardtune.memory.allocator import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, CachingAllocatorModel
    from shardtune.memory.trace_tracker import AllocationLog

    logs = []

    class Recorded(AllocationLog):
        def __init__(self):
            super().__init__()
            logs.append(self)

    monkeypatch.setattr(trace, "AllocationLog", Recorded)
    cfg = config(models[model], **values)
    fake = trace_training_step(cfg, world_size, target_device="cuda")
    real = trace_training_step(cfg, world_size, fake=False, target_device="cuda")
    for result, log in zip((fake, real), logs):
        live: dict[int, int] = {}
        peak = 0
        for key, nbytes, _stream in log.events:
            live.pop(key, None)
            if nbytes:
                live[key] = nbytes
            peak = max(peak, sum(live.values()))
        assert peak == result.peak_bytes  # the tracker measures the last step; the log covers both
        replayed = CachingAllocatorModel().replay(log.events)
        assert result.reserved_bytes == replayed.peak_reserved + CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES
        assert replayed.peak_reserved >= replayed.peak_allocated >= result.peak_bytes
    assert fake.reserved_bytes == real.reserved_bytes
    # FSDP2 allocates its all-gather and reduce-scatter buffers on streams of their own; nothing else does.
    streams = {stream for log in logs for _, nbytes, stream in log.events if nbytes}
    assert streams == ({0, 1, 2} if values.get("distributed_type") == "FSDP" else {0})
    assert any("caching allocator" in note for note in fake.notes)


def test_estimate_trace_judges_the_fit_by_the_traced_reserved_memory(models, capsys, traced_once):
    """On a GPU sized between the formula's figure and the trace's reserved memory, the trace's verdict is shown;
    where the formula says it fits and the trace says it does not, with a warning. On this small model the formula
    is the larger (its fitted reserve starts at 160 MiB), so the warning is checked on the same result with the
    two figures the other way round."""
    from shardtune.cli import main
    from shardtune.memory.trace_setup import render_text

    args = ["estimate", models["small"], *CHECKED_AT_ARGS, "--method", "lora", "--seq-len", "256", "--batch-size", "4",
            "--strategy", "NO", "--trace"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    formula = data["nvidia_smi_bytes"]  # the formula's total and the CUDA context
    traced = data["trace"]["reserved_bytes"] + data["trace"]["cuda_context_bytes"]
    assert data["trace"]["cuda_context_bytes"] == data["cuda_context"]
    assert formula != traced
    between = (formula + traced) / 2 / 2**30
    assert main([*args, "--gpu-memory", f"{between:.6f}"]) == 0
    out = capsys.readouterr().out
    trace_fits = traced < formula
    assert f"by the trace it {'fits' if trace_fits else 'does NOT fit'}: {traced / 2**30:.2f} GiB with the CUDA " \
           "context" in out
    warning = "warning: the analytic estimate says it fits and the trace says it does not"
    assert (warning in out) == (not trace_fits)
    assert main([*args, "--gpu-memory", f"{traced / 2**30 + 0.01:.6f}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["trace"]
    assert result["fits"] is True
    # a GPU that holds the traced tensors' peak but not the memory reserved for them: the reserved memory decides
    allocated = data["trace"]["peak_bytes"] + data["trace"]["cuda_context_bytes"]
    assert traced - allocated > 2**20, (allocated, traced)
    assert main([*args, "--gpu-memory", f"{(allocated + traced) / 2 / 2**30:.6f}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["fits"] is False
    assert len(traced_once) == 1  # every --gpu-memory above judged the one job
    # the trace above the formula on a GPU between them: its verdict, and the warning
    lower = traced - result["cuda_context_bytes"] - 2**20
    result |= {"fits": False, "gpu_memory_bytes": traced - 2**19}
    text = render_text(result, formula_peak=lower)
    assert f"by the trace it does NOT fit: {traced / 2**30:.2f} GiB with the CUDA context" in text
    assert warning in text
    assert warning not in render_text(result, formula_peak=traced)
