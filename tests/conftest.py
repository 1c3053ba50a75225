import json
import warnings

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Each test counts models afresh and never writes into the user's ~/.cache."""
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
    # Each training job would trace itself at the end (seconds); the test of that feature turns it back on.
    monkeypatch.setenv("SHARDTUNE_PREDICT_MEMORY", "0")
    warnings.filterwarnings("ignore", module="transformers")


@pytest.fixture
def config_dir(tmp_path):
    """Write a config dict as a model folder and return its path."""

    def make(config: dict, name: str = "model"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return make


@pytest.fixture
def restore_logging():
    """``train`` in this process sets up logging and warning filters as a training process does: undo it."""
    from tests.trainutil import logging_restored

    with logging_restored():
        yield


@pytest.fixture
def no_torchrun(monkeypatch):
    """Fails the test if ``shardtune launch`` starts torchrun: the refusal under test comes before it."""
    import shardtune.cli.launch as launch

    def started(args):
        raise AssertionError(f"torchrun started with {args}")

    monkeypatch.setattr(launch, "run_torchrun", started)


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers on two cores) each worker computes on one thread, and so
    does every process it starts: two workers of two threads each would contend for the two cores."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
