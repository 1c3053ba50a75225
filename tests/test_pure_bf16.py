"""Pure bf16 training (``torch_dtype: bfloat16``): bf16 weights, gradients and AdamW moments, no fp32 master.

- The update: plain bf16 AdamW rounds small steps away; the stochastically rounded one follows fp32 AdamW.
- The state: bf16 everywhere, the moments half of fp32 AdamW's bytes, the total what the estimator's table counts.
- Real runs: one process against FSDP2 on two gloo processes (losses within one bf16 rounding unit), an exact
  resume (losses and final weights bitwise), bf16 export; the same for QLoRA (bf16 adapters on the 4-bit base);
  the trace against the formula; refusals, exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from shardtune.train.bf16_adamw import BF16AdamW, round_to_bf16
from tests.trainutil import flags, losses, run_shardtune, shardtune_env, write_chat_data

# One bf16 rounding unit (8 significant bits): one process and FSDP2 run the same bf16 arithmetic in another
# order (the loss's per-rank partial sums, bf16 gradients reduced over two ranks), so their mean losses differ by
# rounding alone; a real divergence (a lost or doubled gradient at lr 1e-3) moves the loss by ~1e-2 relative.
BF16_REL_TOL = 2.0 ** -9
STEPS = 4


def _quadratic_run(kind: str, w0: torch.Tensor, target: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    param = torch.nn.Parameter(w0.to(dtype, copy=True))
    opt = (BF16AdamW([param], lr=lr) if kind == "stochastic" else
           torch.optim.AdamW([param], lr=lr, weight_decay=0.0, foreach=False))
    for _ in range(steps):
        param.grad = (param.detach().float() - target).to(dtype)  # gradient of 0.5 |w - target|^2
        opt.step()
    return param.detach().float()


def test_plain_bf16_adamw_stalls_where_stochastic_rounding_follows_fp32():
    """lr 1e-5 on weights ~1 (bf16 spacing 2^-7): each step is ~1/800 of a spacing. Measured on the fp32 run's
    displacement d: plain bf16 moves 0.4% of it, the stochastic rounding 100.7% (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 64, generator=gen).bfloat16().float()
    target = w0 + 0.01 * torch.randn(64, 64, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4096-value ops: waking a second thread on busy shared cores costs more than they do
    try:
        fp32, plain, rounded = (_quadratic_run(kind, w0, target, 1e-5, 300)
                                for kind in ("fp32", "bf16", "stochastic"))
    finally:
        torch.set_num_threads(threads)
    d = fp32 - w0

    def share(w):  # the part of fp32's displacement this run made
        return float((w - w0).mul(d).sum() / d.square().sum())

    assert abs(share(plain)) < 0.05
    assert 0.9 < share(rounded) < 1.1
    # Its distance to the target closes most of what fp32's does; plain bf16's hardly moves.
    start, reached = (w0 - target).norm(), (fp32 - target).norm()
    assert (start - (rounded - target).norm()) > 0.6 * (start - reached)
    assert (start - (plain - target).norm()) < 0.05 * (start - reached)


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    """A quarter of a spacing above each of the 128 bf16 values in [1, 2), rounded at 400 steps (a weight that
    keeps getting the same small update): rounding to nearest loses it every time, the stochastic rounding keeps it
    on average (the mean of 51,200 draws has a standard deviation of 0.002 spacings; the bound is 0.01); values
    that are bf16 already come back unchanged (DCP's lr-0 step): every finite bf16 value at 16 steps, 2^20 draws,
    so that a carry the 16 random bits cause one time in 65,536 (an off-by-one in the addition) is seen."""
    grid = 1 + torch.arange(128, dtype=torch.float32) / 128
    spacing = 2.0 ** -7
    values = grid + spacing / 4
    assert float((values.bfloat16().float() - values).mean()) == pytest.approx(-spacing / 4)
    for sign in (1, -1):
        errors = [round_to_bf16(sign * values, step).float() - sign * values for step in range(1, 401)]
        assert abs(float(torch.stack(errors).mean())) < spacing / 100
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    exact = patterns[~torch.isnan(patterns)].float()
    assert all(torch.equal(round_to_bf16(exact, step).float(), exact) for step in range(1, 17))


def _one_step(model, *, pure: bool):
    from shardtune.config import OptimConfig
    from shardtune.train.optim import build_optimizer

    opt = build_optimizer(model, OptimConfig(learning_rate=1e-3), torch.device("cpu"), pure_bf16=pure)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_weights_and_optimizer_state_are_bf16_and_half_of_fp32(tiny_model):
    from shardtune.config import LoraConfig, ModelConfig
    from shardtune.memory.optimizer_state import state_bytes
    from shardtune.train.model import Precision, apply_lora, load_base_model

    model_cfg = ModelConfig(model_name_or_path=str(tiny_model), torch_dtype="bfloat16")
    cpu = torch.device("cpu")
    pure = load_base_model(model_cfg, LoraConfig(), Precision("no", pure_bf16=True), cpu)
    mixed = load_base_model(model_cfg, LoraConfig(), Precision("bf16"), cpu)
    assert {p.dtype for p in pure.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}  # the fp32 master copy of mixed precision
    pure_opt, mixed_opt = _one_step(pure, pure=True), _one_step(mixed, pure=False)
    assert {p.grad.dtype for p in pure.parameters()} == {torch.bfloat16}

    def moment_bytes(opt):
        return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")

    from shardtune.train.bf16_adamw import BF16AdamW

    assert isinstance(pure_opt, BF16AdamW) and not isinstance(mixed_opt, BF16AdamW)  # stochastically rounded
    states = [s for s in pure_opt.state.values()]
    assert {s["exp_avg"].dtype for s in states} | {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}
    assert 2 * moment_bytes(pure_opt) == moment_bytes(mixed_opt)
    # Everything the optimizer holds (moments and the 0-d fp32 step) is what the estimator's table counts.
    shapes = [tuple(p.shape) for p in pure.parameters()]
    held = sum(t.numel() * t.element_size() for s in states for t in s.values())
    assert held == state_bytes("adamw_torch", shapes, 2)

    lora = LoraConfig(use_peft_lora=True, lora_r=4)
    base = load_base_model(model_cfg, lora, Precision("no", pure_bf16=True), cpu)
    adapted = apply_lora(base, lora, seed=0, trainable_dtype=Precision("no", pure_bf16=True).trainable_dtype)
    trained = [p for p in adapted.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in adapted.parameters()} == {torch.bfloat16}


def _config(*extra: str):
    return load_train_config(["--model_name_or_path", "m", "--output_dir", "o", "--dataset_name", "d", *extra])


def test_dtype_is_an_alias_and_bfloat16_selects_pure_bf16():
    assert _config("--dtype", "bfloat16").model.pure_bf16
    assert _config("--torch_dtype", "bfloat16", "--dtype", "bfloat16").model.pure_bf16
    assert not _config("--torch_dtype", "auto").model.pure_bf16
    assert not _config("--torch_dtype", "float32", "--bf16", "true").model.pure_bf16


@pytest.mark.parametrize("extra, needle", [
    (["--torch_dtype", "float16"], "torch_dtype=float16: pure fp16 training diverges"),
    (["--torch_dtype", "bfloat16", "--dtype", "float32"], "torch_dtype=bfloat16 and dtype=float32 disagree"),
    (["--dtype", "int8"], "dtype='int8' is not accepted; use one of auto, float32, bfloat16"),
    (["--torch_dtype", "bfloat16", "--optim", "adamw_8bit"], "torch_dtype=bfloat16 with optim adamw_8bit"),
    (["--torch_dtype", "bfloat16", "--optim", "sgd"], "torch_dtype=bfloat16 with optim sgd"),
    (["--torch_dtype", "bfloat16", "--fp16", "true"], "torch_dtype=bfloat16 with fp16 mixed precision"),
])
def test_refusals_are_one_line(extra, needle):
    with pytest.raises(UsageError) as exc:
        _config(*extra)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_pure_bf16_checkpoint_resumed_with_fp32_master_weights_is_refused_naming_torch_dtype(tmp_path):
    """Its BF16AdamW state cannot be read by torch's AdamW: the load failed calling the checkpoint damaged. The
    other way (fp32 master weights resumed in pure bf16) loads, converting both, and is allowed."""
    from shardtune.train.resume import check_resume

    def cfg(*extra: str):
        return load_train_config(["--model_name_or_path", "M", "--dataset_name", "chat.jsonl", "--output_dir",
                                  str(tmp_path), *extra])

    with pytest.raises(UsageError, match=r"torch_dtype was 'bfloat16' \(pure bf16\) when the checkpoint was saved "
                                         r"and is None now; .* Set torch_dtype bfloat16 back"):
        check_resume(tmp_path, cfg("--torch_dtype", "bfloat16"), cfg(), saved_world=1, world=1)
    check_resume(tmp_path, cfg(), cfg("--torch_dtype", "bfloat16"), saved_world=1, world=1)
    check_resume(tmp_path, cfg("--torch_dtype", "bfloat16"), cfg("--dtype", "bfloat16"), saved_world=1, world=1)


def test_train_refuses_float16_with_exit_2(tmp_path, capsys):
    from shardtune.cli import main

    code = main(["train", "--model_name_or_path", "m", "--output_dir", str(tmp_path / "o"), "--dataset_name", "d",
                 "--torch_dtype", "float16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "fp16 mixed precision" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("method, strategy, gpus", [("full", "FSDP", 4), ("qlora", "NO", 1)])
def test_trace_of_a_pure_bf16_job_agrees_with_the_formula(small_model, method, strategy, gpus):
    """The trainer's step traced on fake tensors (bf16 weights, gradients, moments, the bf16 reduce-scatter; the
    stochastically rounded update's temporaries) against ``--pure-bf16``'s formula, within test_trace_formula.py's
    7% (measured -1.3%; one process with checkpointing -4.4%, DDP x2 -3.7%, LoRA -1.6% to +2.3%, QLoRA +2.1%).
    The job must really be pure bf16 on both sides: the trace holds AdamW's two moments in bf16 (2 bytes each per
    trainable parameter of this rank), and its peak is below the same job's mixed-precision trace by at least the
    moments' halving (its weights and gradients shrink too); a pure_bf16 lost on both sides would agree as well."""
    from tests.setups import checked_setup
    from shardtune.memory.formula import estimate
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.trace import trace_training_step
    from shardtune.memory.trace_setup import config_from_setup

    def job(torch_dtype):
        return checked_setup(method=method, distributed_type=strategy, num_gpus=gpus, per_device_train_batch_size=2,
                             max_seq_len=256, gradient_checkpointing=True, mixed_precision="bf16",
                             torch_dtype=torch_dtype, loss="shardtune")

    def trace(setup):
        return trace_training_step(config_from_setup(small_model, setup), setup.world_size, num_nodes=setup.num_nodes)

    setup, mixed_setup = job("bfloat16"), job(None)
    cfg = config_from_setup(small_model, setup)
    assert cfg.model.torch_dtype == "bfloat16"  # what --emit-config writes
    assert setup.pure_bf16 and cfg.model.pure_bf16
    assert not mixed_setup.pure_bf16 and not config_from_setup(small_model, mixed_setup).model.pure_bf16
    analysis = ModelAnalysis(small_model)
    formula = estimate(analysis.inventory, setup, analysis.lora_of(setup)).tensors
    pure, mixed = trace(setup), trace(mixed_setup)
    assert abs(formula / pure.peak_bytes - 1) <= 0.07, f"formula {formula:,} B vs trace {pure.peak_bytes:,} B"

    shards = gpus if strategy == "FSDP" else 1
    moments = 2 * torch.bfloat16.itemsize * pure.trainable_parameters // shards
    assert moments > 0
    held = pure.categories["optimizer"]  # the moments and AdamW's 0-d fp32 step per tensor
    assert moments <= held <= 1.01 * moments, (held, moments)
    assert mixed.categories["optimizer"] >= 2 * moments  # fp32 moments
    saved = mixed.categories["optimizer"] - held
    assert mixed.peak_bytes - pure.peak_bytes >= saved, (pure.peak_bytes, mixed.peak_bytes, saved)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("pure_bf16") / "model")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    return str(make_model_folder(tmp_path_factory.mktemp("pure_bf16") / "small", hidden_size=256,
                                 intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4))


@pytest.fixture(scope="module", params=["full", "qlora"])
def runs(request, tmp_path_factory, tiny_model):
    """Full fine-tuning; QLoRA: bf16 adapters on the 4-bit base (torchtune's and fsdp_qlora's bf16 QLoRA)."""
    job = ("--use_peft_lora", "true", "--use_4bit_quantization", "true", "--learning_rate", "1e-2")
    return _three_runs(tmp_path_factory.mktemp(f"pure_bf16_{request.param}"), tiny_model,
                       *(job if request.param == "qlora" else ()))


def _three_runs(root, tiny_model, *job: str):
    """One process (checkpoint at step 2), FSDP2 on two processes, and the first resumed from its step 2."""
    data = write_chat_data(root / "chat.jsonl", rows=300)  # 4 steps of 8 packed rows need ~100 dialogues

    def command(name: str, *extra: str) -> list[str]:
        return ["train", *flags("--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--splits",
                                "train", "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS),
                                "--logging_steps", "1", "--learning_rate", "1e-3", "--seed", "7",
                                "--torch_dtype", "bfloat16", "--output_dir", str(root / name), *job, *extra)]

    def ok(result) -> None:
        assert result.returncode == 0, result.stderr[-3000:]

    # The two-process job runs beside the single-process ones: much of each run is single-threaded start-up.
    fsdp = subprocess.Popen([sys.executable, "-m", "shardtune", "launch", "--num_processes", "2",
                             *command("fsdp", "--per_device_train_batch_size", "2", "--distributed_type", "FSDP",
                                      "--save_strategy", "no")],
                            cwd=root, env=shardtune_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ok(run_shardtune(command("single", "--per_device_train_batch_size", "4", "--save_steps", "2"), root))
        # The resumed run continues the single run's own step-2 checkpoint, in a copy of its folder.
        shutil.copytree(root / "single", root / "resumed", ignore=shutil.ignore_patterns("final", "step-4"))
        ok(run_shardtune(command("resumed", "--per_device_train_batch_size", "4", "--save_steps", "2",
                                 "--resume_from_checkpoint", "true"), root))
        stdout, stderr = fsdp.communicate(timeout=300)
    finally:
        if fsdp.poll() is None:  # a single-process run failed: torchrun passes SIGTERM on to its workers
            fsdp.terminate()
            fsdp.wait(timeout=60)
    ok(subprocess.CompletedProcess(fsdp.args, fsdp.returncode, stdout, stderr))
    return root / "single", root / "fsdp", root / "resumed"


def test_one_process_and_fsdp_losses_agree_within_bf16_rounding(runs):
    single, fsdp, _ = runs
    ref, other = losses(single), losses(fsdp)
    assert len(ref) == len(other) == STEPS and all(math.isfinite(x) for x in ref)
    assert ref[-1] < ref[0] - 0.1  # it trains
    for step, (a, b) in enumerate(zip(ref, other), start=1):
        assert abs(a - b) <= BF16_REL_TOL * abs(a), f"step {step}: {a} vs {b}"


def _weights(folder):
    from safetensors.torch import load_file

    final = folder / "final"
    return load_file(str(final / ("adapter_model.safetensors" if (final / "adapter_config.json").exists()
                                  else "model.safetensors")))


def test_resume_is_bitwise_and_export_is_bf16(runs):
    single, _, resumed = runs
    # It resumed, at step 2: a run that ignored the checkpoint and started over would log the same losses too.
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (2, STEPS - 2), summary
    assert losses(resumed) == losses(single)  # steps 3-4 redone from the checkpoint: bitwise
    want, got = _weights(single), _weights(resumed)
    assert want.keys() == got.keys() and {t.dtype for t in want.values()} == {torch.bfloat16}
    assert all(torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want)
    if not (single / "final" / "adapter_config.json").exists():
        config = json.loads((single / "final" / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    # the trainer stepped the stochastically rounded AdamW: its param groups hold its own settings only, none of
    # torch's AdamW (amsgrad, foreach, fused...), and its moments are bf16
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(single / "checkpoints" / "step-2" / "dcp")).read_metadata().state_dict_metadata
    groups = {key.rsplit(".", 1)[-1] for key in saved if key.startswith("optim.param_groups.")}
    assert {"lr", "betas", "eps", "weight_decay"} <= groups and not groups & {"amsgrad", "foreach", "fused"}
    moments = {saved[key].properties.dtype for key in saved
               if key.startswith("optim.state.") and key.endswith((".exp_avg", ".exp_avg_sq"))}
    assert moments == {torch.bfloat16}


def test_an_older_config_yaml_with_dtype_unset_keeps_torch_dtype(tmp_path):
    """config.yaml written before dtype became torch_dtype's alias holds both keys, dtype null after torch_dtype:
    the unset alias must not undo the run's pure bf16 when it is read back (resume, export)."""
    saved = tmp_path / "config.yaml"
    saved.write_text("model_name_or_path: m\ndataset_name: d\noutput_dir: o\ntorch_dtype: bfloat16\ndtype: null\n")
    assert load_train_config([str(saved)]).model.pure_bf16
