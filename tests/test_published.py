"""The estimate against published per-GPU peaks (tests/data/published_memory.json): within 15%.

Each point runs the setup of the recipe that produced the figure (its config at the commit that published it:
LoRA targets and rank, batch, sequence length, pure bf16, chunked and compiled cross-entropy, FSDP resharding).
The published figures do not say whether they are reserved or allocated memory; the estimate's ``total``
predicts reserved memory, the larger of the two (docs/estimator.md).
"""

import json
from pathlib import Path

import pytest

from shardtune.cli import main

POINTS = json.loads((Path(__file__).parent / "data" / "published_memory.json").read_text())
BOUND = 0.15


@pytest.mark.parametrize("point", POINTS, ids=[p["label"] for p in POINTS])
def test_estimate_is_near_the_published_peak(point, capsys):
    assert main(["estimate", *point["args"], "--json"]) == 0
    predicted_gib = json.loads(capsys.readouterr().out)["per_gpu"]["total"] / 2**30
    error = predicted_gib / point["measured_gib"] - 1
    print(f"{point['label']}: predicted {predicted_gib:.2f} GiB, measured {point['measured_gib']} GiB, {error:+.1%}")
    assert abs(error) <= BOUND
