"""bf16 mixed precision by default where the hardware computes bf16 natively, and what a bf16 run keeps in fp32.

- The rule per device kind, the hardware mocked: CUDA compute capability 8.0 and above, CPUs with AVX512-BF16 or
  AMX-BF16 (as torch reads them); fp32 elsewhere. ``--bf16 false`` and ``mixed_precision no`` opt out, an explicit
  ``--bf16 true`` runs as asked (with a warning where bf16 is emulated), and a run records its choice.
- A real run on this machine, at the defaults: the precision its CPU has, printed with the reason, in config.yaml.
- The bf16 loss: a LoRA base stored in bf16 under autocast gives the loss of fp32 weights under autocast (TRL's
  default) where the checkpoint holds bf16 values, and stays within 1.5e-3 of fp32's.
- The frozen base: bf16 (half of fp32's bytes), never cast in a step; adapters, their gradients and optimizer
  states fp32; FSDP2 on two processes keeps the same dtypes and gathers in bf16, reducing in fp32.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.config import load_train_config
from shardtune.dist import DistInfo
from shardtune.hardware import native_bf16
from shardtune.train import model as model_module
from tests.trainutil import flags, run_shardtune, tiny_workspace

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "precision", rows=64)


def _argv(root, out: str, *extra: str) -> list[str]:
    return flags("--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                 "--splits", "train", "--max_seq_len", "64", "--per_device_train_batch_size", "4",
                 "--max_steps", "1", "--logging_steps", "1", "--save_strategy", "no", "--use_peft_lora", "true",
                 "--lora_dropout", "0", "--output_dir", str(root / out), *extra)


@pytest.mark.parametrize("capability,native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_devices_from_compute_capability_8_have_bf16(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    found, why = native_bf16("cuda")
    assert found is native and f"compute capability {capability[0]}.{capability[1]}" in why


@pytest.mark.parametrize("features,native", [({}, False), ({"avx512_bf16": False, "amx_bf16": False}, False),
                                             ({"avx512_bf16": True}, True), ({"amx_bf16": True}, True)])
def test_cpus_with_avx512_bf16_or_amx_have_bf16(monkeypatch, features, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **features})
    found, why = native_bf16("cpu")
    assert found is native and ("AVX512-BF16" in why or "AMX-BF16" in why)
    assert native_bf16("mps")[0] is False  # no device kind is assumed to have it


@pytest.mark.parametrize("extra,native,expected", [
    ([], True, "bf16"), ([], False, "no"),
    (["--bf16", "false"], True, "no"), (["--bf16", "true"], False, "bf16"), (["--fp16", "true"], True, "fp16"),
    (["--mixed_precision", "no"], True, "no"), (["--mixed_precision", "fp16"], True, "fp16"),
    (["--mixed_precision", "bf16", "--bf16", "false"], True, "no"),  # the flag opts out of a recipe's bf16
])
def test_the_config_leaves_precision_to_the_hardware_unless_it_says(extra, native, expected):
    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", *extra])
    assert cfg.precision_on(native) == expected
    assert cfg.precision_left_to_hardware is (not extra)


def test_a_mixed_precision_the_flags_overrule_is_said_at_start(tmp_path):
    """Accelerate's mixed_precision where a bf16/fp16 flag decides otherwise (an Accelerate file's no beside a
    recipe's bf16 true): the flag wins, as in Transformers, and a note names both places and what runs; where they
    agree, or the flag is unset, nothing is said."""
    from shardtune.config.loading import run_config_problems

    acc, recipe = tmp_path / "acc.yaml", tmp_path / "recipe.yaml"
    acc.write_text("distributed_type: NO\nmixed_precision: 'no'\n")
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--config_file", str(acc)]

    def notes(*extra: str) -> list[str]:
        said: list[str] = []
        cfg = run_config_problems([*base, *extra], said)[0]
        return [cfg.precision_on(True), *said]

    recipe.write_text("learning_rate: 1e-4\nbf16: true\n")
    assert notes(str(recipe)) == ["bf16", f"mixed_precision=no ({acc}, line 2) is set aside: bf16=true ({recipe}, "
                                          f"line 2) decides, as in Transformers, and the run computes in bf16"]
    assert notes("--fp16", "true")[1].endswith("fp16=true (command line (--fp16)) decides, as in Transformers, and "
                                               "the run computes in fp16")
    assert notes("--mixed_precision", "bf16", "--bf16", "false") == [
        "no", "mixed_precision=bf16 (command line (--mixed_precision)) is set aside: bf16=false (command line "
              "(--bf16)) decides, as in Transformers, and the run computes in fp32"]
    assert notes() == ["no"] and notes("--bf16", "false") == ["no"]  # unset flag, or the same answer: nothing said


@pytest.mark.parametrize("native", [True, False])
def test_a_run_writes_down_what_the_hardware_chose_and_says_why(monkeypatch, caplog, native):
    monkeypatch.setattr("shardtune.hardware.native_bf16", lambda kind: (native, f"{kind} says {native}"))
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
    with caplog.at_level(logging.INFO, logger="shardtune"):
        decided = model_module.decide_precision(load_train_config(base), torch.device("cpu"))
        kept = model_module.decide_precision(load_train_config([*base, "--bf16", "true"]), torch.device("cpu"))
    assert decided.run.bf16 is native and decided.mixed_precision == ("bf16" if native else "no")
    assert f"cpu says {native}" in caplog.records[0].getMessage()
    assert kept.run.bf16 is True  # asked for: kept; where bf16 is only emulated, a warning says fp32 is faster
    assert [r.levelno for r in caplog.records[1:]] == ([] if native else [logging.WARNING])


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_bf16_asked_of_a_gpu_without_it_points_to_fp16(monkeypatch, caplog, kind):
    """bf16 true on a T4 or V100 runs emulated; the warning offered only fp32, many times slower there than the
    fp16 those cards compute natively."""
    monkeypatch.setattr("shardtune.hardware.native_bf16", lambda kind: (False, f"{kind} says no"))
    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--bf16",
                             "true"])
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        model_module.decide_precision(cfg, torch.device(kind))
    said = caplog.records[0].getMessage()
    assert said.startswith(f"bf16 asked for, but {kind} says no: bf16 is emulated there and slower than fp32")
    assert ("--fp16 true" in said) is (kind == "cuda")


@pytest.mark.parametrize("native", [True, False])
def test_pure_bf16_is_said_as_such_not_as_mixed_precision(monkeypatch, caplog, native):
    """torch_dtype bfloat16 with the precision left to the hardware logged 'bf16 mixed precision by default', then
    'pure bf16 (no fp32 master)': two claims about one run."""
    monkeypatch.setattr("shardtune.hardware.native_bf16", lambda kind: (native, f"{kind} says {native}"))
    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o",
                             "--torch_dtype", "bfloat16"])
    with caplog.at_level(logging.INFO, logger="shardtune"):
        model_module.decide_precision(cfg, torch.device("cpu"))
    said = caplog.records[0].getMessage()
    assert said.startswith("precision: pure bf16, as torch_dtype bfloat16 asks") and "mixed" not in said
    assert ("emulated" in said) is (not native)


def _cpu_has_bf16() -> bool:
    """Independently of shardtune: what torch reads of this CPU."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


