"""Fault injection for the test suite, plugged into real training jobs as callbacks (``--callbacks``).

The trainer carries no test hooks: a test names ``tests.faults:Faults`` (and puts the repository on PYTHONPATH, so
every process torchrun starts can import it) and says where the fault strikes in an environment variable:

- ``FAULT_STEP=hang:STEP:RANK`` sleeps forever when that rank begins step STEP; ``die:STEP:RANK`` exits with 17;
  ``term-launcher:STEP:RANK`` sends SIGTERM to the launcher there (the workers get it inside that step).
- ``FAULT_SAVE=POINT:STEP[:RANK[:HOW]]``: POINT ``after_save`` (the checkpoint of step STEP is complete) or
  ``during_save`` (its tensors are written, its manifest not yet) SIGKILLs the rank(s); HOW ``TERM`` sends SIGTERM
  instead, ``TERM-LAUNCHER`` sends it to the launcher, ``HOST`` SIGKILLs the launcher and then the rank(s), as a
  machine that loses power (set it in one host's environment only, to lose that host), ``TRUNCATE`` cuts the
  checkpoint's first shard to half its size and then SIGKILLs (a disk that lost the end of a file), ``BLOCK-FINAL``
  puts a file where final/ goes and lets the job go on (rank 0's export of final/ then fails). POINT
  ``write_full`` (rank 0 writing a FULL_STATE_DICT checkpoint) with HOW ``ENOSPC`` fails as a full disk does, with
  ``INT`` the rank gets SIGINT (Ctrl-C) there.
- ``FAULT_SLOW_SAVE=STEP:SECONDS``: every checkpoint from step STEP on takes SECONDS longer, between its tensors
  and its manifest (a large model's save).
- ``FAULT_END=TERM-LAUNCHER``: rank 0 sends SIGTERM to the launcher as training ends (``on_train_end``, before
  final/ is written), and waits a moment so that it arrives while the run finishes.
- ``FAULT_LOGITS=PATH``: at the end of training, the trained model's logits on a fixed input go to PATH (every rank
  runs the forward, as FSDP must gather; rank 0 writes).

Faults strike on the first attempt of an elastic job only, so a restarted job runs through.

``tests.faults:OneRankSteers`` is a callback's fault: it sets control flags on rank 1 only.
``tests.faults:Fp16Overflow`` makes step 2's gradients infinite, as an fp16 overflow does.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import torch

import shardtune.train.checkpoint as checkpoint

CALLBACK = "tests.faults:Faults"
REPO = Path(__file__).resolve().parents[1]


def fault_env(**faults: str) -> dict[str, str]:
    """The environment a job needs for ``faults`` (FAULT_STEP=..., FAULT_SAVE=..., FAULT_LOGITS=...)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **{f"FAULT_{k.upper()}": v for k, v in faults.items()}}


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _parse(spec: str) -> tuple[str, int, int | None, str]:
    point, step, rank, how = (spec.split(":") + ["", "", "", ""])[:4]
    return point, int(step), int(rank) if rank else None, how


