"""Exact resume and faults with real 2-process gloo jobs (``shardtune launch``) on a tiny Llama.

Every scenario compares per-step losses against an uninterrupted run of the same config; on CPU they must be
bitwise equal. Runs are module-scoped fixtures shared between assertions (each 2-process job costs ~15 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.dist import children, process_state
from tests.faults import CALLBACK as FAULTS
from tests.faults import fault_env
from tests.trainutil import flags, write_sum_rows

SHARDTUNE = [sys.executable, "-m", "shardtune"]
COMMON = ["--splits", "train", "--max_seq_len", "64", "--max_steps", "6", "--logging_steps", "1",
          "--save_steps", "2", "--lr_scheduler_type", "cosine", "--gradient_accumulation_steps", "2",
          "--per_device_train_batch_size", "2", "--packing", "True", "--learning_rate", "1e-3"]
LORA = ["--use_peft_lora", "True", "--lora_dropout", "0.1"]
FULL = ["--use_peft_lora", "False"]
# The reference runs the export tests read compare the exported model's fp32 logits with the trained one's at 1e-6:
# they, and the runs compared with them, train in fp32 (the default is bf16 where the CPU has it). The other
# scenarios (DDP, a resumed evaluation, SIGTERM) resume bitwise at the defaults.
FP32 = ["--bf16", "false"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("resume")
    make_model_folder(root / "M")
    write_sum_rows(root / "chat.jsonl")
    return root


def shardtune(work: Path, out: str, *args: str, nproc: int = 2, fault: str | None = None,
              launcher: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run one training job in ``work`` (through ``shardtune launch`` unless nproc is 0: plain ``train``)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    full_env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **fault_env(**({"save": fault} if fault else {})),
                    **(env or {}))
    head = ["train"] if nproc == 0 else ["launch", "--num_processes", str(nproc), *launcher, "train"]
    cmd = [*SHARDTUNE, *head, *flags("--model_name_or_path", "M", "--dataset_name", "chat.jsonl", *COMMON, *args,
                                     "--output_dir", out, "--callbacks", FAULTS)]
    proc = subprocess.run(cmd, cwd=work, env=full_env, capture_output=True, text=True, timeout=600)
    (work / f"{out}.log").write_text(proc.stdout + proc.stderr)
    return proc


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def assert_same_losses(resumed: Path, reference: Path) -> None:
    """Every step logged exactly once, with the uninterrupted run's loss (bitwise on CPU)."""
    steps = [r["step"] for r in records(resumed) if "loss" in r]
    assert steps == list(range(1, 7)), f"steps logged: {steps}"
    got, want = losses(resumed), losses(reference)
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= 1e-6, f"max |loss difference| {worst:.3g}: {got} vs {want}"
    assert got == want  # bitwise: same data, same RNG draws, same reductions


def cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    """``shardtune export`` / ``merge`` run where the training ran (the checkpoint names the model as M)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*SHARDTUNE, *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def lora_ref(work: Path) -> Path:
    """FSDP x2 LoRA with dropout, cosine schedule and accumulation, uninterrupted; logits of the final model."""
    ok(shardtune(work, "lora_ref", "--distributed_type", "FSDP", *LORA, *FP32,
                 env={"FAULT_LOGITS": str(work / "lora_ref_logits.pt")}))
    return work / "lora_ref"


@pytest.fixture(scope="module")
def full_ref(work: Path) -> Path:
    """FSDP x2 full fine-tuning with FULL_STATE_DICT checkpoints, uninterrupted."""
    ok(shardtune(work, "full_ref", "--distributed_type", "FSDP", *FULL, "--fsdp_state_dict_type", "FULL_STATE_DICT",
                 *FP32, env={"FAULT_LOGITS": str(work / "full_ref_logits.pt")}))
    return work / "full_ref"


def test_fsdp_lora_sigkill_after_checkpoint_resumes_exactly(work: Path, lora_ref: Path) -> None:
    args = ("--distributed_type", "FSDP", *LORA, *FP32)
    killed = shardtune(work, "lora_kill", *args, fault="after_save:2")
    assert killed.returncode != 0
    out = work / "lora_kill"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "final").exists()
    ok(shardtune(work, "lora_kill", *args, "--resume_from_checkpoint", "true"))
    log = (work / "lora_kill.log").read_text()
    assert "resumed from lora_kill/checkpoints/step-2 at step 2" in log
    assert "done: 4 steps (steps 3-6, resumed from step 2) in" in log  # this run's steps, not the whole job's
    assert_same_losses(out, lora_ref)


def assert_memory_record(out: Path, step: int) -> None:
    """The predicted-vs-measured peak memory record, once, at the run's last step."""
    checks = [r for r in records(out) if "predicted_peak_bytes" in r]
    assert [r["step"] for r in checks] == [step], checks
    assert checks[0]["measured_peak_bytes"] > 0