@pytest.mark.parametrize("extra", [[], ["--bf16", "false"]], ids=["defaults", "opted_out"])
def test_a_run_here_trains_in_the_precision_this_cpu_has(workspace, extra):
    out = f"run_{len(extra)}"
    result = run_shardtune(["train", *_argv(workspace, out, *extra)], workspace)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_train_config([str(workspace / out / "config.yaml")])
    expected = _cpu_has_bf16() and not extra
    assert saved.run.bf16 is expected and saved.mixed_precision == ("bf16" if expected else "no")
    said = "bf16 mixed precision by default" if expected else "fp32 by default"
    assert (said in result.stderr) is (not extra)
    assert f"mixed precision {'bf16' if expected else 'no'}" in result.stderr


def _bf16_exact_model(workspace):
    """The tiny model with its weights rounded to bf16 and saved in fp32: what a hub checkpoint in bf16 holds."""
    from transformers import AutoModelForCausalLM

    folder = workspace / "model_bf16_values"
    if not folder.is_dir():
        model = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (workspace / "model" / name).is_file():
                (folder / name).write_bytes((workspace / "model" / name).read_bytes())
    return folder


def _first_loss(workspace, model_folder, *extra: str) -> tuple[float, list[dict]]:
    """Step 1's loss (before any update) of a one-process LoRA job, and its micro-batches."""
    from shardtune.train.job import make_job
    from shardtune.train.step import train_step

    cfg = load_train_config([*_argv(workspace, "unused", *extra), "--model_name_or_path", str(model_folder)])
    cfg = model_module.decide_precision(cfg, torch.device("cpu"))
    job = make_job(cfg, CPU)
    rows = next(iter(job.state.sampler))
    batches = [job.collator([job.data.train[i] for i in micro]) for micro in rows]
    return train_step(job.step, batches).loss, batches