class Faults:
    """One fault of each kind the environment names (see the module docstring)."""

    def __init__(self) -> None:
        self.step_fault = _parse(os.environ["FAULT_STEP"]) if os.environ.get("FAULT_STEP") else None
        self.save_fault = _parse(os.environ["FAULT_SAVE"]) if os.environ.get("FAULT_SAVE") else None
        self.logits_path = os.environ.get("FAULT_LOGITS")
        self.end_fault = os.environ.get("FAULT_END")
        slow = os.environ.get("FAULT_SLOW_SAVE")
        self.slow_save = tuple(map(float, slow.split(":"))) if slow else None

    def _mine(self, fault, step: int) -> bool:
        return fault is not None and fault[1] == step and fault[2] in (None, self.rank) and _first_attempt()

    def on_train_begin(self, args, state, control, *, info, **kwargs) -> None:
        self.rank, self.state = info.rank, state
        if self.save_fault and self.save_fault[0] in ("during_save", "write_full"):
            self._patch_checkpoint_writes()
        if self.slow_save:
            original = checkpoint.rng_state

            def rng_state():
                if self.state.step >= self.slow_save[0]:
                    time.sleep(self.slow_save[1])
                return original()

            checkpoint.rng_state = rng_state

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if not self._mine(self.step_fault, state.step + 1):
            return
        if self.step_fault[0] == "hang":
            # A rank stuck in its work, which the launcher's SIGTERM ends (the trainer's handler would only set a
            # flag for a step that never ends).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(10**6)
        elif self.step_fault[0] == "die":
            os._exit(17)
        elif self.step_fault[0] == "term-launcher":
            _strike("TERM-LAUNCHER")

    def on_save(self, args, state, control, *, checkpoint, **kwargs) -> None:
        if self.save_fault and self.save_fault[0] == "after_save" and self._mine(self.save_fault, state.step):
            if self.save_fault[3] == "BLOCK-FINAL":
                (Path(checkpoint).parents[1] / "final").write_text("not a folder")
                return
            if self.save_fault[3] == "TRUNCATE":
                shard = min(Path(checkpoint).glob("dcp/*.distcp"))
                with shard.open("r+b") as f:
                    f.truncate(shard.stat().st_size // 2)
            _strike(self.save_fault[3])

    def on_train_end(self, args, state, control, *, model, **kwargs) -> None:
        if self.end_fault and self.rank == 0 and _first_attempt():
            _strike(self.end_fault)
            time.sleep(1)
        if self.logits_path:
            _dump_logits(model, self.logits_path if self.rank == 0 else os.devnull)

    def _patch_checkpoint_writes(self) -> None:
        """Make the checkpoint writer fail at the named point: these are the seams where a save is half done."""
        point, _, _, how = self.save_fault
        if point == "during_save":  # each rank's RNG file is written after the tensors, before the manifest
            original = checkpoint.rng_state

            def rng_state():
                if self._mine(self.save_fault, self.state.step):
                    _strike(how)
                return original()

            checkpoint.rng_state = rng_state
        else:
            original_write = checkpoint._write_full

            def write_full(folder, *states):
                if self._mine(self.save_fault, self.state.step):
                    if how == "ENOSPC":
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.safetensors"))
                    _strike(how)
                return original_write(folder, *states)

            checkpoint._write_full = write_full


def _strike(how: str) -> None:
    if how == "INT":  # Ctrl-C where only this rank gets it: Python raises KeyboardInterrupt right here
        os.kill(os.getpid(), signal.SIGINT)
    elif how == "TERM":  # what a scheduler sends this process before preemption
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "TERM-LAUNCHER":  # ... or the launcher, which forwards it to every worker
        os.kill(os.getppid(), signal.SIGTERM)
    elif how == "HOST":  # the whole machine goes: its launcher (and so its other workers) and this rank
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _dump_logits(model: torch.nn.Module, path: str) -> None:
    """The logits of the trained model in memory on a fixed input, to compare exports against."""
    ids = torch.arange(3, 35, dtype=torch.long).reshape(2, 16).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    model.train(was_training)
    torch.save({"input_ids": ids.cpu(), "logits": logits.cpu()}, path)


class OneRankSteers:
    """Steers from rank 1 only, as a callback deciding from its own rank's clock or files does: asks for a
    checkpoint after step 1, an evaluation after step 2 and the stop after step 3. Each rank writes what it did to
    ``OUTPUT_DIR/one_rank_steers_rank{R}.json``: the steps it evaluated at, its checkpoints, the step it ended at."""

    def on_train_begin(self, args, state, control, *, info, **kwargs) -> None:
        self.rank, self.seen = info.rank, {"evaluated": [], "saved": []}

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.rank == 1:
            control.should_save = state.step == 1
            control.should_evaluate = state.step == 2
            control.should_training_stop = state.step == 3

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        self.seen["evaluated"].append(state.step)

    def on_save(self, args, state, control, *, checkpoint, **kwargs) -> None:
        self.seen["saved"].append(Path(checkpoint).name)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        import json

        self.seen["ended_at"] = state.step
        (Path(args.run.output_dir) / f"one_rank_steers_rank{self.rank}.json").write_text(json.dumps(self.seen))


class Fp16Overflow:
    """Step 2's backward turns the gradient reaching the first decoder layer's output infinite, so every gradient
    of that layer and below overflows, as a scaled fp16 gradient does (a hook on the activation, not on a
    parameter: FSDP2 hands its sharded parameters their gradients without autograd)."""

    handle = None

    def on_step_begin(self, args, state, control, *, model, **kwargs) -> None:
        if state.step == 1:  # steps done so far: this is step 2
            layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))

            def overflow(module, inputs, output):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden.register_hook(lambda grad: torch.full_like(grad, float("inf")))

            self.handle = layer.register_forward_hook(overflow)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
