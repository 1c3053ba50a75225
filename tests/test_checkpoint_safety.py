"""A checkpoint or final/ folder never runs code when it is loaded: a pickle planted in any of its files is refused,
not run.

The payload, unpickled, opens (creates) a marker file: proof enough that code ran. It is planted in turn in every
file of a LoRA checkpoint (DCP shards) and of a full fine-tune's FULL_STATE_DICT checkpoint (model.safetensors,
optimizer.pt); resume and export must then stop with one line naming the file and leave no marker. The same in
every file of each run's final/ (adapter and full model), for generate and merge.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from shardtune.train.safe_load import damage, file_digests
from tests.trainutil import logging_restored, write_chat_data


class Planted:
    """Unpickles into a call of ``open(marker, "w")``: what an attacker's pickle would do, made harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def args(root: Path, out: str, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"), "--splits",
            "train", "--max_seq_len", "64", "--packing", "True", "--max_steps", "2", "--save_steps", "2",
            "--per_device_train_batch_size", "2", "--output_dir", str(root / out), *extra]


LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj"]
FULL_STATE = ["--distributed_type", "FSDP", "--fsdp_state_dict_type", "FULL_STATE_DICT"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA run (DCP shards) and a full FSDP run on one process (FULL_STATE_DICT files), 2 steps each."""
    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.loop import train

    root = tmp_path_factory.mktemp("safety")
    make_model_folder(root / "model")
    write_chat_data(root / "chat.jsonl", rows=200)
    with logging_restored():
        train(load_train_config(args(root, "lora", *LORA)))
        train(load_train_config(args(root, "full", *FULL_STATE)))
    return root


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())


def test_the_payload_runs_under_plain_pickle_and_dcp(tmp_path, runs):
    """The control: the planted bytes do run code where nothing guards the load, here in torch's own DCP reader."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Planted(marker)))
    assert marker.exists()
    marker.unlink()
    planted = tmp_path / "dcp"
    shutil.copytree(runs / "lora" / "checkpoints" / "step-2" / "dcp", planted)
    (planted / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # what DCP says after the payload ran
        dcp.load({}, checkpoint_id=str(planted), no_dist=True)
    assert marker.exists()


def test_a_pickled_value_inside_a_dcp_shard_is_refused_by_the_weights_only_reader(tmp_path):
    """A DCP shard holds non-tensor values as pickles at offsets its .metadata records: one that would run code is
    read by PyTorch's weights-only unpickler and refused by name, where torch's own DCP reader runs it (the test
    above replaces whole files, which DCP cannot even read as far as a value)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardtune.train.safe_load import UnsafeCheckpoint, load_dcp

    marker, folder = tmp_path / "ran", tmp_path / "dcp"
    dcp.save({"weight": torch.zeros(2), "extra": Planted(marker)}, checkpoint_id=str(folder), no_dist=True)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint, match=r"^extra: refused to load a value of the checkpoint \(.*\); nothing "
                                               r"of it was run$"):
        load_dcp({"weight": torch.zeros(2), "extra": None}, folder, no_dist=True)
    assert not marker.exists()
    dcp.load({"weight": torch.zeros(2), "extra": None}, checkpoint_id=str(folder), no_dist=True)  # the control
    assert marker.exists()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated"])
def test_ctrl_c_or_sigterm_while_a_checkpoint_loads_is_not_called_damage(tmp_path, monkeypatch, stop):
    """DCP wraps whatever a read raises, Ctrl-C included: ``shardtune export`` stopped by Ctrl-C while it read the
    checkpoint said 'cannot be read (rank 0: KeyboardInterrupt: ); the checkpoint is damaged' with exit 2, of a
    checkpoint that was fine. The interruption comes out as itself (exit 130, or 143 for SIGTERM)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardtune.errors import Terminated
    from shardtune.train import safe_load

    stop = Terminated if stop == "Terminated" else stop
    folder = tmp_path / "dcp"
    dcp.save({"weight": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)

    def interrupted(self, *args, **kwargs):
        raise stop

    monkeypatch.setattr(safe_load.SafeReader, "read_data", interrupted)
    with pytest.raises(stop):
        safe_load.load_dcp({"weight": torch.zeros(2)}, folder, no_dist=True)


@pytest.mark.parametrize("run", ["lora", "full"])
def test_a_planted_pickle_in_any_checkpoint_file_never_runs(tmp_path, runs, run, restore_logging):
    from shardtune.train.export import export_checkpoint
    from shardtune.train.loop import train

    source = runs / run / "checkpoints" / "step-2"
    files = checkpoint_files(source)
    assert {"manifest.json", "trainer_state.json", "config.yaml", "rng/rank-0.pt"} <= {str(f) for f in files}
    assert any(f.suffix == ".distcp" for f in files) == (run == "lora")
    assert (Path("optimizer.pt") in files) == (run == "full")
    refused_by_resume = 0
    for relative in files:
        marker = tmp_path / f"ran-{relative.name}"
        planted = tmp_path / "planted" / str(relative).replace("/", "_")
        shutil.copytree(source, planted)
        (planted / relative).write_bytes(pickle.dumps(Planted(marker)))
        if relative.name != "manifest.json":  # an attacker rewrites the manifest too: it is a checksum, no signature
            manifest = json.loads((planted / "manifest.json").read_text())
            manifest["files"] = file_digests(planted, skip="manifest.json")
            (planted / "manifest.json").write_text(json.dumps(manifest))
        # export reads the config, the manifest and the weights; resume reads every file.
        try:
            export_checkpoint(planted, tmp_path / "exported")
        except UsageError as exc:
            assert "\n" not in str(exc)
        resume = args(runs, f"resumed-{run}", *(LORA if run == "lora" else FULL_STATE),
                      "--resume_from_checkpoint", str(planted), "--max_steps", "3")
        try:
            train(load_train_config(resume))
        except UsageError as exc:
            refused_by_resume += 1
            assert "\n" not in str(exc) and relative.name in str(exc), str(exc)  # the file named, not only its folder
        assert not marker.exists(), f"a pickle planted in {relative} ran"
    # Resume reads every file (config.yaml to compare the saved settings with the new ones): each was refused.
    assert refused_by_resume == len(files)


def flip_bytes(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (inside a tensor's data), keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_found_and_resume_true_takes_the_checkpoint_before(tmp_path, runs, restore_logging,
                                                                            capfd):
    """64 flipped bytes inside a saved LoRA tensor (once: loss frozen at 6.2, final/ up to 9.9e36, exit 0): named
    when the checkpoint is asked for, skipped with a warning by resume_from_checkpoint true, whose run then gives
    the uninterrupted run's losses from the checkpoint before."""
    from shardtune.train.export import export_checkpoint
    from shardtune.train.loop import train

    steps = ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1"]
    train(load_train_config(args(runs, "reference", *LORA, *steps)))
    reference = runs / "reference"
    manifest = json.loads((reference / "checkpoints" / "step-4" / "manifest.json").read_text())
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    damaged = tmp_path / "damaged"
    shutil.copytree(reference, damaged)
    shutil.rmtree(damaged / "final")
    shard = next((damaged / "checkpoints" / "step-4" / "dcp").glob("*.distcp"))
    flip_bytes(shard)

    named = args(runs, "named", *LORA, *steps, "--resume_from_checkpoint", str(shard.parents[1]))
    with pytest.raises(UsageError, match=re.escape(f"{shard} has changed since it was saved")):
        train(load_train_config(named))
    with pytest.raises(UsageError, match=r"has changed since it was saved \(.*\); export an earlier checkpoint"):
        export_checkpoint(shard.parents[1], tmp_path / "exported")

    capfd.readouterr()
    summary = train(load_train_config([*args(runs, "x", *LORA, *steps, "--resume_from_checkpoint", "true"),
                                       "--output_dir", str(damaged)]))
    assert summary["resumed_from_step"] == 2  # step-4 was skipped, with a warning naming it and why
    assert f"resume_from_checkpoint=true: skipping step-4: {shard} has changed since it was saved" in \
        capfd.readouterr().err
    read = lambda out: {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                        if "loss" in r}  # noqa: E731
    assert read(damaged) == read(reference)  # steps 3 and 4 again, bitwise as the uninterrupted run


def test_ranks_share_the_hashing_and_checking_of_a_checkpoint(tmp_path):
    """Each of the world's ranks hashes every world-th file; together they hash each file once, and the rank whose
    share holds a damaged file is the one that finds it."""
    for i in range(7):
        (tmp_path / "dcp" if i % 2 else tmp_path).mkdir(exist_ok=True)
        ((tmp_path / "dcp" if i % 2 else tmp_path) / f"f{i}.bin").write_bytes(bytes([i]) * (100 + i))
    (tmp_path / "manifest.json").write_text("{}")
    whole = file_digests(tmp_path, skip="manifest.json")
    shares = [file_digests(tmp_path, skip="manifest.json", share=(rank, 3)) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(whole) and len(whole) == 7
    assert {name: d for share in shares for name, d in share.items()} == whole
    victim = sorted(whole)[4]  # in rank 1's share of 3 (names in order: 4 % 3 == 1)
    flip_bytes(tmp_path / victim, count=8)
    found = [damage(tmp_path, whole, share=(rank, 3)) for rank in range(3)]
    assert found[0] is None and found[2] is None
    assert found[1] == f"{tmp_path / victim} has changed since it was saved (its SHA-256 differs from the manifest's)"


def test_resume_applies_a_new_learning_rate_and_refuses_new_lora_targets(tmp_path, runs, restore_logging, capfd):
    """A changed learning_rate takes effect from the resumed step and is logged (it used to be written to
    config.yaml while the schedule kept the old one); changed LoRA targets are refused in one line naming both
    values, before config.yaml is touched."""
    from shardtune.train.loop import train

    steps = ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-3",
             "--lr_scheduler_type", "constant"]
    first = tmp_path / "first"
    train(load_train_config([*args(runs, "x", *LORA, *steps), "--output_dir", str(first)]))
    step_2 = str(first / "checkpoints" / "step-2")

    moved = [*args(runs, "x", *LORA, *steps, "--resume_from_checkpoint", step_2, "--learning_rate", "5e-3"),
             "--output_dir", str(tmp_path / "faster")]
    capfd.readouterr()
    train(load_train_config(moved))
    said = capfd.readouterr().err  # the trainer logs to stderr, as its processes do
    assert "resume: learning_rate changed from 0.001 to 0.005; the new value takes effect from here" in said
    # another output_dir: its metrics.jsonl holds this run's steps only, and the log says where the others are
    assert (f"metrics.jsonl: {tmp_path / 'faster' / 'metrics.jsonl'} holds only the steps after 2; the records up to "
            f"step 2 are in the metrics.jsonl of the run that saved {step_2}, and in trainer_state.json's "
            f"log_history") in said
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "faster" / "metrics.jsonl").read_text().splitlines())
           if "lr" in r}
    assert lrs == {3: 5e-3, 4: 5e-3}

    # Another schedule from the resumed step on: its own rate already for step 3, as a run on that schedule from
    # the start has (the first resumed step took the rate the checkpoint's schedule had set, the next ones the new).
    class Rates:
        def __init__(self):
            self.used = {}

        def on_step_begin(self, args, state, control, optimizer, **kwargs):
            self.used[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    linear = [*steps[:-1], "linear"]
    resumed, from_start = Rates(), Rates()
    train(load_train_config([*args(runs, "x", *LORA, *linear, "--resume_from_checkpoint", step_2), "--output_dir",
                             str(tmp_path / "linear")]), [resumed])
    train(load_train_config([*args(runs, "x", *LORA, *linear), "--output_dir", str(tmp_path / "from-start")]),
          [from_start])
    assert resumed.used == {3: 5e-4, 4: 2.5e-4} and from_start.used == {1: 1e-3, 2: 7.5e-4, 3: 5e-4, 4: 2.5e-4}

    saved_config = (first / "config.yaml").read_bytes()
    retargeted = [*args(runs, "x", "--use_peft_lora", "True", "--lora_r", "4", "--lora_target_modules", "q_proj",
                        *steps, "--resume_from_checkpoint", "true"), "--output_dir", str(first)]
    with pytest.raises(UsageError, match=re.escape("lora_target_modules was 'q_proj,v_proj' when the checkpoint "
                                                   "was saved and is 'q_proj' now")):
        train(load_train_config(retargeted))
    assert (first / "config.yaml").read_bytes() == saved_config


def test_a_finished_schedule_given_more_steps_says_the_rate_it_resumes_at(tmp_path, runs, restore_logging, capfd):
    """A finished linear run given more max_steps resumes on the stretched schedule (as Transformers' Trainer does):
    step 5 of 8 trains at half the peak rate, where the checkpoint's schedule had reached 0. The only word of it was
    'max_steps changed'; the rate the resumed step trains at, against the checkpoint's, is said in one line, and a
    resume whose schedule is unchanged says nothing of it."""
    from shardtune.train.loop import train

    steps = ["--save_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-3", "--lr_scheduler_type", "linear"]
    run = tmp_path / "run"
    train(load_train_config([*args(runs, "x", *LORA, *steps, "--max_steps", "4"), "--output_dir", str(run)]))
    capfd.readouterr()
    train(load_train_config([*args(runs, "x", *LORA, *steps, "--max_steps", "8", "--resume_from_checkpoint", "true"),
                             "--output_dir", str(run)]))
    said = capfd.readouterr().err
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert lrs == {1: 1e-3, 2: 7.5e-4, 3: 5e-4, 4: 2.5e-4, 5: 5e-4, 6: 3.75e-4, 7: 2.5e-4, 8: 1.25e-4}
    assert ("resume: step 5 trains at lr 0.0005, this run's schedule's rate, not 0, the checkpoint's schedule's for "
            "that step: the rate follows the new settings from here") in said, said[-3000:]
    train(load_train_config([*args(runs, "x", *LORA, *steps, "--max_steps", "8", "--resume_from_checkpoint",
                                   str(run / "checkpoints" / "step-6")), "--output_dir", str(tmp_path / "same")]))
    assert "trains at lr" not in capfd.readouterr().err


def refused_or_ran_clean(argv: list[str], capsys, planted: Path) -> int:
    """Run a command; it either loads (exit 0) or refuses in one line naming the planted file (exit 2)."""
    from shardtune.cli import main

    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune ")]
    if code != 0:
        assert code == 2 and len(err) == 1 and str(planted) in err[0], (code, err)
    return code


@pytest.mark.parametrize("run", ["lora", "full"])
def test_a_planted_pickle_in_any_final_file_never_runs(tmp_path, runs, run, capsys):
    """Every file of ``final/`` in turn holds the payload: ``generate`` and ``merge`` (of the adapter, or onto the
    full model as its base) load without running it or refuse in one line naming the file. So do weights saved
    as a pickle (``*.bin``) in place of the safetensors, which torch's weights-only unpickler refuses."""
    import torch

    final = runs / run / "final"
    weights = "adapter_model" if run == "lora" else "model"
    files = checkpoint_files(final)
    assert Path(f"{weights}.safetensors") in files
    bin_file = Path("adapter_model.bin" if run == "lora" else "pytorch_model.bin")
    loaded = 0
    for relative in [*files, bin_file]:
        marker = tmp_path / f"ran-{relative.name}"
        planted = tmp_path / "planted" / relative.name
        shutil.copytree(final, planted)
        if relative == bin_file:
            (planted / f"{weights}.safetensors").unlink()
            torch.save({"weight": Planted(marker)}, planted / relative)
        else:
            (planted / relative).write_bytes(pickle.dumps(Planted(marker)))
        generate = ["generate", str(planted), "--prompt", "hi", "--max_new_tokens", "2", "--device", "cpu"]
        merged = str(tmp_path / "merged")
        merge = (["merge", str(planted), "--base", str(runs / "model"), merged, "--overwrite"] if run == "lora" else
                 ["merge", str(runs / "lora" / "final"), "--base", str(planted), merged, "--overwrite"])
        loaded += sum(refused_or_ran_clean(argv, capsys, planted / relative) == 0 for argv in (generate, merge))
        assert not marker.exists(), f"a pickle planted in final/{relative} ran"
    assert loaded == (2 if run == "lora" else 0)  # the adapter's README.md, read by neither command
