"""Rows to a batch: right padding, position ids that restart at every document, and attention that never crosses
documents.

For sdpa and eager the batch carries a 4-D block-diagonal causal mask ``[B, 1, L, L]`` (bool for sdpa, additive
float for eager); transformers' ``create_causal_mask`` passes a 4-D mask through unchanged. For flash attention the
batch carries no ``attention_mask``, and the step adds ``varlen_kwargs``: the documents' boundaries over all rows
(``cu_seq_lens_q/k``), with which transformers runs flash-attn's varlen kernel on the flattened batch. (Left to
itself, transformers finds documents in the position ids of a one-row batch only; with more rows it would run
plain causal attention across the documents of each row.) Padding at the end of a row is one more "document" with
no targets, so no query row of the mask is ever empty (an empty row makes softmax return NaN).
"""

from __future__ import annotations

import torch

from shardtune.config.schema import ATTN_IMPLEMENTATIONS
from shardtune.data.encode import IGNORE


class Collator:
    """Callable that turns a list of rows (``None`` = a padding row) into model inputs and labels."""

    def __init__(self, pad_token_id: int, *, pad_to_multiple_of: int | None = None, attn_implementation: str = "sdpa"):
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation '{attn_implementation}' is not supported for packed batches: "
                             f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}.")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attn_implementation = attn_implementation

    def __call__(self, rows: list[dict | None]) -> dict[str, torch.Tensor]:
        rows = [r if r is not None else {"input_ids": [self.pad_token_id], "labels": [IGNORE], "seq_lens": [1]}
                for r in rows]
        length = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE, dtype=torch.long)
        position_ids = torch.zeros((batch, length), dtype=torch.long)
        segments = torch.zeros((batch, length), dtype=torch.long)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            assert sum(row["seq_lens"]) == n, "seq_lens must add up to the row length"
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[b, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            doc_lens = list(row["seq_lens"]) + ([length - n] if length > n else [])
            position_ids[b] = torch.cat([torch.arange(d) for d in doc_lens])
            segments[b] = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
        out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if self.attn_implementation in ("sdpa", "eager"):
            out["attention_mask"] = block_causal_mask(segments, additive=self.attn_implementation == "eager")
        return out


def block_causal_mask(segments: torch.Tensor, *, additive: bool = False) -> torch.Tensor:
    """``[B, 1, L, L]``: query i may see key j when j <= i and both lie in the same document."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    allowed = allowed[:, None]
    if not additive:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)


def varlen_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor | int]:
    """flash-attn's varlen arguments for a collated batch: every document of every row (a row's padding included)
    starts where its position id is 0, so the flattened batch splits at those offsets."""
    flat = position_ids.flatten().cpu()
    starts = (flat == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