def test_full_finetune_killed_while_saving_resumes_from_previous_checkpoint(work: Path, full_ref: Path) -> None:
    args = ("--distributed_type", "FSDP", *FULL, "--fsdp_state_dict_type", "FULL_STATE_DICT", *FP32)
    out = work / "full_kill"
    killed = shardtune(work, "full_kill", *args, fault="during_save:4")
    assert killed.returncode != 0
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step-4", "step-2"]
    # FULL_STATE_DICT: one consolidated model file and one optimizer file written by rank 0, no DCP shards.
    assert {p.name for p in (ckpts / "step-2").iterdir()} >= {"model.safetensors", "optimizer.pt", "manifest.json"}
    assert not (ckpts / "step-2" / "dcp").exists()
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]  # the killed run logged past its last checkpoint
    ok(shardtune(work, "full_kill", *args, "--resume_from_checkpoint", "true"))
    log = (work / "full_kill.log").read_text()
    assert "ignoring incomplete checkpoint full_kill/checkpoints/.tmp-step-4" in log
    assert "resumed from full_kill/checkpoints/step-2 at step 2" in log
    assert_same_losses(out, full_ref)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4", "step-6"]


def test_ddp_lora_resumes_exactly(work: Path) -> None:
    """Rank 1 is SIGKILLed after step-4 is saved: rank 0, the survivor, says so in one line (which rank, the newest
    complete checkpoint), not the backend's traceback; the launcher exits 128 + 9, as the README's table says."""
    args = ("--distributed_type", "DDP", *LORA)
    # The reference run gets a SIGTERM (to the launcher) as it ends: the workers finish and write final/, and the
    # launcher said "stopped by SIGTERM before the workers saved a checkpoint", exit 1, of a finished run.
    ref = shardtune(work, "ddp_ref", *args, env={"FAULT_END": "TERM-LAUNCHER"})
    ok(ref)
    assert "shardtune launch: SIGTERM came after training finished (6 steps; ddp_ref/final written): nothing to " \
           "resume" in ref.stderr, ref.stderr[-3000:]
    assert (work / "ddp_ref" / "final").is_dir()
    killed = shardtune(work, "ddp_kill", *args, fault="after_save:4:1")
    assert killed.returncode == 137, killed.stderr[-3000:]
    said = [line for line in killed.stderr.splitlines() if line.startswith("shardtune ")]
    assert said == ["shardtune train: rank 0: stopped: rank 1 is gone (the process ended: killed, out of memory, or "
                    "stopped by its own error, printed above), and training cannot go on without it; newest complete "
                    "checkpoint: ddp_kill/checkpoints/step-4; run the same command with resume_from_checkpoint true to "
                    "carry on from it (its files are checked first)",
                    "shardtune launch: rank 1 was killed by signal 9 (see its messages above)"], said
    assert "Traceback" not in killed.stderr and "Connection closed by peer" not in killed.stderr
    ok(shardtune(work, "ddp_kill", *args, "--resume_from_checkpoint", "true"))
    assert_same_losses(work / "ddp_kill", work / "ddp_ref")


