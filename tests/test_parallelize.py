"""Which modules become FSDP units under each wrap policy (no process group needed to decide that)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.train.fsdp import _wrap_targets
from shardtune.train.plan import Plan


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config

    return AutoModelForCausalLM.from_config(tiny_llama_config(512, num_layers=3))


def test_transformer_based_wrap_takes_each_decoder_layer(model):
    targets = _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="TRANSFORMER_BASED_WRAP"))
    assert targets == list(model.model.layers)


def _size_based_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """The rule, worked bottom-up: a module that can run (not a ModuleList), is neither the root nor the head,
    and holds at least ``min_params`` parameters no unit below it took, becomes a unit."""
    units, claimed = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or module is model.lm_head or type(module).forward is nn.Module.forward:
            return
        if sum(p.numel() for p in module.parameters() if id(p) not in claimed) >= min_params:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(model)
    return units


@pytest.mark.parametrize("min_params", [10_000, 20_000, 40_000, 10**9])
def test_size_based_wrap_units_reach_the_minimum_and_can_run(model, min_params):
    targets = _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="SIZE_BASED_WRAP", min_num_params=min_params))
    claimed: set[int] = set()
    for module in targets:  # children come before parents, as fully_shard needs
        own = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        assert own >= min_params
        assert type(module).forward is not nn.Module.forward  # a ModuleList cannot be a unit
        claimed.update(id(p) for p in module.parameters())
    # every module the rule makes a unit is one, and no other: fewer units than the minimum allows is wrong too
    assert targets == _size_based_units(model, min_params)
    assert (targets == []) == (min_params > sum(p.numel() for p in model.parameters()))
    if targets:  # reaching is at equality: with the first unit's own count as the minimum, it is a unit still
        first_own = sum(p.numel() for p in targets[0].parameters())
        exact = _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="SIZE_BASED_WRAP", min_num_params=first_own))
        assert exact[:1] == targets[:1] and first_own >= min_params


@pytest.mark.parametrize("policy", ["SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"])
def test_the_head_is_never_its_own_unit(model, policy):
    """The fused loss calls the head once per chunk of tokens, a count that differs between ranks: as its own unit
    the head would all-gather that many times and the ranks' collectives would go out of step."""
    plan = Plan(strategy="FSDP", wrap_policy=policy, min_num_params=1,
                layer_classes=("LlamaDecoderLayer", "Linear") if policy == "TRANSFORMER_BASED_WRAP" else ())
    targets = _wrap_targets(model, plan)
    assert model.lm_head not in targets
    assert model.model.embed_tokens in targets or policy == "TRANSFORMER_BASED_WRAP"
    assert model.model.layers[0].mlp.down_proj in targets  # a Linear like the head, but not the head


def test_no_wrap_leaves_only_the_root(model):
    assert _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="NO_WRAP")) == []


def test_setups_that_place_weights_themselves_load_into_cpu_ram():
    """FSDP, MP and PP must not load the whole model onto one GPU first: a model larger than a GPU could not start."""
    import torch

    from shardtune.dist import DistInfo
    from shardtune.train.build import load_device

    info = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cuda", 0))
    where = {s: load_device(Plan(strategy=s), info).type for s in ("NO", "DDP", "FSDP", "MP", "PP")}
    assert where == {"NO": "cuda", "DDP": "cuda", "FSDP": "cpu", "MP": "cpu", "PP": "cpu"}


def test_attention_is_chosen_for_the_device_the_model_runs_on_not_where_it_loads(tmp_path, monkeypatch):
    """FSDP loads into CPU RAM but trains on the GPU: flash attention (and the collator's matching masks) must follow
    the GPU. Loaded onto the CPU, the weights stay there until the setup moves them."""
    import torch

    from shardtune.config import LoraConfig, ModelConfig
    from shardtune.testing.tiny import make_model_folder
    from shardtune.train import model as model_module

    asked = []
    monkeypatch.setattr(model_module, "attn_implementation", lambda cfg, device, dtype: asked.append(device) or "eager")
    folder = make_model_folder(tmp_path / "M")
    loaded = model_module.load_base_model(ModelConfig(model_name_or_path=str(folder), use_flash_attn=True),
                                          LoraConfig(), model_module.Precision("no"), torch.device("cuda", 0),
                                          load_on=torch.device("cpu"))
    assert asked == [torch.device("cuda", 0)]
    assert loaded.config._attn_implementation == "eager"
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}


