"""Pipeline parallel on 2 gloo processes gives the losses, gradient norms, eval losses and weights of one process,
and a killed pipeline run resumes exactly.

The one-process references run in this process (``train(cfg)``); the pipeline runs as ``shardtune launch`` runs
them, both in one pair of gloo processes (tests/trainutil.py ``train_jobs``), the killed one through ``shardtune
launch`` itself. fp32, no dropout: the only differences are summation order.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.faults import CALLBACK as FAULTS
from tests.faults import fault_env
from tests.trainutil import flags, run_shardtune, train_jobs, write_chat_data

TOL = 1e-4
# Trained weights against one process's: AdamW moves each weight by up to the learning rate (1e-2 here) a step,
# whatever its gradient's size, so where a gradient is near zero the last bits of sums taken in another order (the
# stages' boundary, another CPU's kernels) move it by a share of that. 1% of one step; a tensor left untrained or
# taken from another stage is off by whole steps.
WEIGHT_TOL = 1e-4
STEPS = 3
# Evaluate after every step: eval batches of 8 rows (training: 4) and each switch between the schedule's training
# and evaluation modes are exercised, and a resumed run evaluates again.
EVAL = ["--eval_strategy", "steps", "--eval_steps", "1", "--eval_split_ratio", "0.05"]
ONE_F_ONE_B = ["--pipeline_schedule", "1F1B", "--pipeline_microbatches", "2"]
LORA = ["--use_peft_lora", "True", "--gradient_accumulation_steps", "2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.families import make_family_folder
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("pipeline")
    model = make_model_folder(root / "model", num_layers=4)
    make_family_folder(root / TIED, "qwen2")  # a head tied to the embeddings
    data = write_chat_data(root / "chat.jsonl")
    return root, model, data


def args(assets, out: str, extra: list[str]) -> list[str]:
    """The job, in fp32 (not this machine's bf16 default): the pipeline must do one process's arithmetic, checked at
    1e-4, and bf16 rounds the two layouts differently."""
    root, model, data = assets
    model = root / TIED if out in ON_TIED else model
    return flags("--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                 "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS), "--logging_steps", "1",
                 "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--output_dir", str(root / out),
                 "--per_device_train_batch_size", "4", "--bf16", "false", *extra)


def one_process(assets, out: str, extra: list[str]) -> list[dict]:
    from shardtune.train.loop import train

    train(load_train_config(args(assets, out, extra)))
    return records(assets[0] / out)


# LoRA's variants whose tensors are not lora_A/lora_B: DoRA's magnitudes, a trained copy of the last stage's head
# (modules_to_save), every bias (this Llama has none in its linears; the norms' weights are not biases).
LORA_EXTRAS = [*LORA, "--use_dora", "True", "--lora_modules_to_save", "lm_head", "--lora_bias", "all"]
# LoRA on the first decoder layer only: the last stage holds no trainable parameter.
FIRST_STAGE = [*LORA, "--lora_target_modules", "layers.0.self_attn.q_proj"]
TIED = "tied"  # the folder (in the module's root) of a tiny Qwen2, whose head is tied to its embeddings
# PEFT trains a copy of each end of that tied head, each with its own gradient (lora_modules_to_save both ends).
TIED_COPIES = [*LORA, "--lora_modules_to_save", "embed_tokens,lm_head"]
PIPELINES = {"pp_1f1b": [*EVAL, *ONE_F_ONE_B],
             # offloading the checkpointed inputs changes no number; each stage offloads its own layers' only
             "pp_gpipe_lora": [*LORA, "--pipeline_schedule", "GPipe", "--pipeline_microbatches", "4",
                               "--activation_offloading", "true"],
             "pp_lora_extras": [*LORA_EXTRAS, *ONE_F_ONE_B],
             "pp_tied_copies": [*TIED_COPIES, *ONE_F_ONE_B],
             "pp_first_stage": [*FIRST_STAGE, *ONE_F_ONE_B, "--save_strategy", "steps", "--save_steps", "2"],
             # after pp_first_stage (the jobs run in this order): on from its step-2 checkpoint
             "pp_first_stage_resumed": [*FIRST_STAGE, *ONE_F_ONE_B, "--resume_from_checkpoint",
                                        "{root}/pp_first_stage/checkpoints/step-2"]}
ON_TIED = {"pp_tied_copies", "ref_tied_copies"}  # the runs of the tied model


@pytest.fixture(scope="module")
def pipelines(assets) -> dict[str, str]:
    """Both pipeline runs of PIPELINES, as ``shardtune launch --num_processes 2 train`` runs them, in one pair of
    processes (train_jobs): each run's error, or ""."""
    root = assets[0]
    return train_jobs(root, {out: (2, [*args(assets, out, [a.format(root=root) for a in extra]), "--distributed_type",
                                       "PP", "--callbacks", "tests.setup_probe:SetupProbe"])
                             for out, extra in PIPELINES.items()})


def pipeline(assets, pipelines, out: str) -> list[dict]:
    assert not pipelines[out], pipelines[out]
    return records(assets[0] / out)


def launched(assets, out: str, extra: list[str]) -> list[dict]:
    """A pipeline run through ``shardtune launch`` itself."""
    result = run_shardtune(["launch", "--num_processes", "2", "train", *args(assets, out, extra),
                            "--distributed_type", "PP"], assets[0])
    assert result.returncode == 0, result.stderr[-3000:]
    return records(assets[0] / out)


def records(out, key: str = "loss") -> list[dict]:
    """The training records (``key`` loss) or the eval records (``eval_loss``): one per step."""
    found = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in found if key in r]
    assert [r["step"] for r in found] == list(range(1, STEPS + 1)) and all(math.isfinite(r[key]) for r in found)
    return found