def _loss_of_fp32_weights_under_autocast(model_folder, batches) -> float:
    """TRL's default: fp32 weights, bf16 autocast, the same fused loss."""
    from transformers import AutoModelForCausalLM

    from shardtune.train.loss import install_fused_loss, num_targets
    from shardtune.train.runner import model_inputs

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32, attn_implementation="sdpa")
    install_fused_loss(model)
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in batches:
            total += model(**model_inputs(batch, CPU.device), loss_labels=batch["labels"]).loss.item()
    return total / sum(num_targets(b["labels"]) for b in batches)


def test_a_bf16_lora_loss_is_that_of_fp32_weights_under_autocast(workspace, restore_logging):
    """The base is stored in bf16, and the residual stream still runs in fp32 (from the embeddings' output): on
    a checkpoint of bf16 values that is fp32 weights under autocast to the last digits (a bf16 residual stream
    is ~1e-3 away), and within 1.5e-3 of fp32's loss."""
    folder = _bf16_exact_model(workspace)
    bf16, batches = _first_loss(workspace, folder, "--bf16", "true")
    fp32, _ = _first_loss(workspace, folder, "--bf16", "false")
    reference = _loss_of_fp32_weights_under_autocast(folder, batches)
    assert abs(bf16 - reference) <= 1e-6 * reference
    assert abs(bf16 - fp32) <= 1.5e-3 * fp32


class _BaseCasts(TorchDispatchMode):
    """Counts the copies in another dtype that ops make of the given tensors (base weights, by their storage)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages, self.casts = {w.untyped_storage().data_ptr() for w in weights}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype \
                and args[0].untyped_storage().data_ptr() in self.storages:
            self.casts += 1
        return out


def test_the_frozen_base_is_bf16_and_never_cast_in_a_step(workspace, restore_logging):
    """LoRA at bf16: the base in bf16 (its bytes half of fp32's), adapters, their gradients and AdamW moments in
    fp32, and no copy of a base weight made in a step. The same step with the base stored in fp32 (as fp32
    weights under autocast keep it) casts every base matmul weight: the count sees casts where there are some."""
    from shardtune.train.job import make_job
    from shardtune.train.step import train_step

    cfg = model_module.decide_precision(load_train_config(_argv(workspace, "unused", "--bf16", "true")), CPU.device)
    job = make_job(cfg, CPU)
    frozen = [p for p in job.model.parameters() if not p.requires_grad]
    trained = [p for p in job.model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16} and {p.dtype for p in trained} == {torch.float32}
    assert sum(p.nbytes for p in frozen) * 2 == sum(p.numel() * 4 for p in frozen)
    batches = [job.collator([job.data.train[i] for i in micro]) for micro in next(iter(job.state.sampler))]
    job.runner.forward_backward(batches, scale=1.0)
    assert {p.grad.dtype for p in trained} == {torch.float32} and all(p.grad is None for p in frozen)
    job.optimizer.zero_grad(set_to_none=True)
    with _BaseCasts(frozen) as stored_bf16:
        train_step(job.step, batches)
    states = [t for s in job.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}
    for param in frozen:
        param.data = param.data.float()
    with _BaseCasts(frozen) as stored_fp32:
        train_step(job.step, batches)
    linears = [m for m in job.model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert stored_bf16.casts == 0 and stored_fp32.casts >= len(linears) > 0


def test_a_forward_outside_autocast_runs_on_the_bf16_base(workspace, restore_logging):
    """The fp32 residual stream is autocast's: a forward outside it (a callback's evaluation, say) runs the bf16
    base in bf16 instead of meeting it with fp32 activations in a plain matmul, and gives the logits of autocast
    to within bf16's rounding."""
    from shardtune.train.job import make_job

    cfg = model_module.decide_precision(load_train_config(_argv(workspace, "unused", "--bf16", "true")), CPU.device)
    model = make_job(cfg, CPU).model.eval()
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: embedded.append(out.dtype))
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        plain = model(input_ids=ids).logits.float()
        with torch.autocast("cpu", torch.bfloat16):
            autocast = model(input_ids=ids).logits.float()
    assert embedded == [torch.bfloat16, torch.float32]  # the stream: bf16 outside autocast, fp32 inside
    assert (plain - autocast).abs().max() <= 0.05 * autocast.abs().max()


