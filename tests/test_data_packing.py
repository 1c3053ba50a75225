"""Packing: documents share rows but never attention; the per-token losses prove it on a tiny model."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardtune.data import Collator, DataConfig, load_tokenizer, prepare_datasets
from shardtune.data.encode import IGNORE
from shardtune.data.report import DataReport
from shardtune.data.rows import pack
from shardtune.testing.tiny import make_model_folder, sample_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model folder and a packed chat data set of documents of varied length."""
    root = tmp_path_factory.mktemp("packing")
    model_dir = str(make_model_folder(root / "model"))
    lines = sample_corpus(60, seed=3)
    rng = random.Random(0)
    rows = []
    for i in range(0, 60, 3):
        turns = [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}]
        if rng.random() < 0.5:
            turns += [{"role": "user", "content": "And?"}, {"role": "assistant", "content": lines[i + 2]}]
        rows.append({"messages": turns})
    path = root / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(dataset_name=str(path), splits="train", max_seq_len=160, packing=True,
                     chat_template_format="chatml")
    tok = load_tokenizer(model_dir, cfg)
    data = prepare_datasets(cfg, tok, seed=0, cache_dir=str(root / "cache"))
    return model_dir, tok, data, rows


def token_losses(model, batch):
    """Per-position loss of predicting the next token (0 where the next label is ignored)."""
    # use_cache=False as in training: with a KV cache transformers does not look for documents in position ids
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none",
                           ignore_index=IGNORE)


def _varlen_attention(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, max_length_q=None,
                      scaling=None, dropout=0.0, **kwargs):
    """flash-attn's varlen contract on the CPU: the flattened batch split at ``cu_seq_lens_q``, causal attention
    inside each piece. Without the offsets it refuses, so a test through it proves they reach every layer."""
    assert attention_mask is None and cu_seq_lens_q is not None and max_length_q is not None
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    flat = [t.transpose(1, 2).reshape(batch * length, heads, dim) for t in (query, key, value)]
    out = torch.empty_like(flat[0])
    bounds = cu_seq_lens_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_length_q
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in flat)
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling).transpose(0, 1)
    return out.view(batch, length, heads, dim), None


@pytest.fixture(scope="module")
def varlen_attention():
    """The name of ``_varlen_attention`` for transformers (flash attention's mask function: no mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register("varlen_cpu_test", _varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_cpu_test", flash_attention_mask)
    return "varlen_cpu_test"


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
def test_packed_losses_equal_documents_run_one_by_one(setup, attn, varlen_attention):
    from transformers import AutoModelForCausalLM

    from shardtune.train.runner import model_inputs, uses_varlen_attention

    model_dir, tok, data, _ = setup
    # flash_attention_2 is not on CPU: its batch (no mask) goes through the step's model_inputs, which adds the
    # documents' offsets, into _varlen_attention, which keeps flash-attn's varlen contract
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=varlen_attention if attn == "flash_attention_2" else attn,
        dtype=torch.float32).eval()
    # transformers reserves names with "flash" for its kernels: the stand-in has another, so say what it is
    varlen = attn == "flash_attention_2"
    assert uses_varlen_attention(SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))) == varlen
    collator = Collator(tok.pad_token_id, attn_implementation=attn)

    def collate(rows):
        batch = collator(rows)
        return {**model_inputs(batch, torch.device("cpu"), varlen=varlen), "labels": batch["labels"]}

    rows = [r for r in data.train if len(r["seq_lens"]) >= 3][:2]
    assert len(rows) == 2
    with torch.no_grad():
        packed = token_losses(model, collate(rows + [None]))
        # the padding row and the padding tail are never targets
        assert (packed[2] == 0).all()
        for b, row in enumerate(rows):
            start, compared = 0, 0
            for n in row["seq_lens"]:
                alone = token_losses(model, collate([{"input_ids": row["input_ids"][start:start + n],
                                                      "labels": row["labels"][start:start + n], "seq_lens": [n]}]))[0]
                torch.testing.assert_close(packed[b, start:start + n - 1], alone, rtol=0, atol=2e-5)
                compared += int((alone > 0).sum())
                if start + n < len(row["input_ids"]):
                    assert packed[b, start + n - 1] == 0  # never predicts the next document's first token
                start += n
            assert compared == sum(1 for x in row["labels"] if x != IGNORE)


def test_without_block_mask_documents_leak(setup):
    """The check above can fail: with a plain causal mask the later documents' losses change."""
    from transformers import AutoModelForCausalLM

    model_dir, tok, data, _ = setup
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    row = next(r for r in data.train if len(r["seq_lens"]) >= 2)
    batch = Collator(tok.pad_token_id)([row])
    leaky = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]),
                 position_ids=torch.arange(batch["input_ids"].shape[1])[None])
    with torch.no_grad():
        assert (token_losses(model, batch) - token_losses(model, leaky)).abs().max() > 1e-3


