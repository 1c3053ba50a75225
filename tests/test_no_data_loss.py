"""Nothing a user already has is lost: export and merge write only their own files, resume sets aside what it would
replace, a refusal writes nothing, and a checkpoint's contents are checked as well as its hashes.

Each case snapshots every file (SHA-256) of the destination and of the source run before the command and compares
after it: a refusal leaves both exactly as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from shardtune.cli import main
from shardtune.config import load_train_config
from shardtune.errors import TrainingStopped, UsageError
from shardtune.train.plot import write_plots
from tests.trainutil import flags, logging_restored, tiny_workspace


def snapshot(*folders: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folders`` (hidden ones included), by path."""
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for folder in folders
            for path in sorted(Path(folder).rglob("*")) if path.is_file()}


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"), "--splits",
            "train", "--max_seq_len", "64", "--packing", "True", "--max_steps", "4", "--save_steps", "2",
            "--per_device_train_batch_size", "2", "--use_peft_lora", "True", "--lora_r", "4",
            "--lora_target_modules", "q_proj,v_proj", "--output_dir", str(out), *extra]


# The umask the run of ``made`` trains under, whatever the shell's: under 077 mkdtemp's 0700 is also the umask's
# mode, and the tests of the modes it wrote could not tell them apart.
RUN_UMASK = 0o022


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A tiny model, chat data, and a finished LoRA run (checkpoints step-2 and step-4, final/), trained under
    RUN_UMASK."""
    import os

    from shardtune.train.loop import train

    root = tiny_workspace(tmp_path_factory, "keep", rows=200)
    mask = os.umask(RUN_UMASK)
    try:
        with logging_restored():
            train(load_train_config(args(root, root / "run")))
    finally:
        os.umask(mask)
    return root


@pytest.fixture
def run(made, tmp_path) -> Path:
    """A copy of the finished run that the test may damage."""
    return Path(shutil.copytree(made / "run", tmp_path / "run"))


def test_export_and_merge_refuse_to_write_over_their_source_run(made, run, capsys):
    before = snapshot(run)
    assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(run)]) == 2
    assert one_error_line(capsys) == (f"shardtune merge: error: OUT {run}: holds the source {run / 'final'}, which an "
                                      f"export never writes over; give a new folder, such as ./exported")
    assert main(["export", str(run / "checkpoints" / "step-2"), str(run), "--overwrite"]) == 2
    assert f"OUT {run}: holds the source {run / 'checkpoints' / 'step-2'}" in one_error_line(capsys)
    assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(run.parent), "--overwrite"]) == 2
    assert f"OUT {run.parent}: holds the source {run / 'final'}" in one_error_line(capsys)
    assert snapshot(run) == before


def test_export_and_merge_refuse_folders_inside_their_source_or_what_a_run_manages(made, run, tmp_path, capsys):
    """An export inside final/ or a checkpoint (which a resume moves aside, and save_total_limit or
    overwrite_output_dir delete), or a GGUF written into the adapter folder it reads (generate then took the
    folder for a GGUF one), is refused; a folder of its own in the run's output_dir is fine, and generate loads an
    adapter folder that holds a .gguf as the adapter."""
    before = snapshot(run)
    step = run / "checkpoints" / "step-2"
    cases = [(["export", str(step), str(step / "out")], run / "checkpoints", "export"),
             (["export", str(run), str(run / "final" / "sub")], run / "final", "export"),
             (["export", str(run), str(run / "final"), "--format", "gguf"], run / "final", "export"),
             (["merge", str(run / "final"), "--base", str(made / "model"), str(run / "final" / "m")], run / "final",
              "merge")]
    for argv, inside, command in cases:
        assert main(argv) == 2
        out = argv[2] if command == "export" else argv[4]
        shown = f"{out}/model-q8_0.gguf" if "gguf" in argv else out
        assert one_error_line(capsys) == (f"shardtune {command}: error: OUT {shown}: is inside {inside}, which the run "
                                          f"in {run} manages (a resume, save_total_limit or overwrite_output_dir "
                                          f"moves or deletes what it holds); give a folder outside it, such as "
                                          f"./exported")
    assert snapshot(run) == before
    adapter = Path(shutil.copytree(run / "final", tmp_path / "adapter"))
    assert main(["export", str(adapter), str(adapter / "x.gguf"), "--format", "gguf"]) == 2
    assert one_error_line(capsys).endswith(f"OUT {adapter / 'x.gguf'}: is inside the source {adapter}; give a folder "
                                           f"outside it, such as ./exported")
    assert main(["export", str(run), str(run / "gguf"), "--format", "gguf"]) == 0
    capsys.readouterr()
    # a project of its own with a config.yaml and a checkpoints/ folder is no shardtune run: its folders are free
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 0.1\n")
    assert main(["export", str(step), str(project / "checkpoints" / "adapter")]) == 0
    capsys.readouterr()
    (adapter / "stray.gguf").write_bytes((run / "gguf" / "model-q8_0.gguf").read_bytes())
    assert main(["generate", str(adapter), "--prompt", "hi", "--max_new_tokens", "2"]) == 0


def test_exporting_a_checkpoint_over_a_base_of_other_shapes_says_to_fix_base(run, tmp_path, capsys):
    """It said the checkpoint was damaged and to resume from another one."""
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    other = make_model_folder(tmp_path / "other", tokenizer=make_tokenizer(), hidden_size=32, intermediate_size=64)
    capsys.readouterr()  # the model folder's own progress bars
    assert main(["export", str(run / "checkpoints" / "step-2"), str(tmp_path / "out"), "--base", str(other)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bars
    assert line.startswith("shardtune export: error: ") and line.endswith(
        "give --base the base model the run trained, or leave --base out"), line
    assert not (tmp_path / "out").exists()


def test_export_refuses_the_current_folder_and_a_folder_with_the_users_files(run, tmp_path, monkeypatch, capsys):
    here, notes = tmp_path / "here", tmp_path / "notes"
    for folder in (here, notes):
        folder.mkdir()
        (folder / "notes.txt").write_text("three weeks of notes")
    before = snapshot(run, here, notes)
    monkeypatch.chdir(here)
    assert main(["export", str(run / "checkpoints" / "step-2"), "."]) == 2
    assert one_error_line(capsys) == ("shardtune export: error: OUT .: is the current folder, which an export never "
                                      "writes over; give a new folder, such as ./exported")
    assert main(["export", str(run / "checkpoints" / "step-2"), "..", "--overwrite"]) == 2
    assert "OUT ..: holds the current folder" in one_error_line(capsys)
    assert main(["export", str(run / "checkpoints" / "step-2"), "../notes"]) == 2
    assert one_error_line(capsys).endswith("OUT ../notes: not empty (it holds notes.txt); give a new or empty folder, "
                                           "or add --overwrite to replace the files of an earlier shardtune export "
                                           "there (nothing else is touched)")
    assert snapshot(run, here, notes) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "notes", "run"]  # no temporary folder left


def test_overwrite_replaces_an_earlier_exports_files_and_nothing_else(made, run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(run / "checkpoints" / "step-2"), str(out)]) == 0
    capsys.readouterr()
    first = snapshot(out)
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run / "checkpoints" / "step-4"), str(out)]) == 2  # not without --overwrite
    assert "not empty" in one_error_line(capsys)
    assert main(["export", str(run / "checkpoints" / "step-4"), str(out), "--overwrite"]) == 0
    capsys.readouterr()
    after = snapshot(out)
    assert after[str(out / "notes.txt")] == hashlib.sha256(b"mine").hexdigest()
    assert after[str(out / "adapter_model.safetensors")] != first[str(out / "adapter_model.safetensors")]
    # a merge over the adapter export: the adapter's files (listed by the export) go, the user's file stays
    assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(out), "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "adapter_model.safetensors" not in names and "adapter_config.json" not in names
    assert "model.safetensors" in names and (out / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    # a file the earlier export wrote and the user then changed is the user's: refused, untouched
    (out / "config.json").write_text('{"edited": true}')
    before = snapshot(out)
    assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(out), "--overwrite"]) == 2
    assert one_error_line(capsys).endswith("config.json there was not written by a shardtune export (or changed "
                                           "since), and --overwrite replaces only those; move it away or give a new "
                                           "folder")
    assert snapshot(out) == before


def test_gguf_export_keeps_an_existing_gguf_and_the_users_modelfile(run, tmp_path, capsys):
    out = tmp_path / "gguf"
    out.mkdir()
    (out / "Modelfile").write_text("FROM ./mine.gguf\nSYSTEM my own prompt\n")
    before = snapshot(run, out)
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(run), str(out), "--format", "gguf", "--quantize", "f16", *extra]) == 2
        assert one_error_line(capsys) == (f"shardtune export: error: OUT {out / 'model-f16.gguf'}: {out / 'Modelfile'} "
                                          f"is there and shardtune did not write it (or it was edited since); move it "
                                          f"away or export into another folder")
    assert snapshot(run, out) == before
    (out / "Modelfile").unlink()
    assert main(["export", str(run), str(out), "--format", "gguf", "--quantize", "f16"]) == 0
    capsys.readouterr()
    written = snapshot(out)
    assert main(["export", str(run), str(out), "--format", "gguf", "--quantize", "f16"]) == 2
    assert one_error_line(capsys).endswith("already exist; add --overwrite to replace them, or give another OUT")
    assert snapshot(out) == written
    assert main(["export", str(out / "model-f16.gguf"), str(out / "model-f16.gguf"), "--format", "gguf",
                 "--quantize", "f16", "--overwrite"]) == 2
    assert "is what the export reads" in one_error_line(capsys)
    assert main(["export", str(run), str(out), "--format", "gguf", "--quantize", "f16", "--overwrite"]) == 0
    assert set(snapshot(out)) == set(written)
    # A GGUF of the user's (here a copy of ours with its shardtune mark rewritten) is refused even with --overwrite.
    capsys.readouterr()
    users = tmp_path / "users"
    users.mkdir()
    mine = users / "model-f16.gguf"
    mine.write_bytes((out / "model-f16.gguf").read_bytes().replace(b"written by shardtune", b"written by somebody  "))
    kept = snapshot(users)
    assert main(["export", str(run), str(users), "--format", "gguf", "--quantize", "f16", "--overwrite"]) == 2
    assert one_error_line(capsys).endswith(f"{mine} is there and shardtune did not write it; move it away or "
                                           f"export into another folder")
    assert snapshot(users) == kept
    # A GGUF without the mark is the user's even beside a Modelfile of shardtune's naming it: a Modelfile is easily
    # copied next to any file (tests/test_gguf.py has the user's SmolLM2 so).
    older = (out / "model-f16.gguf").read_bytes().replace(b"written by shardtune", b"written by somebody  ")
    (out / "model-f16.gguf").write_bytes(older)
    kept = snapshot(out)
    assert main(["export", str(run), str(out), "--format", "gguf", "--quantize", "f16", "--overwrite"]) == 2
    assert "shardtune did not write it" in one_error_line(capsys)
    assert snapshot(out) == kept


def train_in_process(argv: list[str], callbacks=()) -> dict:
    from shardtune.train.loop import train

    with logging_restored():
        return train(load_train_config(argv), callbacks)


def test_a_resume_takes_the_same_data_named_by_another_path(made, tmp_path, monkeypatch, capfd):
    """A run given its data as a relative path resumes with the same file named ./data, absolutely, or relatively
    from another working directory (it was refused: 'dataset_name was ... Set it back', impossible from there), and
    from a copy elsewhere (a job that copies its data to the node's own disk, at another path each time, was refused
    the same way on every requeue): the rows' SHA-256 decides. A file of other rows is refused naming dataset_name."""
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(made / "chat.jsonl", work / "chat.jsonl")
    monkeypatch.chdir(work)
    job = ["--model_name_or_path", str(made / "model"), "--splits", "train", "--max_seq_len", "64", "--packing",
           "True", "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "2", "--use_peft_lora",
           "True", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj"]
    train_in_process([*job, "--dataset_name", "chat.jsonl", "--output_dir", "run"])
    monkeypatch.chdir(tmp_path)
    step_2 = str(work / "run" / "checkpoints" / "step-2")
    for data in ("w/chat.jsonl", "./w/chat.jsonl", str(work / "chat.jsonl")):
        summary = train_in_process([*job, "--dataset_name", data, "--output_dir", str(work / "run"),
                                    "--resume_from_checkpoint", step_2])
        assert summary["steps"] == 4, data
    capfd.readouterr()
    copy = tmp_path / "node-local" / "copy.jsonl"
    copy.parent.mkdir()
    shutil.copy(work / "chat.jsonl", copy)
    summary = train_in_process([*job, "--dataset_name", str(copy), "--output_dir", str(work / "run"),
                                "--resume_from_checkpoint", step_2])
    assert (summary["steps"], summary["resumed_from_step"]) == (4, 2)
    assert f"resume: dataset_name changed from 'chat.jsonl' to '{copy}'; allowed where the training rows stay the " \
           "checkpoint's (compared when the data is read)" in capfd.readouterr().err
    lines = (work / "chat.jsonl").read_text().splitlines()
    (tmp_path / "other.jsonl").write_text("\n".join([lines[0].replace("plus", "added to"), *lines[1:]]) + "\n")
    with pytest.raises(UsageError) as refused:
        train_in_process([*job, "--dataset_name", "other.jsonl", "--output_dir", str(work / "run"),
                          "--resume_from_checkpoint", step_2])
    assert "training rows are not the checkpoint's" in str(refused.value) and str(refused.value).endswith(
        "; dataset_name was 'chat.jsonl' when the checkpoint was saved and is 'other.jsonl' now: set it back")


def test_a_resume_takes_the_same_model_from_another_path_and_refuses_other_weights(made, tmp_path, capfd):
    """A job that copies its model to the node's own disk at a new path each run (as its data) could never resume:
    'model_name_or_path was ... Set it back'. The checkpoint records the model files' fingerprint (config.json,
    each weight file's size and pieces of its bytes), and a copy resumes with one line. Other weights put at the
    model's path since (same config, another seed) carried the adapters over another base without a word: refused."""
    from shardtune.hub import model_fingerprint
    from shardtune.testing.tiny import make_model_folder

    first, node = tmp_path / "job1" / "model", tmp_path / "job2" / "model"
    shutil.copytree(made / "model", first)
    job = ["--dataset_name", str(made / "chat.jsonl"), "--splits", "train", "--max_seq_len", "64", "--packing",
           "True", "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "2", "--use_peft_lora",
           "True", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj", "--output_dir", str(tmp_path / "run")]
    train_in_process(["--model_name_or_path", str(first), *job])
    step_2 = tmp_path / "run" / "checkpoints" / "step-2"
    recorded = json.loads((step_2 / "trainer_state.json").read_text())["model_fingerprint"]
    assert recorded == model_fingerprint(str(made / "model"))
    shutil.copytree(first, node)
    shutil.rmtree(first.parent)
    capfd.readouterr()
    summary = train_in_process(["--model_name_or_path", str(node), *job, "--resume_from_checkpoint", str(step_2)])
    assert (summary["steps"], summary["resumed_from_step"]) == (4, 2)
    assert f"resume: model_name_or_path '{first}' -> '{node}': the same model files" in capfd.readouterr().err
    shutil.rmtree(node)
    make_model_folder(node, seed=11)  # the same shapes and config, other weights
    assert model_fingerprint(str(node)) != recorded
    with pytest.raises(UsageError, match=r"the model at the same path is not the one the checkpoint was trained on"):
        train_in_process(["--model_name_or_path", str(node), *job, "--resume_from_checkpoint",
                          str(tmp_path / "run" / "checkpoints" / "step-4")])


def test_a_finished_run_without_checkpoints_requeued_says_only_that_it_finished(made, run, capfd):
    """A run that saved no checkpoint (save_strategy no, or save_total_limit rotated them off) and finished,
    requeued with resume_from_checkpoint true: it said "starting from scratch", then that it had nothing to train."""
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    train_in_process(args(made, run, "--resume_from_checkpoint", "true"))
    err = capfd.readouterr().err
    assert "nothing to train" in err and "starting from scratch" not in err, err[-2000:]
    assert snapshot(run) == before
    # Asked for more steps, it started again from step 1 beside the finished run ('starting from scratch'): the
    # extension the user asked for cannot be had without a checkpoint, and retraining is not carrying it on.
    with pytest.raises(UsageError) as refused:
        train_in_process(flags(*args(made, run, "--resume_from_checkpoint", "true"), "--max_steps", "6"))
    assert str(refused.value) == (
        f"resume_from_checkpoint=true: {run} holds a run that finished at step 4 and saved no checkpoint, so it "
        f"cannot be carried on to step 6: this run would start again from step 1. To train on from its final/, "
        f"merge its adapter into the base (shardtune merge {run / 'final'} --base BASE MERGED) and give "
        f"model_name_or_path MERGED, in a new output_dir; to train again from scratch here, set "
        f"resume_from_checkpoint false and overwrite_output_dir true")
    assert snapshot(run) == before


def test_overwrite_output_dir_deletes_the_earlier_runs_files_and_keeps_the_users(made, run, capfd):
    """overwrite_output_dir true deletes what the earlier run wrote (its checkpoints by their manifests, final/ by
    its export list, a folder a resume set aside) and names it; a user's notes in checkpoints/ and final/, and a
    model card they edited, are kept (final/'s remainder moved aside, so that this run writes its own)."""
    shutil.copytree(run / "checkpoints" / "step-2", run / "checkpoints" / "superseded-1" / "checkpoints" / "step-2")
    (run / "checkpoints" / "my_notes.txt").write_text("lr 2e-4 diverged at step 900\n")
    (run / "final" / "my_eval_results.txt").write_text("mmlu 61.2\n")
    (run / "final" / "README.md").write_text("# my model card\n")
    # Nothing outside the run goes: a manifest naming a path out of its folder, a symlink in a tracker's folder.
    outside = run.parent / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine\n")
    forged = run / "checkpoints" / "step-99"
    forged.mkdir()
    (forged / "manifest.json").write_text(json.dumps({"files": {"../../../outside/keep.txt": {}}}))
    (run / "tensorboard").mkdir(exist_ok=True)
    (run / "tensorboard" / "linked").symlink_to(outside)
    # A note inside a checkpoint, and a checkpoint whose manifest lists no files (an older format): moved aside,
    # never taken for the new run's nor replaced by it.
    (run / "checkpoints" / "step-2" / "note.txt").write_text("good one\n")
    (run / "checkpoints" / "step-500").mkdir()
    (run / "checkpoints" / "step-500" / "manifest.json").write_text(json.dumps({"format": 1, "step": 500}))
    # The earlier run's plots (shardtune plot RUN) would show its curves beside the new run's metrics.jsonl; a
    # picture of the user's in plots/ stays.
    plotted = write_plots(run)
    (run / "plots" / "my_chart.png").write_bytes(b"\x89PNG mine")
    train_in_process(args(made, run, "--overwrite_output_dir", "true"))
    assert plotted and not any(path.exists() for path in plotted)
    assert (run / "plots" / "my_chart.png").read_bytes() == b"\x89PNG mine"
    assert (outside / "keep.txt").read_text() == "mine\n"
    err = capfd.readouterr().err
    assert "deleted the earlier run" in err and "checkpoints/superseded-1" in err, err[-2000:]
    assert "kept what the earlier run's manifests and lists do not name: checkpoints/my_notes.txt, " \
           "checkpoints/step-2/note.txt, checkpoints/step-500/manifest.json, final/README.md, " \
           "final/my_eval_results.txt and 1 more" in err, err[-2000:]
    assert (run / "checkpoints" / "my_notes.txt").read_text() == "lr 2e-4 diverged at step 900\n"
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("superseded-2")]
    assert len(aside) == 1, sorted(p.name for p in (run / "checkpoints").iterdir())
    assert sorted(p.name for p in (aside[0] / "final").iterdir()) == ["README.md", "my_eval_results.txt"]
    assert (aside[0] / "checkpoints" / "step-2" / "note.txt").read_text() == "good one\n"
    assert (aside[0] / "checkpoints" / "step-500" / "manifest.json").is_file()
    assert (aside[0] / "final" / "my_eval_results.txt").read_text() == "mmlu 61.2\n"
    assert not (run / "checkpoints" / "superseded-1").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-4"]
    assert (run / "final" / "adapter_model.safetensors").is_file()


def test_overwrite_output_dir_keeps_the_earlier_run_when_the_new_one_is_refused(made, run, tmp_path, capfd):
    """A run that stops on bad input (data it cannot read, a LoRA target the model lacks) leaves the earlier run as
    it was: overwrite_output_dir deleted it first, so a typo in the new command cost the old run."""
    before = snapshot(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "a row with no column shardtune reads"}) + "\n")
    for extra in (("--dataset_name", str(bad)), ("--lora_target_modules", "no_such_proj")):
        with pytest.raises(UsageError):
            train_in_process(args(made, run, "--overwrite_output_dir", "true", *extra))
        assert snapshot(run) == before, extra
    assert "deleted the earlier run" not in capfd.readouterr().err


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_and_final_aside(made, run, capfd):
    later = snapshot(run / "checkpoints" / "step-4", run / "final")
    summary = (run / "summary.json").read_bytes()
    metrics = (run / "metrics.jsonl").read_bytes()
    train_in_process(args(made, run, "--resume_from_checkpoint", str(run / "checkpoints" / "step-2")))
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1
    kept = snapshot(aside[0] / "checkpoints" / "step-4", aside[0] / "final")
    assert sorted(kept.values()) == sorted(later.values()) and len(kept) == len(later)
    assert (aside[0] / "summary.json").read_bytes() == summary
    assert (aside[0] / "metrics.jsonl").read_bytes() == metrics
    said = [line for line in capfd.readouterr().err.splitlines() if "superseded" in line]
    assert len(said) == 1 and (f"resuming at step 2, but the run holds checkpoints/step-4, final, summary.json, "
                               f"written after that checkpoint: moved to {aside[0]} (with a copy of metrics.jsonl) "
                               f"rather than replaced" in said[0])
    # the resumed run wrote its own step-4 and final/, and the old ones are still aside
    assert (run / "checkpoints" / "step-4" / "manifest.json").is_file() and (run / "final").is_dir()


