"""The optimizers ``optim`` names: the state bytes the trainer's optimizers hold equal config/optimizers.py's table,
the estimator counts the same bytes, bad pairings are refused in one line, and every optimizer resumes exactly.

The 2-process part is one launch of tests/optim_cases.py running all cases (FSDP x2 + LoRA for bitsandbytes'
AdamW and Lion in 8 bits, whose small tensors keep fp32 state, so bitsandbytes' 32-bit path is covered too;
DDP x2 + LoRA for Adafactor, which FSDP cannot shard). SGD keeps no state (checked by the table test), so its
resume is the weights' and the data's, which tests/test_resume.py covers. Paged optimizers need CUDA: on CPU only
their refusal is tested, and their state bytes through the table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from shardtune.config import OptimConfig
from shardtune.config.optimizers import OPTIMIZERS
from shardtune.memory.optimizer_state import bytes_per_param, state_bytes
from shardtune.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
NOT_PAGED = [name for name, spec in OPTIMIZERS.items() if not spec.paged]
LORA_64 = ["--use_peft_lora", "True", "--lora_r", "64", "--lora_alpha", "64", "--lora_dropout", "0.1"]
# lora_r 64 on the tiny Llama (hidden 64): most adapters have 4096 or 8192 values, so bitsandbytes keeps them in
# 8 bits, and k/v's B (32 x 64) in fp32: both kinds of state are saved, sharded and resumed.
CASES = {
    "adamw_8bit": ["--optim", "adamw_8bit", "--distributed_type", "FSDP", *LORA_64],
    "lion_8bit": ["--optim", "lion_8bit", "--distributed_type", "FSDP", *LORA_64],
    "adafactor": ["--optim", "adafactor", "--distributed_type", "DDP", *LORA_64],
}


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage once (bitsandbytes shares its quantisation maps)."""
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def stepped(model: nn.Module, optim: str, device: str = "cpu") -> torch.optim.Optimizer:
    """``optim`` built as the trainer builds it, after one step (the states exist from the first step)."""
    torch.manual_seed(0)
    model.to(device)
    optimizer = build_optimizer(model, OptimConfig(optim=optim, learning_rate=1e-3), torch.device(device))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config

    return AutoModelForCausalLM.from_config(tiny_llama_config(300))


@pytest.mark.parametrize("optim", NOT_PAGED)
def test_the_trainers_optimizer_holds_the_state_bytes_of_the_table(tiny_model, optim):
    """A whole tiny Llama: embeddings (300 x 64), 64 x 64 and 32 x 64 projections, 128 x 64 MLPs, 64-value norms,
    so bitsandbytes' 8-bit and fp32 (under 4096 values) states both occur; the embeddings' is fp32 under every
    8-bit optimizer."""
    embedding = tiny_model.get_input_embeddings().weight
    shapes = [tuple(p.shape) for p in tiny_model.parameters() if p is not embedding]
    held = state_nbytes(stepped(tiny_model, optim))
    assert held == state_bytes(optim, shapes, weight_bytes=4, embedding_shapes=[tuple(embedding.shape)])


@pytest.mark.parametrize("optim", ["adamw_8bit", "lion_8bit"])
def test_8bit_optimizers_step_as_transformers_trainer_steps_them(tiny_model, optim):
    """The optimizer Transformers' Trainer makes for ``optim`` and shardtune's, on the same weights and gradients,
    make the same weights over 3 steps, bit for bit: the Trainer keeps the embedding's state in fp32 under its
    8-bit optimizers, which shardtune did not (its embedding drifted 1e-3 from the Trainer's in 5 steps)."""
    import copy

    from transformers import Trainer, TrainingArguments

    ours, theirs = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    args = TrainingArguments(output_dir="unused", optim=optim, learning_rate=1e-3, weight_decay=0.1, report_to=[],
                             use_cpu=True)
    pair = [build_optimizer(ours, OptimConfig(optim=optim, learning_rate=1e-3, weight_decay=0.1),
                            torch.device("cpu")), Trainer(model=theirs, args=args).create_optimizer()]
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=generator) for p in tiny_model.parameters()]
            for model, optimizer in zip((ours, theirs), pair):
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.clone()
                optimizer.step()
    finally:  # the Trainer's override lives in bitsandbytes' process-wide manager, by parameter id: clear it
        import bitsandbytes

        bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()
    assert pair[0].state[ours.get_input_embeddings().weight]["state1"].dtype == torch.float32
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_8bit_states_are_a_quarter_of_adamw_by_the_expected_bytes():
    """One 64 x 128 weight: AdamW 2 x 4 bytes a value + its step; 8-bit AdamW 2 x (1 byte + 4 / 256), plus the two
    256-entry maps; Lion one moment."""
    weight = nn.Linear(128, 64, bias=False)
    measured = {name: state_nbytes(stepped(weight, name)) for name in ("adamw_torch", "adamw_8bit", "lion_8bit")}
    assert measured["adamw_torch"] == 8192 * 8 + 4
    assert measured["adamw_8bit"] == 8192 * 2 + 2 * 4 * 32 + 2 * 1024
    assert measured["lion_8bit"] == 8192 + 4 * 32 + 1024
    # Per weight, without the shared maps: 2.03 bytes against 8.
    assert (measured["adamw_8bit"] - 2 * 1024) / 8192 == 2 * (1 + 4 / 256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("optim") / "M")


