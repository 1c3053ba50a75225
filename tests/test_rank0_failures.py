"""Writes and reads that only rank 0 performs: a failure reaches every rank at once, and nothing half-written stays.

The jobs run with ddp_timeout=600, so stopping within a minute is never a collective's timeout. On gloo a waiting
rank also stops soon after rank 0's process exits, but only with "Connection closed by peer": what shows that the
failure was shared is the other rank's message, naming rank 0, the path and the cause.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.test_resume import FULL, shardtune

QUICK = ["--max_steps", "2", "--save_steps", "2", "--ddp_timeout", "600"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from shardtune.tiny import make_model_folder
    from tests.trainutil import write_chat_data

    root = tmp_path_factory.mktemp("rank0")
    make_model_folder(root / "M")
    write_chat_data(root / "chat.jsonl", rows=200)
    return root


def stopped_line(stderr: str, rank: int) -> str:
    """The one line ``shardtune train`` prints for a rank that stopped (it may follow rank 0's progress bar)."""
    lines = re.findall(f"shardtune train: rank {rank}: stopped: .*", stderr)
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_full_state_dict_write_failure_reaches_every_rank(work: Path) -> None:
    # Rank 0 writes model.safetensors and optimizer.pt alone; the disk fills up while it does (step 2).
    started = time.monotonic()
    proc = shardtune(work, "full_enospc", "--distributed_type", "FSDP", *FULL, "--fsdp_state_dict_type",
                     "FULL_STATE_DICT", *QUICK, fault="write_full:2:0:ENOSPC")
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"
    ckpts = "full_enospc/checkpoints"
    cause = f"OSError: [Errno 28] No space left on device: '{ckpts}/.tmp-step-2/model.safetensors'"
    assert f"rank 0 failed saving checkpoint {ckpts}/step-2: {cause}" in stopped_line(proc.stderr, 1)
    assert f"checkpoint was not saved ({cause})" in stopped_line(proc.stderr, 0)
    assert "Last good checkpoint: none" in stopped_line(proc.stderr, 1)
    assert list((work / ckpts).iterdir()) == []  # the temporary folder is gone
    assert not (work / "full_enospc" / "final").exists()


def test_final_export_failure_reaches_every_rank(work: Path) -> None:
    # A file where final/ goes: rank 0's export fails (found before it writes anything).
    out = work / "blocked"
    out.mkdir()
    (out / "final").write_text("not a folder")
    started = time.monotonic()
    proc = shardtune(work, "blocked", "--distributed_type", "DDP", "--use_peft_lora", "True", *QUICK)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"
    cause = "NotADirectoryError: [Errno 20] a file is where the exported folder goes; move it away:"
    assert f"rank 0 failed writing blocked/final: {cause}" in stopped_line(proc.stderr, 1)
    assert f"blocked/final was not written ({cause}" in stopped_line(proc.stderr, 0)
    assert "Last checkpoint: blocked/checkpoints/step-2" in stopped_line(proc.stderr, 1)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]  # .tmp-final is gone
    assert (out / "checkpoints" / "step-2" / "manifest.json").is_file()  # the checkpoint before is intact


def _resume_worker(rank: int, world: int, init_file: str, folder: str, frozen: bool) -> None:
    import torch
    import torch.distributed as dist

    from shardtune.train.dist import DistInfo, shutdown

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                    device=torch.device("cpu"))
    result = _save_and_resume(Path(folder), frozen, info)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
    shutdown()  # the model is gone by now (see shutdown)


def _save_and_resume(folder: Path, frozen: bool, info) -> dict:
    """Save a FULL_STATE_DICT checkpoint of a 2-rank FSDP2 model, change the model, load it back.

    ``frozen``: the first layer does not train, as the base model under LoRA (the checkpoint holds the rest only).
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardtune.train import checkpoint as ckpt
    from shardtune.train.dist import RankFailed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].requires_grad_(not frozen)
    model = fully_shard(model, mesh=init_device_mesh("cpu", (info.world_size,)))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.1)

    def train_step() -> None:
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def local() -> list:
        return [t.to_local().clone() for t in model.parameters()] + \
               [optimizer.state[p]["exp_avg"].to_local().clone() for p in trained]

    train_step()
    path = ckpt.save_checkpoint(folder, 1, model=model, optimizer=optimizer, trainable_only=frozen,
                                trainer_state={"step": 1}, config_yaml="", info=info, state_dict_type=ckpt.FULL)
    want = local()
    train_step()
    reads = []
    read_full = ckpt._read_full
    ckpt._read_full = lambda p: reads.append(str(p)) or read_full(p)
    ckpt.load_checkpoint(path, model=model, optimizer=optimizer, trainable_only=frozen, info=info)
    result = {"reads": reads[:], "restored": all(a.equal(b) for a, b in zip(local(), want))}
    dist.barrier()
    if info.is_main:
        (path / "optimizer.pt").unlink()
    dist.barrier()
    try:
        ckpt.load_checkpoint(path, model=model, optimizer=optimizer, trainable_only=frozen, info=info)
        result["error"] = ""
    except (RankFailed, FileNotFoundError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen-base"])
def test_full_state_dict_resume_reads_the_files_on_rank0_only(tmp_path: Path, frozen: bool) -> None:
    mp.spawn(_resume_worker, args=(2, str(tmp_path / "init"), str(tmp_path), frozen), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["reads"] == [str(tmp_path / "checkpoints" / "step-1")] and r1["reads"] == []
    assert r0["restored"] and r1["restored"]  # each rank's shards of weights and Adam moments, bitwise
    # A file rank 0 cannot read stops the other rank at once too.
    assert r0["error"].startswith("FileNotFoundError:")
    assert r1["error"].startswith(f"RankFailed: rank 0 failed reading checkpoint {tmp_path}/checkpoints/step-1: "
                                  "FileNotFoundError:")


def test_failed_export_leaves_the_previous_folder_and_no_temporary_one(tmp_path: Path) -> None:
    # export / merge / final/ write into .tmp-NAME and rename; a write that fails half-way removes .tmp-NAME.
    from shardtune.train import checkpoint as ckpt

    def disk_fills_up(model, state, folder: Path) -> None:  # noqa: ARG001
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "adapter_model.safetensors"))

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.write_export(tmp_path / "final", None, {}, None, True, save_adapter=disk_fills_up)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert (tmp_path / "final" / "adapter_config.json").read_text() == "{}"
