"""One rank of tests/test_optimizers.py's 2-process job: several short training cases in one process launch.

Run as ``python -m tests.optim_cases WORK PORTS CASES_JSON`` by two processes (RANK 0 and 1). Each case trains
twice through ``shardtune.train.loop.train``: uninterrupted, writing beside its step-2 checkpoint the optimizer
state it held when saving; and resumed from that checkpoint into another output_dir by a new job, which builds
model and optimizer afresh and loads them from disk (all a killed run leaves is that checkpoint), and whose
loaded state is compared with the written one, tensor by tensor. Every run joins a new process
group on its own store (gloo cannot rejoin the group it left on the same store): the TCPStores that the test holds
on ports the OS chose (tests/ports.py), one per run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMON = ["--splits", "train", "--max_seq_len", "64", "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2",
          "--lr_scheduler_type", "cosine", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
          "--packing", "True", "--learning_rate", "1e-2", "--weight_decay", "0.1", "--save_total_limit", "5"]


def local_state(optimizer) -> list[dict]:
    """This rank's optimizer state in parameter order, every tensor as its local shard (a copy)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [{key: (value.to_local() if isinstance(value, DTensor) else value).clone()
             if hasattr(value, "clone") else value for key, value in optimizer.state[p].items()} for p in params]


class StateAtSave:
    """Writes this rank's optimizer state as it is when the step-``step`` checkpoint is saved."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_begin(self, args, state, control, *, optimizer, **kwargs) -> None:
        self.optimizer = optimizer

    def on_save(self, args, state, control, **kwargs) -> None:
        import torch

        if state.step == self.step:
            torch.save(local_state(self.optimizer), self.path)


class CompareLoadedState:
    """After resuming, compares the optimizer state loaded from disk with what was saved, bitwise; writes a
    report: the tensors compared, by dtype, and any that differ."""

    def __init__(self, saved: Path, report: Path) -> None:
        self.saved, self.report = saved, report

    def on_train_begin(self, args, state, control, *, optimizer, **kwargs) -> None:
        import torch

        want, got = torch.load(self.saved, weights_only=True), local_state(optimizer)
        compared, differ = {}, []
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if set(w) != set(g):
                differ.append(f"param {i}: keys {sorted(w)} vs {sorted(g)}")
            for key in set(w) & set(g):
                a, b = w[key], g[key]
                if isinstance(a, torch.Tensor):
                    compared[str(a.dtype)] = compared.get(str(a.dtype), 0) + 1
                    same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                else:
                    same = a == b
                if not same:
                    differ.append(f"param {i} {key}")
        self.report.write_text(json.dumps({"compared": compared, "differ": differ}))


def run(work: Path, port: int, out: str, args: list[str], callbacks=()) -> None:
    from shardtune.config.loading import load_train_config
    from shardtune.train.loop import train

    os.environ["MASTER_PORT"] = str(port)
    cfg = load_train_config(["--model_name_or_path", str(work / "M"), "--dataset_name", str(work / "chat.jsonl"),
                             *COMMON, *args, "--output_dir", str(work / out)])
    train(cfg, callbacks=list(callbacks))


def main() -> None:
    work, ports, cases = Path(sys.argv[1]), [int(p) for p in sys.argv[2].split(",")], json.loads(sys.argv[3])
    os.environ.update(SHARDTUNE_PREDICT_MEMORY="0", HF_HUB_OFFLINE="1")
    rank = os.environ["RANK"]
    for i, (name, args) in enumerate(cases.items()):
        saved, report = work / f"{name}_state_{rank}.pt", work / f"{name}_loaded_{rank}.json"
        run(work, ports[2 * i], f"{name}_ref", args, [StateAtSave(saved, 2)])
        step_2 = work / f"{name}_ref" / "checkpoints" / "step-2"
        run(work, ports[2 * i + 1], f"{name}_resumed", [*args, "--resume_from_checkpoint", str(step_2)],
            [CompareLoadedState(saved, report)])


if __name__ == "__main__":
    main()
