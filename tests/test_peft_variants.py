"""PEFT's LoRA variants end to end: DoRA, rsLoRA, lora_bias, modules_to_save, added-token rows, PiSSA/OLoRA init,
regex targets; on one process and FSDP2 x2, through checkpoint, resume, final/, merge and generate; and the tied
full fine-tune that writes its shared weight once.

Few real runs, each covering several variants at once (CPU time is shared): one LoRA recipe turns on DoRA, rsLoRA,
trainable biases, a whole module to save and added tokens together, trained on one process (with checkpoints and a
resume) and on FSDP x2.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.faults import CALLBACK, fault_env
from tests.trainutil import flags, losses, shardtune_env, write_chat_data

REL_TOL = 1e-4
STEPS = 4
# Every variant at once; the tiny model gets attention biases so lora_bias all has biases to train, and the
# llama-3 template's special tokens grow the vocabulary (their rows must train and travel in the adapter).
VARIANTS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--use_dora", "True",
            "--use_rslora", "True", "--lora_bias", "all", "--lora_modules_to_save", "lm_head",
            "--chat_template_format", "llama-3", "--add_special_tokens", "True"]


def shardtune(args: list[str], cwd, **faults: str) -> subprocess.CompletedProcess:
    env = {**shardtune_env(cwd), **fault_env(**faults)}
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def model_folder(path, **overrides) -> None:
    """The tiny Llama folder with ``overrides`` set on its config (biases, tied embeddings)."""
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import make_tokenizer, tiny_llama_config

    tokenizer = make_tokenizer()
    config = tiny_llama_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    model_folder(root / "model", attention_bias=True)
    model_folder(root / "tied", tie_word_embeddings=True)
    write_chat_data(root / "chat.jsonl", rows=300)
    (root / "elsewhere").mkdir()
    return root


def train(root, out: str, extra: list[str], nproc: int = 1, model: str = "model", steps: int = STEPS
          ) -> list[float]:
    """A run with a relative model path (as users type it), logging ``steps`` losses; the trained logits go to
    OUT.logits.pt."""
    args = flags("--model_name_or_path", model, "--dataset_name", "chat.jsonl", "--splits", "train",
                 "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS), "--logging_steps", "1",
                 "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--output_dir", out,
                 "--per_device_train_batch_size", "4", "--callbacks", CALLBACK,
                 # fp32: FSDP x2 and one process must agree to 1e-4, and the exported logits to the trained ones
                 "--bf16", "false", *extra)
    cmd = ["train", *args] if nproc == 1 else ["launch", "--num_processes", str(nproc), "train", *args]
    result = shardtune(cmd, root, logits=str(root / f"{out}.logits.pt"))
    assert result.returncode == 0, result.stderr[-3000:]
    found = losses(root / out)
    assert len(found) == steps and all(math.isfinite(x) for x in found)
    return found


def trained_logits(root, out: str) -> tuple[torch.Tensor, torch.Tensor]:
    saved = torch.load(root / f"{out}.logits.pt", weights_only=True)
    return saved["input_ids"], saved["logits"]


def adapter_logits(base, adapter, ids) -> torch.Tensor:
    """PEFT's own loading of the adapter onto the unmodified base (grown to the adapter's tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)), mean_resizing=False)
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def model_logits(folder, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), (a - b).abs().max().item()