def test_a_resume_at_max_steps_says_it_redoes_nothing(made, run, capfd):
    """Resumed from step-2 with max_steps 2, the run trains nothing: the record of step 4 (the last step, which
    logs) leaves metrics.jsonl (its copy goes aside with step-4 and final/), and the log said "which this run
    redoes"."""
    train_in_process(args(made, run, "--resume_from_checkpoint", str(run / "checkpoints" / "step-2"),
                          "--max_steps", "2"))
    said = capfd.readouterr().err
    assert "metrics.jsonl: dropped 1 record(s) after step 2, where this run resumes and, at max_steps, ends" in said
    assert "redoes" not in said
    assert max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()) <= 2


def test_a_requeue_after_sigterm_sets_nothing_aside(tmp_path):
    """SIGTERM saves step N and writes summary.json at step N; the requeue resumes at N. That summary was taken for
    one "from later on": every preemption moved it into a superseded folder with a copy of metrics.jsonl, and said
    so. A summary of a later step, final/ and later checkpoints are still set aside."""
    from shardtune.train.output_dir import newer_than

    (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 5, "stopped_by": "SIGTERM"}))
    assert newer_than(tmp_path, 5) == []
    assert newer_than(tmp_path, 4) == [tmp_path / "checkpoints" / "step-5", tmp_path / "summary.json"]
    (tmp_path / "final").mkdir()
    (tmp_path / "summary.json").write_text("{cut short")
    assert newer_than(tmp_path, 5) == [tmp_path / "final", tmp_path / "summary.json"]


