"""The estimate command as a user runs it: JSON contract, tables, and one-line errors with exit code 2."""

import json
import re
import subprocess
import sys

import pytest

from shardtune.cli import main
from tests.setups import CHECKED_AT_ARGS

DONE_WHEN = ["llama-2-70b", "--method", "lora", "--num-gpus", "8", "--gpu", "h100-80gb", "--batch-size", "8",
             "--seq-len", "2048", "--gradient-checkpointing", "--mixed-precision", "bf16"]


def run_json(capsys, args):
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_carries_the_contract_fields(capsys):
    out = run_json(capsys, DONE_WHEN)
    assert out["parameters"] == 68_976_648_192
    assert out["trainable_parameters"] == 103_546_880  # LoRA r=8 on every linear layer of the 80 decoder layers
    per_gpu = out["per_gpu"]
    assert set(per_gpu) == {"params", "grads", "optimizer", "activations", "overhead", "total"}
    parts = per_gpu["params"] + per_gpu["grads"] + per_gpu["optimizer"] + per_gpu["activations"] + per_gpu["overhead"]
    assert per_gpu["total"] == parts == sum(i["bytes"] for i in out["items"])
    # What nvidia-smi would show is the allocator's peak plus the CUDA context, and that is what must fit the GPU.
    assert out["nvidia_smi_bytes"] == per_gpu["total"] + out["cuda_context"] and out["cuda_context"] > 0
    assert out["fits"] is (out["nvidia_smi_bytes"] <= out["gpu"]["memory_bytes"]) is True
    assert out["recommendation"]["strategy"] == "FSDP" and out["recommendation"]["max_batch_size"] >= 8
    # 70B in bf16 is 128 GiB: a replica cannot fit an 80 GB GPU, so DDP must be ruled out.
    ddp = next(s for s in out["strategies"] if s["strategy"] == "DDP")
    assert ddp["fits"] is False and ddp["per_gpu"]["params"] > 128 * 2**30


def test_sharding_across_more_gpus_shrinks_model_states(capsys):
    # without checkpointing both peak in the same phase, so each item is the same tensors, sharded 2 or 8 ways
    two = run_json(capsys, ["llama-3-8b", "--num-gpus", "2", "--strategy", "fsdp", "--no-gradient-checkpointing"])
    eight = run_json(capsys, ["llama-3-8b", "--num-gpus", "8", "--strategy", "fsdp", "--no-gradient-checkpointing"])
    assert two["peak_phase"] == eight["peak_phase"] == "backward (last layer)"
    two, eight = two["per_gpu"], eight["per_gpu"]
    for key in ("params", "optimizer"):
        assert eight[key] == pytest.approx(two[key] / 4, rel=1e-6)
    # The only gradient then is the LM head's, unsharded (bf16, 128256 x 4096) until the root's reduce-scatter
    # after the whole backward: the same on 2 GPUs and on 8.
    assert eight["grads"] == two["grads"] == 128256 * 4096 * 2
    assert eight["activations"] == two["activations"]  # each GPU still runs its own micro-batch


def test_full_finetune_model_states_are_16_bytes_per_parameter(capsys):
    # fp32 weights (4), fp32 gradients (4), AdamW's two fp32 states (8): ZeRO paper, sec. 3.1.
    out = run_json(capsys, ["llama-2-7b", "--strategy", "NO", "--gpu-memory", "200", *CHECKED_AT_ARGS])
    phases = out["phases"]
    assert out["peak_phase"] in phases
    step = phases["optimizer step"]
    assert step == pytest.approx(16 * 6_738_415_616, rel=1e-6)


def test_recommends_ddp_when_a_replica_fits(capsys):
    out = run_json(capsys, ["llama-3.2-1b", "--num-gpus", "4", "--method", "lora", *CHECKED_AT_ARGS])
    assert out["recommendation"]["strategy"] == "DDP"