def assert_same_losses(reference: list[float], other: list[float]) -> None:
    for step, (a, b) in enumerate(zip(reference, other), start=1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: {a} vs {b}"


@pytest.fixture(scope="module")
def variants_single(root):
    return train(root, "single", [*VARIANTS, "--gradient_accumulation_steps", "2", "--save_strategy", "steps",
                                  "--save_steps", "2"])


def test_variants_train_and_fsdp_x2_equals_one_process(root, variants_single):
    """DoRA + rsLoRA + biases + lm_head saved whole + added-token rows: FSDP x2 gives one process's losses."""
    assert variants_single[-1] < variants_single[0]
    fsdp = train(root, "fsdp", [*VARIANTS, "--distributed_type", "FSDP"], nproc=2)
    assert_same_losses(variants_single, fsdp)
    ids, single_logits = trained_logits(root, "single")
    assert_close(trained_logits(root, "fsdp")[1], single_logits)


def test_variants_adapter_holds_every_trainable_part_and_resumes_exactly(root, variants_single):
    from safetensors.torch import load_file

    final = root / "single" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["use_dora"], config["use_rslora"], config["bias"]) == (True, True, "all")
    assert config["modules_to_save"] == ["lm_head"]
    from transformers import AutoConfig, AutoTokenizer

    base_vocab = AutoConfig.from_pretrained(root / "model").vocab_size
    added = list(range(base_vocab, len(AutoTokenizer.from_pretrained(final))))
    assert added and config["trainable_token_indices"] == {"embed_tokens": added}  # lm_head is saved whole
    keys = load_file(final / "adapter_model.safetensors")
    for part in ("lora_magnitude_vector", "modules_to_save", "self_attn.q_proj.base_layer.bias",
                 "trainable_tokens_delta"):
        assert any(part in key for key in keys), part
    # The same run resumed from its step-2 checkpoint: the same losses and the same adapter, to the bit.
    resumed = train(root, "resumed", [*VARIANTS, "--gradient_accumulation_steps", "2",
                                      "--resume_from_checkpoint", "single/checkpoints/step-2"], steps=2)
    assert resumed == variants_single[2:]
    again = load_file(root / "resumed" / "final" / "adapter_model.safetensors")
    assert keys.keys() == again.keys() and all(torch.equal(keys[k], again[k]) for k in keys)


def test_variants_merge_and_peft_load_give_the_trained_logits(root, variants_single):
    ids, trained = trained_logits(root, "single")
    final = root / "single" / "final"
    # Loaded by PEFT onto the untouched base: the added rows come from the adapter, not from a new random draw.
    assert_close(adapter_logits(root / "model", final, ids), trained)
    result = shardtune(["merge", "--base", "model", str(final), "merged"], root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_close(model_logits(root / "merged", ids), trained)


def test_estimate_counts_the_added_token_rows_the_run_trained(root, variants_single, tmp_path, capsys):
    """The llama-3 template's tokens grow the vocabulary: estimate --config counts the grown embeddings and head
    and the rows PEFT trains in the input embeddings (lm_head is saved whole), the numbers the run reported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.cli import main as shardtune_main

    pairs = dict(zip(VARIANTS[0::2], VARIANTS[1::2]))
    recipe = {key.lstrip("-"): value for key, value in pairs.items()}
    recipe.update(model_name_or_path=str(root / "model"), dataset_name="unused.jsonl", bf16="false")
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    assert shardtune_main(["estimate", "--config", str(tmp_path / "recipe.yaml"), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    summary = json.loads((root / "single" / "summary.json").read_text())
    assert estimate["trainable_parameters"] == summary["trainable_parameters"]
    # The base as train grew it: the template's three tokens (<|start_header_id|>, <|end_header_id|>, <|eot_id|>)
    # add a row to the embeddings and one to the untied head.
    base = AutoModelForCausalLM.from_pretrained(root / "model")
    rows = len(AutoTokenizer.from_pretrained(root / "single" / "final")) - base.config.vocab_size
    assert rows == 3
    grown = sum(p.numel() for p in base.parameters()) + 2 * rows * base.config.hidden_size
    assert estimate["parameters"] == grown


def test_adapter_trained_with_a_relative_base_generates_from_another_folder(root, variants_single):
    config = json.loads((root / "single" / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "model").resolve())
    if not (root / "merged").exists():
        assert shardtune(["merge", "--base", "model", "single/final", "merged"], root).returncode == 0
    replies = []
    for folder in (root / "single" / "final", root / "merged"):
        result = shardtune(["generate", str(folder), "--prompt", "What is 2 plus 3?", "--max_new_tokens", "8"],
                           root / "elsewhere")
        assert result.returncode == 0, result.stderr[-2000:]
        replies.append(result.stdout)
    assert replies[0].strip() and replies[0] == replies[1]


def without_pad(folder) -> None:
    """The folder's tokenizer as Llama 3's is: no pad and no unk token, the <|pad|> slot a reserved special token."""
    tokenizer_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    text = tokenizer_file.read_text().replace('"<|pad|>"', '"<|reserved_special_token_0|>"')
    tokenizer_file.write_text(text)
    config = json.loads(config_file.read_text())
    config.pop("pad_token")
    config_file.write_text(json.dumps(config))


def test_an_adapter_of_a_model_without_a_pad_token_loads_onto_its_base_as_it_is(root):
    """A tokenizer with no pad and no unk (Llama 3's) got a <|pad|> added: the embeddings grew by a row, the adapter
    carried it as a trainable token, and PeftModel.from_pretrained on the base as it is failed (index out of
    bounds). A reserved special token pads instead: no row is added, and PEFT's load gives the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_folder(root / "nopad")
    without_pad(root / "nopad")
    train(root, "nopad_lora", ["--use_peft_lora", "True", "--lora_r", "4"], model="nopad")
    final = root / "nopad_lora" / "final"
    ids, trained = trained_logits(root, "nopad_lora")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "nopad", dtype=torch.float32),
                                      final).eval()
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits.float(), trained)
    assert AutoTokenizer.from_pretrained(final).pad_token == "<|reserved_special_token_0|>"
    assert not json.loads((final / "adapter_config.json").read_text()).get("trainable_token_indices")


