"""The counts shipped for the catalog (shardtune/memory/catalog_counts.json) are the ones the meta model gives.

The shipped data lets the first estimate of a catalog model skip importing torch and transformers (~3 s); it is
only trustworthy if it equals what the meta-device code computes with the installed transformers, model by model.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from shardtune import catalog
from shardtune.memory.catalog_build import compute_entry
from shardtune.memory.catalog_data import _load, config_sha256


@pytest.mark.parametrize("name", catalog.names())
def test_shipped_counts_equal_the_model_rebuilt_on_meta(name):
    shipped = _load()["models"][name]
    assert shipped == json.loads(json.dumps(compute_entry(name)))  # tuples become lists, as in the file
    assert shipped["config_sha256"] == config_sha256(catalog.load(name))


def test_a_changed_config_is_counted_afresh(config_dir):
    """The shipped counts are keyed by the exact config: one changed key and the model is built instead."""
    from shardtune.memory.inventory import ModelAnalysis

    config = catalog.load("llama-3.2-1b") | {"num_hidden_layers": 2}
    analysis = ModelAnalysis(config_dir(config, name="llama-3.2-1b"))
    assert analysis._packaged() is None
    assert analysis.inventory.num_layers == 2


def test_first_estimate_of_405b_is_instant_and_imports_no_torch(tmp_path):
    code = ("import sys, io, contextlib; from shardtune.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(['estimate', 'llama-3.1-405b', '--method', 'lora', "
            "'--num-gpus', '8', '--json'])\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules); print(out.getvalue())")
    env = dict(os.environ, SHARDTUNE_CACHE=str(tmp_path / "fresh"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - start
    first, _, payload = proc.stdout.partition("\n")
    assert first == "0 False False", proc.stderr
    result = json.loads(payload)
    assert result["parameters"] == 405_853_388_800
    # r=8 on the 7 projections of 126 layers: 126 * 8 * (in + out summed over q, k, v, o, gate, up, down)
    per_layer = 8 * ((16384 + 16384) + 2 * (16384 + 1024) + (16384 + 16384) + 3 * (16384 + 53248))
    assert result["trainable_parameters"] == 126 * per_layer
    # 0.5 s on an idle 2-core machine. The torch-free path is asserted above; this bound, with room for a machine
    # shared with other jobs, catches slow counting code.
    assert elapsed < 3.0