@pytest.mark.parametrize("argv, strategy, last_resort", [
    (["llama-3.1-8b", "--method", "lora", "--gpu", "rtx4090"], "NO", ["--strategy", "FSDP", "--offload-params"]),
    (["llama-3.1-70b", "--method", "lora", "--num-gpus", "8", "--gpu", "a100-40gb"], "FSDP", ["--strategy", "MP"]),
])
def test_a_smaller_micro_batch_is_recommended_before_offload_or_model_parallel(argv, strategy, last_resort, capsys):
    """The asked micro-batch (train's default 8) fits only with CPU offload or model parallel, slower than the
    same global batch in smaller micro-batches on the GPUs: the estimate recommended offload for 8B LoRA on one
    RTX 4090 and model parallel for 70B LoRA on 8 A100-40GB (6.5x the time). The largest micro-batch that divides
    the 8 rows and fits is recommended, with the accumulation that keeps the global batch."""
    out = run_json(capsys, argv)
    rec, setup = out["recommendation"], out["setup"]
    assert (rec["strategy"], rec["offload_params"], out["fits"]) == (strategy, False, True)
    micro = setup["batch_size"]
    assert micro < 8 and 8 % micro == 0 and setup["gradient_accumulation_steps"] == 8 // micro
    assert f"at micro-batch {micro} x {8 // micro} accumulation steps" in rec["reason"]
    # The asked micro-batch fits only as a last resort; the next larger divisor of 8 does not fit this strategy.
    assert run_json(capsys, [*argv, *last_resort])["fits"]
    named = ["--strategy", strategy] + (["--sharding-strategy", rec["sharding_strategy"]] if strategy == "FSDP" else [])
    assert not run_json(capsys, [*argv, *named])["fits"]
    assert not run_json(capsys, [*argv, *named, "--batch-size", str(2 * micro)])["fits"]


def test_what_would_fit_when_nothing_does(capsys):
    # batch 4, no gradient checkpointing
    out = run_json(capsys, ["llama-3.1-70b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "4",
                            "--no-gradient-checkpointing"])
    rec = out["recommendation"]
    assert rec["fits"] is False and out["fits"] is False
    # Micro-batch 2 with CPU offload fits, checkpointed (the 2.1B embedding and head parameters are gathered,
    # activations are small), the largest below the asked 4 that does; checkpointing was off, so the suggestion
    # turns it on, and keeps the global batch of 4 rows.
    assert rec["suggestions"][0].startswith("batch size 2 and --gradient-checkpointing with FSDP FULL_SHARD + CPU "
                                            "offload")
    assert rec["suggestions"][0].endswith("--gradient-accumulation-steps 2")
    offloaded = ["llama-3.1-70b", "--gpu", "rtx4090", "--strategy", "FSDP", "--offload-params", *CHECKED_AT_ARGS]
    assert run_json(capsys, [*offloaded, "--batch-size", "2"])["fits"]
    assert not run_json(capsys, [*offloaded, "--batch-size", "3"])["fits"]
    # Checkpointed already, as asked: the smaller micro-batch with offload is the recommendation itself, keeping
    # the global batch (nothing holds micro-batch 4; offload, the last resort, holds 2).
    out = run_json(capsys, ["llama-3.1-70b", "--gpu", "rtx4090", *CHECKED_AT_ARGS, "--batch-size", "4"])
    rec = out["recommendation"]
    assert (rec["fits"], rec["strategy"], rec["offload_params"], rec["batch_size"]) == (True, "FSDP", True, 2)
    assert out["setup"]["gradient_accumulation_steps"] == 2 and "at micro-batch 4 no setup holds it" in rec["reason"]
    # the accumulation the reason names is the recommendation's own figure in --json (it was left out)
    assert rec["gradient_accumulation_steps"] == 2 and "at micro-batch 2 x 2 accumulation steps" in rec["reason"]
    # What offload asks of the host, which the estimate cannot see, is said beside it.
    host = out["cpu_bytes_per_node"] / 2**30
    assert host > 100 and f"It keeps {host:,.0f} GiB per node in host RAM: check that each node" in rec["reason"]