@pytest.mark.parametrize("init,nproc", [("pissa", 1), ("olora", 2)])
def test_mutating_init_adapter_is_converted_for_the_untouched_base(root, init, nproc):
    """PiSSA/OLoRA rewrite the base: final/ holds the equivalent plain adapter (rank 2r), which PEFT loads onto the
    original base with the trained logits. OLoRA runs on FSDP x2, whose ranks 1.. are built on meta."""
    extra = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--init_lora_weights", init]
    if nproc == 2:
        extra += ["--distributed_type", "FSDP"]
    found = train(root, init, extra, nproc=nproc)
    assert found[-1] < found[0]
    final = root / init / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (8, 16, True)
    # [B, -B0]: the second half is the starting B the init computed, non-zero (a plain init's is zero, and its
    # "converted" adapter would reproduce the logits as well)
    from safetensors.torch import load_file

    starts = [t[:, 4:] for k, t in load_file(final / "adapter_model.safetensors").items() if "lora_B" in k]
    assert starts and all(t.abs().max() > 0 for t in starts)
    ids, trained = trained_logits(root, init)
    assert_close(adapter_logits(root / "model", final, ids), trained)


def test_tied_full_fine_tune_writes_the_shared_weight_once(root):
    from safetensors import safe_open

    train(root, "tied_full", ["--max_steps", "2"], model="tied", steps=2)
    with safe_open(root / "tied_full" / "final" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    ids, trained = trained_logits(root, "tied_full")
    assert_close(model_logits(root / "tied_full" / "final", ids), trained)


def test_bad_lora_values_exit_2_with_one_line(root):
    result = shardtune(["train", "--model_name_or_path", "model", "--dataset_name", "chat.jsonl", "--output_dir",
                        "bad", "--use_peft_lora", "True", "--lora_bias", "some", "--init_lora_weights", "eva",
                        "--lora_target_modules", "re:(q_proj"], root)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for key in ("lora_bias='some'", "init_lora_weights='eva'", "lora_target_modules='re:(q_proj'"):
        assert key in lines[0]


def test_estimator_counts_regex_targets_as_peft_does(root):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    # PEFT full-matches the pattern: in the second, "up" names no module whole (up_proj goes on), so a search
    # that matched it inside layer 1's up_proj would count that adapter too.
    for spec in (r"re:.*layers\.1\..*(q_proj|v_proj)", r"re:.*layers\.1\..*(q_proj|v_proj|up)"):
        result = shardtune(["estimate", "model", "--method", "lora", "--lora-r", "4", "--lora-target-modules", spec,
                            "--json"], root)
        assert result.returncode == 0, result.stderr[-2000:]
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                                    LoraConfig(r=4, target_modules=spec[3:]))
        assert json.loads(result.stdout)["trainable_parameters"] == peft_model.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("extra,peft_kwargs", [
    ({"use_dora": True}, {"use_dora": True}),
    ({"lora_modules_to_save": ["lm_head"]}, {"modules_to_save": ["lm_head"]}),
    # PEFT saves every module whose name ends with the entry, dot or not: 'head' is lm_head (train ran it; estimate
    # refused it, matching at dots as for target_modules)
    ({"lora_modules_to_save": ["head"]}, {"modules_to_save": ["head"]}),
    ({"use_dora": True, "lora_modules_to_save": ["embed_tokens", "lm_head"]},
     {"use_dora": True, "modules_to_save": ["embed_tokens", "lm_head"]}),
])
def test_estimate_of_a_recipe_counts_dora_and_modules_to_save_as_peft_does(root, tmp_path, capsys, extra,
                                                                           peft_kwargs):
    """DoRA's magnitudes and the trained copies of modules_to_save are trainable weights with gradients and
    optimizer states: `estimate --config` counts them, equal to PEFT's own count."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main as shardtune_main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model_name_or_path": str(root / "model"), "dataset_name": "unused.jsonl",
                                  "use_peft_lora": True, "lora_r": 4, "lora_target_modules": "q_proj,v_proj",
                                  **extra}))
    assert shardtune_main(["estimate", "--config", str(recipe), "--json"]) == 0
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **peft_kwargs))
    trainable = json.loads(capsys.readouterr().out)["trainable_parameters"]
    assert trainable == peft_model.get_nb_trainable_parameters()[0]
    # The same job given by estimate's own options (they reached it only through --config)
    options = [*(["--use-dora"] if extra.get("use_dora") else []),
               *(["--lora-modules-to-save", ",".join(extra["lora_modules_to_save"])]
                 if "lora_modules_to_save" in extra else [])]
    assert shardtune_main(["estimate", str(root / "model"), "--method", "lora", "--lora-r", "4",
                           "--lora-target-modules", "q_proj,v_proj", *options, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_parameters"] == trainable


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """The tiny Qwen2: biases on q, k and v, none elsewhere."""
    from shardtune.testing.families import make_family_folder

    return make_family_folder(tmp_path_factory.mktemp("qwen2") / "qwen2", "qwen2")


@pytest.mark.parametrize("lora_bias, modules_to_save", [
    ("none", []), ("all", []), ("lora_only", []),
    ("all", ["k_proj"]),  # k_proj's copy trains with its bias; its frozen original's bias does not train
])
def test_estimate_counts_the_biases_lora_bias_trains_as_peft_does(qwen2, tmp_path, capsys, lora_bias,
                                                                 modules_to_save):
    """lora_bias trains the base's biases (all: every one; lora_only: those of adapted layers), each with a
    gradient and optimizer states: `estimate --config` counts them as PEFT marks them trainable. q_proj and o_proj
    adapted, so all (q, k and v's biases) and lora_only (q's) differ."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main as shardtune_main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model_name_or_path": str(qwen2), "dataset_name": "unused.jsonl",
                                  "use_peft_lora": True, "lora_r": 4, "lora_target_modules": "q_proj,o_proj",
                                  "lora_bias": lora_bias, "lora_modules_to_save": modules_to_save}))
    assert shardtune_main(["estimate", "--config", str(recipe), "--json"]) == 0

    def peft_count(bias: str) -> int:
        config = LoraConfig(r=4, target_modules=["q_proj", "o_proj"], bias=bias,
                            modules_to_save=modules_to_save or None)
        return get_peft_model(AutoModelForCausalLM.from_pretrained(qwen2), config).get_nb_trainable_parameters()[0]

    expected = peft_count(lora_bias)
    assert json.loads(capsys.readouterr().out)["trainable_parameters"] == expected
    options = ["--lora-bias", lora_bias, *(["--lora-modules-to-save", ",".join(modules_to_save)]
                                           if modules_to_save else [])]
    assert shardtune_main(["estimate", str(qwen2), "--method", "lora", "--lora-r", "4", "--lora-target-modules",
                           "q_proj,o_proj", *options, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_parameters"] == expected
    assert (expected != peft_count("none")) == (lora_bias != "none")  # the model has biases the option trains


def test_estimate_refuses_modules_to_save_it_cannot_count(root, tmp_path, capsys):
    from shardtune.cli import main as shardtune_main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model_name_or_path": str(root / "model"), "dataset_name": "unused.jsonl",
                                  "use_peft_lora": True, "lora_modules_to_save": ["norm"]}))
    assert shardtune_main(["estimate", "--config", str(recipe), "--json"]) == 2
    assert "lora_modules_to_save norm" in capsys.readouterr().err


