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
