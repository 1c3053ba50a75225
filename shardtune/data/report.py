"""What the data pipeline did to the data set: rows, tokens, targets, truncation, packing efficiency."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class DataReport:
    """Figures of one split after tokenisation (and packing)."""

    split: str = "train"
    data_format: str = ""
    max_seq_len: int = 0
    packing: bool = False
    documents: int = 0  # examples kept
    rows: int = 0  # sequences the model sees (packed rows when packing)
    tokens: int = 0  # real tokens (no padding)
    target_tokens: int = 0  # tokens with a label
    truncated_rows: int = 0
    dropped_tokens: int = 0  # tokens cut by truncation
    estimated_rows: int = 0  # truncated rows cut before tokenising: their dropped tokens are an estimate
    bad_rows_skipped: int = 0
    empty_rows_dropped: int = 0  # rows with no target token left (e.g. the reply truncated away)
    length_histogram: list[tuple[int, int, int]] = field(default_factory=list)  # (low, high, documents), high incl.
    # the documents' token counts (after truncation) at min, median, 95th percentile and max: ((name, tokens), ...)
    length_percentiles: list[tuple[str, int]] = field(default_factory=list)
    packing_efficiency: float | None = None  # real tokens / (rows * max_seq_len)
    eval: DataReport | None = None
    notes: list[str] = field(default_factory=list)
    # SHA-256 of the rows the model sees (ids, labels, packed lengths): a resume checks it against the checkpoint's,
    # so other rows of the same count are not trained on from the middle of the first run's order. "": not known.
    rows_sha256: str = ""
    # How the prompts were written: "chat template" (chat rows, conversational prompt/completion), "plain text"
    # (plain prompt/completion, alpaca, text rows), "mixed"; "" where not known (an older cache). shardtune
    # generate feeds a prompt to a run's final/ the same way.
    prompt_style: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DataReport:
        d = dict(d)
        ev = d.pop("eval", None)
        for name in ("length_histogram", "length_percentiles"):
            d[name] = [tuple(x) for x in d.get(name, [])]
        return cls(**d, eval=cls.from_dict(ev) if ev else None)

    def lines(self) -> list[str]:
        pct = f" ({100 * self.truncated_rows / max(self.documents + self.empty_rows_dropped, 1):.1f}%)"
        estimated = (f" (estimated for {self.estimated_rows:,} rows cut before tokenising)" if self.estimated_rows
                     else "")
        out = [(f"{self.split}: {self.documents:,} documents -> {self.rows:,} rows ({self.data_format}, "
                f"max_seq_len {self.max_seq_len}{', packed' if self.packing else ''})"),
               (f"  tokens {self.tokens:,}, target tokens {self.target_tokens:,} "
                f"({100 * self.target_tokens / max(self.tokens, 1):.1f}%)"),
               f"  truncated rows {self.truncated_rows:,}{pct}, dropped tokens {self.dropped_tokens:,}{estimated}",
               (f"  bad rows skipped {self.bad_rows_skipped:,}, rows without targets dropped "
                f"{self.empty_rows_dropped:,}")]
        if self.packing_efficiency is not None:
            out.append(f"  packing efficiency {100 * self.packing_efficiency:.1f}% (real tokens / "
                       f"{self.rows:,} rows x {self.max_seq_len} slots)")
        if self.length_histogram:
            peak = max(c for _, _, c in self.length_histogram) or 1
            shown = ", ".join(f"{name} {tokens:,}" for name, tokens in self.length_percentiles)
            out.append(f"  document lengths{' (tokens): ' + shown if shown else ':'}")
            for low, high, count in self.length_histogram:
                out.append(f"    {low:>6}-{high:<6} {count:>8,} {'#' * round(30 * count / peak)}")
        out += [f"  note: {n}" for n in self.notes]
        return out

    def format(self) -> str:
        """The report as plain text, eval split included."""
        lines = self.lines()
        if self.eval is not None:
            lines += self.eval.lines()
        return "\n".join(lines)

    def __rich__(self):
        from rich.text import Text

        return Text(self.format())


def length_histogram(lengths: list[int], max_seq_len: int, bins: int = 8) -> list[tuple[int, int, int]]:
    """Counts of document lengths in ``bins`` equal bins from 1 to ``max_seq_len``."""
    width = max(1, -(-max_seq_len // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, max(0, (n - 1) // width))] += 1
    return [(i * width + 1, min((i + 1) * width, max_seq_len), c) for i, c in enumerate(counts)]


def length_percentiles(lengths: list[int]) -> list[tuple[str, int]]:
    """The documents' lengths at min, median, 95th percentile and max (nearest rank); none for no documents."""
    if not lengths:
        return []
    ordered = sorted(lengths)
    # the smallest length with at least that share of the documents at or below it (1e-9: 0.95 x 60 is 57.00000001)
    return [(name, ordered[max(0, math.ceil(share * len(ordered) - 1e-9) - 1)])
            for name, share in (("min", 0.0), ("median", 0.5), ("p95", 0.95), ("max", 1.0))]