class RecordDtypes:
    """A callback (``--callbacks tests.test_precision_default:RecordDtypes``): after step 1 each rank writes the
    dtypes of its frozen and trained parameter shards, of its AdamW moments, and FSDP2's gather and reduce dtypes,
    to ``$RECORD_DTYPES-RANK.json``."""

    def on_train_begin(self, args, state, control, *, model, optimizer, plan, info, **kwargs) -> None:
        self.model, self.optimizer, self.plan, self.info = model, optimizer, plan, info

    def on_step_end(self, args, state, control, **kwargs) -> None:
        import os

        local = [(p.to_local() if hasattr(p, "to_local") else p, p.requires_grad) for p in self.model.parameters()]
        record = {"frozen": sorted({str(t.dtype) for t, grad in local if not grad}),
                  "trained": sorted({str(t.dtype) for t, grad in local if grad}),
                  "moments": sorted({str(t.dtype) for s in self.optimizer.state.values() for t in s.values()
                                     if t.dim() > 0}),
                  **self._fsdp_policy()}
        with open(f"{os.environ['RECORD_DTYPES']}-{self.info.rank}.json", "w") as f:
            json.dump(record, f)

    def _fsdp_policy(self) -> dict[str, list[str]]:
        """What FSDP2 was given for each unit (its MixedPrecisionPolicy), not what the plan asked for."""
        from tests.setup_probe import fsdp_units

        groups = [g for _, _, unit_groups in fsdp_units(self.model) for g in unit_groups]
        return {"gather": sorted({str(g.mp_policy.param_dtype) for g in groups}),
                "reduce": sorted({str(g.mp_policy.reduce_dtype) for g in groups})}



def test_fsdp2_shards_keep_a_bf16_base_and_fp32_adapters(workspace, monkeypatch):
    from tests.faults import fault_env

    record = workspace / "dtypes"
    for key, value in fault_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RECORD_DTYPES", str(record))
    result = run_shardtune(["launch", "--num_processes", "2", "train",
                            *_argv(workspace, "fsdp", "--bf16", "true", "--distributed_type", "FSDP", "--callbacks",
                                   "tests.test_precision_default:RecordDtypes")], workspace)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        found = json.loads((workspace / f"dtypes-{rank}.json").read_text())
        assert found == {"frozen": ["torch.bfloat16"], "trained": ["torch.float32"], "moments": ["torch.float32"],
                         "gather": ["torch.bfloat16"], "reduce": ["torch.float32"]}


def test_qlora_in_fp16_trains_with_fp16_4bit_weights(workspace):
    """QLoRA with fp16 true (a T4's choice) stopped at its first forward with CPU autocast's 'Unexpected floating
    ScalarType': its 4-bit dtypes stayed bf16. Left unset, they follow the run's precision, written down."""
    result = run_shardtune(["train", *_argv(workspace, "qlora_fp16", "--use_4bit_quantization", "true", "--fp16",
                                            "true", "--max_steps", "2", "--learning_rate", "1e-3")], workspace)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_train_config([str(workspace / "qlora_fp16" / "config.yaml")])
    assert (saved.lora.bnb_4bit_compute_dtype, saved.lora.bnb_4bit_quant_storage_dtype) == ("float16", "float16")
    found = [json.loads(line)["loss"] for line in (workspace / "qlora_fp16" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(found) == 2 and found[1] < found[0]