def assert_same(reference: list[dict], other: list[dict]) -> None:
    for ref, got in zip(reference, other):
        for key in ("loss", "grad_norm"):
            assert abs(ref[key] - got[key]) <= TOL * abs(ref[key]), \
                f"step {ref['step']} {key}: {ref[key]} vs {got[key]}"
        assert ref["tokens"] == got["tokens"] and ref["target_tokens"] == got["target_tokens"]


def assert_same_eval(reference_out, other_out) -> None:
    for ref, got in zip(records(reference_out, "eval_loss"), records(other_out, "eval_loss")):
        assert abs(ref["eval_loss"] - got["eval_loss"]) <= TOL * ref["eval_loss"], f"step {ref['step']}: {ref} vs {got}"
        assert ref["eval_tokens"] == got["eval_tokens"] > 0


@pytest.fixture(scope="module")
def full_runs(assets, pipelines) -> tuple[list[dict], list[dict]]:
    """The one-process full fine-tune and its 1F1B pipeline twin, both evaluating after every step."""
    return one_process(assets, "ref_full", EVAL), pipeline(assets, pipelines, "pp_1f1b")


def test_pp_1f1b_full_finetune_matches_one_process(assets, full_runs):
    from tests.setup_probe import probe

    reference, piped = full_runs
    assert_same(reference, piped)
    # 1F1B, 2 micro-batches of the 4 rows: the last stage runs each one's backward right after its forward (step 1
    # also begins with one forward and backward of a micro-batch before the pattern)
    schedule = probe(assets[0] / "pp_1f1b", rank=1)["schedule"]
    assert schedule[-4:] == ["F2", "B", "F2", "B"] and set(schedule) == {"F2", "B"}
    assert_same_eval(assets[0] / "ref_full", assets[0] / "pp_1f1b")
    # The exported model is the whole unsplit model with the weights one process trained.
    from safetensors.torch import load_file

    ref = load_file(str(assets[0] / "ref_full" / "final" / "model.safetensors"))
    got = load_file(str(assets[0] / "pp_1f1b" / "final" / "model.safetensors"))
    start = load_file(str(assets[1] / "model.safetensors"))
    assert ref.keys() == got.keys()
    # AdamW moves a weight by about the learning rate whatever its gradient's size, so fp32 summation-order noise in
    # a near-zero gradient shows as a step-sized difference: the two runs' weights agree to 1e-3 of how far
    # training moved them (1.5e-5 of 2.0e-2 on this machine's kernels; an absolute 1e-5 held on some CPUs only).
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # it trained
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-3 * moved


def test_pp_gpipe_lora_with_accumulation_matches_one_process(assets, pipelines):
    reference = one_process(assets, "ref_lora", LORA)
    from tests.setup_probe import probe

    piped = pipeline(assets, pipelines, "pp_gpipe_lora")
    assert_same(reference, piped)
    # GPipe, 4 micro-batches of each accumulated batch's 4 rows: all forwards, then all backwards, twice (step 1
    # also begins with one forward and backward of a micro-batch before the pattern)
    schedule = probe(assets[0] / "pp_gpipe_lora", rank=1)["schedule"]
    assert schedule[-16:] == (["F1"] * 4 + ["B"] * 4) * 2 and set(schedule) == {"F1", "B"}
    from safetensors.torch import load_file

    ref = load_file(str(assets[0] / "ref_lora" / "final" / "adapter_model.safetensors"))
    got = load_file(str(assets[0] / "pp_gpipe_lora" / "final" / "adapter_model.safetensors"))
    assert ref.keys() == got.keys() and len(ref) > 0
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < WEIGHT_TOL


