"""The demo's base model: a ~1M-parameter Llama pre-trained by shardtune on text it generates, shipped as safetensors.

``scripts/pretrain_demo_base.py`` runs :func:`pretrain` with :data:`BASE_SPEC` and writes the folder that ships in
``shardtune/demo/base_model/`` (config, weights, tokenizer and ``pretrain.json``, the spec it was made with). A test
checks that the shipped folder matches the spec, so the script and the weights cannot drift apart.

Pre-training is plain next-token prediction on one process: the point of the demo is the fine-tune, and this loop
only has to leave a model that knows its sums and writes English-like filler.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardtune.demo.task import MAX_OPERAND, all_sums, pretraining_lines
from shardtune.files import give_plain_mode

BASE_MODEL_DIR = Path(__file__).parent / "base_model"
SPEC_FILE = "pretrain.json"


@dataclass(frozen=True)
class BaseSpec:
    """Everything that decides the shipped base model: shape, tokenizer, corpus and optimisation."""

    vocab_size: int = 512
    num_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 352
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    max_operand: int = MAX_OPERAND
    filler_lines: int = 600  # English-like lines from testing.tiny.sample_corpus, so it is a language model too
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 700
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0


BASE_SPEC = BaseSpec()


def corpus(spec: BaseSpec) -> list[str]:
    """The pre-training lines: every sum in four phrasings, plus filler text."""
    from shardtune.testing.tiny import sample_corpus

    return pretraining_lines(all_sums(spec.max_operand)) + sample_corpus(spec.filler_lines, seed=spec.seed)


def _token_stream(lines: list[str], tokenizer, rng: random.Random) -> list[int]:
    """The lines shuffled and joined into one stream, each starting with BOS (the tokenizer adds it) and ending EOS."""
    lines = lines[:]
    rng.shuffle(lines)
    stream: list[int] = []
    for ids in tokenizer(lines)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    return stream


def _lr_at(step: int, spec: BaseSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _print(message: str) -> None:
    print(message, flush=True)  # flushed, so a log file shows progress while it runs


def pretrain(out_dir: str | Path, spec: BaseSpec = BASE_SPEC, *,
             log: Callable[[str], None] = _print) -> dict:
    """Build the tokenizer, pre-train the model on :func:`corpus` and write a model folder; returns the final stats."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import make_tokenizer, tiny_llama_config

    lines = corpus(spec)
    tokenizer = make_tokenizer(lines, vocab_size=spec.vocab_size)
    config = tiny_llama_config(len(tokenizer), num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                               intermediate_size=spec.intermediate_size, num_heads=spec.num_heads,
                               num_kv_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=spec.learning_rate)
    tokens_per_batch = spec.seq_len * spec.batch_size
    stream: list[int] = []
    started = time.perf_counter()
    loss_value = float("nan")
    for step in range(spec.steps):
        while len(stream) < tokens_per_batch:
            stream += _token_stream(lines, tokenizer, rng)
        batch = torch.tensor(stream[:tokens_per_batch]).view(spec.batch_size, spec.seq_len)
        stream = stream[tokens_per_batch:]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, spec)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"pretrain step {step + 1}/{spec.steps}: loss {loss_value:.4f} "
                f"({time.perf_counter() - started:.0f} s)")
    model.eval()
    stats = {"final_loss": loss_value, "wall_s": time.perf_counter() - started,
             "parameters": sum(p.numel() for p in model.parameters()),
             "plain_text_accuracy": plain_text_accuracy(model, tokenizer, all_sums(spec.max_operand))}
    log(f"plain-text accuracy ('A + B =' completed greedily): {stats['plain_text_accuracy']:.1%}")
    _write_folder(out_dir, model, tokenizer, spec, stats)
    return stats


def plain_text_accuracy(model, tokenizer, sums: list) -> float:
    """The fraction of ``A + B =`` prompts the model completes with the right number (greedy): does it know its sums?"""
    from shardtune.infer.generate import generate

    correct = 0
    for s in sums:
        ids = generate(model, tokenizer, tokenizer(f"{s.a} + {s.b} =")["input_ids"], max_new_tokens=4)
        correct += tokenizer.decode(ids, skip_special_tokens=True).strip() == s.answer
    return correct / max(1, len(sums))


def _write_folder(out_dir: str | Path, model, tokenizer, spec: BaseSpec, stats: dict) -> None:
    """Write to a temp folder next to ``out_dir`` and swap it in, so a half-written model never ships."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    give_plain_mode(*tmp.glob("*.safetensors"))  # safetensors writes 0600; the rest is the umask's mode
    tokenizer.save_pretrained(tmp)
    (tmp / SPEC_FILE).write_text(json.dumps({"spec": dataclasses.asdict(spec), "stats": stats}, indent=1) + "\n")
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)  # left by an interrupted earlier swap
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def shipped_spec(folder: str | Path = BASE_MODEL_DIR) -> BaseSpec:
    """The spec the shipped base model was made with (from its ``pretrain.json``)."""
    data = json.loads((Path(folder) / SPEC_FILE).read_text())
    return BaseSpec(**data["spec"])