def test_a_resume_at_a_finished_runs_last_step_sets_its_summary_aside(tmp_path):
    """A run that completed at step 5 (max_steps raised, resume_from_checkpoint true): its final/ went aside, but
    its summary.json, at the resumed step too, was taken for a preempted run's and stayed, to be overwritten by
    the resumed run's: the finished run's train_loss, runtime and best checkpoint were lost."""
    from shardtune.train.output_dir import set_aside_newer

    (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
    (tmp_path / "final").mkdir()
    summary = json.dumps({"steps": 5, "stopped_by": "completed", "train_loss": 1.5})
    (tmp_path / "summary.json").write_text(summary)
    aside = set_aside_newer(tmp_path, 5)
    assert (aside / "summary.json").read_text() == summary and (aside / "final").is_dir()
    assert not (tmp_path / "summary.json").exists()


def test_overwrite_output_dir_with_a_resume_says_the_resume_wins(made, run, capfd):
    """Both set (Transformers' recipes often carry overwrite_output_dir): it was logged as "changed ... takes
    effect from here" and then did nothing. The resume wins, as in Transformers, and the log says so."""
    kept = snapshot(run / "checkpoints" / "step-2", run / "checkpoints" / "step-4")
    train_in_process(args(made, run, "--resume_from_checkpoint", str(run / "checkpoints" / "step-2"),
                          "--overwrite_output_dir", "true"))
    said = capfd.readouterr().err
    assert (f"overwrite_output_dir true: nothing is deleted, since resume_from_checkpoint {run}/checkpoints/step-2 "
            f"carries the run in {run} on; set resume_from_checkpoint false to start afresh there") in said
    assert "overwrite_output_dir changed" not in said
    aside = next(p for p in (run / "checkpoints").iterdir() if p.name.startswith("superseded-"))
    assert snapshot(run / "checkpoints" / "step-2").items() <= kept.items()
    assert (aside / "checkpoints" / "step-4" / "manifest.json").is_file()


def test_a_manifest_missing_what_loading_reads_is_damage(run, caplog):
    """A manifest.json without world_size stopped the resume with a KeyError traceback, and true did not go on to
    the checkpoint before it."""
    from shardtune.train.checkpoint import resolve_resume

    manifest = run / "checkpoints" / "step-4" / "manifest.json"
    values = json.loads(manifest.read_text())
    del values["world_size"]
    manifest.write_text(json.dumps(values))
    with caplog.at_level("WARNING", logger="shardtune"):
        assert resolve_resume("true", run) == run / "checkpoints" / "step-2"
    assert f"skipping step-4: {manifest} has no world_size (a save writes a whole number >= 1 there)" in caplog.text
    with pytest.raises(UsageError, match=re.escape(f"{manifest} has no world_size (a save writes a whole number >= 1 "
                                                   f"there); resume from an earlier checkpoint")):
        resolve_resume(str(manifest.parent), run)


def test_final_has_the_mode_of_a_plain_folder(made):
    """final/ was made by mkdtemp and renamed: 0700, so a team's readers and a serving account could not read it,
    where checkpoints/ has the umask's mode."""
    assert (made / "run" / "final").stat().st_mode & 0o777 == 0o777 & ~RUN_UMASK
    assert (made / "run" / "checkpoints" / "step-2").stat().st_mode & 0o777 == 0o777 & ~RUN_UMASK


def test_exported_weights_have_the_mode_of_every_other_file(made, run, tmp_path, capsys):
    """safetensors' save_file creates 0600 whatever the umask: final/'s, an export's and a merge's weights were
    unreadable to a team where every other file was 0644. Every file has the umask's mode, here 0640 under 027."""
    import os

    def modes(folder: Path) -> dict[str, int]:
        return {p.name: p.stat().st_mode & 0o777 for p in sorted(folder.iterdir()) if p.is_file()}

    mask = os.umask(0o027)
    try:
        assert main(["export", str(run / "checkpoints" / "step-2"), str(tmp_path / "exported")]) == 0
        assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(tmp_path / "merged")]) == 0
    finally:
        os.umask(mask)
    exported, merged = modes(tmp_path / "exported"), modes(tmp_path / "merged")
    assert exported["adapter_model.safetensors"] == merged["model.safetensors"] == 0o640
    assert set(exported.values()) == set(merged.values()) == {0o640}, (exported, merged)
    final = modes(made / "run" / "final")  # written under RUN_UMASK
    assert final["adapter_model.safetensors"] == 0o666 & ~RUN_UMASK and set(final.values()) == {0o666 & ~RUN_UMASK}, \
        final
    from shardtune.train.checkpoint import _write_full  # a FULL_STATE_DICT checkpoint's weights, likewise

    (tmp_path / "full").mkdir()
    mask = os.umask(0o027)
    try:
        _write_full(tmp_path / "full", {"w": torch.ones(2)}, {})
    finally:
        os.umask(mask)
    assert modes(tmp_path / "full") == {"model.safetensors": 0o640, "optimizer.pt": 0o640}


