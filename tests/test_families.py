"""The model-family matrix: Llama 2 and 3, Mistral, Qwen2 (= Qwen2.5), Qwen3, Gemma 2 and 3, Phi-3 and Mixtral, each
a tiny model built from transformers' own config class (shardtune/testing/families.py), each trained in full and
with LoRA (all-linear, r 4).

For every family x method: FSDP2 on 2 gloo processes, gradient checkpointing on, gives one process's losses
(fp32, ``REL_TOL`` per step), and so do DDP x2, naive model parallel over two CPU "devices" (MP) and a 2-stage
pipeline on 2 processes (PP), gradient norms too; ``final/`` and ``shardtune export`` of the run's checkpoint
(single, FSDP and PP) load in transformers/PEFT and give the trained model's logits; ``shardtune merge`` of the
adapter gives them too (a full run's final/ is refused by merge); ``shardtune estimate`` counts what
``get_peft_model`` on meta and the trainer count. The first step's loss equals transformers' own loss with every
packed document run alone, which holds only if the fused loss applies the family's logit transforms (Gemma's soft
cap) and the packed masks carry the family's sliding window. All cases run in two launches
(tests/families_worker.py): one process for one process and MP, two for FSDP, DDP and PP. What PP and MP cannot
carry is refused in one line, tested here too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardtune.testing.families import FAMILIES, make_family_folder
from shardtune.testing.tiny import make_tokenizer
from tests.families_worker import METHODS, STEPS, case_args
from tests.trainutil import REPO, losses, shardtune_env, write_chat_data

REL_TOL = 1e-4  # losses per step, FSDP x2 against one process: only the summation order differs
# Logits of a reloaded folder against the trained model in memory, relative to the largest logit: the same fp32
# weights, so only the order of a few sums differs (a merged adapter adds B @ A into the weight once).
SAME_WEIGHTS_TOL = 1e-5
# FSDP's and PP's final/ against the single process's trained model: three steps from weights ~1e-7 apart.
FSDP_WEIGHTS_TOL = 1e-3
CASES = [(family, method) for family in FAMILIES for method in METHODS]
IDS = [f"{family}-{method}" for family, method in CASES]
OTHER_SETUPS = ("ddp", "mp", "pp")


@pytest.fixture(autouse=True)
def _one_thread():
    """This module's tiny forwards on one thread: on the 2 shared cores of a busy machine, two threads spinning
    against each other made them 7 times slower (14 s against 2 s for three export cases)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """Every family's model folder (``models/<family>``) and the chat data, nothing trained yet."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_family_folder(root / "models" / family, family, tokenizer=tokenizer)
    write_chat_data(root / "chat.jsonl", rows=120)
    return root


@pytest.fixture(scope="module")
def root(models):
    """``models`` and all runs of all cases (one process and MP; FSDP, DDP and PP x2)."""
    root = models
    env = shardtune_env(root) | {"PYTHONPATH": str(REPO)}
    worker = ["-m", "tests.families_worker", str(root)]
    for command in ([sys.executable, *worker, "single", "mp"],
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     *worker, "fsdp", "ddp", "pp"]):
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stderr[-4000:]
    return root


def run_dir(root, mode: str, family: str, method: str):
    return root / mode / f"{family}-{method}"


def shardtune(*args: str, capsys) -> tuple[int, str]:
    """A ``shardtune`` command in this process (its imports paid once); (exit code, stdout + stderr)."""
    from shardtune.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def trained(run) -> dict[str, torch.Tensor]:
    return torch.load(run / "trained_logits.pt", weights_only=True)


def logits_of(folder, root, family: str, method: str, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits of a saved model folder, or of an adapter folder on the family's base model."""
    from transformers import AutoModelForCausalLM

    if method == "lora":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(root / "models" / family, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits.float()


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    return ((other - reference).abs().max() / reference.abs().max()).item()


def ran_as(run) -> dict:
    """The run's summary.json: checkpointing and the layouts leave the losses as they are, so the summary says
    which strategy on how many processes actually ran."""
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("family,method", CASES, ids=IDS)
def test_fsdp_two_processes_checkpointed_equal_one_process(root, family, method):
    """Equal losses hold with or without checkpointing: the FSDP run's rank 0 also ran layer 0's attention twice
    a step (its one micro-batch forward, then recomputed in backward), where without checkpointing it runs once."""
    single = losses(run_dir(root, "single", family, method))
    fsdp = losses(run_dir(root, "fsdp", family, method))
    assert len(single) == len(fsdp) == STEPS
    assert single[-1] < single[0] - 0.1, single  # it learns, so equal losses say something
    for step, (a, b) in enumerate(zip(single, fsdp), start=1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: one process {a}, FSDP x2 {b}"
    summary = ran_as(run_dir(root, "fsdp", family, method))
    assert (summary["strategy"], summary["world_size"]) == ("FSDP", 2)
    assert summary["layer_0_attention_calls"] == 2 * STEPS, "gradient checkpointing recomputed nothing"


@pytest.mark.parametrize("mode", OTHER_SETUPS)
@pytest.mark.parametrize("family,method", CASES, ids=IDS)
def test_ddp_mp_and_pp_equal_one_process(root, family, method, mode):
    """DDP x2 with accumulation, MP (two CPU "devices") and PP (2 stages of 2 micro-batches), all running the
    model's own decoder forward with the runner's masks: packed rows of 128 tokens against a 16-token window,
    Gemma's local/global layers and per-type RoPE, soft caps, Phi-3's fused projections, Mixtral's routing, and the
    heads tied to the embeddings (Llama 3.2, Qwen, Gemma: PP adds both ends' gradients of the weight and counts it
    once in the norm)."""
    single = records(run_dir(root, "single", family, method))
    split = records(run_dir(root, mode, family, method))
    assert [r["step"] for r in split] == [r["step"] for r in single] == list(range(1, STEPS + 1))
    for a, b in zip(single, split):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(a[key]), f"step {a['step']} {key}: {a[key]} vs {mode} {b[key]}"
    # MP run as one device, or DDP as FSDP, gives these numbers too: the summary names the strategy that ran.
    summary = ran_as(run_dir(root, mode, family, method))
    assert (summary["strategy"], summary["world_size"]) == (mode.upper(), 1 if mode == "mp" else 2)


def records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("family,method", CASES, ids=IDS)
def test_first_loss_is_transformers_own_loss_document_by_document(root, family, method):
    """The trainer's step-1 loss (fused head + loss, packed rows under one 4-D mask) against transformers' forward
    of each document alone: Gemma's soft cap and embedding scale, sliding windows (16 tokens, documents of 25-40),
    Qwen's biases and norms, Phi-3's fused projections and Mixtral's routing all enter both."""
    run = run_dir(root, "single", family, method)
    first = json.loads((run / "first_batch.json").read_text())
    assert first["packed_rows"] >= 4, "too few rows of the first batch hold two documents to test the packed mask"
    assert abs(losses(run)[0] - first["document_loss"]) <= 1e-5 * first["document_loss"]


@pytest.mark.parametrize("family,method", CASES, ids=IDS)
def test_final_and_exported_checkpoints_give_the_trained_logits(root, family, method, tmp_path, capsys):
    """final/ and ``shardtune export`` of the last checkpoint (one process's, FSDP's sharded DCP from 2 ranks, and
    the pipeline's stages keyed by the unsplit model's names) load in transformers (PEFT for adapters) and give the
    trained model's logits; a tied head is saved once (the pipeline's last stage holds a copy)."""
    expected = trained(run_dir(root, "single", family, method))
    ids = expected["input_ids"]
    for mode in ("single", "fsdp", "pp"):
        run = run_dir(root, mode, family, method)
        code, output = shardtune("export", str(run / "checkpoints" / f"step-{STEPS}"), str(tmp_path / mode),
                                 capsys=capsys)
        assert code == 0, output
        final = logits_of(run / "final", root, family, method, ids)
        exported = logits_of(tmp_path / mode, root, family, method, ids)
        assert relative_error(final, exported) <= SAME_WEIGHTS_TOL, (mode, "export vs final")
        tolerance = SAME_WEIGHTS_TOL if mode == "single" else FSDP_WEIGHTS_TOL
        assert relative_error(expected["logits"], final) <= tolerance, (mode, "final vs trained")
        assert saved_names(run / "final") == saved_names(run_dir(root, "single", family, method) / "final"), mode


def saved_names(folder) -> set[str]:
    """The tensor names in a final/ folder's weights file (a tied head's weight is saved once, as one process
    saves it)."""
    from safetensors import safe_open

    name = "adapter_model.safetensors" if (folder / "adapter_config.json").exists() else "model.safetensors"
    with safe_open(folder / name, framework="pt") as weights:
        return set(weights.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_adapter_gives_the_trained_logits(root, family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    run = run_dir(root, "single", family, "lora")
    code, output = shardtune("merge", str(run / "final"), "--base", str(root / "models" / family),
                             str(tmp_path / "merged"), capsys=capsys)
    assert code == 0, output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    expected = trained(run)
    with torch.no_grad():
        logits = merged.eval()(input_ids=expected["input_ids"]).logits
    assert relative_error(expected["logits"], logits) <= SAME_WEIGHTS_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_refuses_a_full_fine_tune(root, family, tmp_path, capsys, monkeypatch):
    """Nothing to merge in a full run's final/: one line, exit 2, before any model loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(*args, **kwargs):
        raise AssertionError("merge loaded a model before refusing a full run's final/")

    for cls in (AutoModelForCausalLM, PeftModel):
        monkeypatch.setattr(cls, "from_pretrained", load)
    final = run_dir(root, "single", family, "full") / "final"
    code, output = shardtune("merge", str(final), "--base", str(root / "models" / family), str(tmp_path / "merged"),
                             capsys=capsys)
    assert code == 2 and output.count("\n") == 1, output
    assert output.startswith(f"shardtune merge: error: {final}: a whole model (config.json and its weights), not a "
                             f"PEFT adapter folder (no adapter_config.json): nothing to merge"), output
    assert not (tmp_path / "merged").exists()


def meta_counts(model_dir, method: str) -> tuple[int, int]:
    """(trainable, total) of the family's model built on meta; LoRA's from PEFT's own injection."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    total = sum(p.numel() for p in model.parameters())
    if method == "full":
        return total, total
    trainable, _ = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")) \
        .get_nb_trainable_parameters()
    return trainable, total


@pytest.mark.parametrize("family,method", CASES, ids=IDS)
def test_estimate_counts_what_peft_and_the_trainer_count(root, family, method, capsys):
    model_dir = root / "models" / family
    code, output = shardtune("estimate", str(model_dir), "--method", method,
                             *(["--lora-r", "4"] if method != "full" else []), "--json", capsys=capsys)
    assert code == 0, output
    estimate = json.loads(output[output.index("{"):output.rindex("}") + 1])
    trainable, total = meta_counts(model_dir, method)
    assert (estimate["trainable_parameters"], estimate["parameters"]) == (trainable, total)
    added = trainable if method == "lora" else 0  # the trainer's total counts the adapters too
    for mode in ("single", "fsdp"):
        summary = json.loads((run_dir(root, mode, family, method) / "summary.json").read_text())
        assert (summary["trainable_parameters"], summary["parameters"]) == (trainable, total + added), mode


# Family quirks beyond what every case above already checks.

def adapter_tensors(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


def test_phi3_lora_targets_its_fused_projections(root):
    """all-linear on Phi-3 adapts qkv_proj (q, k and v in one: 64 + 2 x 32 outputs) and gate_up_proj (2 x 128)."""
    tensors = adapter_tensors(run_dir(root, "single", "phi3", "lora"))
    shapes = {name.split(".")[-3]: t.shape for name, t in tensors.items()
              if ".layers.0." in name and ".lora_B." in name}
    assert shapes == {"qkv_proj": (128, 4), "gate_up_proj": (256, 4), "o_proj": (64, 4), "down_proj": (64, 4)}


def test_mixtral_lora_adapts_the_experts_and_the_router(root):
    tensors = adapter_tensors(run_dir(root, "single", "mixtral", "lora"))
    layer0 = {name for name in tensors if ".layers.0." in name}
    assert any(".experts." in name for name in layer0) and any(".gate." in name for name in layer0), sorted(layer0)
    assert all(t.abs().max() > 0 for name, t in tensors.items() if "lora_B" in name)  # every adapter trained


def test_qwen2_biases_train_in_full_and_stay_frozen_under_lora(root):
    from safetensors.torch import load_file

    base = load_file(root / "models" / "qwen2" / "model.safetensors")
    full = load_file(run_dir(root, "single", "qwen2", "full") / "final" / "model.safetensors")
    biases = [name for name in base if name.endswith("_proj.bias")]
    assert len(biases) == 2 * 3  # q, k and v in each of 2 layers
    for name in biases:
        assert (full[name] - base[name]).abs().max() > 1e-4, f"{name} did not train"
    lora = run_dir(root, "single", "qwen2", "lora")
    adapters = adapter_tensors(lora)
    assert not any("bias" in name for name in adapters)
    # Frozen, not only unsaved: what trained is exactly the adapters saved (a base bias set to train was not seen).
    trained = json.loads((lora / "summary.json").read_text())["trainable_parameters"]
    assert trained == sum(t.numel() for t in adapters.values())


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_packed_masks_carry_the_sliding_window(family, tokenizer):
    """Three documents packed in one row, two longer than the 16-token window: with the runner's masks the row's
    loss is the sum of each document's alone; with the bare block-causal mask (what transformers passes through
    unchanged) tokens attend past the window and the loss moves by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    from shardtune.data.collate import Collator
    from shardtune.data.encode import IGNORE
    from shardtune.testing.families import family_config
    from shardtune.train.loss import token_loss_sum
    from shardtune.train.model import family_attention
    from shardtune.train.runner import attention_masks, model_inputs

    config = family_config(family, tokenizer)
    torch.manual_seed(0)
    attn = family_attention(config, "sdpa")  # Gemma 2 has no sdpa: eager, which reads an additive mask
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    docs = [30, 20, 14]
    ids = torch.randint(3, len(tokenizer), (sum(docs),), generator=torch.Generator().manual_seed(0)).tolist()
    labels = list(ids)
    for start in (0, 30, 50):
        labels[start] = IGNORE  # each document's first token is nobody's target, as BOS is
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": ids, "labels": labels, "seq_lens": docs}])
    with torch.no_grad():
        alone = sum(token_loss_sum(model(input_ids=torch.tensor([ids[a:a + n]])).logits,
                                   torch.tensor([labels[a:a + n]])) for a, n in zip((0, 30, 50), docs))
        masked = token_loss_sum(model(**model_inputs(batch, torch.device("cpu"),
                                                     masks=attention_masks(model))).logits, batch["labels"])
        bare = token_loss_sum(model(**model_inputs(batch, torch.device("cpu"))).logits, batch["labels"])
    assert abs(masked / alone - 1) <= 1e-5
    assert abs(bare / alone - 1) > 10 * 1e-5


def test_gemma2_eager_attention_is_said_in_the_log_not_as_a_python_warning(tokenizer, caplog):
    """The switch to eager was a Python UserWarning: 'shardtune/train/model.py:191: UserWarning: ...' followed by
    the source line 'attn = family_attention(config, attn)', amid the run's log lines."""
    import warnings

    from shardtune.testing.families import family_config
    from shardtune.train.model import _warn_once, family_attention

    _warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="shardtune"):
        warnings.simplefilter("always")
        assert family_attention(family_config("gemma2", tokenizer), "sdpa") == "eager"
    assert not caught
    assert "Gemma2ForCausalLM has no sdpa attention, using eager instead" in caplog.text


def with_config(root, family: str, folder, **changes):
    """A copy of ``family``'s model folder whose config.json has ``changes``."""
    import shutil

    shutil.copytree(root / "models" / family, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


def test_the_router_auxiliary_loss_is_refused_not_dropped(models, tmp_path, capsys):
    """A Mixtral whose config asks for the router's auxiliary loss, which the trainer's loss does not add: one
    process (the runner of MP, DDP and FSDP too) and a pipeline stage refuse it in one line, before any step."""
    from transformers import AutoModelForCausalLM

    from shardtune.errors import UsageError
    from shardtune.train.pipeline_parallel import keep_stage

    model_dir = with_config(models, "mixtral", tmp_path / "mixtral", output_router_logits=True)
    out = tmp_path / "run"
    args = case_args(models, "mixtral", "full", "single")
    args[args.index("--model_name_or_path") + 1], args[args.index("--output_dir") + 1] = str(model_dir), str(out)
    code, output = shardtune("train", *args, capsys=capsys)
    refusal = [line for line in output.splitlines() if "output_router_logits is true" in line]
    assert code == 2 and len(refusal) == 1 and str(model_dir / "config.json") in refusal[0], output[-2000:]
    assert "Traceback" not in output and not (out / "metrics.jsonl").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(UsageError, match="output_router_logits is true"):
        keep_stage(model, (0, 1), first=True, last=False)


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_pipeline_refuses_added_token_rows_shared_by_a_tied_head(models, family):
    """PEFT trains the rows of tokens a tokenizer added in the embeddings, and a tied head holds the same tensor:
    the pipeline's two ends would train it apart, so PP refuses it in one line. An untied head (Mistral) has rows
    of its own, and a tied head's own weight (full fine-tuning, above) is trained as one: both are split."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.errors import UsageError
    from shardtune.train.pipeline_parallel import keep_stage

    model = AutoModelForCausalLM.from_pretrained(models / "models" / family)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"],
                                             trainable_token_indices={"embed_tokens": [1, 2]}))
    if family == "mistral":
        keep_stage(model, (0, 1), first=True, last=False)
        return
    with pytest.raises(UsageError, match="ties its LM head") as refused:
        keep_stage(model, (0, 1), first=True, last=False)
    assert "\n" not in str(refused.value)
