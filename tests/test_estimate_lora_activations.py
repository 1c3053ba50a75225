"""LoRA's activations: with the base frozen, autograd keeps an op's input only where a gradient needs it.

A frozen projection keeps no input, a frozen norm keeps no normalised copy, and each adapter keeps its r-wide A
output. The formula must predict the bytes a real PEFT model keeps for backward, for several target sets, on a
batch from shardtune's collator and, for fp32 adapters, under torch.autocast: as the trainer runs them.
"""

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.memory.formula import Activations, _Model
from shardtune.memory.setup import dtypes
from shardtune.memory.inventory import ModelAnalysis
from shardtune.memory.measure import LiveStorages, parameter_storages
from shardtune.train.model import upcast_embeddings_output
from tests.setups import checked_setup
from tests.test_activations import batch_bytes, trainer_batch

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
}
TARGETS = ["q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj", "q_proj,down_proj", "all-linear"]
BATCH, SEQ, RANK = 2, 64, 8


def _measure_lora(config: dict, targets: str, pure_bf16: bool = True, dropout: float = 0.0) -> int:
    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    peft_targets = "all-linear" if targets == "all-linear" else targets.split(",")
    # PEFT keeps the adapters of a bf16 model in fp32; pure bf16 casts them down too.
    model = get_peft_model(model, LoraConfig(r=RANK, target_modules=peft_targets, lora_dropout=dropout))
    model = (model.to(torch.bfloat16) if pure_bf16 else model).train()
    if not pure_bf16:  # under autocast the trainer runs the residual stream in fp32 from the embeddings' output
        upcast_embeddings_output(model)
    inputs = trainer_batch(torch.randint(0, cfg.vocab_size, (BATCH, SEQ)))
    # The trainer runs fp32 adapters on a bf16 base under autocast (shardtune.train.runner.LocalRunner._autocast).
    with LiveStorages() as live, torch.autocast("cpu", torch.bfloat16, enabled=not pure_bf16):
        out = model(**inputs)
    loss = out.loss
    del out
    gc.collect()
    return live.live_bytes(parameter_storages(model)) + batch_bytes(inputs) - loss.nbytes


def _predict(folder: str, targets: str, method: str = "lora", pure_bf16: bool = True, dropout: float = 0.0) -> int:
    analysis = ModelAnalysis(folder)
    inv = analysis.inventory
    setup = checked_setup(method=method, gradient_checkpointing=False, per_device_train_batch_size=BATCH,
                          max_seq_len=SEQ, torch_dtype="bfloat16" if pure_bf16 else None, lora_r=RANK,
                          lora_target_modules=targets, lora_dropout=dropout, loss="full")
    dt = dtypes(setup)
    act = Activations(inv, setup, dt)
    saved = BATCH * SEQ * (inv.num_layers * act.layer() + act.outside_layers()) + act.rope_tables()
    if method == "full":
        return saved
    model = _Model(inv, setup, dt, analysis.lora(RANK, targets))  # autocast's copies of fp32 adapters' weights
    return saved + sum(model.autocast_copy_of_layer(i) for i in range(inv.num_layers))


CASES = [(arch, targets, True) for arch in CONFIGS for targets in TARGETS] + [
    ("llama", targets, False) for targets in TARGETS]  # the trainer's: fp32 adapters on the bf16 base, autocast


@pytest.mark.parametrize("arch,targets,pure_bf16", CASES,
                         ids=[f"{a}-{t}-{'bf16' if p else 'fp32'}-adapters" for a, t, p in CASES])
def test_lora_activations_match_the_real_peft_model(arch, targets, pure_bf16, config_dir):
    folder = config_dir(CONFIGS[arch])
    measured = _measure_lora(CONFIGS[arch], targets, pure_bf16)
    predicted = _predict(folder, targets, pure_bf16=pure_bf16)
    # Closer than one adapter's r-wide A output in every layer (BATCH x SEQ x RANK bf16 values a layer): a formula
    # that left any adapter's output out is off by more. (rel=0.005 let q_proj,v_proj count one output of two.)
    one_adapter = BATCH * SEQ * RANK * 2 * CONFIGS[arch]["num_hidden_layers"]
    assert abs(predicted - measured) < one_adapter, (measured, predicted)


def _cuda_dropout(x, p=0.5, training=True, inplace=False):
    """What F.dropout runs on CUDA (the fused kernel, which keeps a boolean mask); on the CPU it keeps a mask in
    the input's dtype instead."""
    return torch.native_dropout(x, p, training)[0] if training and p > 0 else x


@pytest.mark.parametrize("targets,pure_bf16", [("q_proj,k_proj,v_proj,o_proj", True), ("all-linear", True),
                                               ("all-linear", False)])
def test_lora_dropout_gives_each_adapter_its_own_input_and_mask(targets, pure_bf16, config_dir, monkeypatch):
    """PEFT's dropout (lora_dropout > 0) hands each adapter its own copy of the input and keeps its mask, where
    without it the projections behind one norm share one copy: the formula follows a real PEFT model."""
    monkeypatch.setattr(torch.nn.functional, "dropout", _cuda_dropout)
    folder = config_dir(CONFIGS["llama"])
    measured = _measure_lora(CONFIGS["llama"], targets, pure_bf16, dropout=0.1)
    assert measured > _measure_lora(CONFIGS["llama"], targets, pure_bf16)
    # The first layer's q, k and v read the norm of the frozen embeddings, which needs no gradient, so their
    # dropout keeps no mask there; the formula counts every layer alike (over by 1 byte a value of those three).
    unkept_masks = 3 * BATCH * SEQ * CONFIGS["llama"]["hidden_size"]
    predicted = _predict(folder, targets, pure_bf16=pure_bf16, dropout=0.1)
    assert predicted - unkept_masks == pytest.approx(measured, rel=0.005)
    assert predicted != pytest.approx(measured, rel=0.005)  # the test sees masks of 1 byte a value


def test_frozen_base_keeps_less_than_full_finetuning(config_dir):
    """The full-fine-tuning count would over-state q,v LoRA by a quarter on this model: the difference is real."""
    folder = config_dir(CONFIGS["llama"])
    lora = _predict(folder, "q_proj,v_proj")
    full = _predict(folder, "q_proj,v_proj", method="full")
    assert full > 1.25 * lora
