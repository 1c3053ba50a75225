"""Checkpoint files on one process: round trips, completeness, metrics trimming, the CLI's errors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.train import checkpoint as ckpt

INFO = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _trained(frozen: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    if frozen:
        model[0].requires_grad_(False)  # a frozen base, as under LoRA
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state(step: int) -> dict:
    """A trainer state a run at ``step`` could save: 100 rows, one a step (resume checks the values)."""
    return {"step": step, "epoch": step / 100,
            "sampler": {"epoch": 0, "step_in_epoch": step, "num_rows": 100, "global_batch_size": 1}}


def _save(tmp_path: Path, step: int, model, optimizer, frozen: bool, kind: str) -> Path:
    return ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=optimizer, trainable_only=frozen,
                                trainer_state=_state(step), config_yaml="seed: 1\n", info=INFO,
                                state_dict_type=kind)


@pytest.mark.parametrize("kind", [ckpt.SHARDED, ckpt.FULL])
@pytest.mark.parametrize("frozen", [False, True])
def test_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path, kind: str, frozen: bool) -> None:
    model, optimizer = _trained(frozen)
    want_params = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters() if p.requires_grad]
    path = _save(tmp_path, 2, model, optimizer, frozen, kind)
    draws = (torch.rand(3), random.random(), np.random.rand())

    # Train on, draw more random numbers: loading must bring all of it back.
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    torch.rand(5), random.random(), np.random.rand()
    state = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, trainable_only=frozen, info=INFO)
    assert state == _state(2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, want_params[name]), name
    got_exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(got_exp_avg, want_exp_avg))
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    files = {p.name for p in path.iterdir()}
    assert ("dcp" in files) == (kind == ckpt.SHARDED) and ("model.safetensors" in files) == (kind == ckpt.FULL)
    if kind == ckpt.FULL:
        from safetensors.torch import load_file

        # LoRA-style checkpoints hold the trainable part only.
        assert sorted(load_file(path / "model.safetensors")) == (["1.bias", "1.weight"] if frozen else
                                                                 ["0.bias", "0.weight", "1.bias", "1.weight"])


def test_save_total_limit_and_incomplete_checkpoints(tmp_path: Path, caplog) -> None:
    model, optimizer = _trained(False)
    for step in (4, 6, 8):  # then step 10: the newest by number, the oldest by name
        _save(tmp_path, step, model, optimizer, False, ckpt.SHARDED)
    ckpt.save_checkpoint(tmp_path, 10, model=model, optimizer=optimizer, trainable_only=False,
                         trainer_state=_state(10), config_yaml="", info=INFO, save_total_limit=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-8", "step-10"]
    # A save killed before its rename leaves .tmp-step-N; a step folder without a manifest is not complete either.
    (tmp_path / "checkpoints" / ".tmp-step-12" / "dcp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-14").mkdir()
    with caplog.at_level("WARNING", logger="shardtune"):
        assert ckpt.resolve_resume("true", tmp_path) == tmp_path / "checkpoints" / "step-10"
    assert ".tmp-step-12" in caplog.text and "step-14" in caplog.text
    assert ckpt.resolve_resume("false", tmp_path) is None
    assert ckpt.resolve_resume(None, tmp_path) is None
    assert ckpt.resolve_resume("true", tmp_path / "nowhere") is None
    with pytest.raises(UsageError, match="step-14.*manifest.json"):
        ckpt.resolve_resume(str(tmp_path / "checkpoints" / "step-14"), tmp_path)


def test_save_total_limit_keeps_a_users_file_in_a_checkpoint(tmp_path: Path, caplog) -> None:
    """save_total_limit deleted the oldest checkpoint folder whole, a file the user put in it (eval notes) too;
    overwrite_output_dir keeps such a file. Now the files the manifest lists go, and what is left is moved aside
    to checkpoints/superseded-*, and named."""
    model, optimizer = _trained(False)
    _save(tmp_path, 4, model, optimizer, False, ckpt.SHARDED)
    (tmp_path / "checkpoints" / "step-4" / "eval").mkdir()
    (tmp_path / "checkpoints" / "step-4" / "eval" / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING", logger="shardtune"):
        ckpt.save_checkpoint(tmp_path, 6, model=model, optimizer=optimizer, trainable_only=False,
                             trainer_state=_state(6), config_yaml="", info=INFO, save_total_limit=1)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-6"]
    aside = list((tmp_path / "checkpoints").glob("superseded-*"))
    assert len(aside) == 1 and not (tmp_path / "checkpoints" / "step-4").exists()
    assert [str(p.relative_to(aside[0])) for p in aside[0].rglob("*") if p.is_file()] == \
        ["checkpoints/step-4/eval/notes.txt"]
    assert (aside[0] / "checkpoints" / "step-4" / "eval" / "notes.txt").read_text() == "mine"
    assert "eval/notes.txt" in caplog.text


def test_lora_checkpoint_refuses_full_finetune_resume(tmp_path: Path) -> None:
    model, optimizer = _trained(True)
    path = _save(tmp_path, 2, model, optimizer, True, ckpt.SHARDED)
    with pytest.raises(UsageError, match="use_peft_lora"):
        ckpt.load_checkpoint(path, model=model, optimizer=optimizer, trainable_only=False, info=INFO)


def test_trim_metrics_drops_records_after_the_checkpoint(tmp_path: Path) -> None:
    lines = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)] + [{"step": 4, "eval_loss": 0.5}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "lo'  # the kill cut the last line
    (tmp_path / "metrics.jsonl").write_text("[6]\n" + text)  # and a line that is JSON but no record
    assert ckpt.trim_metrics(tmp_path, 3) == 5
    assert ckpt.logged_losses(tmp_path, 3) == [[1, 1.0], [2, 0.5], [3, 1 / 3]]
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:3]
    assert ckpt.trim_metrics(tmp_path, 3) == 0
    assert ckpt.trim_metrics(tmp_path / "none", 3) == 0


def test_export_and_merge_cli_errors(tmp_path: Path, capsys) -> None:
    from shardtune.cli import main

    source = tmp_path / "source"
    source.mkdir()
    assert main(["export", str(source), str(tmp_path / "out")]) == 2
    assert "not a complete shardtune checkpoint" in capsys.readouterr().err
    assert main(["merge", str(source), "--base", str(source), str(tmp_path / "out")]) == 2
    assert "not a PEFT adapter folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # A run's final/ (or an earlier export) is already in the form export writes: said so, with what to do instead.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert main(["export", str(adapter), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"shardtune export: error: {adapter}: a PEFT adapter folder (a LoRA run's "
                                       f"final/, or an export), already in the form export writes, not a checkpoint: "
                                       f"load it with PEFT as it is, fold it into its base with 'shardtune merge', or "
                                       f"convert it with --format gguf\n")
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "config.json").write_text("{}")
    (whole / "model.safetensors").write_bytes(b"")
    assert main(["export", str(whole), str(tmp_path / "out")]) == 2
    assert f"{whole}: a whole model folder (a full fine-tune's final/" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # A run's output_dir given where its final/ adapter goes (export takes either): pointed at final/
    (source / "final").mkdir()
    (source / "final" / "adapter_config.json").write_text("{}")
    assert main(["merge", str(source), "--base", str(source), str(tmp_path / "out")]) == 2
    assert f"give {source / 'final'}" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")  # a file where OUT goes: refused before anything is loaded
    for command in (["export", str(source)], ["merge", str(source), "--base", str(source)]):
        assert main([*command, str(tmp_path / "a-file")]) == 2
        assert "a file is there, where the folder goes; give another path" in capsys.readouterr().err
    # OUT named like a GGUF for a folder (a forgotten --format gguf): it wrote an adapter folder 'model.gguf'
    gguf = tmp_path / "model.gguf"
    merge_fix = f"give a folder name, or write a GGUF with 'shardtune export {source} {gguf} --format gguf'"
    for command, fix in ((["export", str(source)], "add --format gguf to write a GGUF file, or give a folder name"),
                         (["merge", str(source), "--base", str(source)], merge_fix)):
        assert main([*command, str(gguf)]) == 2
        assert capsys.readouterr().err == (f"shardtune {command[0]}: error: OUT {gguf}: a name ending in .gguf, but "
                                           f"{command[0]} writes a Transformers/PEFT folder there; {fix}\n")
    assert not gguf.exists()


def test_an_adapter_on_a_base_of_other_shapes_is_one_line(tmp_path: Path, capsys) -> None:
    """merge, a GGUF export and generate of an adapter over a base it was not trained on gave torch's size-mismatch
    traceback (exit 1); now one line naming a weight and its two shapes, exit 2, nothing written."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    tok = make_tokenizer()
    trained = make_model_folder(tmp_path / "trained", tokenizer=tok)
    other = make_model_folder(tmp_path / "other", tokenizer=tok, hidden_size=32, intermediate_size=64)
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(trained), LoraConfig(r=2)).save_pretrained(adapter)
    says = ("the weights do not fit the model (base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight "
            "is [2, 64] in the files, [2, 32] in the model): the adapter was trained on a base model of other shapes; "
            "give that base model")
    for argv in (["merge", str(adapter), "--base", str(other), str(tmp_path / "merged")],
                 ["export", str(adapter), str(tmp_path / "gguf"), "--format", "gguf", "--base", str(other)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == f"shardtune {argv[0]}: error: adapter {adapter} on --base {other}: {says}"
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(other)}))
    assert main(["generate", str(adapter), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"shardtune generate: error: '{adapter}': {says}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "other", "trained"]


@pytest.mark.parametrize("code,fix", [
    ("ENOSPC", "free disk space or give a path on another disk"),
    # the fix was 'free disk space, fix the permissions or give another path' whatever the cause
    ("EROFS", "the file system is read-only: give a path on a writable one"),
])
def test_a_failed_export_write_is_one_line_and_leaves_nothing(tmp_path: Path, capsys, monkeypatch, code,
                                                                fix) -> None:
    import errno

    import transformers.modeling_utils
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    base = make_model_folder(tmp_path / "base", tokenizer=make_tokenizer())
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2)).save_pretrained(adapter)

    def disk_full(tensors, filename, *args, **kwargs):  # what safetensors raises when the disk fills up
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)  # save_pretrained's writer
    out = tmp_path / "new" / "merged"  # the folder made for it goes too (it stayed, empty, as 'new')
    assert main(["merge", str(adapter), "--base", str(base), str(out)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    number = getattr(errno, code)
    assert errors[0].startswith(f"shardtune merge: error: [Errno {number}] {os.strerror(number)}: '{tmp_path}")
    assert errors[0].endswith(f"'; {fix}"), errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # no OUT, no temporary folder


def test_push_to_hub_uploads_final_and_only_warns_when_the_hub_fails(tmp_path, monkeypatch, caplog):
    """No network here: the hub client is replaced by one that records what it was asked, or fails."""
    import huggingface_hub

    from shardtune.config import load_train_config
    from shardtune.train.run_end import push_to_hub

    calls: list[tuple] = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create", repo_id, private, exist_ok))

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload", repo_id, folder_path))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    def config(*extra: str):
        return load_train_config(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir",
                                  str(tmp_path / "run"), *extra])

    cfg = config("--push_to_hub", "--hub_model_id", "me/tuned", "--hub_token", "hf_secret",
                 "--hub_private_repo", "true")
    assert push_to_hub(cfg, str(final)) == {"hub_model_id": "me/tuned"}  # summary.json records it
    assert calls == [("token", "hf_secret"), ("create", "me/tuned", True, True), ("upload", "me/tuned", str(final))]
    calls.clear()
    # Without hub_model_id the repository is named after the output folder; nothing happens unless asked.
    push_to_hub(config("--push_to_hub"), str(final))
    assert calls[1] == ("create", "run", False, True)
    calls.clear()
    push_to_hub(config(), str(final))
    assert calls == []

    class Offline(FakeApi):
        def create_repo(self, *args, **kwargs):
            raise ConnectionError("Name or service not known\nmore detail")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    with caplog.at_level("WARNING", logger="shardtune"):
        # the run succeeded: a failed upload is a warning, not an error, which says how to upload it later, and
        # summary.json says it failed
        assert push_to_hub(cfg, str(final)) == {"push_to_hub_failed": "me/tuned: Name or service not known"}
    assert "could not upload" in caplog.text and "Name or service not known" in caplog.text
    assert f"upload it once the hub is reachable with 'hf upload me/tuned {final}'" in caplog.text
    assert "more detail" not in caplog.text


@pytest.mark.parametrize("cause, says", [
    (OSError(28, "No space left on device"), "[Errno 28] No space left on device: '{}'"),
    # what torch's writer says of a full disk: nothing names a file or the disk
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
     "[Errno 5] write failed, the disk may be full ([enforce fail at inline_container.cc:672] . unexpected pos 704 "
     "vs 598): '{}'"),
])
def test_a_failed_sharded_write_leaves_no_temporary_folder(tmp_path, monkeypatch, cause, says):
    """DCP raises CheckpointException (a BaseException) on every rank; the half-written folder goes with it, and
    the failed write names the checkpoint's folder and the disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    def full_disk(*args, **kwargs):
        raise CheckpointException("write failed", {0: (cause, None)})

    monkeypatch.setattr(ckpt.dcp, "save", full_disk)
    model, optimizer = _trained(frozen=False)
    with pytest.raises(OSError) as failed:
        _save(tmp_path, 3, model, optimizer, frozen=False, kind=ckpt.SHARDED)
    assert str(failed.value) == says.format(ckpt.checkpoints_dir(tmp_path) / "step-3" / "dcp")
    assert list(ckpt.checkpoints_dir(tmp_path).iterdir()) == []


@pytest.mark.parametrize("says", ["config", "weights"])
def test_merge_saves_the_bases_own_dtype(tmp_path: Path, says: str) -> None:
    """A bf16 base was merged and saved as float32, twice its size. The sum is taken in float32 and saved in the
    base's dtype, as named by its config.json (or, without one there, by its weights): bit for bit PEFT's float32
    merge rounded to bf16, half the bytes of the float32 merge."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    tok = make_tokenizer()
    fp32 = make_model_folder(tmp_path / "fp32", tokenizer=tok, seed=1)
    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(base)
    tok.save_pretrained(base)
    if says == "weights":
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dtype"}))
    adapter = tmp_path / "adapter"
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=2, init_lora_weights=False))
    peft_model.save_pretrained(adapter)
    assert main(["merge", str(adapter), "--base", str(base), str(tmp_path / "merged")]) == 0
    assert main(["merge", str(adapter), "--base", str(fp32), str(tmp_path / "merged32")]) == 0
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          str(adapter)).merge_and_unload().state_dict()
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    for name, tensor in saved.items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    changed = "model.layers.0.self_attn.q_proj.weight"
    base_weights = load_file(base / "model.safetensors")
    assert not torch.equal(saved[changed], base_weights[changed])  # the adapter is in it
    with safe_open(str(tmp_path / "merged32" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # a float32 base stays float32
    sizes = [(tmp_path / name / "model.safetensors").stat().st_size for name in ("merged", "merged32")]
    assert sizes[0] < 0.51 * sizes[1], sizes
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"


def test_merge_without_base_takes_the_one_the_adapter_names(tmp_path: Path, capsys) -> None:
    """merge required --base where the adapter's adapter_config.json names its base (generate and export read it
    there): without --base it merges into that base, and where that names nothing on this machine it says so."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.testing.tiny import make_model_folder

    base = make_model_folder(tmp_path / "base", seed=1)
    adapter = tmp_path / "adapter"
    torch.manual_seed(0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, init_lora_weights=False)) \
        .save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert main(["merge", str(adapter), "--base", str(base), str(tmp_path / "given")]) == 0
    assert main(["merge", str(adapter), str(tmp_path / "named")]) == 0
    given, named = (load_file(tmp_path / name / "model.safetensors") for name in ("given", "named"))
    assert given.keys() == named.keys() and all(torch.equal(given[k], named[k]) for k in given)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/hub-model"}))
    capsys.readouterr()
    assert main(["merge", str(adapter), str(tmp_path / "nowhere")]) == 2
    assert ("base_model_name_or_path 'org/hub-model' is neither a local model folder nor in the local Hugging Face "
            "cache" in capsys.readouterr().err)
    assert not (tmp_path / "nowhere").exists()


def test_merge_and_generate_of_a_qlora_adapter_say_they_use_the_unquantised_base(tmp_path: Path, tmp_path_factory,
                                                                                  capsys) -> None:
    """merge folded a QLoRA run's adapter into the float32 base, and generate ran it on that base, without a word:
    a user took the result for the 4-bit model the run trained. Both now say it, from the run's summary.json (its
    final/) or the export list of a checkpoint exported; the merge is the unquantised base plus the adapter's
    update, as PEFT makes it. A LoRA run's adapter gets no note."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from tests.trainutil import logging_restored, tiny_workspace

    work = tiny_workspace(tmp_path_factory, "qlora-notes", rows=16)
    runs = {}
    for method, extra in (("qlora", ["--use_4bit_quantization", "true", "--bnb_4bit_quant_type", "fp4"]),
                          ("lora", [])):
        runs[method] = work / method
        with logging_restored():
            assert main(["train", "--model_name_or_path", str(work / "model"), "--dataset_name",
                         str(work / "chat.jsonl"), "--output_dir", str(runs[method]), "--use_peft_lora", "true",
                         "--max_steps", "2", "--save_steps", "1", "--max_seq_len", "64", "--bf16", "true",
                         "--learning_rate", "1e-2", "--predict_memory", "false", *extra]) == 0
    assert json.loads((runs["qlora"] / "summary.json").read_text())["base_quantization"] == "fp4"
    capsys.readouterr()

    def notes(*argv: str) -> list[str]:
        assert main(list(argv)) == 0
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]

    final = runs["qlora"] / "final"
    said = (f"note: {final} was trained on a 4-bit (fp4) base (QLoRA); it is merged into the unquantised base "
            f"{work / 'model'} (float32), the weights the 4-bit ones were quantised from")
    (merge_note,) = notes("merge", str(final), str(tmp_path / "merged"))
    assert merge_note.startswith(said)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "model"), str(final)) \
        .merge_and_unload().state_dict()
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.equal(tensor, reference[name]) for name, tensor in merged.items())
    (generate_note,) = notes("generate", str(final), "--prompt", "What is 1 plus 2?", "--max_new_tokens", "2")
    assert "generate runs it on its base model unquantised" in generate_note
    assert main(["export", str(runs["qlora"] / "checkpoints" / "step-1"), str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    (exported_note,) = notes("merge", str(tmp_path / "exported"), str(tmp_path / "merged_export"))
    assert exported_note.startswith(f"note: {tmp_path / 'exported'} was trained on a 4-bit (fp4) base (QLoRA)")
    assert notes("merge", str(runs["lora"] / "final"), str(tmp_path / "merged_lora")) == []
    assert notes("generate", str(tmp_path / "merged"), "--prompt", "hi", "--max_new_tokens", "1") == []


def test_a_qlora_checkpoint_exports_to_gguf_as_its_final_does(tmp_path: Path, tmp_path_factory, capsys) -> None:
    """shardtune export CHECKPOINT OUT --format gguf of a QLoRA run stopped at "no llama.cpp tensor for
    '...q_proj.weight.absmax'": the adapters were merged into the 4-bit base, whose packed weights no GGUF type
    holds. They are merged into the unquantised base, as the run's final/ is: the two GGUFs hold the same tensors."""
    import gguf

    from shardtune.cli import main
    from tests.trainutil import logging_restored, tiny_workspace

    work = tiny_workspace(tmp_path_factory, "qlora-gguf", rows=16)
    run = work / "run"
    with logging_restored():
        assert main(["train", "--model_name_or_path", str(work / "model"), "--dataset_name", str(work / "chat.jsonl"),
                     "--output_dir", str(run), "--use_peft_lora", "true", "--use_4bit_quantization", "true",
                     "--max_steps", "1", "--max_seq_len", "64", "--bf16", "true", "--learning_rate", "1e-2",
                     "--predict_memory", "false"]) == 0
    capsys.readouterr()
    for source, out in ((run, "final"), (run / "checkpoints" / "step-1", "checkpoint")):
        assert main(["export", str(source), str(tmp_path / out / "m.gguf"), "--format", "gguf", "--quantize",
                     "f16"]) == 0
        assert (f"note: {source} was trained on a 4-bit (nf4) base (QLoRA); the GGUF holds its adapters merged "
                f"into its base unquantised") in capsys.readouterr().err
    final, checkpoint = ({t.name: t.data.copy() for t in gguf.GGUFReader(tmp_path / out / "m.gguf").tensors}
                         for out in ("final", "checkpoint"))
    assert final.keys() == checkpoint.keys() and all((final[k] == checkpoint[k]).all() for k in final)


def test_an_adapter_whose_modules_the_base_lacks_is_refused(tmp_path: Path, capsys) -> None:
    """PEFT adapts the base's modules that the adapter's config names and drops the adapter's other tensors: a
    Llama adapter on every linear layer merged into a Phi-3 base (one qkv_proj, one gate_up_proj) kept o_proj and
    down_proj alone, exit 0. merge and generate refuse it, naming how many tensors would be left out; the
    adapter's own base still merges."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main
    from shardtune.testing.families import make_family_folder
    from shardtune.testing.tiny import make_tokenizer

    tok = make_tokenizer()
    llama, phi3 = (make_family_folder(tmp_path / family, family, tokenizer=tok) for family in ("llama2", "phi3"))
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama), LoraConfig(r=2, target_modules="all-linear")
                   ).save_pretrained(adapter)
    tok.save_pretrained(adapter)
    assert main(["merge", str(adapter), "--base", str(phi3), str(tmp_path / "wrong")]) == 2
    err = capsys.readouterr().err
    assert f"adapter {adapter}: 20 of its 28 tensors fit no module of the base" in err, err
    assert not (tmp_path / "wrong").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(phi3)}))
    assert main(["generate", str(adapter), "--prompt", "hi", "--max_new_tokens", "1"]) == 2
    assert "20 of its 28 tensors fit no module of the base" in capsys.readouterr().err
    assert main(["merge", str(adapter), "--base", str(llama), str(tmp_path / "right")]) == 0


def test_a_model_folder_stops_at_the_eos_its_template_made_in_transformers_generate(tmp_path: Path) -> None:
    """llama-3 with add_special_tokens makes <|eot_id|> the tokenizer's EOS, and every trained turn ends with it;
    final/ (and export, merge) kept the base's generation_config, whose EOS ids transformers' generate stops at,
    so a model folder loaded there talked past the end of its turn. The template's EOS is now listed first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    from shardtune.data import DataConfig
    from shardtune.data.templates import configure_tokenizer
    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.export import write_export
    from shardtune.train.model import resize_for_tokenizer

    base = make_model_folder(tmp_path / "base")
    tokenizer = configure_tokenizer(AutoTokenizer.from_pretrained(base),
                                    DataConfig(chat_template_format="llama-3", add_special_tokens=True))
    model = AutoModelForCausalLM.from_pretrained(base)
    base_eos = model.generation_config.eos_token_id
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.eos_token_id != base_eos
    resize_for_tokenizer(model, len(tokenizer))
    write_export(tmp_path / "final", model, model.state_dict(), tokenizer, is_peft=False)

    class EndOfTurn(LogitsProcessor):  # a model that answers with the end of its turn at once
        def __call__(self, input_ids, scores):
            scores[:, tokenizer.eos_token_id] = scores.max() + 1
            return scores

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    prompt = torch.tensor([[tokenizer.bos_token_id, 5, 6]])
    out = saved.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                         logits_processor=LogitsProcessorList([EndOfTurn()]))
    assert out[0, 3:].tolist() == [tokenizer.eos_token_id]
    assert saved.generation_config.eos_token_id == [tokenizer.eos_token_id, base_eos]  # the base's EOS still stops


def test_a_model_folder_stops_at_the_end_of_turn_of_its_own_template_in_transformers_generate(tmp_path: Path) -> None:
    """A base whose own template ends a reply with a token that is not its EOS (Gemma's <end_of_turn>, Qwen2.5
    base's <|im_end|>; here the tiny tokenizer's ChatML <|im_end|> beside <|end_of_text|>) trains every turn to end
    there, but final/ (and export, merge) listed only the EOS in the generation config, so transformers' generate
    talked past the end of the turn. The template's end of a reply is now listed too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    from shardtune.data import DataConfig
    from shardtune.data.templates import configure_tokenizer
    from shardtune.testing.tiny import IM_END, make_model_folder
    from shardtune.train.export import write_export

    base = make_model_folder(tmp_path / "base")
    tokenizer = configure_tokenizer(AutoTokenizer.from_pretrained(base), DataConfig())
    model = AutoModelForCausalLM.from_pretrained(base)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id != end
    write_export(tmp_path / "final", model, model.state_dict(), tokenizer, is_peft=False)

    class EndOfTurn(LogitsProcessor):  # a model that ends its reply at once, as it trained to
        def __call__(self, input_ids, scores):
            scores[:, end] = scores.max() + 1
            return scores

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    prompt = torch.tensor([[tokenizer.bos_token_id, 5, 6]])
    out = saved.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                         logits_processor=LogitsProcessorList([EndOfTurn()]))
    assert out[0, 3:].tolist() == [end]
    assert saved.generation_config.eos_token_id == [end, tokenizer.eos_token_id]


def test_a_model_folder_keeps_the_bases_kv_cache_setting_after_checkpointed_training(tmp_path: Path) -> None:
    """Gradient checkpointing (on by default) set the model config's use_cache to false, and final/ saved that
    config: a model loaded from final/ returned no KV cache from its forward, and final/config.json differed from
    'shardtune export' of the same run's checkpoint. The config now keeps the base's value."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.export import write_export
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan

    base = make_model_folder(tmp_path / "base")
    model, runner = parallelize(AutoModelForCausalLM.from_pretrained(base), Plan(strategy="NO",
                                                                                gradient_checkpointing=True), INFO)
    write_export(tmp_path / "final", model, model.state_dict(), AutoTokenizer.from_pretrained(base), is_peft=False)
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert saved["use_cache"] is json.loads((base / "config.json").read_text())["use_cache"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        assert loaded(torch.tensor([[0, 5, 6]])).past_key_values is not None
