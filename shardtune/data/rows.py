"""Tokenised documents to the rows the model sees: filtered, counted, packed and written as Arrow columns.

Everything here works on flat numpy arrays of token ids, never on a Python list per row: a data set of a few
hundred thousand rows has hundreds of millions of tokens, and a Python int per token (plus a list slot for it) costs
about ten times the int32 the cache stores, many gigabytes more than the data itself.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import numpy as np

from shardtune.data.encode import IGNORE

COLUMNS = ("input_ids", "labels", "seq_lens")
# Tokens per Arrow chunk of a column: far below the 2**31 a list column's int32 offsets can address, and small
# enough that gathering one chunk's rows needs little memory beside them.
CHUNK_TOKENS = 1 << 24


@dataclass
class Documents:
    """The documents kept, as slices of flat arrays: document ``d`` is ``ids[starts[d]:starts[d] + counts[d]]``
    (``labels`` alike), then an EOS where ``eos[d]`` (the separator ``append_concat_token`` adds, not a target)."""

    ids: np.ndarray  # int32, every tokenised row's tokens one after another
    labels: np.ndarray  # int32, as ids
    starts: np.ndarray  # int64, per document
    counts: np.ndarray  # int64, per document, without its separator
    eos: np.ndarray  # bool, per document
    eos_id: int
    targets: int  # target tokens of the documents kept

    @property
    def lengths(self) -> np.ndarray:
        return self.counts + self.eos


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """A list column (an Arrow ChunkedArray) as (every value in one int32 array, each row's length)."""
    chunks = [chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False) for chunk in column.chunks]
    lengths = [chunk.value_lengths().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    if len(chunks) == 1:  # the values as Arrow holds them, not a copy
        return chunks[0], lengths[0].astype(np.int64)
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.int32),
            np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64))


def documents(table, *, eos_id: int, max_seq_len: int, append_eos: bool) -> tuple[Documents, list[str], dict]:
    """The documents of the tokenised rows ``table`` (an Arrow table of ``encode_batch``'s columns) that have a
    target: (them, each bad row's problem in order, counts of the rows truncated and of those without a target).

    ``append_eos``: end each document that does not end with EOS, and has room for it, with a separator EOS."""
    ids, row_lengths = _flat(table.column("input_ids"))
    labels, _ = _flat(table.column("labels"))
    bad = table.column("bad").to_pylist()
    good = np.fromiter((not b for b in bad), dtype=bool, count=len(bad))
    starts = np.cumsum(row_lengths) - row_lengths
    row_targets = np.zeros(len(starts), np.int64)
    filled = row_lengths > 0  # reduceat sums from each start to the next; empty rows (bad ones) have none
    if filled.any():
        row_targets[filled] = np.add.reduceat(labels != IGNORE, starts[filled], dtype=np.int64)
    dropped = table.column("dropped_tokens").to_numpy()[good]
    estimated = table.column("dropped_estimated").to_numpy(zero_copy_only=False)[good]
    counts = {"truncated_rows": int((dropped > 0).sum()), "dropped_tokens": int(dropped.sum()),
              "estimated_rows": int((estimated & (dropped > 0)).sum()),
              "empty_rows_dropped": int((good & (row_targets == 0)).sum())}
    kept = good & (row_targets > 0)
    starts, row_lengths = starts[kept], row_lengths[kept]
    last = ids[starts + row_lengths - 1]
    eos = append_eos & (last != eos_id) & (row_lengths < max_seq_len)
    docs = Documents(ids=ids, labels=labels, starts=starts, counts=row_lengths, eos=eos, eos_id=eos_id,
                     targets=int(row_targets[kept].sum()))
    return docs, [b for b in bad if b], counts


def pack(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: document indices per row, each row holding at most ``max_seq_len`` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted, so the tightest bin that fits is found by bisect
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
            bins[b].append(i)
        else:
            room, b = max_seq_len, len(bins)
            bins.append([i])
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``starts[0]..starts[0]+counts[0]-1``, then those of the next range, and so on."""
    before = np.cumsum(counts) - counts  # where each range begins in the result
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - before, counts)


def _list_array(offsets: np.ndarray, values: np.ndarray):
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()), pa.array(values, pa.int32()))


def row_columns(docs: Documents, groups: list[list[int]]):
    """The rows (each the documents of one group, in order) as an Arrow table of ``COLUMNS``, and its SHA-256
    (``rows_sha256``'s)."""
    import pyarrow as pa

    order = np.fromiter((d for group in groups for d in group), dtype=np.int64)
    sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
    doc_lengths = docs.lengths[order]
    row_ends = np.cumsum(doc_lengths)[np.cumsum(sizes) - 1] if len(order) else np.zeros(0, np.int64)
    row_offsets = np.concatenate([[0], row_ends])
    doc_offsets = np.concatenate([[0], np.cumsum(sizes)])
    chunks: dict[str, list] = {name: [] for name in COLUMNS}
    values: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
    first = 0
    while first < len(groups):  # a chunk of rows at a time: the gather's indices stay small
        last = max(first + 1, int(np.searchsorted(row_offsets, row_offsets[first] + CHUNK_TOKENS, "right")) - 1)
        docs_here = order[doc_offsets[first]:doc_offsets[last]]
        index = _ranges(docs.starts[docs_here], docs.counts[docs_here])
        ids, labels = docs.ids[index], docs.labels[index]
        del index
        if docs.eos[docs_here].any():  # each separator goes after its document's tokens
            at = np.cumsum(docs.counts[docs_here])[docs.eos[docs_here]]
            ids, labels = np.insert(ids, at, docs.eos_id), np.insert(labels, at, IGNORE)
        for name, column, offsets in (("input_ids", ids, row_offsets[first:last + 1]),
                                      ("labels", labels, row_offsets[first:last + 1]),
                                      ("seq_lens", doc_lengths[doc_offsets[first]:doc_offsets[last]],
                                       doc_offsets[first:last + 1])):
            values[name].append(column.astype(np.int32, copy=False))
            chunks[name].append(_list_array(offsets, values[name][-1]))
        first = last
    h = hashlib.sha256()  # each column as its rows' lengths (int64), then their values (int32)
    for name, lengths in (("input_ids", np.diff(row_offsets)), ("labels", np.diff(row_offsets)), ("seq_lens", sizes)):
        h.update(lengths.astype(np.int64))
        for part in values[name]:
            h.update(part)  # the array's own bytes, not a copy
    table = pa.table({name: pa.chunked_array(chunks[name], pa.list_(pa.int32())) for name in COLUMNS})
    return table, h.hexdigest()