@pytest.mark.parametrize("targets, saved", [("q_proj", ["q_proj"]), ("lm_head", ["lm_head"]),
                                            ("q_proj,v_proj", ["q_proj"])])
def test_estimate_refuses_targets_that_are_all_saved_whole_as_peft_does(root, tmp_path, capsys, targets, saved):
    """Targets that are all in lora_modules_to_save: PEFT trains them whole and adapts nothing, and refuses the job
    (train exits 2), while estimate counted the copies (8,192 for q_proj). Where some target is left to adapt, PEFT
    adapts it and the estimate's count is PEFT's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main as shardtune_main

    try:
        config = LoraConfig(r=4, target_modules=targets.split(","), modules_to_save=saved)
        expected = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                                  config).get_nb_trainable_parameters()[0]
    except ValueError as exc:
        assert "No modules were targeted for adaptation" in str(exc)
        expected = None
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model_name_or_path": str(root / "model"), "dataset_name": "unused.jsonl",
                                  "use_peft_lora": True, "lora_r": 4, "lora_target_modules": targets,
                                  "lora_modules_to_save": saved}))
    capsys.readouterr()  # PEFT's loading above
    code = shardtune_main(["estimate", "--config", str(recipe), "--json"])
    out, err = capsys.readouterr()
    if expected is None:
        assert code == 2 and err.count("\n") == 1
        assert err.startswith(f"shardtune estimate: error: {recipe}, line 1: lora_target_modules {targets}: every "
                              f"module it names is also in lora_modules_to_save")
    else:
        assert code == 0 and json.loads(out)["trainable_parameters"] == expected


def test_loras_estimate_options_on_a_full_fine_tune_are_refused(root, capsys):
    """--lora-r, --use-dora, ... with --method full (the default) were dropped without a word: the estimate was of
    a full fine-tune, which train refuses those keys with."""
    from shardtune.cli import main as shardtune_main

    assert shardtune_main(["estimate", str(root / "model"), "--lora-r", "16", "--use-dora"]) == 2
    assert ("--lora-r, --use-dora: LoRA's options with --method full, which trains every weight and no adapters; "
            "add --method lora (or qlora), or leave them out") in capsys.readouterr().err


def test_tokens_added_on_spare_rows_of_a_padded_vocabulary_train_under_lora(tmp_path, capsys):
    """Phi-3 (32064 rows for 32011 tokens), Qwen2.5 and Gemma 3 hold spare rows past their tokenizer: a template's
    tokens added there (llama-3's <|eot_id|>, the EOS every reply then ends with) needed no new rows, so LoRA left
    them frozen at the base's untrained values and out of the adapter. They now train and travel in it, and the
    estimate counts them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.cli import main
    from shardtune.testing.tiny import make_tokenizer
    from tests.trainutil import logging_restored

    model_folder(tmp_path / "model", vocab_size=len(make_tokenizer()) + 16)
    write_chat_data(tmp_path / "chat.jsonl", rows=16)
    with logging_restored():
        assert main(["train", *flags("--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                                     str(tmp_path / "chat.jsonl"), "--max_seq_len", "64", "--max_steps", "2",
                                     "--learning_rate", "1e-2", "--per_device_train_batch_size", "4",
                                     "--save_strategy", "no", "--predict_memory", "false", "--output_dir",
                                     str(tmp_path / "run"), "--use_peft_lora", "True", "--chat_template_format",
                                     "llama-3", "--add_special_tokens", "True")]) == 0
    final = tmp_path / "run" / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert eot < base.config.vocab_size == base.get_input_embeddings().num_embeddings  # a spare row, no growth
    before = base.get_input_embeddings().weight[eot].clone()
    trained = PeftModel.from_pretrained(base, final).merge_and_unload()
    assert not torch.allclose(trained.get_input_embeddings().weight[eot], before)
    assert eot in json.loads((final / "adapter_config.json").read_text())["trainable_token_indices"]["embed_tokens"]
    # shardtune estimate counts those rows as the trainer does
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    with logging_restored():
        assert main(["estimate", "--config", str(tmp_path / "run" / "config.yaml"), "--json"]) == 0
    out = capsys.readouterr().out
    estimate = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert estimate["trainable_parameters"] == summary["trainable_parameters"]


def test_untrained_rows_start_at_the_mean_of_the_trained_ones():
    """A base model's rows that pretraining never trained (near zero) among the tokens the data writes start at the
    mean of the matrix's trained rows, each matrix on its own; trained rows and tokens the data does not write stay
    as they were."""
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.model import revive_untrained_rows

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(64))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        embed[[5, 6, 9]] = 0  # 9: untrained too, but not written by the data
        head[6] = 1e-7 * head[7]  # near zero: weight decay's remains
    before = embed.detach().clone(), head.detach().clone()
    assert revive_untrained_rows(model, [5, 6, 7]) == [5, 6]
    for weight, old, revived in ((embed, before[0], [5, 6]), (head, before[1], [6])):
        trained = [row for row in range(64) if row not in ([5, 6, 9] if weight is embed else [6])]
        mean = old[trained].mean(dim=0)
        for row in range(64):
            torch.testing.assert_close(weight[row], mean if row in revived else old[row], rtol=1e-6, atol=1e-7)


