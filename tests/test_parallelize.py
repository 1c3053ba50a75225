"""Which modules become FSDP units under each wrap policy (no process group needed to decide that)."""

from __future__ import annotations

import pytest
from torch import nn

from shardtune.train.parallelize import Plan, _wrap_targets


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from shardtune.tiny import tiny_llama_config

    return AutoModelForCausalLM.from_config(tiny_llama_config(512, num_layers=3))


def test_transformer_based_wrap_takes_each_decoder_layer(model):
    targets = _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="TRANSFORMER_BASED_WRAP"))
    assert targets == list(model.model.layers)


@pytest.mark.parametrize("min_params", [10_000, 20_000, 40_000, 10**9])
def test_size_based_wrap_units_reach_the_minimum_and_can_run(model, min_params):
    targets = _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="SIZE_BASED_WRAP", min_num_params=min_params))
    claimed: set[int] = set()
    for module in targets:  # children come before parents, as fully_shard needs
        own = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        assert own >= min_params
        assert type(module).forward is not nn.Module.forward  # a ModuleList cannot be a unit
        claimed.update(id(p) for p in module.parameters())
    if min_params > sum(p.numel() for p in model.parameters()):
        assert targets == []


def test_no_wrap_leaves_only_the_root(model):
    assert _wrap_targets(model, Plan(strategy="FSDP", wrap_policy="NO_WRAP")) == []
