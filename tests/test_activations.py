"""The activation formula against the bytes real transformers models keep for backward on CPU.

Each case builds a small model of a catalog architecture, runs a real forward pass with labels on a batch made
by shardtune's collator (as the trainer feeds it: position ids and the block-causal attention mask of packed
documents), and measures the storages still alive afterwards (what autograd keeps for backward, plus autocast's
weight copies), with the batch itself. The formula must predict that number.
"""

import gc

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.data.collate import Collator
from shardtune.memory.formula import Activations, _Model
from shardtune.memory.setup import dtypes
from shardtune.memory.inventory import ModelAnalysis
from shardtune.memory.measure import LiveStorages, parameter_storages, saved_tensor_bytes
from tests.setups import checked_setup

ARCHS = {
    "llama": dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
    "mistral": dict(model_type="mistral", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1200),
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
}
MODES = {"pure bf16": dict(torch_dtype="bfloat16"), "bf16 autocast": dict(), "fp32": dict(mixed_precision="no")}


def trainer_batch(ids: torch.Tensor, attn_implementation: str = "sdpa") -> dict[str, torch.Tensor]:
    """``ids`` as the trainer's collator hands them to the model: each row one document, every token a target."""
    rows = [{"input_ids": row, "labels": row, "seq_lens": [len(row)]} for row in ids.tolist()]
    return Collator(0, attn_implementation=attn_implementation)(rows)


def batch_bytes(batch: dict[str, torch.Tensor]) -> int:
    """The model's inputs, made outside the recorder (the labels count as the loss's shifted copy of them)."""
    return sum(t.nbytes for name, t in batch.items() if name != "labels")


def _measure(config: dict, mode: str, checkpointing: bool, batch: int = 2, seq: int = 64, collate: bool = True):
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16 if mode == "pure bf16" else torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    inputs = trainer_batch(ids) if collate else {"input_ids": ids, "labels": ids}
    with LiveStorages() as live, torch.autocast("cpu", torch.bfloat16, enabled=mode == "bf16 autocast"):
        out = model(**inputs)
    loss = out.loss
    del out  # the logits are not kept for backward
    gc.collect()
    # The batch was made outside the recorder; the loss scalar is alive but not kept for backward.
    return live.live_bytes(parameter_storages(model)) + batch_bytes(inputs) - loss.nbytes, loss, model


def _predict(folder: str, mode: str, checkpointing: bool, batch: int = 2, seq: int = 64) -> int:
    inv = ModelAnalysis(folder).inventory
    setup = checked_setup(gradient_checkpointing=checkpointing, per_device_train_batch_size=batch, max_seq_len=seq,
                          loss="full", **MODES[mode])
    dt = dtypes(setup)
    act, model = Activations(inv, setup, dt), _Model(inv, setup, dt, None)
    per_layer = act.layer_checkpointed() if checkpointing else act.layer()
    saved = batch * seq * (inv.num_layers * per_layer + act.outside_layers()) + act.rope_tables()
    copies = model.autocast_copy_of_head()
    if not checkpointing:  # checkpointed layers re-cast their weights when recomputed, so keep no copies
        copies += sum(model.autocast_copy_of_layer(i) for i in range(inv.num_layers))
    return saved + copies


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_saved_activations_match_the_real_model(arch, mode, checkpointing, config_dir):
    folder = config_dir(ARCHS[arch])
    measured, _, _ = _measure(ARCHS[arch], mode, checkpointing)
    predicted = _predict(folder, mode, checkpointing)
    # What is left out: a few scalars (the loss's normaliser, the step count).
    assert predicted == pytest.approx(measured, rel=0.005), (measured, predicted)


def test_live_storages_agree_with_the_autograd_graph():
    """Two independent measurements of the same thing: what the graph saved, and what is still alive."""
    measured, loss, model = _measure(ARCHS["llama"], "pure bf16", checkpointing=False, collate=False)
    assert measured == saved_tensor_bytes(loss, parameter_storages(model))


def test_eager_attention_keeps_the_score_matrices(config_dir):
    config = dict(ARCHS["llama"], attn_implementation="eager")
    folder = config_dir(ARCHS["llama"])
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model("llama", **kwargs)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).train()
    inputs = trainer_batch(torch.randint(0, cfg.vocab_size, (2, 64)), "eager")
    with LiveStorages() as live:
        out = model(**inputs)
    loss = out.loss
    del out
    gc.collect()
    measured = live.live_bytes(parameter_storages(model)) + batch_bytes(inputs) - loss.nbytes
    inv = ModelAnalysis(folder).inventory
    setup = checked_setup(gradient_checkpointing=False, per_device_train_batch_size=2, max_seq_len=64,
                          torch_dtype="bfloat16", attn_implementation="eager", loss="full")
    act = Activations(inv, setup, dtypes(setup))
    predicted = 2 * 64 * (inv.num_layers * act.layer() + act.outside_layers()) + act.rope_tables()
    assert predicted == pytest.approx(measured, rel=0.005)
    sdpa = checked_setup(gradient_checkpointing=False, per_device_train_batch_size=2, max_seq_len=64,
                         torch_dtype="bfloat16")
    assert act.attention() > Activations(inv, sdpa, dtypes(sdpa)).attention()