def elastic_restart_from(work: Path, lora_ref: Path, out: str, fault: str, step: int = 2) -> str:
    """A 2-process FSDP LoRA job with ``fault``, restarted once by torchrun: it must go on from step-``step`` with
    the uninterrupted run's losses. Returns its log."""
    proc = shardtune(work, out, "--distributed_type", "FSDP", *LORA, *FP32, "--resume_from_checkpoint", "true",
                     fault=fault, launcher=("--max_restarts", "1"))
    ok(proc)
    log = (work / f"{out}.log").read_text()
    assert f"resumed from {out}/checkpoints/step-{step} at step {step}" in log
    assert_same_losses(work / out, lora_ref)
    return log


def test_elastic_restart_resumes_from_newest_complete_checkpoint(work: Path, lora_ref: Path) -> None:
    # Rank 1 dies while writing step-6; torchrun restarts both workers, which find step-2 and step-4 complete and
    # carry on from step-4 (with only one complete checkpoint, the oldest would have passed for the newest).
    log = elastic_restart_from(work, lora_ref, "elastic", "during_save:6:1", step=4)
    assert "ignoring incomplete checkpoint elastic/checkpoints/.tmp-step-6" in log


def test_elastic_restart_skips_a_damaged_newest_checkpoint(work: Path, lora_ref: Path) -> None:
    # Step-4 is complete but its first shard loses its second half, and rank 0 dies: the restarted workers find
    # step-4 damaged against its manifest, say so, and go on from step-2.
    log = elastic_restart_from(work, lora_ref, "elastic_cut", "after_save:4:0:TRUNCATE")
    assert "resume_from_checkpoint=true: skipping step-4: elastic_cut/checkpoints/step-4/dcp/__0_0.distcp has " in log


def test_two_process_checkpoint_resumes_on_one_process(work: Path, lora_ref: Path) -> None:
    # Same global batch (2 x 4 x 1 = 2 x 2 x 2): the same rows per step; dropout masks differ on 1 process.
    proc = shardtune(work, "one_proc", "--distributed_type", "NO", *LORA, *FP32, "--gradient_accumulation_steps", "4",
                     "--resume_from_checkpoint", str(lora_ref / "checkpoints" / "step-4"), "--predict_memory", "True",
                     nproc=0)
    ok(proc)
    assert "resuming a 2-process checkpoint on 1 process:" in proc.stderr
    got, want = losses(work / "one_proc"), losses(lora_ref)
    assert sorted(got) == [5, 6]
    assert all(abs(got[s] - want[s]) < 5e-3 for s in got), (got, want)  # measured ~2e-4, 8e-4
    assert (work / "one_proc" / "final" / "adapter_model.safetensors").is_file()
    assert "done: 2 steps (steps 5-6, resumed from step 4) in" in proc.stderr
    # A resumed run checks the memory prediction too (on CPU it measures its first step, 5, under the tracker).
    assert_memory_record(work / "one_proc", step=6)