def test_flash_attention_only_where_its_kernels_run(monkeypatch, caplog):
    """flash-attn needs CUDA and bf16/fp16 compute (it has no fp32 kernels); elsewhere the configured attention,
    said once in the log."""
    import logging

    import torch

    from shardtune.config import ModelConfig
    from shardtune.train.model import _warn_once, attn_implementation

    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: True)
    cfg, gpu = ModelConfig(use_flash_attn=True), torch.device("cuda", 0)
    assert attn_implementation(cfg, gpu, torch.bfloat16) == "flash_attention_2"
    assert attn_implementation(cfg, gpu, torch.float16) == "flash_attention_2"
    _warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        assert attn_implementation(cfg, gpu, torch.float32) == "sdpa"
        assert attn_implementation(cfg, gpu, torch.float32) == "sdpa"
    said = [r.getMessage() for r in caplog.records if "it computes in bf16 or fp16 only" in r.getMessage()]
    assert len(said) == 1 and "this job computes in fp32" in said[0]
    assert attn_implementation(cfg, torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert attn_implementation(ModelConfig(), gpu, torch.bfloat16) == "sdpa"
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: False)  # the package is missing
    assert attn_implementation(cfg, gpu, torch.bfloat16) == "sdpa"


def test_model_parallel_moves_everything_off_the_cpu_including_unplaced_tensors():
    """Loaded into CPU RAM, an MP model ends with every tensor on a stage device; one the split does not know by
    name (an architecture's extra buffer) goes to the first. The meta device stands in for GPUs."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.model_parallel import split_across_devices

    net = AutoModelForCausalLM.from_config(tiny_llama_config(512, num_layers=3))
    net.model.register_buffer("extra_table", torch.ones(4))
    split_across_devices(net, Plan(strategy="MP", stage_bounds=((0, 2), (2, 3)), devices=("meta", "meta")))
    assert {t.device.type for t in [*net.parameters(), *net.buffers()]} == {"meta"}


def test_a_pipeline_stage_moves_only_its_own_layers_to_the_device():
    """The other stages' layers and the embeddings this stage drops never reach the device: moving the whole model
    first and dropping them after would put a model larger than one GPU on it. The meta device stands in for a GPU;
    the dropped modules, held here, show whether they were moved."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.dist import DistInfo
    from shardtune.train.pipeline_parallel import split_for_stage

    net = AutoModelForCausalLM.from_config(tiny_llama_config(512, num_layers=3))
    dropped = [*net.model.layers[:2], net.model.embed_tokens]
    info = DistInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("meta"))
    stage = split_for_stage(net, Plan(strategy="PP", stage_bounds=((0, 2), (2, 3)), pipeline_microbatches=2), info)
    kept = [type(layer).__name__ for layer in stage.model.layers]
    assert kept == ["OtherStage", "OtherStage", "LlamaDecoderLayer"] and stage.model.embed_tokens is None
    assert {t.device.type for t in [*stage.parameters(), *stage.buffers()]} == {"meta"}
    assert {t.device.type for module in dropped for t in [*module.parameters(), *module.buffers()]} == {"cpu"}


def test_forward_prefetch_chains_each_decoder_layer_to_the_next(tmp_path):
    """fsdp_forward_prefetch: every decoder layer's FSDP unit prefetches the next layer's, the last none."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from shardtune.dist import DistInfo, shutdown
    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.fsdp import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_config(tiny_llama_config(64, num_layers=3))
        info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
        apply_fsdp(model, Plan(strategy="FSDP", forward_prefetch=True), info)
        layers = list(model.model.layers)
        states = [layer._get_fsdp_state() for layer in layers]
        prefetched = [[states.index(s) for s in state._states_to_forward_prefetch] for state in states]
        assert prefetched == [[1], [2], []]
    finally:
        shutdown()


@pytest.mark.parametrize("flags,expected", [
    ([], (25 * 2**20, True, False)),  # torch's own defaults where the keys are unset
    (["--ddp_bucket_cap_mb", "5", "--ddp_broadcast_buffers", "false", "--ddp_static_graph", "true"],
     (5 * 2**20, False, True)),
])
def test_transformers_ddp_keys_reach_distributed_data_parallel(flags, expected):
    """ddp_bucket_cap_mb, ddp_broadcast_buffers and ddp_static_graph (Transformers' TrainingArguments) were refused
    as keys with no counterpart; they are DDP's arguments, as the Trainer passes them."""
    import torch.distributed as dist

    from shardtune.config import load_train_config
    from shardtune.dist import DistInfo, shutdown
    from shardtune.train.ddp import apply_ddp
    from shardtune.train.plan import make_plan

    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o",
                             "--distributed_type", "DDP", *flags])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # Two ranks as apply_ddp sees the job (one process wraps nothing); DDP itself runs on this one-rank group.
        info = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
        plan = make_plan(cfg.distributed, info, param_dtype=None, gradient_checkpointing=False, use_reentrant=False)
        ddp = apply_ddp(nn.Linear(4, 4), plan, info)
        assert (ddp.bucket_bytes_cap, ddp.broadcast_buffers, ddp.static_graph) == expected
    finally:
        shutdown()