def test_a_resume_into_a_folder_holding_another_history_is_refused(made, run, tmp_path, capsys):
    """A checkpoint carries on the losses logged before it: resumed into a folder whose metrics.jsonl logged other
    ones (another run, or this run after a resume from an earlier step took another branch), the two runs' records
    were mixed in one file. Refused, naming the fix, with nothing written; into an empty folder it carries on."""
    train_in_process(args(made, run, "--resume_from_checkpoint", str(run / "checkpoints" / "step-2"),
                          "--learning_rate", "1e-2"))  # another branch from step 2: its step 4 logs another loss
    aside = next(p for p in (run / "checkpoints").iterdir() if p.name.startswith("superseded-"))
    old = aside / "checkpoints" / "step-4"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    before = [json.loads(line) for line in (aside / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["step"] == 4] != [r["loss"] for r in before if r["step"] == 4]
    kept = snapshot(run)
    with pytest.raises(UsageError) as refused:
        train_in_process(args(made, run, "--resume_from_checkpoint", str(old)))
    assert str(refused.value) == (
        f"resume_from_checkpoint {old}: output_dir {run} holds another history (its metrics.jsonl up to step 4 is "
        f"not what the checkpoint was trained through: another run, or another branch of this one); resume into "
        f"the run folder that saved the checkpoint, or give an empty output_dir to carry on from it there")
    assert snapshot(run) == kept
    # The same branch's own checkpoint, and the old one into an empty folder, carry on.
    assert train_in_process(args(made, run, "--resume_from_checkpoint", "true"))["steps"] == 4
    assert train_in_process(args(made, tmp_path / "fresh", "--resume_from_checkpoint", str(old)))["steps"] == 4


def test_a_refusal_writes_nothing(made, run, tmp_path, capsys, restore_logging):
    new = tmp_path / "new-run"
    assert main(["train", *flags(*args(made, new, "--lora_target_modules", "no_such_proj"))]) == 2
    assert "lora_target_modules=no_such_proj: no module of the model is named no_such_proj" in capsys.readouterr().err
    assert not new.exists()
    before = snapshot(run)
    assert main(["train", *flags(*args(made, run, "--resume_from_checkpoint", "true", "--lora_r", "8"))]) == 2
    assert "lora_r was 4 when the checkpoint was saved and is 8 now" in capsys.readouterr().err
    assert snapshot(run) == before


@pytest.mark.parametrize("change, refused", [
    (("--init_lora_weights", "pissa"), "init_lora_weights was 'true' when the checkpoint was saved and is 'pissa'"),
    (("--use_dora", "true"), "use_dora was False when the checkpoint was saved and is True"),
    (("--lora_modules_to_save", "lm_head"), "lora_modules_to_save was [] when the checkpoint was saved"),
    (("--lora_alpha", "64"), "lora_alpha was 16 when the checkpoint was saved and is 64"),
    (("--use_rslora", "true"), "use_rslora was False when the checkpoint was saved"),
    (("--lora_bias", "all"), "lora_bias was 'none' when the checkpoint was saved"),
    (("--lora_target_modules", "v_proj, q_proj"), None),  # the same modules
    (("--init_lora_weights", "gaussian"), "init_lora_weights was 'true' when the checkpoint was saved and is "
                                          "'gaussian'"),  # the adapters' first values: they were made long ago
    (("--lora_dropout", "0.1"), None),
])
def test_a_resume_refuses_lora_settings_that_change_what_the_adapters_compute(made, change, refused):
    """PiSSA's init rewrites the base weights, alpha and rsLoRA scale the update, DoRA, modules_to_save and biases
    add tensors: changed on resume, they were accepted ("takes effect from here") and trained another model, or
    failed to load naming the checkpoint damaged. Another order of the same targets was refused."""
    from shardtune.train.resume import check_resume

    checkpoint = made / "run" / "checkpoints" / "step-2"
    saved = load_train_config(args(made, made / "run"))
    now = load_train_config(args(made, made / "run", *change))
    if refused is None:
        assert list(check_resume(checkpoint, saved, now, saved_world=1, world=1).changed) == \
            (["lora_dropout"] if change[0] == "--lora_dropout" else [])
    else:
        with pytest.raises(UsageError, match=re.escape(refused)):
            check_resume(checkpoint, saved, now, saved_world=1, world=1)


def test_a_resume_from_another_directory_says_where_the_models_relative_path_is_read(tmp_path, monkeypatch):
    """A run started as 'train --model_name_or_path models/base' in the project and resumed from elsewhere with
    the folder's whole path is refused (a model is not matched by its path's ending: it could be another model's
    folder), and "set it back" could not work from there: the refusal now says to resume from where it started."""
    from shardtune.train.resume import check_resume

    base = tmp_path / "project" / "models" / "base"
    base.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    flags = ["--dataset_name", "d.jsonl", "--output_dir", str(tmp_path / "run")]
    monkeypatch.chdir(tmp_path / "project")
    saved = load_train_config(["--model_name_or_path", "models/base", *flags])
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match=re.escape(
            "Set model_name_or_path back (a relative path, read from the directory the run was started in: resume "
            "from there), or start a new run")):
        check_resume(tmp_path / "ck", saved, load_train_config(["--model_name_or_path", str(base), *flags]),
                     saved_world=1, world=1)
    monkeypatch.chdir(tmp_path / "project")  # from there, the same words say nothing more
    with pytest.raises(UsageError, match=re.escape("Set model_name_or_path back, or start")):
        check_resume(tmp_path / "ck", saved, load_train_config(["--model_name_or_path", str(tmp_path), *flags]),
                     saved_world=1, world=1)


