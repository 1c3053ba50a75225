"""Writes and reads that only rank 0 performs: a failure reaches every rank at once, and nothing half-written stays.

The jobs run with ddp_timeout=600, and no rank stops by a collective's timeout (its own message, checked absent). On
gloo a waiting rank also stops soon after rank 0's process exits, but only with "Connection closed by peer": what
shows that the failure was shared is the other rank's message, naming rank 0, the path and the cause. Nothing here
is timed: which rank said what, and in which order, is what is checked.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.test_resume import COMMON, FULL, shardtune
from tests.trainutil import flags, tiny_workspace

QUICK = ["--max_steps", "2", "--save_steps", "2", "--ddp_timeout", "600"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_workspace(tmp_path_factory, "rank0", model="M")


def stopped_line(stderr: str, rank: int) -> str:
    """The one line ``shardtune train`` prints for a rank that stopped (it may follow rank 0's progress bar)."""
    lines = re.findall(f"shardtune train: rank {rank}: stopped: .*", stderr)
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def failed_without_a_timeout(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``proc`` failed, and no rank of it stopped because a collective timed out."""
    assert proc.returncode != 0
    assert "a collective timed out" not in proc.stderr, proc.stderr[-3000:]
    return proc


def fsdp_full_state_job_that_fails(work: Path, name: str, fault: str):
    """A 2-process FSDP job saving FULL_STATE_DICT checkpoints with ``fault`` injected; it must fail, and not by a
    collective's timeout."""
    return failed_without_a_timeout(shardtune(work, name, "--distributed_type", "FSDP", *FULL,
                                              "--fsdp_state_dict_type", "FULL_STATE_DICT", *QUICK, fault=fault))


def test_full_state_dict_write_failure_reaches_every_rank(work: Path) -> None:
    # Rank 0 writes model.safetensors and optimizer.pt alone; the disk fills up while it does (step 2).
    proc = fsdp_full_state_job_that_fails(work, "full_enospc", fault="write_full:2:0:ENOSPC")
    ckpts = "full_enospc/checkpoints"
    cause = f"OSError: [Errno 28] No space left on device: '{ckpts}/.tmp-step-2/model.safetensors'"
    assert f"rank 0 failed saving checkpoint {ckpts}/step-2: {cause}" in stopped_line(proc.stderr, 1)
    assert f"checkpoint was not saved ({cause})" in stopped_line(proc.stderr, 0)
    assert "Last good checkpoint: none" in stopped_line(proc.stderr, 1)
    assert list((work / ckpts).iterdir()) == []  # the temporary folder is gone
    assert not (work / "full_enospc" / "final").exists()


def test_ctrl_c_on_rank0_while_it_writes_stops_every_rank(work: Path) -> None:
    # Rank 0 alone gets SIGINT while it writes the FULL_STATE_DICT files: it stops as Ctrl-C stops a program
    # (exit 130, no message of its own), and rank 1 learns why instead of waiting in the collective.
    proc = fsdp_full_state_job_that_fails(work, "ctrl_c", fault="write_full:2:0:INT")
    ckpts = "ctrl_c/checkpoints"
    assert (f"checkpoint was not saved (rank 0 failed saving checkpoint {ckpts}/step-2: KeyboardInterrupt). "
            f"Last good checkpoint: none; rank 0 was interrupted, so this rank stopped too; then run again"
            in stopped_line(proc.stderr, 1))
    assert "rank 0: stopped" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert list((work / ckpts).iterdir()) == []  # the temporary folder is gone
    assert not (work / "ctrl_c" / "final").exists()


# safetensors' own words for a full disk (0.8.0, measured on a full tmpfs): no path, no OSError.
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"
FULL_DISK_WORKER = f"""
import sys

import safetensors
import safetensors.torch


def full_disk(tensors, filename, metadata=None):
    raise safetensors.SafetensorError({SAFETENSORS_ENOSPC!r})


safetensors.torch.save_file = full_disk  # what the trainer calls to write model.safetensors
from shardtune.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_safetensors_full_disk_is_one_line_on_every_rank(work: Path, tmp_path: Path) -> None:
    # The real error of a full disk from safetensors is a SafetensorError, not an OSError: rank 0 must still
    # report it as a failed write (path, cause, what to do) in one line, not as a traceback.
    worker = tmp_path / "full_disk_worker.py"
    worker.write_text(FULL_DISK_WORKER)
    out = "st_enospc"
    launcher = "import sys; from shardtune.cli.launch import run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))"
    cmd = [sys.executable, "-c", launcher, "--standalone", "--nproc_per_node", "2", "--max_restarts", "0",
           str(worker), *flags("--model_name_or_path", "M", "--dataset_name", "chat.jsonl", *COMMON,
                               "--distributed_type", "FSDP", *FULL, "--fsdp_state_dict_type", "FULL_STATE_DICT", *QUICK,
                               "--output_dir", out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ckpts = f"{out}/checkpoints"
    cause = f"OSError: [Errno 28] No space left on device: '{ckpts}/.tmp-step-2/model.safetensors'"
    fix = f"free disk space or fix the permissions under {out}, or point output_dir elsewhere; then run again"
    assert f"checkpoint was not saved ({cause}). Last good checkpoint: none; {fix}" in stopped_line(proc.stderr, 0)
    assert f"rank 0 failed saving checkpoint {ckpts}/step-2: {cause}" in stopped_line(proc.stderr, 1)
    assert list((work / ckpts).iterdir()) == []  # the temporary folder is gone


def test_library_write_errors_become_oserrors_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    # safetensors and torch.save say a write failed in their own words; a bug raised while writing stays itself.
    import safetensors
    import safetensors.torch
    import torch

    from shardtune.train import checkpoint as ckpt

    def raises(exc):
        def save(*args, **kwargs):  # noqa: ARG001
            raise exc
        return save

    monkeypatch.setattr(safetensors.torch, "save_file", raises(safetensors.SafetensorError(SAFETENSORS_ENOSPC)))
    with pytest.raises(OSError) as failed:
        ckpt._write_full(tmp_path, {"w": torch.zeros(2)}, {})
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(tmp_path / "model.safetensors"))
    assert isinstance(failed.value.__cause__, safetensors.SafetensorError)  # the library's words stay chained

    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: None)
    # torch 2.13's zip writer on a full disk says nothing of the disk
    monkeypatch.setattr(torch, "save", raises(RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                           "unexpected pos 704 vs 598")))
    with pytest.raises(OSError, match=r"\[Errno 5\] write failed, the disk may be full \(\[enforce fail.*"
                                      r"optimizer\.pt'$"):
        ckpt._write_full(tmp_path, {"w": torch.zeros(2)}, {})
    monkeypatch.setattr(torch, "save", raises(RuntimeError("No space left on device")))
    with pytest.raises(OSError, match="No space left on device"):
        ckpt._write_full(tmp_path, {"w": torch.zeros(2)}, {})

    for bug in (RuntimeError("expected a tensor, got dict"), TypeError("save() got an unexpected keyword"),
                safetensors.SafetensorError("You are trying to save a non contiguous tensor")):
        monkeypatch.setattr(safetensors.torch, "save_file", raises(bug))
        with pytest.raises(type(bug)) as raised:
            ckpt._write_full(tmp_path, {"w": torch.zeros(2)}, {})
        assert raised.value is bug


def test_final_export_failure_reaches_every_rank(work: Path) -> None:
    # A file appears where final/ goes after the last checkpoint: rank 0's export fails (found before it writes
    # anything). A file there before the run would be an earlier run's, moved aside by a resume or refused.
    out = work / "blocked"
    proc = failed_without_a_timeout(shardtune(work, "blocked", "--distributed_type", "DDP", "--use_peft_lora", "True",
                                              *QUICK, fault="after_save:2:0:BLOCK-FINAL"))
    cause = "NotADirectoryError: [Errno 20] a file is where the exported folder goes; move it away:"
    assert f"rank 0 failed writing blocked/final: {cause}" in stopped_line(proc.stderr, 1)
    assert f"blocked/final was not written ({cause}" in stopped_line(proc.stderr, 0)
    assert "Last checkpoint: blocked/checkpoints/step-2" in stopped_line(proc.stderr, 1)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]  # .tmp-final is gone
    assert (out / "checkpoints" / "step-2" / "manifest.json").is_file()  # the checkpoint before is intact


def _resume_worker(rank: int, world: int, init_file: str, folder: str, frozen: bool) -> None:
    import torch
    import torch.distributed as dist

    from shardtune.dist import DistInfo, shutdown

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
    from shardtune.dist import RankFailed

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


def _interrupted_worker(rank: int, world: int, init_file: str, folder: str, kind: str) -> None:
    """rank 0's shared write stops with ``kind`` (no Exception); what each rank raised, to a file, and whether rank
    1 had written its file while rank 0 was still in the group."""
    import shutil
    from datetime import timedelta

    import torch.distributed as dist

    from shardtune.dist import run_and_share, shutdown

    timeout_s = 60
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    tmp = Path(folder) / ".tmp-step-1"

    def write() -> None:
        tmp.mkdir()
        raise KeyboardInterrupt if kind == "KeyboardInterrupt" else SystemExit(3)

    def drop_tmp() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    try:
        run_and_share(write, runs=rank == 0, what=f"saving checkpoint {folder}/step-1", on_failure=drop_tmp)
        raised = "nothing"
    except BaseException as exc:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(exc).__name__}: {exc}"
    result = {"raised": raised}
    if rank == 0:  # rank 0 stays (as a real one still cleaning up would): the other rank must not need it gone
        waited = time.monotonic()
        while not (Path(folder) / "rank1.json").exists() and time.monotonic() - waited < timeout_s + 30:
            time.sleep(0.1)
        result["rank1_done_before_rank0_left"] = (Path(folder) / "rank1.json").exists()
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
    shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit"])
def test_interrupted_rank0_write_reaches_every_rank(tmp_path: Path, kind: str) -> None:
    mp.spawn(_interrupted_worker, args=(2, str(tmp_path / "init"), str(tmp_path), kind), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # Rank 0 keeps its own BaseException (Ctrl-C stays Ctrl-C); rank 1 hears of it from rank 0 (a timeout or rank
    # 0 leaving would raise another error), while rank 0 is still in the group.
    assert r0["raised"] == ("KeyboardInterrupt: " if kind == "KeyboardInterrupt" else "SystemExit: 3")
    assert r1["raised"] == f"RankFailed: rank 0 failed saving checkpoint {tmp_path}/step-1: {kind}" + \
        ("" if kind == "KeyboardInterrupt" else ": 3")
    assert r0["rank1_done_before_rank0_left"]
    assert not (tmp_path / ".tmp-step-1").exists()  # removed by on_failure, also for an interrupted write


def test_failed_export_leaves_the_previous_folder_and_no_temporary_one(tmp_path: Path) -> None:
    # export / merge / final/ write into .tmp-NAME and rename; a write that fails half-way removes .tmp-NAME.
    from shardtune.train.export import write_export

    def disk_fills_up(model, state, folder: Path) -> None:  # noqa: ARG001
        folder.mkdir(exist_ok=True)  # the temporary folder exists already, as save_pretrained finds it
        (folder / "adapter_model.safetensors").write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "adapter_model.safetensors"))

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    with pytest.raises(OSError, match="No space left on device"):
        write_export(tmp_path / "final", None, {}, None, True, save_adapter=disk_fills_up)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert (tmp_path / "final" / "adapter_config.json").read_text() == "{}"
