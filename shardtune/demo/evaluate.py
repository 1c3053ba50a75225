"""Did the fine-tune work? Eval loss on the held-out rows and exact-match accuracy of greedy answers.

The loss is the trainer's own: the rows go through the same data pipeline (chat template, assistant-only labels)
and the same per-token loss as ``shardtune train``'s eval, so the before and after numbers compare with the
``eval_loss`` records in ``metrics.jsonl``. The accuracy asks each held-out question through the chat template,
decodes greedily with the KV cache (``shardtune.infer.generate``) and compares the stripped reply with the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


class Question(Protocol):
    """A held-out item of a demo task (a sum, a name to convert): its question and the exact expected reply."""

    @property
    def answer(self) -> str: ...

    def question(self) -> str: ...


@dataclass
class Answer:
    question: str
    expected: str
    reply: str

    @property
    def correct(self) -> bool:
        return self.reply.strip() == self.expected


@dataclass
class Evaluation:
    """Eval loss (mean over answer tokens, EOS included) and exact-match accuracy on the held-out sums."""

    eval_loss: float
    answers: list[Answer] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(a.correct for a in self.answers) / max(1, len(self.answers))


@torch.inference_mode()
def eval_loss(model: Any, tokenizer: Any, dataset_dir: str | Path, *, max_seq_len: int = 128,
              batch_size: int = 16) -> float:
    """Mean next-token loss over the target tokens of the dataset's test split, as ``shardtune train`` computes it."""
    from shardtune.data import Collator, DataConfig, EvalSampler, prepare_datasets
    from shardtune.train.loss import num_targets, token_loss_sum
    from shardtune.train.runner import model_inputs

    cfg = DataConfig(dataset_name=str(dataset_dir), splits="train,test", max_seq_len=max_seq_len)
    data = prepare_datasets(cfg, tokenizer, seed=0)
    collate = Collator(tokenizer.pad_token_id, attn_implementation=model.config._attn_implementation)
    device = next(model.parameters()).device
    loss_sum, targets = 0.0, 0
    for indices in EvalSampler(len(data.eval), batch_size=batch_size, world_size=1, rank=0):
        batch = collate([data.eval[i] for i in indices if i is not None])
        logits = model(**model_inputs(batch, device), use_cache=False).logits
        labels = batch["labels"].to(device)
        loss_sum += float(token_loss_sum(logits, labels))
        targets += num_targets(labels)
    return loss_sum / max(1, targets)


def answer_questions(model: Any, tokenizer: Any, sums: Sequence[Question], *,
                     max_new_tokens: int | None = 8, batch_size: int = 16) -> list[Answer]:
    """Greedy replies to each question, asked through the tokenizer's chat template. ``max_new_tokens`` None: the
    longest expected answer's tokens plus 4, room for the stop token and for a too-long reply to show as one (a base
    model that rambles costs seconds per token on a CPU). The questions go ``batch_size`` at a time (the replies
    are those each gets alone, in float32, a few times sooner)."""
    from shardtune.infer.generate import encode_prompt, generate_batch

    if max_new_tokens is None:
        max_new_tokens = 4 + max(len(tokenizer(s.answer, add_special_tokens=False)["input_ids"]) for s in sums)
    replies = generate_batch(model, tokenizer, [encode_prompt(tokenizer, s.question()) for s in sums],
                             batch_size=batch_size, max_new_tokens=max_new_tokens)
    return [Answer(s.question(), s.answer, tokenizer.decode(ids, skip_special_tokens=True))
            for s, (ids, _) in zip(sums, replies)]


def evaluate_model(model_or_adapter: str | Path, dataset_dir: str | Path, sums: Sequence[Question], *,
                   max_seq_len: int = 128, max_new_tokens: int | None = 8) -> Evaluation:
    """Load a model folder (or an adapter on its base) on the CPU in fp32 and measure loss and accuracy."""
    from shardtune.infer.generate import load_for_generation

    # PEFT imports bitsandbytes, which warns that an optional CPU kernel package is missing; the fallback is fine.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    model, tokenizer = load_for_generation(model_or_adapter, dtype=torch.float32, device="cpu")
    return Evaluation(eval_loss=eval_loss(model, tokenizer, dataset_dir, max_seq_len=max_seq_len),
                      answers=answer_questions(model, tokenizer, sums, max_new_tokens=max_new_tokens))