def rewrite_state(checkpoint: Path, change) -> None:
    """Change ``trainer_state.json`` and record its new digest in the manifest, as a forger (or a buggy tool)
    would: the hashes then agree, so only a check of the values can tell."""
    from shardtune.train.safe_load import file_digest

    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    change(state)
    state_file.write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = file_digest(state_file)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, problem", [
    (lambda s: s.update(step=-3), "trainer_state.json: step -3 is not a whole number >= 0"),
    (lambda s: s.update(step=3), "trainer_state.json: step 3 does not match the folder's step-4"),
    (lambda s: s["sampler"].update(step_in_epoch=900),
     "trainer_state.json: the sampler is at step 900 of an epoch that has 68 (136 rows, 2 a step)"),
    (lambda s: s["sampler"].update(epoch=2), "trainer_state.json: the sampler's position (epoch 2, step 4 of 68) is "
                                             "not step 4"),
    (lambda s: s.update(epoch=float("nan")), "trainer_state.json: epoch nan is not a finite number >= 0"),
    (lambda s: s.update(steps_cut=-1), "trainer_state.json: steps_cut -1 is not a whole number >= 0"),
    (lambda s: s.update(steps_cut=1), "trainer_state.json: the sampler's position (epoch 0, step 4 of 68, less "
                                      "steps_cut 1) is not step 4"),
    (lambda s: s.update(tokens_seen=-5), "trainer_state.json: tokens_seen -5 is not a whole number >= 0"),
])
def test_a_checkpoints_trainer_state_is_range_checked(made, run, change, problem, caplog):
    from shardtune.train.checkpoint import checkpoint_problem, resolve_resume

    newest = run / "checkpoints" / "step-4"
    assert checkpoint_problem(newest) is None
    rewrite_state(newest, change)
    assert problem in checkpoint_problem(newest)
    with pytest.raises(UsageError, match=f"resume_from_checkpoint={newest}: .*{problem}".replace("(", r"\(")
                       .replace(")", r"\)")):
        resolve_resume(str(newest), run)
    assert resolve_resume("true", run) == run / "checkpoints" / "step-2"  # the newest sane one
    assert f"skipping step-4: {problem}" in caplog.text


