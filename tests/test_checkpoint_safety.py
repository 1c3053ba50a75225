"""A checkpoint never runs code when it is loaded: a pickle planted in any of its files is refused, not run.

The payload, unpickled, opens (creates) a marker file: proof enough that code ran. It is planted in turn in every
file of a LoRA checkpoint (DCP shards) and of a full fine-tune's FULL_STATE_DICT checkpoint (model.safetensors,
optimizer.pt); resume and export must then stop with one line naming the file and leave no marker.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.trainutil import write_chat_data


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
    import logging
    import warnings

    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.loop import train

    root = tmp_path_factory.mktemp("safety")
    make_model_folder(root / "model")
    write_chat_data(root / "chat.jsonl", rows=200)
    level = logging.getLogger("bitsandbytes").level
    with warnings.catch_warnings():
        train(load_train_config(args(root, "lora", *LORA)))
        train(load_train_config(args(root, "full", *FULL_STATE)))
    logging.getLogger("bitsandbytes").setLevel(level)
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
            assert "\n" not in str(exc) and (str(relative.name) in str(exc) or str(planted) in str(exc)), str(exc)
        assert not marker.exists(), f"a pickle planted in {relative} ran"
    # Every file a resume needs was refused (config.yaml is the saved copy; the run uses its own config).
    assert refused_by_resume == len(files) - 1