@pytest.mark.parametrize("optim,alias", [("adamw_torch", "adamw"), ("adamw_8bit", "adamw-8bit"), ("lion_8bit", None),
                                         ("lion_32bit", None), ("adafactor", None), ("sgd", None),
                                         ("paged_adamw_8bit", None), ("paged_adamw_32bit", None)])
def test_estimators_optimizer_bytes_equal_the_trainers(model_dir, capsys, optim, alias):
    """LoRA r 64 on q_proj and o_proj of the tiny Llama (hidden 64): eight 64 x 64 adapters, whose size is a whole
    number of 256-value blocks, so the estimator's per-weight rate is exact but for the per-tensor and shared
    constants (torch's step, Adafactor's RMS, bitsandbytes' maps), which the table adds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main

    def estimate(name: str) -> dict:
        assert main(["estimate", str(model_dir), "--method", "lora", "--lora-r", "64", "--lora-target-modules",
                     "q_proj,o_proj", "--optimizer", name, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    data = estimate(optim)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=64, lora_alpha=64, target_modules=["q_proj", "o_proj"]))
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    assert data["trainable_parameters"] == sum(math.prod(s) for s in shapes) == 8 * 4096
    assert data["per_gpu"]["optimizer"] == 8 * 4096 * bytes_per_param(optim, 4, (64, 64))
    # What the per-weight rate leaves out: a 4-byte step (torch) or RMS (Adafactor) per tensor; a 1 KiB map per
    # 8-bit moment, shared.
    spec = OPTIMIZERS[optim]
    per_tensor = 4 if optim in ("adamw_torch", "adafactor") else 0
    shared = 1024 * spec.moments if spec.state_bits == 8 else 0
    table = state_bytes(optim, shapes, weight_bytes=4)
    assert table == data["per_gpu"]["optimizer"] + 8 * per_tensor + shared
    if not OPTIMIZERS[optim].paged:
        assert state_nbytes(stepped(model, optim)) == table
    else:  # the state of its unpaged twin (whose case checks it against the trainer's), paged; built only on CUDA
        twin = {"paged_adamw_8bit": "adamw_8bit", "paged_adamw_32bit": "adamw_torch"}[optim]
        assert data["per_gpu"]["optimizer"] == estimate(twin)["per_gpu"]["optimizer"]
        if torch.cuda.is_available():
            assert state_nbytes(stepped(model, optim, "cuda")) == table
    if alias:
        assert estimate(alias)["per_gpu"]["optimizer"] == data["per_gpu"]["optimizer"]


def _refusal(capsys, argv: list[str]) -> str:
    """Exit code 2 and exactly one stderr line besides progress bars (trainutil.refused): the refusal."""
    from tests.trainutil import refused

    err = refused(capsys, argv)
    assert err.startswith("shardtune ") and ": error: " in err, err
    return err


WARMING = ("linear, cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts, polynomial, "
           "inverse_sqrt, warmup_stable_decay or constant_with_warmup")


@pytest.mark.parametrize("args,says", [
    (["--optim", "adamw_apex_fused"], "optim='adamw_apex_fused' is not accepted; use one of adamw_torch,"),
    # Transformers' torchao optimizers were answered 'did you mean adamw_torch?', 4 or 8 times their state.
    (["--optim", "adamw_torch_8bit"], "optim=adamw_torch_8bit: torchao's 8-bit AdamW is not run here; use adamw_8bit, "
     "bitsandbytes' 8-bit AdamW, with the same state bytes (adamw_torch keeps 4 times as many)"),
    (["--optim", "adamw_torch_4bit"], "optim=adamw_torch_4bit: torchao's 4-bit AdamW is not run here; use adamw_8bit"),
    (["--optim", "adafactor", "--distributed_type", "FSDP"], "use DDP (or one process) for adafactor"),
    (["--optim", "lion_8bit", "--adam_epsilon", "1e-6"], "adam_epsilon=1e-06 does nothing with optim lion_8bit"),
    (["--optim", "sgd", "--adam_beta1", "0.8"], "adam_beta1=0.8 does nothing with optim sgd"),
    # torch's AdamW raised ValueError with a traceback after the model had loaded
    (["--adam_beta1", "1.5"], "adam_beta1=1.5 must be in [0, 1)"),
    (["--adam_beta2", "-0.1"], "adam_beta2=-0.1 must be in [0, 1)"),
    (["--adam_epsilon", "-1e-8"], "adam_epsilon=-1e-08 must not be negative"),
    # Accepted: the first step made NaN of every weight with a zero gradient, and the stop blamed learning_rate.
    (["--adam_epsilon", "0"], "adam_epsilon=0 turns every weight whose gradient is 0 so far (unused embedding rows; "
     "LoRA's A at the first step) into NaN with optim adamw_torch; use a small positive value such as 1e-8"),
    (["--adam_epsilon", "0", "--optim", "adamw_8bit", "--use_peft_lora", "true"], "adam_epsilon=0 turns every"),
    (["--lr_scheduler_type", "constant", "--warmup_steps", "2"], "warmup_steps=2 set without lr_scheduler_type "
     f"{WARMING}: it acts only with it; set lr_scheduler_type {WARMING}, or leave it out"),
    (["--lr_scheduler_type", "constant", "--warmup_ratio", "0.1"], "warmup_ratio=0.1 set without lr_scheduler_type "
     f"{WARMING}"),
    pytest.param(["--optim", "paged_adamw_8bit"], "no CUDA GPU is visible; use optim adamw_8bit",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="paged optimizers run on CUDA")),
    pytest.param(["--optim", "paged_adamw_32bit"], "use optim adamw_torch (the same optimizer, not paged)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="paged optimizers run on CUDA")),
])
def test_optimizer_settings_that_cannot_act_are_refused_in_one_line(model_dir, tmp_path, capsys, args, says):
    data = tmp_path / "chat.jsonl"
    data.write_text("")
    err = _refusal(capsys, ["train", "--model_name_or_path", str(model_dir), "--dataset_name", str(data),
                            "--output_dir", str(tmp_path / "out"), *args])
    assert says in err


def test_estimator_refuses_an_optimizer_it_does_not_know(model_dir, capsys):
    err = _refusal(capsys, ["estimate", str(model_dir), "--optimizer", "rmsprop"])
    assert "unknown optimizer 'rmsprop'" in err and "adamw_8bit" in err
    # Transformers' torchao names: as train's optim refuses them, not 'Did you mean adamw_torch?'
    err = _refusal(capsys, ["estimate", str(model_dir), "--optimizer", "adamw_torch_8bit"])
    assert err.endswith("--optimizer adamw_torch_8bit: torchao's 8-bit AdamW is not run here; use adamw_8bit, "
                        "bitsandbytes' 8-bit AdamW, with the same state bytes (adamw_torch keeps 4 times as many)")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """Every case of CASES trained on two gloo processes: uninterrupted, and resumed from its step 2 (optim_cases)."""
    from shardtune.testing.tiny import make_model_folder
    from tests.ports import held_stores
    from tests.trainutil import run_ranks, shardtune_env, write_sum_rows

    work = tmp_path_factory.mktemp("optim_resume")
    make_model_folder(work / "M")
    write_sum_rows(work / "chat.jsonl")
    stores = held_stores(2 * len(CASES))  # one per run, held here until both ranks are done
    ports = ",".join(str(store.port) for store in stores)
    logs = [work / f"rank{r}.log" for r in range(2)]
    codes = run_ranks(["-m", "tests.optim_cases", str(work), ports, json.dumps(CASES)],
                      shardtune_env(work) | {"PYTHONPATH": str(REPO)}, logs, timeout=600)
    assert codes == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    return work


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.parametrize("name", list(CASES))
def test_each_optimizer_resumes_its_sharded_state_exactly(resumed, name):
    """The resumed run logs the uninterrupted run's losses bitwise, and the optimizer state it loaded is, tensor
    for tensor on each rank, the state the cut run had when it saved (8-bit codes, absmax and maps included)."""
    ref, again = _losses(resumed / f"{name}_ref"), _losses(resumed / f"{name}_resumed")
    assert [s for s, _ in again] == [3, 4]
    assert again == ref[2:]
    for rank in (0, 1):
        report = json.loads((resumed / f"{name}_loaded_{rank}.json").read_text())
        assert report["differ"] == []
        want = {"adafactor": {"torch.float32"}}.get(
            name, {"torch.uint8", "torch.float32"})
        assert set(report["compared"]) == want, report


def test_8bit_state_made_over_two_shards_is_not_resumed_on_one(resumed, tmp_path, capsys):
    """The FSDP x2 checkpoint's 8-bit blocks were cut per shard: one process would read codes against another
    block's scale, so the resume is refused in one line (the same global batch, so nothing else stops it)."""
    import shutil

    from tests.optim_cases import COMMON
    from tests.trainutil import flags

    out = tmp_path / "one"
    shutil.copytree(resumed / "adamw_8bit_ref", out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    shutil.rmtree(out / "final")  # a run that has not ended (one that has is left as it is, nothing resumed)
    (out / "summary.json").unlink()
    argv = flags("--model_name_or_path", str(resumed / "M"), "--dataset_name", str(resumed / "chat.jsonl"), *COMMON,
                 *CASES["adamw_8bit"], "--distributed_type", "NO", "--gradient_accumulation_steps", "4",
                 "--output_dir", str(out), "--resume_from_checkpoint", "true")
    err = _refusal(capsys, ["train", *argv])
    assert "8-bit optimizer state was made over 2 shard(s) of each weight and this run has 1" in err


def test_resume_keeps_the_optimizer_whose_state_the_checkpoint_holds(tmp_path):
    """Another optimizer cannot read the checkpoint's state; another name of the same one can."""
    from shardtune.config.loading import load_train_config
    from shardtune.errors import UsageError
    from shardtune.train.resume import check_resume

    def cfg(optim: str):
        return load_train_config(["--model_name_or_path", "M", "--dataset_name", "chat.jsonl", "--output_dir",
                                  str(tmp_path), "--optim", optim])

    check_resume(tmp_path, cfg("adamw_torch"), cfg("adamw_torch_fused"), saved_world=1, world=1)
    check_resume(tmp_path, cfg("adamw_bnb_8bit"), cfg("adamw_8bit"), saved_world=1, world=1)
    with pytest.raises(UsageError, match="optim was 'adamw_8bit' when the checkpoint was saved and is 'lion_8bit'"):
        check_resume(tmp_path, cfg("adamw_8bit"), cfg("lion_8bit"), saved_world=1, world=1)


def test_a_paged_optimizer_is_not_built_for_a_cpu_run():
    """Where a job reaches the trainer without the command's checks (train() called from Python)."""
    from shardtune.errors import UsageError

    with pytest.raises(UsageError, match="use optim lion_8bit"):
        build_optimizer(nn.Linear(4, 4), OptimConfig(optim="paged_lion_8bit"), torch.device("cpu"))


def test_estimator_counts_the_embeddings_fp32_state_under_8bit_optimizers(model_dir, capsys):
    """Full fine-tuning with adamw_8bit: 2 x (1 + 4/256) bytes of state per weight, but 2 x 4 for the embedding's,
    which the trainer keeps in fp32 (it was counted at the 8-bit rate)."""
    from transformers import AutoConfig

    from shardtune.cli import main

    assert main(["estimate", str(model_dir), "--method", "full", "--optimizer", "adamw_8bit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    config = AutoConfig.from_pretrained(model_dir)
    embedding = config.vocab_size * config.hidden_size
    rest = data["trainable_parameters"] - embedding
    assert data["per_gpu"]["optimizer"] == pytest.approx(rest * 2 * (1 + 4 / 256) + embedding * 8)