def test_a_two_process_qlora_checkpoint_exports_and_resumes_on_one_process(work: Path) -> None:
    """An FSDP2 QLoRA checkpoint holds the adapters without the 4-bit base's quantisation state (absmax, quant_map,
    ...), which one process's model also asked for: shardtune export (also --format gguf) and a 1-process resume
    stopped at "Missing key ... base_layer.weight.absmax", calling the checkpoint damaged. Now the export equals
    the run's final/ adapter, and the resumed steps give the 2-process run's losses."""
    import torch
    from safetensors.torch import load_file

    qlora = ("--use_peft_lora", "True", "--use_4bit_quantization", "True", "--bf16", "True", "--max_steps", "4")
    ok(shardtune(work, "qlora_fsdp", "--distributed_type", "FSDP", *qlora))
    ok(cli(work, "export", "qlora_fsdp/checkpoints/step-4", "qlora_exported"))
    exported, final = (load_file(work / folder / "adapter_model.safetensors")
                       for folder in ("qlora_exported", "qlora_fsdp/final"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    ok(shardtune(work, "qlora_one", "--distributed_type", "NO", *qlora, "--gradient_accumulation_steps", "4",
                 "--resume_from_checkpoint", str(work / "qlora_fsdp" / "checkpoints" / "step-2"), nproc=0))
    got, want = losses(work / "qlora_one"), losses(work / "qlora_fsdp")
    assert sorted(got) == [3, 4] and all(abs(got[s] - want[s]) < 2e-3 for s in got), (got, want)


def test_eval_epochs_match_training_records_and_a_finished_run_resumes_to_nothing(work: Path) -> None:
    args = ("--distributed_type", "NO", *LORA, "--max_steps", "2", "--eval_strategy", "steps", "--eval_steps", "1",
            "--eval_split_ratio", "0.1")
    ok(shardtune(work, "evals", *args, nproc=0))
    out = work / "evals"
    logged = records(out)
    train = {r["step"]: r["epoch"] for r in logged if "loss" in r}
    evals = {r["step"]: r["epoch"] for r in logged if "eval_loss" in r}
    assert sorted(evals) == [1, 2] and all(0 < e < 1 for e in evals.values()), logged
    assert evals == train  # the same epoch count as the training record of the same step (epoch 1 of N: 1/N)

    # Resumed at its last step (a requeued job that had finished): nothing to train, said so; no record added, no
    # "done: 2 steps", and final/ and summary.json stay as they are (they were moved aside and written again).
    summary, final = (out / "summary.json").read_text(), (out / "final" / "adapter_model.safetensors").stat()
    proc = shardtune(work, "evals", *args, "--resume_from_checkpoint", "true", nproc=0)
    ok(proc)
    assert ("nothing to train: evals finished at step 2 already (completed, max_steps 2); its final/ and "
            "summary.json are kept as they are; raise max_steps to train further") in proc.stderr
    assert "done:" not in proc.stderr
    assert records(out) == logged and (out / "summary.json").read_text() == summary
    assert (out / "final" / "adapter_model.safetensors").stat().st_mtime_ns == final.st_mtime_ns
    assert not list((out / "checkpoints").glob("superseded-*"))
    # The same when the newest checkpoint is older than the end (save_steps not dividing max_steps): a requeue
    # does not train the rest again.
    shutil.move(out / "checkpoints" / "step-2", tmp_path_step2 := work / "evals-step-2")
    ok(proc := shardtune(work, "evals", *args, "--resume_from_checkpoint", "true", nproc=0))
    assert "nothing to train: evals finished at step 2 already" in proc.stderr
    assert records(out) == logged and not list((out / "checkpoints").glob("superseded-*"))
    shutil.move(tmp_path_step2, out / "checkpoints" / "step-2")
    # Killed after its last checkpoint, before final/: the resume writes final/ from it.
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    proc = shardtune(work, "evals", *args, "--resume_from_checkpoint", "true", nproc=0)
    ok(proc)
    assert ("nothing to train: resumed at step 2, already max_steps (2), so no step was taken (final/ written from "
            "evals/checkpoints/step-2); raise max_steps to train further") in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"], summary["resumed_from_step"]) == (2, 0, 2)


def test_a_resume_refused_for_its_data_leaves_the_finished_run_as_it_was(work: Path) -> None:
    """Raising max_steps of a finished run over other data (other tokens in as many rows; more rows) is refused,
    and the run's final/, summary.json and checkpoints stay where they were (they were moved aside first); the
    other spellings of true (latest) leave a finished run alone as true does."""
    lines = (work / "chat.jsonl").read_text().splitlines()
    data = work / "moved.jsonl"  # the file the run reads, edited in place below
    data.write_text("\n".join(lines) + "\n")
    args = ("--distributed_type", "NO", *LORA, "--max_steps", "2", "--dataset_name", data.name)
    ok(shardtune(work, "moved", *args, nproc=0))
    out = work / "moved"
    def files() -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    before = files()
    edited = [lines[0].replace("plus", "added to"), *lines[1:]]
    assert edited[0] != lines[0]
    for rows, says in ((edited, "training rows are not the checkpoint's (as many, other tokens"),
                       (lines + lines[:40], "the checkpoint's data order has num_rows=")):
        data.write_text("\n".join(rows) + "\n")
        proc = shardtune(work, "moved", *args, "--max_steps", "4", "--resume_from_checkpoint", "true", nproc=0)
        assert proc.returncode == 2 and "cannot resume: " in proc.stderr and says in proc.stderr, proc.stderr[-2000:]
        assert files() == before
    data.write_text("\n".join(lines) + "\n")
    # a tenth of the rows held out for eval: fewer training rows. The refusal named neither the checkpoint nor
    # eval_split_ratio; it names both now
    proc = shardtune(work, "moved", *args, "--max_steps", "4", "--eval_split_ratio", "0.1",
                     "--resume_from_checkpoint", "true", nproc=0)
    said = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and said.startswith("shardtune train: error: resume_from_checkpoint=") and \
        f"{out.name}/checkpoints/step-2: cannot resume: " in said and "eval_split_ratio)" in said, said
    assert said.endswith("; eval_split_ratio was 0.0 when the checkpoint was saved and is 0.1 now: set it back"), said
    assert files() == before
    # as many rows, other labels: the key that changed them is named with both values (it was logged as taking
    # effect, then refused as 'the data, the tokenizer or its chat template changed')
    proc = shardtune(work, "moved", *args, "--max_steps", "4", "--train_on_prompt", "true",
                     "--resume_from_checkpoint", "true", nproc=0)
    said = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "training rows are not the checkpoint's" in said and said.endswith(
        "; train_on_prompt was False when the checkpoint was saved and is True now: set it back"), said
    assert "train_on_prompt changed from False to True; allowed where the training rows stay the checkpoint's" \
        in proc.stderr and "takes effect" not in proc.stderr.split("train_on_prompt changed")[1].splitlines()[0]
    assert files() == before
    proc = shardtune(work, "moved", *args, "--resume_from_checkpoint", "latest", nproc=0)
    ok(proc)
    assert "nothing to train: moved finished at step 2 already" in proc.stderr
    assert files() == before


def test_checkpoint_at_an_epochs_last_step_resumes_with_the_next_epoch(work: Path) -> None:
    """A save_steps checkpoint that falls on an epoch's end records the epoch as done, and a run resumed from it
    with more epochs trains the next epoch exactly as an uninterrupted run does."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus 3?"},
                          {"role": "assistant", "content": f"{a} plus 3 is {a + 3}."}]} for a in range(12)]
    (work / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 12 rows, global batch 4: 3 steps an epoch; max_steps -1 lets num_train_epochs decide.
    args = ("--distributed_type", "NO", *LORA, "--dataset_name", "small.jsonl", "--packing", "False",
            "--max_steps", "-1", "--save_steps", "3", "--lr_scheduler_type", "constant")
    ok(shardtune(work, "epochs_ref", *args, "--num_train_epochs", "2", nproc=0))
    ok(shardtune(work, "epochs", *args, "--num_train_epochs", "1", nproc=0))
    state = json.loads((work / "epochs" / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["epoch"] == 1.0 and state["sampler"]["step_in_epoch"] == 3, state

    again = shardtune(work, "epochs", *args, "--num_train_epochs", "1", "--resume_from_checkpoint", "true", nproc=0)
    ok(again)
    assert "nothing to train: epochs finished at step 3 already" in again.stderr, again.stderr[-2000:]
    assert json.loads((work / "epochs" / "summary.json").read_text())["epochs"] == 1

    more = shardtune(work, "epochs", *args, "--num_train_epochs", "2", "--resume_from_checkpoint", "true", nproc=0)
    ok(more)
    got, want = losses(work / "epochs"), losses(work / "epochs_ref")
    assert sorted(got) == list(range(1, 7)) and got == want  # epoch 2 in the uninterrupted run's order, bitwise
    assert [r["epoch"] for r in records(work / "epochs") if "loss" in r] == [0.3333, 0.6667, 1.0, 1.3333, 1.6667, 2.0]
    assert json.loads((work / "epochs" / "summary.json").read_text())["epochs"] == 2


def test_sigterm_to_launcher_saves_and_exits_preempted(work: Path) -> None:
    # Rank 0 sends SIGTERM to the launcher as step 3 begins, as a scheduler would before preemption. The checkpoint
    # the SIGTERM saves (step 3 or later) takes 4 s, longer than torchrun's agent waits (set to 1 s here; 30 s by
    # default, short of a large model's save) before it SIGKILLs the workers: the launcher waits for the save
    # itself. (Sent right after step-2's save, it often stopped the run at step 2, whose checkpoint was there
    # already: nothing was saved after it, and a launcher that did not wait passed.)
    proc = shardtune(work, "sigterm", "--distributed_type", "FSDP", *LORA,
                     env={"FAULT_STEP": "term-launcher:3:0", "FAULT_SLOW_SAVE": "3:4",
                          "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})
    summary = json.loads((work / "sigterm" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and 3 <= summary["steps"] < 6
    last = Path(work / summary["last_checkpoint"])
    assert last.name == f"step-{summary['steps']}" and (last / "manifest.json").is_file()
    assert not (work / "sigterm" / "final").exists()
    # Not 0: a scheduler must not count a run stopped at step 2 of 6 as complete.
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert (f"stopped by SIGTERM at step {summary['steps']} of 6; checkpoint {summary['last_checkpoint']} saved and "
            f"verified") in proc.stderr


@pytest.fixture(scope="module")
def sigterm_single(work: Path) -> subprocess.CompletedProcess:
    """One process, SIGTERM to itself right after step-2 is saved; the end-of-run memory check on, as users have it
    (the tests' environment turns it off)."""
    return shardtune(work, "sigterm1", "--distributed_type", "NO", *LORA, "--gradient_accumulation_steps", "4",
                     "--predict_memory", "true", fault="after_save:2:0:TERM", nproc=0)


def test_sigterm_single_process_exits_preempted(work: Path, sigterm_single) -> None:
    proc = sigterm_single
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "stopped by SIGTERM at step 2 of 6; checkpoint sigterm1/checkpoints/step-2 saved and verified" in proc.stderr
    # The run's own last line says it stopped, not that it is done.
    assert "] stopped by SIGTERM: 2 steps in " in proc.stderr and "] done: " not in proc.stderr, proc.stderr[-2000:]
    # The grace period is the checkpoint's: the end-of-run memory trace (seconds to a minute, before the checkpoint
    # was verified) is left to the resumed run, whose end records it once.
    assert "predicting this job's peak memory" not in proc.stderr
    assert not [r for r in records(work / "sigterm1") if "predicted_peak_bytes" in r]
    summary = json.loads((work / "sigterm1" / "summary.json").read_text())
    assert (summary["stopped_by"], summary["steps"]) == ("SIGTERM", 2)
    assert summary["last_checkpoint"].endswith("step-2")


def test_a_second_run_in_a_used_folder_is_refused_before_writing(work: Path, sigterm_single) -> None:
    # A folder another run is using: its lock is held (here by this test process).
    from shardtune.train.output_dir import OutputDirLock

    (work / "busy").mkdir()
    lock = OutputDirLock(work / "busy")
    lock.acquire()
    try:
        busy = shardtune(work, "busy", *LORA, nproc=0)
    finally:
        lock.release()
    assert busy.returncode == 2, busy.stderr[-3000:]
    assert f"output_dir busy is in use by another run (pid {os.getpid()} on host" in busy.stderr
    assert sorted(p.name for p in (work / "busy").iterdir()) == []

    # A folder holding a finished run (sigterm1's step-2 checkpoint and its records), whose lock was left behind by a
    # process that died: the lock is taken over with a warning, and the run refused, nothing written.
    used = work / "sigterm1"
    def files() -> dict[str, bytes]:  # every file under it, checkpoints/ included (the top level alone missed them)
        return {str(p.relative_to(used)): p.read_bytes() for p in used.rglob("*") if p.is_file()}

    before = files()
    (used / ".shardtune.lock").write_text('{"host": "gone", "pid": 4242, "started": "yesterday"}\n')
    again = shardtune(work, "sigterm1", *LORA, nproc=0)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "taking over the lock of a run that is no longer running (pid 4242 on host gone, started yesterday)" \
        in again.stderr
    assert ("output_dir sigterm1 holds an earlier run (checkpoints step-2, metrics.jsonl, summary.json): set "
            "resume_from_checkpoint true") in again.stderr
    assert files() == before  # lock released too

    # overwrite_output_dir true: the earlier run's files go, and this run's are the only ones there.
    fresh = shardtune(work, "sigterm1", *LORA, "--max_steps", "1", "--overwrite_output_dir", "true", nproc=0)
    ok(fresh)
    assert "overwrite_output_dir: deleted the earlier run in sigterm1" in fresh.stderr
    assert [r["step"] for r in records(used)] == [1]
    # the earlier run's step-2 is gone; step 1, the run's last, is saved as Transformers saves the last step
    assert sorted(p.name for p in (used / "checkpoints").iterdir()) == ["step-1"] and (used / "final").is_dir()


def _alive(pid: int) -> bool:
    return process_state(pid) == "running"


def _launch(work: Path, out: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [*SHARDTUNE, "launch", "--num_processes", "2", "train",
           *flags("--model_name_or_path", "M", "--dataset_name", "chat.jsonl", *COMMON, *LORA, "--output_dir", out,
                  *args)]
    return subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sigterm_during_start_up_says_no_checkpoint_was_saved(work: Path) -> None:
    proc = _launch(work, "early")
    _wait_for(lambda: len(children(proc.pid)) == 2, 60)  # the workers are importing or loading
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "stopped by SIGTERM before the workers saved a checkpoint: no checkpoint was saved for it" in stderr
    assert not (work / "early" / "checkpoints").exists()


def test_sigkill_of_the_launcher_kills_its_workers(work: Path) -> None:
    proc = _launch(work, "orphans", "--max_steps", "100000", "--save_steps", "100000")
    _wait_for(lambda: (work / "orphans" / "metrics.jsonl").is_file(), 120)  # both workers are training
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.wait()  # not communicate(): workers that outlived it would hold its pipes open
    proc.stdout.close()
    proc.stderr.close()
    try:
        # Gone, where left alone they would train on for 100000 steps (the wait's limit only keeps a failure from
        # hanging the suite; nothing is timed).
        _wait_for(lambda: not any(_alive(pid) for pid in workers), 120)
    finally:
        for pid in filter(_alive, workers):  # a failed check leaves no training behind
            os.kill(pid, signal.SIGKILL)
    # The dead run's lock is taken over by the next run in the folder, which resumes (from nothing saved): the
    # workers were killed, not left to stop on their own, which would have released it.
    again = shardtune(work, "orphans", *LORA, "--max_steps", "1", "--resume_from_checkpoint", "true", nproc=0)
    ok(again)
    assert "taking over the lock of a run that is no longer running" in again.stderr
    assert [r["step"] for r in records(work / "orphans")] == [1]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_export_and_merge_match_trained_lora_model(work: Path, lora_ref: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = torch.load(work / "lora_ref_logits.pt", weights_only=True)
    ids, want = trained["input_ids"], trained["logits"]
    base = lambda: AutoModelForCausalLM.from_pretrained(str(work / "M"), dtype=torch.float32)  # noqa: E731
    # Measured on CPU fp32: adapter 0 (same weights, same kernels), merged ~2e-7 (W + BA rounds once more).
    adapter = _logits(PeftModel.from_pretrained(base(), str(lora_ref / "final")), ids)
    assert (adapter - want).abs().max().item() <= 1e-6
    assert (want - _logits(base(), ids)).abs().max().item() > 1e-3  # the adapter changed the model

    # export from a checkpoint (one process, DCP resharded) gives the same adapter as the run's final/
    for step in (2, 6):
        ok(cli(work, "export", str(lora_ref / "checkpoints" / f"step-{step}"), str(work / f"lora_export{step}")))
    final, exported = load_file(lora_ref / "final" / "adapter_model.safetensors"), \
        load_file(work / "lora_export6" / "adapter_model.safetensors")
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)
    early = load_file(work / "lora_export2" / "adapter_model.safetensors")
    assert any(not torch.equal(final[k], early[k]) for k in final)

    ok(cli(work, "merge", str(work / "lora_export6"), "--base", str(work / "M"), str(work / "merged")))
    merged = _logits(AutoModelForCausalLM.from_pretrained(str(work / "merged"), dtype=torch.float32), ids)
    assert (merged - want).abs().max().item() <= 1e-5


def test_export_full_state_dict_checkpoint_matches_trained_model(work: Path, full_ref: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = torch.load(work / "full_ref_logits.pt", weights_only=True)
    final = _logits(AutoModelForCausalLM.from_pretrained(str(full_ref / "final"), dtype=torch.float32),
                    trained["input_ids"])
    assert (final - trained["logits"]).abs().max().item() <= 1e-6
    ok(cli(work, "export", str(full_ref / "checkpoints" / "step-6"), str(work / "full_export")))
    a, b = load_file(full_ref / "final" / "model.safetensors"), load_file(work / "full_export" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("ran, resumed_from, says", [
    (1, 2, "done: 1 step (step 3, resumed from step 2) in"),  # was "1 steps (steps 3-3, ...)"
    (4, 2, "done: 4 steps (steps 3-6, resumed from step 2) in"), (1, None, "done: 1 step in"),
    (5, None, "done: 5 steps in")])
def test_the_last_line_counts_this_runs_steps_in_words(caplog, ran, resumed_from, says):
    from shardtune.config import TrainConfig
    from shardtune.train.run_end import log_summary

    summary = {"steps": ran + (resumed_from or 0), "steps_this_run": ran, "resumed_from_step": resumed_from,
               "mfu": None, "device_type": "cpu", "stopped_by": None, "wall_s": 1.0, "tokens_per_s": 10.0,
               "peak_memory_bytes": 1}
    with caplog.at_level("INFO", logger="shardtune"):
        log_summary(summary, TrainConfig())
    assert says in caplog.text


@pytest.mark.parametrize("max_steps, says", [
    (4, "nothing to train: resumed at step 4, already max_steps (4), so no step was taken (final/ written from "
        "run/checkpoints/step-4); raise max_steps to train further"),
    # was "already max_steps (2)": final/ holds step 4's weights, which max_steps 2 did not ask for
    (2, "nothing to train: resumed at step 4, past max_steps (2), so no step was taken (final/ written from "
        "run/checkpoints/step-4); raise max_steps to train further, or resume from a checkpoint at or before step 2 "
        "to end there")])
def test_a_resume_at_or_past_max_steps_says_which(caplog, max_steps, says):
    from dataclasses import replace

    from shardtune.config import TrainConfig
    from shardtune.train.run_end import log_summary

    summary = {"steps": 4, "steps_this_run": 0, "resumed_from_step": 4, "final": "run/final",
               "last_checkpoint": "run/checkpoints/step-4"}
    cfg = TrainConfig()
    with caplog.at_level("INFO", logger="shardtune"):
        log_summary(summary, replace(cfg, run=replace(cfg.run, max_steps=max_steps)))
    assert [r.getMessage() for r in caplog.records] == [says]