def test_a_stage_offloads_only_the_layers_it_runs(assets, pipelines):
    """Checkpointing, activation offloading and torch_compile were applied to the whole model before the pipeline
    split it: summary.json (and the log) said the first stage offloaded (compiled) all 4 decoder layers of the
    model. The stage is split first now, so they act on, and report, the layers it runs."""
    from tests.trainutil import job_log

    root = assets[0]
    assert not pipelines["pp_gpipe_lora"], pipelines["pp_gpipe_lora"]
    stages = re.search(r"PP stages \(decoder layers per stage\): (\d+)-(\d+),", job_log(root, "pp_gpipe_lora", 2))
    first_stage_layers = int(stages[2]) - int(stages[1]) + 1
    offloaded = json.loads((root / "pp_gpipe_lora" / "summary.json").read_text())["activation_offloading"]
    assert offloaded["layers"] == first_stage_layers < 4 and offloaded["bytes_moved"] > 0


def test_pp_final_adapter_holds_every_stages_dora_and_modules_to_save(assets, pipelines):
    """final/ of a pipeline run is PEFT's adapter of the whole model: it kept only tensors named '.lora_', so a
    trained lm_head copy (modules_to_save) was dropped without a word and DoRA's magnitudes stopped the export.
    Now it holds what one process's final/ holds, the same values, and loads into PEFT with the trained logits."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert_same(one_process(assets, "ref_lora_extras", LORA_EXTRAS), pipeline(assets, pipelines, "pp_lora_extras"))
    ref = load_file(str(assets[0] / "ref_lora_extras" / "final" / "adapter_model.safetensors"))
    got = load_file(str(assets[0] / "pp_lora_extras" / "final" / "adapter_model.safetensors"))
    assert ref.keys() == got.keys()
    assert any("lora_magnitude_vector" in k for k in ref) and any(k.endswith("lm_head.weight") for k in ref)
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < WEIGHT_TOL
    ids = torch.arange(1, 33).unsqueeze(0)
    logits = []
    for out in ("ref_lora_extras", "pp_lora_extras"):
        base = AutoModelForCausalLM.from_pretrained(str(assets[1]), dtype=torch.float32)
        logits.append(PeftModel.from_pretrained(base, str(assets[0] / out / "final")).eval()(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(str(assets[1]), dtype=torch.float32).eval()
    assert not torch.allclose(base(ids).logits, logits[0], atol=1e-3)  # the adapter trained


def test_pp_trains_the_two_copies_of_a_tied_head_apart_as_one_process_does(assets, pipelines):
    """A head tied to the embeddings, with lora_modules_to_save naming both ends: PEFT trains a copy of each, each
    with its own gradient. The pipeline added the two ends' gradients as for one tied weight (the losses drifted
    from one process's by 2% and the gradient norms by 20% within 3 steps), and final/ held the last stage's
    untrained copy of the embeddings. Now the losses, gradient norms and both trained copies are one process's."""
    from safetensors.torch import load_file

    assert_same(one_process(assets, "ref_tied_copies", TIED_COPIES), pipeline(assets, pipelines, "pp_tied_copies"))
    ref = load_file(str(assets[0] / "ref_tied_copies" / "final" / "adapter_model.safetensors"))
    got = load_file(str(assets[0] / "pp_tied_copies" / "final" / "adapter_model.safetensors"))
    start = load_file(str(assets[0] / TIED / "model.safetensors"))["model.embed_tokens.weight"]
    copies = [k for k in ref if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert ref.keys() == got.keys() and len(copies) == 2
    for k in copies:
        assert (ref[k] - start).abs().max() > 1e-3  # each copy trained, and apart from the other
    assert (ref[copies[0]] - ref[copies[1]]).abs().max() > 1e-3
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < WEIGHT_TOL


def test_a_stage_with_nothing_to_train_saves_and_resumes(assets, pipelines):
    """LoRA on the first decoder layer only leaves the last stage without a trainable parameter: its checkpoint
    stopped the run on torch's "optim state_dict is empty" (a traceback on rank 1, after the steps had run). Now it
    saves, and a run resumed on 2 stages from its step-2 checkpoint goes on as it did, one process's losses."""
    from safetensors.torch import load_file

    whole = pipeline(assets, pipelines, "pp_first_stage")
    assert_same(one_process(assets, "ref_first_stage", FIRST_STAGE), whole)
    assert not pipelines["pp_first_stage_resumed"], pipelines["pp_first_stage_resumed"]
    resumed = [json.loads(line) for line in (assets[0] / "pp_first_stage_resumed" / "metrics.jsonl").open()]
    assert [(r["step"], r["loss"]) for r in resumed] == [(STEPS, whole[-1]["loss"])]
    ref = load_file(str(assets[0] / "ref_first_stage" / "final" / "adapter_model.safetensors"))
    for out in ("pp_first_stage", "pp_first_stage_resumed"):
        got = load_file(str(assets[0] / out / "final" / "adapter_model.safetensors"))
        assert ref.keys() == got.keys() and all("layers.0." in k for k in ref)
        assert max((ref[k] - got[k]).abs().max().item() for k in ref) < WEIGHT_TOL


def test_keep_stage_keeps_original_names(assets):
    from transformers import AutoModelForCausalLM

    from shardtune.train.pipeline_parallel import keep_stage

    full = AutoModelForCausalLM.from_pretrained(str(assets[1]))
    names = set(full.state_dict())
    first = keep_stage(AutoModelForCausalLM.from_pretrained(str(assets[1])), (0, 1), first=True, last=False)
    last = keep_stage(AutoModelForCausalLM.from_pretrained(str(assets[1])), (1, 4), first=False, last=True)
    first_names, last_names = set(first.state_dict()), set(last.state_dict())
    assert first_names | last_names == names and not first_names & last_names
    assert "model.layers.3.self_attn.q_proj.weight" in last_names and "lm_head.weight" in last_names
    assert "model.embed_tokens.weight" in first_names and "model.layers.1.mlp.up_proj.weight" not in first_names


@pytest.mark.parametrize("kind, says", [
    ("granite", "scales its input embeddings (embedding_multiplier 3.0) inside the forward every stage runs"),
    ("tied-head-copy", "and the head alone is trained (lora_modules_to_save)"),
    ("tied-embeddings-copy", "and the embeddings alone is trained (lora_modules_to_save)"),
])
def test_pp_refuses_what_its_stages_would_compute_apart(kind, says):
    """Granite scales inputs_embeds in the forward each stage runs, so PP scaled the hidden states again on every
    later stage (other losses than one process's, exit 0); a trained copy of one end of a tied head
    (modules_to_save) made one stage all-reduce the tied gradient alone, and gloo aborted. Both are refused
    before any step, one line."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from shardtune.train.pipeline_parallel import keep_stage

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    if kind == "granite":
        model = transformers.AutoModelForCausalLM.from_config(transformers.GraniteConfig(**sizes,
                                                                                       embedding_multiplier=3.0))
    else:
        base = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**sizes,
                                                                                     tie_word_embeddings=True))
        saved = "lm_head" if kind == "tied-head-copy" else "embed_tokens"
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=[saved]))
    for first, last in ((True, False), (False, True)):
        with pytest.raises(UsageError, match=re.escape(says)):
            keep_stage(model, (0, 1) if first else (1, 2), first=first, last=last)


def test_pp_resume_reproduces_the_uninterrupted_run(assets, full_runs, monkeypatch):
    """Killed after its step-2 checkpoint, resumed on 2 stages: the uninterrupted run's losses, bitwise on CPU.

    The same checkpoint resumed on one process (other stage bounds, the optimizer state resharded) also goes on
    as one process would.
    """
    root = assets[0]
    extra = [*EVAL, *ONE_F_ONE_B, "--save_strategy", "steps", "--save_steps", "2"]
    for key, value in fault_env(save="after_save:2").items():
        monkeypatch.setenv(key, value)
    killed = run_shardtune(["launch", "--num_processes", "2", "train", *args(assets, "pp_killed", extra),
                            "--distributed_type", "PP", "--callbacks", FAULTS], root)
    monkeypatch.delenv("FAULT_SAVE")
    assert killed.returncode != 0 and (root / "pp_killed" / "checkpoints" / "step-2").is_dir()
    shutil.copytree(root / "pp_killed", root / "one_resumed")
    resume = [*extra, "--resume_from_checkpoint", "true"]
    resumed = launched(assets, "pp_killed", resume)
    want = {r["step"]: r["loss"] for r in full_runs[1]}
    assert {r["step"]: r["loss"] for r in resumed} == want
    assert records(root / "pp_killed", "eval_loss") == records(root / "pp_1f1b", "eval_loss")
    assert_same(full_runs[0], one_process(assets, "one_resumed", resume))
    assert_same_eval(root / "ref_full", root / "one_resumed")


@pytest.mark.parametrize("extra, message", [
    (["--pipeline_microbatches", "3"], "multiple of pipeline_microbatches=3"),
    (["--pipeline_schedule", "zigzag"], "pipeline_schedule='zigzag'"),
    (["--eval_strategy", "steps", "--per_device_eval_batch_size", "3"], "per_device_eval_batch_size=3 must be"),
    (["--eval_on_start", "true", "--per_device_eval_batch_size", "3"], "per_device_eval_batch_size=3 must be"),
    (["--fp16", "true"], "fp16 with distributed_type=PP: the pipeline's stages do not scale the loss"),
    # Reentrant checkpointing cannot give a stage the gradients of its received hidden states: a traceback on rank 1.
    (["--use_reentrant", "true"], "use_reentrant true with distributed_type=PP: a pipeline stage's backward asks"),
    # 1F1B fills the pipeline with a micro-batch per stage: torch raised it on every rank, a traceback each.
    (["--num_processes", "4", "--pipeline_microbatches", "2"],
     "pipeline_schedule 1F1B needs at least one micro-batch per stage: pipeline_microbatches=2 for 4 stages"),
])
def test_pipeline_config_errors(assets, extra, message):
    with pytest.raises(UsageError, match=message):
        load_train_config(args(assets, "bad", ["--distributed_type", "PP", *extra]))


def test_more_stages_than_layers_is_refused_before_any_process_starts(assets, monkeypatch, capsys):
    """PP (then MP, below) with 5 stages for the tiny model's 4 decoder layers: refused from its config.json in one
    line naming both counts, by launch before torchrun starts a rank, and by each rank's train before its data is
    tokenised (it was refused only once the stages were placed, after tokenising). 4 stages are accepted."""
    from shardtune.cli import main
    from shardtune.cli.common import load_job_config

    started = []
    monkeypatch.setattr("shardtune.cli.launch.run_torchrun", lambda argv: started.append(argv) or 0)
    job = [*args(assets, "five", ["--distributed_type", "PP", "--pipeline_schedule", "GPipe"])]
    model = assets[1]
    says = (f"distributed_type=PP runs one pipeline stage per process: 5 stages for the 4 decoder layers of "
            f"model_name_or_path '{model}' ({model}/config.json: num_hidden_layers); launch 4 processes or fewer "
            f"(--num_processes 4)")
    assert main(["launch", "--num_processes", "5", "train", *job]) == 2
    err = capsys.readouterr().err
    assert started == [] and err.count("\n") == 1 and f"command line (--num_processes): {says}" in err, err
    with pytest.raises(UsageError) as refused:  # what each rank reads first
        load_job_config([*job, "--num_processes", "5"])
    assert str(refused.value) == f"command line (--num_processes): {says}"
    assert main(["launch", "--num_processes", "4", "train", *job]) == 0 and len(started) == 1
    # MP: one stage per device of mp_devices, refused the same way (it failed only when placing its stages).
    mp = [*args(assets, "mp", ["--distributed_type", "MP"]), "--mp_devices"]
    with pytest.raises(UsageError) as refused:
        load_job_config([*mp, "cpu,cpu,cpu,cpu,cpu"])
    assert str(refused.value) == (
        f"command line (--mp_devices): distributed_type=MP runs one model-parallel stage per device: 5 stages for "
        f"the 4 decoder layers of model_name_or_path '{model}' ({model}/config.json: num_hidden_layers); name 4 "
        f"devices or fewer in mp_devices")
    assert load_job_config([*mp, "cpu,cpu,cpu,cpu"]).distributed.mp_devices == "cpu,cpu,cpu,cpu"


def test_pp_config_is_accepted(assets):
    """A PP recipe with every PP key off its default, lower-case spellings included, keeps each as given."""
    cfg = load_train_config(args(assets, "ok", ["--distributed_type", "pp", "--pipeline_schedule", "gpipe",
                                                "--pipeline_microbatches", "4", *EVAL,
                                                "--resume_from_checkpoint", "true"]))
    d = cfg.distributed
    assert (d.distributed_type, d.pipeline_schedule, d.pipeline_microbatches) == ("PP", "GPipe", 4)
    # GPipe runs any number of micro-batches through any number of stages.
    assert load_train_config(args(assets, "ok", ["--distributed_type", "PP", "--pipeline_schedule", "GPipe",
                                                 "--num_processes", "4", "--pipeline_microbatches", "2"]))
    assert cfg.run.eval_strategy == "steps" and cfg.checkpoint.resume_from_checkpoint == "true"