def test_what_would_fit_names_each_lighter_method_as_it_would_run(capsys):
    """Full fine-tuning of Llama-3.1-70B on two RTX 4090s without checkpointing: the one change offered was a
    smaller micro-batch with checkpointing and CPU offload, 1 TB of host RAM; LoRA and QLoRA were tried only as
    asked (micro-batch 8, no checkpointing), so the QLoRA that fits with 38 GiB of host RAM went unsaid. Each lighter
    method is now offered as it would run, and its figure is what estimating that job says."""
    job = ["llama-3.1-70b", "--gpu", "rtx4090", "--num-gpus", "2", "--no-gradient-checkpointing"]
    rec = run_json(capsys, job)["recommendation"]
    assert not rec["fits"]
    qlora = next(line for line in rec["suggestions"] if line.startswith("--method qlora"))
    assert qlora.startswith("--method qlora and --gradient-checkpointing with FSDP FULL_SHARD + CPU offload at "
                            "micro-batch 4 x 2 accumulation steps (")
    held = run_json(capsys, ["llama-3.1-70b", "--gpu", "rtx4090", "--num-gpus", "2", "--method", "qlora",
                             "--gradient-checkpointing", "--strategy", "FSDP", "--offload-params", "--batch-size", "4",
                             "--gradient-accumulation-steps", "2"])
    assert held["fits"] and qlora.endswith(f"({held['nvidia_smi_bytes'] / 2**30:.1f} GiB, "
                                           f"{held['cpu_bytes_per_node'] / 2**30:,.0f} GiB of host RAM per node)")
    assert any(line.startswith("--method lora and --gradient-checkpointing with ") for line in rec["suggestions"])


def test_what_would_fit_on_a_card_without_bf16_names_fp16(capsys):
    """A T4 trains in fp32 by default; fp16 mixed precision halves the activations, and was never among the
    changes offered where nothing fits. Its figure is what estimating that job says."""
    job = ["llama-3.1-8b", "--gpu", "t4", "--method", "qlora", "--batch-size", "1", "--no-gradient-checkpointing",
           "--seq-len", "1024"]
    out = run_json(capsys, job)
    assert out["fits"] is False and out["setup"]["mixed_precision"] == "no"
    half = run_json(capsys, [*job, "--mixed-precision", "fp16", "--strategy", "NO"])
    assert half["fits"]
    gib = (half["per_gpu"]["total"] + half["cuda_context"]) / 2**30
    assert f"--mixed-precision fp16 with single GPU ({gib:.1f} GiB)" in out["recommendation"]["suggestions"]


def test_a_last_resort_names_the_lighter_methods_that_fit_without_it(capsys):
    """Full fine-tuning of Llama-3.1-8B on one RTX 4090 (train's defaults: micro-batch 8 x 2048 tokens) fits only
    with CPU offload, 120 GiB of host RAM and every step across PCIe. Whether LoRA or QLoRA would fit on the GPU
    alone is the question to answer next: each is named with its setup, and its figures are what estimating that
    job says. A recommendation that needs no last resort names none."""
    job = ["llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--mixed-precision", "bf16"]
    rec = run_json(capsys, job)["recommendation"]
    assert (rec["fits"], rec["offload_params"]) == (True, True)
    lora, qlora = rec["suggestions"]
    assert lora.startswith("--method lora with single GPU at micro-batch 4 x 2 accumulation steps, the same rows")
    on_gpu = [*job, "--strategy", "NO"]
    assert not run_json(capsys, [*on_gpu, "--method", "lora"])["fits"]  # 8 rows at a time do not fit
    held = run_json(capsys, [*on_gpu, "--method", "lora", "--batch-size", "4", "--gradient-accumulation-steps", "2"])
    assert held["fits"] and lora.endswith(f"({held['nvidia_smi_bytes'] / 2**30:.1f} GiB)")
    held = run_json(capsys, [*on_gpu, "--method", "qlora"])
    assert held["fits"] and qlora == (f"--method qlora with single GPU ({held['nvidia_smi_bytes'] / 2**30:.1f} GiB), "
                                      f"micro-batch up to {held['recommendation']['max_batch_size']}")
    assert run_json(capsys, [*job, "--method", "qlora"])["recommendation"]["suggestions"] == []
    assert main(["estimate", *job]) == 0
    assert "Without CPU offload, a lighter method fits: - --method lora with single GPU" in " ".join(
        capsys.readouterr().out.split())


