"""The counts shipped for the catalog (shardtune/memory/catalog_counts.json) are the ones the meta model gives.

The shipped data lets the first estimate of a catalog model skip importing torch and transformers (~3 s); it is
only trustworthy if it equals what the meta-device code computes with the installed transformers, model by model.
"""

import json

import pytest

from shardtune import catalog
from shardtune.memory import catalog_data, inventory
from shardtune.memory.catalog_build import compute_entry
from shardtune.memory.catalog_data import _load, config_sha256
from tests.fresh import run_fresh


@pytest.mark.parametrize("name", catalog.names())
def test_shipped_counts_equal_the_model_rebuilt_on_meta(name, monkeypatch):
    shipped = _load()["models"][name]

    def read_shipped(*args):
        raise AssertionError("the reference read the shipped counts instead of building the model")

    def read_cached(*args):
        raise AssertionError("the reference read the count cache instead of building the model")

    # The reference must be built, not read: compared with the file itself (or with counts cached under
    # ~/.cache/shardtune by an earlier version), stale counts would pass.
    monkeypatch.setattr(catalog_data, "packaged_counts", read_shipped)
    monkeypatch.setattr(inventory._CountCache, "get", read_cached)
    assert shipped == json.loads(json.dumps(compute_entry(name)))  # tuples become lists, as in the file
    assert shipped["config_sha256"] == config_sha256(catalog.load(name))


def test_a_changed_config_is_counted_afresh(config_dir):
    """The shipped counts are keyed by the exact config: one changed key and the model is built instead."""
    from shardtune.memory.inventory import ModelAnalysis

    config = catalog.load("llama-3.2-1b") | {"num_hidden_layers": 2}
    analysis = ModelAnalysis(config_dir(config, name="llama-3.2-1b"))
    assert analysis._packaged() is None
    assert analysis.inventory.num_layers == 2


def test_first_estimate_of_405b_reads_the_shipped_counts_and_imports_no_torch(tmp_path):
    """Counted, not timed: a fresh interpreter estimating the 405B model imports only shardtune, rich and yaml
    beside the standard library (no torch, transformers or numpy, so no model is built), and never the code that
    builds the shipped counts; the counts are the published ones."""
    ran = run_fresh(["estimate", "llama-3.1-405b", "--method", "lora", "--num-gpus", "8", "--json"],
                    tmp_path / "fresh")
    assert (ran["rc"], ran["packages"]) == (0, ["rich", "shardtune", "yaml"])
    assert "shardtune.memory.catalog_build" not in ran["modules"]
    result = json.loads(ran["stdout"])
    assert result["parameters"] == 405_853_388_800
    # r=8 on the 7 projections of 126 layers: 126 * 8 * (in + out summed over q, k, v, o, gate, up, down)
    per_layer = 8 * ((16384 + 16384) + 2 * (16384 + 1024) + (16384 + 16384) + 3 * (16384 + 53248))
    assert result["trainable_parameters"] == 126 * per_layer


def test_the_build_scripts_help_writes_nothing():
    """`python -m shardtune.memory.catalog_build --help` recounted all 19 models and rewrote the shipped file."""
    import subprocess
    import sys

    before = catalog_data.DATA_PATH.stat().st_mtime_ns
    out = subprocess.run([sys.executable, "-m", "shardtune.memory.catalog_build", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "rewrite catalog_counts.json" in out.stdout
    assert catalog_data.DATA_PATH.stat().st_mtime_ns == before