def test_packing_report_and_rows(setup):
    _, tok, data, rows = setup
    rep = data.report
    assert rep.documents == len(rows) and rep.rows == len(data.train) < len(rows)
    tokens = sum(len(r["input_ids"]) for r in data.train)
    assert rep.tokens == tokens and sum(sum(r["seq_lens"]) for r in data.train) == tokens
    assert rep.packing_efficiency == pytest.approx(tokens / (rep.rows * 160))
    # the documents' lengths by nearest rank, from the packed rows' own document lengths
    lengths = sorted(n for r in data.train for n in r["seq_lens"])
    assert len(set(lengths)) > 4 and rep.length_percentiles == [
        ("min", lengths[0]), ("median", lengths[math.ceil(len(lengths) / 2) - 1]),
        ("p95", lengths[math.ceil(0.95 * len(lengths)) - 1]), ("max", lengths[-1])]
    shown = ", ".join(f"{name} {n:,}" for name, n in rep.length_percentiles)
    assert f"  document lengths (tokens): {shown}" in rep.lines()
    assert DataReport.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep  # as the cache keeps it
    assert rep.target_tokens == sum(1 for r in data.train for x in r["labels"] if x != IGNORE)
    assert all(len(r["input_ids"]) <= 160 for r in data.train)
    for r in data.train:  # the first token of every document is never a target
        starts = [sum(r["seq_lens"][:i]) for i in range(len(r["seq_lens"]))]
        assert all(r["labels"][s] == IGNORE for s in starts)
        assert r["input_ids"].count(tok.bos_token_id) == len(r["seq_lens"])  # one BOS per document


def test_append_concat_token_ends_documents_with_untrained_eos(setup, tmp_path):
    model_dir, _, _, rows = setup
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(dataset_name=str(path), splits="train", max_seq_len=160, packing=True,
                     chat_template_format="chatml", append_concat_token=True)
    tok = load_tokenizer(model_dir, cfg)
    data = prepare_datasets(cfg, tok, seed=0, cache_dir=str(tmp_path / "cache"))
    for r in data.train:
        ends = [sum(r["seq_lens"][:i + 1]) - 1 for i in range(len(r["seq_lens"]))]
        assert all(r["input_ids"][e] == tok.eos_token_id and r["labels"][e] == IGNORE for e in ends)


def test_pack_places_every_document_once_within_the_limit():
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = pack(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # best-fit decreasing is within 11/9 OPT + 1 of the optimum; OPT >= total / capacity
    assert len(bins) <= 11 / 9 * (-(-sum(lengths) // 128)) + 1


@pytest.mark.parametrize("packing", [False, True])
def test_rows_are_built_without_a_python_object_per_token(monkeypatch, packing):
    """Turning tokenised rows into training rows took 150 bytes per token as Python lists (an int object and a
    list slot per token, for ids, labels, then the rows again, and `datasets` pickling the result to fingerprint
    it): gigabytes for a few hundred thousand chat rows. A tokenised table stands in for tokenising here."""
    import tracemalloc

    import datasets
    import numpy as np
    import pyarrow as pa
    from datasets.table import InMemoryTable

    from shardtune.data import pipeline

    num_rows, length, eos = 20_000, 50, 3
    offsets = pa.array(np.arange(num_rows + 1, dtype=np.int32) * length)
    ids = np.tile(np.arange(1000, 1000 + length, dtype=np.int32), num_rows)  # no row ends with EOS
    labels = np.where(np.arange(ids.size) % length < length // 2, IGNORE, ids).astype(np.int32)
    encoded = datasets.Dataset(InMemoryTable(pa.table({
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
        "labels": pa.ListArray.from_arrays(offsets, pa.array(labels)),
        "dropped_tokens": pa.array(np.zeros(num_rows, np.int64)), "dropped_estimated": pa.array([False] * num_rows),
        "bad": pa.array([""] * num_rows)})))
    monkeypatch.setattr(pipeline, "_tokenise", lambda *args: encoded)
    cfg = DataConfig(dataset_name="x.jsonl", max_seq_len=256, packing=packing, append_concat_token=packing)
    tok = SimpleNamespace(eos_token_id=eos)
    examples = [{"kind": "chat"}] * num_rows
    tracemalloc.start()
    try:
        rows, report = pipeline.build_split(examples, cfg, tok, "train", "chat", [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    per_document = length + packing  # the separator EOS
    assert report.documents == num_rows and report.tokens == num_rows * per_document
    assert report.target_tokens == num_rows * (length - length // 2)
    assert report.rows == (-(-num_rows * per_document // (256 // per_document * per_document)) if packing else num_rows)
    first = rows[0]
    assert first["input_ids"][:length] == ids[:length].tolist() and first["seq_lens"][0] == per_document
    assert first["input_ids"][length:length + 1] == ([eos] if packing else [])  # the separator
    assert first["labels"][length:length + 1] == ([IGNORE] if packing else [])
    assert peak / report.tokens < 30  # bytes per token, about 20; Python lists of ints took 150


def test_collator_pads_and_restarts_positions():
    collate = Collator(7, pad_to_multiple_of=8)
    batch = collate([{"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "seq_lens": [3, 2]}, None])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7], [7] * 8]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, 5] + [IGNORE] * 3, [IGNORE] * 8]
    assert batch["position_ids"].tolist()[0] == [0, 1, 2, 0, 1, 0, 1, 2]
    mask = batch["attention_mask"][0, 0]
    docs = [0, 0, 0, 1, 1, 2, 2, 2]
    expected = [[docs[i] == docs[j] and j <= i for j in range(8)] for i in range(8)]
    assert mask.tolist() == expected and mask.dtype == torch.bool
    eager = Collator(7, attn_implementation="eager")([None])["attention_mask"]
    assert eager.dtype == torch.float32 and eager.tolist() == [[[[0.0]]]]
    assert "attention_mask" not in Collator(7, attn_implementation="flash_attention_2")([None])