def test_table_output_names_the_recommendation(capsys):
    assert main(["estimate", *DONE_WHEN]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "68,976,648,192" in text
    # FULL_SHARD is named in the table's title and rows whatever is recommended: the recommendation is the line
    # and the starred row (a replica of 70B in bf16, 128 GiB, fits no 80 GB GPU, so DDP is never it).
    assert "Recommended: FSDP FULL_SHARD:" in text and " FSDP FULL_SHARD * " in text
    # the one starred row of the side-by-side table (a star on every row would name nothing)
    starred = [line.split(" *")[0].strip() for line in out.splitlines() if re.search(r" \*\s+\d", line)]
    assert starred == ["FSDP FULL_SHARD"], starred


@pytest.mark.parametrize("args,message", [
    (["llama-2-7x"], "did you mean 'llama-2-7b'"),
    (["llama-2-7b", "--num-gpus", "0"], "--num-gpus must be a whole number >= 1"),
    (["llama-2-7b", "--sharding-strategy", "FULL_SHARDING"], "unknown sharding strategy"),
    (["llama-2-7b", "--method", "qlor"], "Did you mean 'qlora'"),
    (["llama-2-7b", "--gpu", "h100"], "unknown GPU"),
    # The fix names the option that asked for more than one GPU (it said "--num-gpus 1" where that was already 1).
    (["llama-2-7b", "--strategy", "NO", "--num-nodes", "2"], "--num-gpus x --num-nodes is 2: use another strategy, "
                                                              "or --num-nodes 1."),
    (["llama-2-7b", "--strategy", "NO", "--num-gpus", "2", "--num-nodes", "2"], "or --num-gpus 1 --num-nodes 1."),
    # The estimator's earlier word for one GPU is no strategy's name; the strategy it meant is suggested.
    (["llama-2-7b", "--strategy", "single"], "unknown strategy 'single': choose one of NO, DDP, FSDP, MP, PP. Did "
                                             "you mean 'NO'?"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "shardtune", "estimate", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreadable_config_names_file_and_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    proc = subprocess.run([sys.executable, "-m", "shardtune", "estimate", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "line 3" in proc.stderr and str(bad) in proc.stderr


def test_zero_stage_names_map_to_fsdp(capsys):
    zero3 = run_json(capsys, ["llama-3-8b", "--num-gpus", "8", "--strategy", "zero3"])
    assert zero3["setup"]["strategy"] == "FSDP" and zero3["setup"]["sharding_strategy"] == "FULL_SHARD"
    zero2 = run_json(capsys, ["llama-3-8b", "--num-gpus", "8", "--strategy", "fsdp", "--sharding-strategy", "zero2"])
    assert zero2["setup"]["sharding_strategy"] == "SHARD_GRAD_OP"


def test_a_zero_stage_says_what_it_runs_as(capsys):
    """--strategy zero1 was estimated as FSDP SHARD_GRAD_OP without a word, where a DeepSpeed file's ZeRO-1 says at
    start that it runs so (FSDP has no optimizer-only sharding): the same line is said on stderr."""
    assert main(["estimate", "llama-3-8b", "--num-gpus", "8", "--strategy", "zero1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["setup"]["sharding_strategy"] == "SHARD_GRAD_OP"
    assert captured.err == ("note: --strategy zero1: ZeRO-1 -> FSDP SHARD_GRAD_OP (ZeRO-1 shards only optimizer "
                            "states; SHARD_GRAD_OP also shards gradients: less memory, same traffic)\n")


def test_a_zero_stage_beside_another_sharding_strategy_is_refused_naming_both(capsys):
    """--strategy zero3 --sharding-strategy SHARD_GRAD_OP estimated FULL_SHARD, the sharding option dropped without
    a word; the same sharding spelled either way is still taken."""
    same = run_json(capsys, ["llama-3-8b", "--num-gpus", "8", "--strategy", "zero2", "--sharding-strategy",
                             "shard_grad_op"])
    assert same["setup"]["sharding_strategy"] == "SHARD_GRAD_OP"
    assert main(["estimate", "llama-3-8b", "--num-gpus", "8", "--strategy", "zero3", "--sharding-strategy",
                 "SHARD_GRAD_OP"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shardtune estimate: error: --sharding-strategy SHARD_GRAD_OP contradicts --strategy zero3, which is FSDP "
        "FULL_SHARD; give one of them: --strategy FSDP --sharding-strategy SHARD_GRAD_OP, or --strategy zero3 alone")


def test_list_prints_the_catalog(capsys):
    assert main(["estimate", "--list"]) == 0
    assert "llama-3.1-405b" in capsys.readouterr().out


def test_list_takes_json_and_refuses_an_estimate_beside_it(capsys):
    """--list --json printed the table (--json did nothing), and --list llama-3.1-8b --method lora printed the
    catalog, the estimate asked beside it dropped without a word."""
    from shardtune import catalog

    assert main(["estimate", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in listed] == catalog.names()
    assert all(row["parameters"] == catalog.metadata(row["name"])["published_parameters"]
               and row["hf_id"] == catalog.metadata(row["name"])["hf_id"] for row in listed)
    assert main(["estimate", "--list", "llama-3.1-8b", "--method", "lora"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shardtune estimate: error: --list prints the catalog and estimates nothing, so MODEL llama-3.1-8b, --method "
        "would do nothing beside it; run 'shardtune estimate --list' (--json for JSON) alone, then the estimate "
        "without --list")


def test_estimate_takes_a_catalog_models_hub_id_as_its_name(capsys):
    """--list prints the hub ids and --emit-config writes them: estimate accepts them back, in any case; and the
    catalog names too, as a model card spells them (Llama-3.1-8B was refused with "did you mean 'llama-3.1-8b'")."""
    import json

    from shardtune.cli import main

    outputs = []
    for name in ("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b", "Llama-3.1-8B"):
        assert main(["estimate", name, "--method", "lora", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["model"] == "llama-3.1-8b" and all(out == outputs[0] for out in outputs)


def test_emit_config_writes_the_hub_id_whatever_the_case_of_the_name(tmp_path, capsys):
    """The recipe of a catalog model names the weights train downloads, its Hugging Face id as the catalog holds it,
    however the user typed the name (Llama-3.1-8B was written as it was typed: no hub repository is called that)."""
    from shardtune import catalog
    from shardtune.cli import main
    from shardtune.config import load_train_config

    for typed in ("Llama-3.1-8B", "META-LLAMA/llama-3.1-8b"):
        path = tmp_path / "recipe.yaml"
        assert main(["estimate", typed, "--method", "lora", "--emit-config", str(path)]) == 0
        capsys.readouterr()
        recipe = load_train_config([str(path)])
        assert recipe.model.model_name_or_path == catalog.metadata("llama-3.1-8b")["hf_id"]
        path.unlink()


def test_estimate_without_options_describes_the_job_train_runs_without_options(capsys):
    # Both read config/schema.py's defaults: the estimate's setup is the job `shardtune train` resolves from a
    # recipe that names only the model and the data, on one process (the GPU is large enough to keep one GPU).
    from shardtune.config import load_train_config
    from shardtune.memory.trace_setup import setup_from_config

    out = run_json(capsys, ["llama-3.2-1b", "--gpu-memory", "1000"])
    trained = load_train_config(["--model_name_or_path", "llama-3.2-1b", "--dataset_name", "rows.jsonl",
                                 "--output_dir", "out"])
    assert out["setup"] == setup_from_config(trained, 1).to_dict()
    assert out["setup"]["strategy"] == "NO" and out["setup"]["batch_size"] == trained.run.per_device_train_batch_size


@pytest.mark.parametrize("args, strategy", [([], "NO"), (["--num-gpus", "2", "--strategy", "DDP"], "DDP"),
                                            (["--num-gpus", "2", "--strategy", "FSDP", "--offload-params"], "FSDP")])
def test_the_estimates_setup_names_the_sharding_as_a_runs_summary_does(args, strategy, capsys):
    # README: summary.json's strategy, sharding_strategy and offload_params are the names of the estimate's `setup`;
    # a strategy that shards nothing has no sharding strategy in either (null), not the FSDP key's default.
    out = run_json(capsys, ["llama-3.2-1b", "--gpu-memory", "1000", *args])
    sharding = "FULL_SHARD" if strategy == "FSDP" else None
    assert (out["setup"]["strategy"], out["setup"]["sharding_strategy"]) == (strategy, sharding)
    assert out["setup"]["offload_params"] is (strategy == "FSDP")
    rows = {(r["strategy"], r["sharding_strategy"], r["offload_params"]) for r in out["strategies"]}
    assert (strategy, sharding, strategy == "FSDP") in rows  # the side-by-side rows name it the same way


@pytest.mark.parametrize("command", [["train"], ["estimate"], ["launch"], ["data", "inspect"], ["bench", "strategies"],
                                     ["config", "schema"], ["demo"], ["plot"]])
def test_help_shows_no_docstring_markup(command, capsys):
    """The commands' descriptions are their module docstrings: --help showed their ``name`` markup as it is."""
    try:
        code = main([*command, "--help"])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0 and "shardtune" in out
    assert "``" not in out


def test_an_instruction_tuned_variants_hub_id_is_estimated_with_its_base_models_config(tmp_path, capsys):
    """meta-llama/Llama-3.1-8B-Instruct (the model most people fine-tune), in a TRL recipe or typed, was "unknown
    model ... did you mean 'llama-3.1-8b'?", though it is the catalog's Llama-3.1-8B fine-tuned. A variant named by
    its owner's words (-Instruct, -it, -chat) whose base id is in the catalog is now estimated with that config,
    saying so, and its recipe names the variant; a variant whose base is not there (Mistral v0.3) is still unknown."""
    import json

    from shardtune import catalog
    from shardtune.cli import main
    from shardtune.config import load_train_config

    variants = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "google/gemma-2-9b-it": "gemma-2-9b",
                "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b", "mistralai/Mistral-7B-Instruct-v0.1": "mistral-7b",
                "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b"}
    for variant, base in variants.items():
        assert catalog.variant_of(variant) == catalog.metadata(base)["hf_id"] and catalog.canonical(variant) == base
        assert main(["estimate", variant, "--method", "qlora", "--json"]) == 0
        captured = capsys.readouterr()
        assert main(["estimate", base, "--method", "qlora", "--json"]) == 0
        assert json.loads(captured.out) == json.loads(capsys.readouterr().out)
        assert (f"note: {variant} is estimated with its base model's config (catalog {base}, "
                f"{catalog.metadata(base)['hf_id']})") in captured.err
    recipe, emitted = tmp_path / "trl.yaml", tmp_path / "emitted.yaml"
    recipe.write_text("model_name_or_path: meta-llama/Llama-3.1-8B-Instruct\nuse_peft_lora: true\ndataset_name: d\n")
    assert main(["estimate", "--config", str(recipe), "--gpu", "h100-80gb", "--emit-config", str(emitted)]) == 0
    capsys.readouterr()
    assert load_train_config([str(emitted)]).model.model_name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    for name in ("mistralai/Mistral-7B-Instruct-v0.3", "llama-3.1-8b-instruct", "microsoft/Phi-3-mini-4k-instruct"):
        assert catalog.variant_of(name) is None
    assert main(["estimate", "mistralai/Mistral-7B-Instruct-v0.3"]) == 2
    assert "unknown model 'mistralai/Mistral-7B-Instruct-v0.3'" in capsys.readouterr().err


def _cache_config(cache, repo_id: str, config: dict) -> None:
    """``repo_id``'s config.json in a Hugging Face cache laid out as 'hf download REPO config.json' leaves it."""
    root, revision = cache / f"models--{repo_id.replace('/', '--')}", "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    (root / "snapshots" / revision).mkdir(parents=True)
    (root / "snapshots" / revision / "config.json").write_text(json.dumps(config))


def test_a_hub_model_whose_config_the_local_cache_holds_is_estimated_with_it(tmp_path, capsys, monkeypatch):
    """A hub id outside the catalog was 'unknown model' even with its config.json in the local Hugging Face cache,
    where 'shardtune train' loads it from; and a cached instruct variant was counted as its catalog base."""
    import huggingface_hub.constants
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    config = tiny_llama_config(512, num_layers=3, hidden_size=96, intermediate_size=256).to_dict()
    _cache_config(cache, "someone/tiny-chat", config)
    built = AutoModelForCausalLM.from_config(tiny_llama_config(512, num_layers=3, hidden_size=96,
                                                               intermediate_size=256))
    out = run_json(capsys, ["someone/tiny-chat", "--strategy", "NO"])
    assert out["model"] == "someone/tiny-chat"
    assert out["parameters"] == out["trainable_parameters"] == sum(p.numel() for p in built.parameters())
    # fp32 master weights, and the state torch's AdamW keeps after a step, as the estimate counts it: its moments
    # (the 0-d step tensors stay on the CPU unless capturable, so they take no GPU memory)
    optimizer = torch.optim.AdamW(built.parameters())
    for p in built.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if t.dim() > 0)
    assert out["items"][0]["label"] == "weights" and out["items"][0]["bytes"] == 4 * out["parameters"]
    assert next(i["bytes"] for i in out["items"] if i["category"] == "optimizer") == moments
    # A variant's own cached config is read, not its catalog base's (Llama-3.1-8B's 8.03B), and no note says so.
    _cache_config(cache, "meta-llama/Llama-3.1-8B-Instruct", config)
    assert main(["estimate", "meta-llama/Llama-3.1-8B-Instruct", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["parameters"] == out["parameters"] and "base model's config" not in captured.err
    # Not in the cache: the error says how to put its config there.
    assert main(["estimate", "someone/other-model"]) == 2
    assert "'hf download someone/other-model config.json' puts its config in the local Hugging Face cache" in \
        capsys.readouterr().err


def test_a_size_alone_names_the_catalog_models_of_about_that_size(capsys):
    """'shardtune estimate 8b' was 'unknown model' with nothing to go on: a size does not say the architecture, so
    it is refused naming the catalog's models within a third of it (their published counts), nearest first."""
    from shardtune import catalog

    assert main(["estimate", "8B", "--method", "lora"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardtune estimate: error: unknown model '8B': a size alone does not say the "
                          "architecture; the catalog's models of about that size: llama-3-8b, llama-3.1-8b, ")
    named = err.split("that size: ")[1].split("; give")[0].split(", ")
    counts = {n: catalog.metadata(n)["published_parameters"] for n in catalog.names()}
    near = [n for n, c in counts.items() if abs(c - 8e9) <= 8e9 / 3]
    assert named == sorted(near, key=lambda n: abs(counts[n] - 8e9))
    assert "llama-3.2-3b" not in named and "llama-3.1-70b" not in named
    assert main(["estimate", "2b"]) == 2
    err = capsys.readouterr().err
    assert "a size alone does not say the architecture; no catalog model is of about that size" in err
