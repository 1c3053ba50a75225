"""Every family x {full, LoRA} trained in this one process, one case after another (tests/test_families.py).

``python -m tests.families_worker ROOT single mp`` runs each case on one process (global batch 4 rows x 2
accumulation steps), recording per case the first batch's loss as transformers computes it one document at a time
and the trained model's logits, then the same cases under naive model parallel over two CPU "devices" (``mp``);
``python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.families_worker ROOT fsdp ddp pp`` runs
them under FSDP2 FULL_SHARD with gradient checkpointing (4 rows per rank), DDP (2 rows x 2 accumulation steps per
rank), then as a 2-stage pipeline (every stage reads the 4 rows x 2 accumulation steps, 2 pipeline micro-batches
each). One process per launch, not per case: importing
torch and transformers is most of a tiny run's time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from shardtune.data.encode import IGNORE
from shardtune.testing.families import FAMILIES
from shardtune.train.loss import token_loss_sum

STEPS = 3
METHODS = ("full", "lora")
LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear"]
MODES = {"single": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"],
         "fsdp": ["--per_device_train_batch_size", "4", "--distributed_type", "FSDP",
                  "--gradient_checkpointing", "True"],
         "ddp": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--distributed_type",
                 "DDP"],
         "mp": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--distributed_type", "MP",
                "--mp_devices", "cpu,cpu"],
         "pp": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--distributed_type", "PP",
                "--pipeline_microbatches", "2"]}
# Longer than the families' 16-token sliding window, so the trained logits depend on it too.
LOGITS_INPUT = torch.arange(3, 83, dtype=torch.long).reshape(2, 40)


def case_args(root: Path, family: str, method: str, mode: str) -> list[str]:
    return ["--model_name_or_path", str(root / "models" / family), "--dataset_name", str(root / "chat.jsonl"),
            # 128 tokens: the chat rows' documents (38 tokens) pack three to a row; at 64 each row held one, and
            # no loss saw whether a document attends to the one before it in its row
            "--splits", "train", "--max_seq_len", "128", "--packing", "True", "--max_steps", str(STEPS),
            "--logging_steps", "1", "--learning_rate", "1e-2", "--seed", "7", "--save_steps", str(STEPS),
            "--output_dir", str(root / mode / f"{family}-{method}"), *MODES[mode],
            # fp32: every layout must compute what one process does (bf16 rounds layouts differently)
            "--bf16", "false",
            *(LORA if method == "lora" else [])]


def document_loss(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """The batch's mean target-token loss with every packed document run alone through the model's own forward
    (transformers' own masks, window and logit caps), before any update; and how many of its rows hold more than
    one trained document (where a mask that let documents see each other would change the loss)."""
    total, targets, packed_rows = 0.0, 0, 0
    with torch.no_grad():
        for batch in micro_batches:
            for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
                starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
                trained = [(start, end) for start, end in zip(starts, starts[1:])
                           if (labels[start + 1:end] != IGNORE).any()]
                packed_rows += len(trained) > 1
                for start, end in zip(starts, starts[1:]):
                    doc_labels = labels[None, start:end]
                    if (doc_labels[:, 1:] != IGNORE).any():
                        logits = model(input_ids=ids[None, start:end]).logits
                        total += token_loss_sum(logits.float(), doc_labels).item()
                        targets += int((doc_labels[:, 1:] != IGNORE).sum())
    return total / targets, packed_rows


class Record:
    """Writes what the test compares against into the case's output folder (one process only)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_begin(self, args, state, control, *, micro_batches, model, **kwargs) -> None:
        if state.step == 0:
            self.first_loss, self.packed_rows = document_loss(model, micro_batches)

    def on_train_end(self, args, state, control, *, model, **kwargs) -> None:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=LOGITS_INPUT).logits.float()
        torch.save({"input_ids": LOGITS_INPUT, "logits": logits}, self.out / "trained_logits.pt")
        (self.out / "first_batch.json").write_text(json.dumps({"document_loss": self.first_loss,
                                                                   "packed_rows": self.packed_rows}))


class CountLayerCalls:
    """Adds to summary.json how often the first decoder layer's attention ran in the run (this rank): once per
    micro-batch, and once more in backward where gradient checkpointing recomputes the layer."""

    def on_train_begin(self, args, state, control, *, model, **kwargs) -> None:
        self.calls = 0
        attention = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn"))
        attention.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def on_train_end(self, args, state, control, *, summary, **kwargs) -> None:
        summary["layer_0_attention_calls"] = self.calls


def main(root: Path, modes: list[str]) -> None:
    from shardtune import dist
    from shardtune.config import load_train_config
    from shardtune.train import loop

    # One process group for every case: ``train`` joins the group that exists, and leaves it standing here
    # (torchrun's rendezvous store does not take a second group on the same ranks after the first is destroyed).
    loop.shutdown = lambda: None
    try:
        for mode, family, method in ((m, f, x) for m in modes for f in FAMILIES for x in METHODS):
            cfg = load_train_config(case_args(root, family, method, mode))
            callbacks = {"single": [Record(Path(cfg.run.output_dir))], "fsdp": [CountLayerCalls()]}.get(mode, [])
            loop.train(cfg, callbacks=callbacks)
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