class PoisonAtStep:
    """Puts a NaN into a LoRA weight after step ``step``: the checkpoint saved next holds it, hashed and all."""

    def __init__(self, step: int) -> None:
        self.step, self.model = step, None

    def on_train_begin(self, args, state, control, model, **kwargs) -> None:
        self.model = model

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.step == self.step:
            with torch.no_grad():
                next(p for n, p in self.model.named_parameters() if "lora_B" in n).fill_(float("nan"))


def test_a_nan_right_after_a_resume_names_the_checkpoint(made, tmp_path):
    out = tmp_path / "poisoned"
    train_in_process(flags(*args(made, out, "--max_steps", "2")), [PoisonAtStep(2)])
    with pytest.raises(TrainingStopped) as stopped:
        train_in_process(args(made, out, "--resume_from_checkpoint", "true"))
    message = str(stopped.value)
    assert message.startswith(f"step 3: loss nan, gradient norm nan, on the first step after resuming from "
                              f"{out / 'checkpoints' / 'step-2'}: that checkpoint is suspect (it put non-finite "
                              f"values in base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight)")
    assert "learning_rate" in message and "will not help" in message


def test_files_written_where_the_user_says_never_replace_the_users_own(made, tmp_path, monkeypatch, capsys):
    """The single files commands write at a path the user names (estimate's recipe and pictures, a run's plots in
    a folder of the user's, bench's results, a cluster job): a file shardtune did not write there is refused
    before any work, with one line, and left as it was; shardtune's own earlier output there is replaced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    users = tmp_path / "mine"
    users.mkdir()
    recipe, picture = users / "recipe.yaml", users / "fit.png"
    recipe.write_text("my: precious\n")
    fig = plt.figure()
    fig.savefig(picture, format="png")  # a PNG of the user's: matplotlib's, not shardtune's
    plt.close(fig)
    (users / "loss_vs_step.png").write_bytes(picture.read_bytes())
    (users / "bench.md").write_text("# my notes\n")
    (users / "job.sbatch").write_text("#!/bin/bash\necho mine\n")
    estimate = ["estimate", "smollm2-135m", "--method", "lora", "--gpu", "rtx4090", "--seq-len", "512"]
    attempts = {
        "--emit-config": [*estimate, "--emit-config", str(recipe)],
        "--plot": [*estimate, "--plot", str(picture)],
        "--plot ": [*estimate, "--time", "--plot", str(users / "fit2.png")],  # its -time.png sibling is the user's
        "--out": ["plot", str(made / "run"), "--out", str(users)],
        "--out  ": ["bench", "strategies", str(made / "run" / "config.yaml"), "--out", str(users / "bench.json")],
        "--slurm": ["launch", "--slurm", str(users / "job.sbatch"), "--num_machines", "2", "--gpus_per_node", "8",
                    "train", "--model_name_or_path", "M", "--dataset_name", "d.jsonl", "--output_dir", "out"],
    }
    (users / "fit2-time.png").write_bytes(picture.read_bytes())
    before = snapshot(users)
    for option, argv in attempts.items():
        assert main(argv) == 2, option
        line = one_error_line(capsys)
        assert option.strip() in line and "shardtune did not write" in line, line
        assert snapshot(users) == before, option
    # shardtune's own outputs are replaced when the same command runs again.
    ours = tmp_path / "ours"
    ours.mkdir()
    for _ in range(2):
        assert main([*estimate, "--time", "--emit-config", str(ours / "r.yaml"), "--plot", str(ours / "p.png")]) == 0
        assert main(["plot", str(made / "run"), "--out", str(ours)]) == 0
    capsys.readouterr()
    assert {p.name for p in ours.iterdir()} >= {"r.yaml", "p.png", "p-time.png", "loss_vs_step.png"}
    # A recipe written before shardtune marked its files (every key of a resolved config) is replaced too.
    older = ours / "r.yaml"
    unmarked = [line for line in older.read_text().splitlines(keepends=True)[1:] if "unedited: sha256" not in line]
    older.write_text("".join(unmarked))
    assert main([*estimate, "--emit-config", str(older)]) == 0
    assert snapshot(users) == before
    # Edited, shardtune's own recipe and cluster job are their user's (their digest line no longer holds): kept.
    # So is a file that quotes the mark below its first lines.
    job = ours / "job.sbatch"
    slurm = [*attempts["--slurm"][:2], str(job), *attempts["--slurm"][3:]]
    assert main(slurm) == 0 and main(slurm) == 0  # its own job, replaced
    capsys.readouterr()
    for path, edit in ((older, lambda text: re.sub(r"(?m)^seed: \d+$", "seed: 7", text)),
                       (job, lambda text: text.replace("set -euo pipefail", "set -eo pipefail"))):
        edited = edit(path.read_text())
        assert edited != path.read_text()
        path.write_text(edited)
    (ours / "quoting.yaml").write_text("learning_rate: 0.1\nseed: 1\nmax_steps: 5\n# like a recipe written by "
                                       "shardtune\n")
    mine = snapshot(ours)
    for argv in ([*estimate, "--emit-config", str(older)], slurm,
                 [*estimate, "--emit-config", str(ours / "quoting.yaml")]):
        assert main(argv) == 2
        assert "shardtune did not write" in one_error_line(capsys)
    assert snapshot(ours) == mine


def test_an_export_list_names_nothing_outside_its_folder(tmp_path):
    """--overwrite replaces and removes the files an earlier export listed: a list naming '../x' or an absolute
    path (with the file's true size and time) would have reached outside OUT."""
    from shardtune.train.layout import EXPORT_LIST, listed_files, stamp

    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("mine\n")
    (out / "model.safetensors").write_bytes(b"x")
    names = {"../outside.txt": stamp(outside), str(outside): stamp(outside),
             "model.safetensors": stamp(out / "model.safetensors")}
    (out / EXPORT_LIST).write_text(json.dumps({"written_by": "shardtune export", "files": names}))
    assert listed_files(out) == {"model.safetensors"}


def test_a_path_ending_alike_is_the_same_data_only_where_the_old_path_names_nothing_here(tmp_path, monkeypatch):
    """The relative path a checkpoint saved names the same place when this one ends in it, only for data (its rows'
    SHA-256 is checked as they are read) and only when it names nothing from here: a base model found that way
    could be another model's folder."""
    from shardtune.train.resume import _same

    for side in ("a", "b"):
        (tmp_path / side / "models" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    other = str(tmp_path / "b" / "models" / "llama")
    assert not _same("model_name_or_path", "models/llama", other)  # names a/models/llama here: another folder
    assert not _same("model_name_or_path", "llama", other)  # a model is never matched by its name's ending
    assert not _same("dataset_name", "models/llama", other)
    assert _same("dataset_name", "b/models/llama", other)  # names nothing from a/: the ending decides
    assert _same("model_name_or_path", "models/llama", str(tmp_path / "a" / "models" / "llama"))


def test_export_and_merge_refuse_an_out_that_is_a_symlink_before_any_work(made, run, tmp_path, capsys):
    """OUT a symlink to an empty folder passed every check and failed only after the whole export, when the
    finished folder was renamed onto it ('[Errno 20] Not a directory', exit 1). It is refused up front, naming the
    folder to give instead; the link and the folder are left as they were, and no temporary folder stays."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "linkout"
    link.symlink_to(real)
    for argv in (["export", str(run / "checkpoints" / "step-2"), str(link)],
                 ["merge", str(run / "final"), "--base", str(made / "model"), str(link)],
                 ["merge", str(run / "final"), "--base", str(made / "model"), str(link), "--overwrite"]):
        assert main(argv) == 2, argv
        assert one_error_line(capsys) == (f"shardtune {argv[0]}: error: OUT {link}: a symlink to {real}, which an "
                                          f"export does not follow; give the folder itself, {real}, or a new folder")
        assert link.is_symlink() and os.readlink(link) == str(real) and list(real.iterdir()) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["linkout", "real", "run"]
    assert main(["merge", str(run / "final"), "--base", str(made / "model"), str(real)]) == 0  # the fix it names
    assert (real / "model.safetensors").is_file()


def test_a_resume_that_derived_its_accumulation_resumes_again_on_as_many_processes(tmp_path_factory, tmp_path,
                                                                                     capsys):
    """A job saved on 2 processes resumes on 1 (an elastic job that lost a machine): gradient_accumulation_steps
    2 -> 4 keeps the checkpoint's global batch. Restarted again on that 1 process (a second failure, a requeue) with
    the same command, it was refused: "the global batch was 8 rows per step ... and is 4 now". The checkpoint
    records the accumulation its run was given, and the same command keeps the derived one; another is refused."""
    from tests.trainutil import run_shardtune

    root = tiny_workspace(tmp_path_factory, "derived-accumulation", rows=48)
    out = root / "run"
    base = ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"), "--output_dir",
            str(out), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--save_steps", "1",
            "--predict_memory", "false", "--disable_tqdm", "true", "--logging_steps", "1"]
    launched = run_shardtune(["launch", "--num_processes", "2", "train", *base, "--max_steps", "1"], tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    for steps in ("2", "3"):
        with logging_restored():
            assert main(["train", *base, "--max_steps", steps, "--resume_from_checkpoint", "true"]) == 0, steps
    state = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert (state["step"], state["sampler"]["global_batch_size"]) == (3, 8)
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    capsys.readouterr()
    with logging_restored():
        assert main(["train", *flags(*base, "--gradient_accumulation_steps", "6"), "--max_steps", "4",
                     "--resume_from_checkpoint", "true"]) == 2
    assert ("the global batch was 8 rows per step (per_device_train_batch_size 2 x gradient_accumulation_steps 4 x 1 "
            "process(es)) and is 12 now (2 x 6 x 1); the data position counts steps of the first. Set "
            "gradient_accumulation_steps 4 to keep it") in capsys.readouterr().err