def test_template_tokens_the_base_never_trained_train_under_lora_and_travel_in_its_adapter(tmp_path, capsys):
    """Llama 3's base models hold (near) zero rows for their own chat template's tokens (<|eot_id|>, the end of
    every reply): LoRA left them frozen there, so the fine-tune's head never learned to end a reply. They now start
    at the mean of the trained rows, train in the adapter (PEFT's trainable_token_indices) and are said; an export
    of the run's checkpoint carries them as its final/ does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import logging_restored

    untrained = ["<|im_start|>", "<|im_end|>"]  # the tiny tokenizer's ChatML template tokens
    make_model_folder(tmp_path / "model", untrained=untrained)
    write_chat_data(tmp_path / "chat.jsonl", rows=16)
    with logging_restored():
        assert main(["train", *flags("--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                                     str(tmp_path / "chat.jsonl"), "--max_seq_len", "64", "--max_steps", "2",
                                     "--learning_rate", "1e-2", "--per_device_train_batch_size", "4",
                                     "--save_strategy", "steps", "--save_steps", "2", "--predict_memory", "false",
                                     "--output_dir", str(tmp_path / "run"), "--use_peft_lora", "True")]) == 0
    assert ("model: the base model never trained the rows of <|im_start|>, <|im_end|>, which the data writes"
            in capsys.readouterr().err)
    ids = AutoTokenizer.from_pretrained(tmp_path / "model").convert_tokens_to_ids(untrained)
    final = tmp_path / "run" / "final"
    assert json.loads((final / "adapter_config.json").read_text())["trainable_token_indices"] == {
        "embed_tokens": ids, "lm_head": ids}
    with logging_restored():
        assert main(["export", str(tmp_path / "run" / "checkpoints" / "step-2"), str(tmp_path / "exported")]) == 0
    merged = [PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), folder)
              .merge_and_unload() for folder in (final, tmp_path / "exported")]
    for matrix in ("get_input_embeddings", "get_output_embeddings"):
        rows = [getattr(model, matrix)().weight[ids] for model in merged]
        assert rows[0].norm(dim=1).min() > 0.1  # trained from the mean: a zero row would have stayed at 0
        torch.testing.assert_close(rows[1], rows[0])
