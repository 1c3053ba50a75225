import json
import os
import warnings

import pytest


@pytest.fixture(autouse=True)
def _no_launcher_left_behind():
    """A test that leaves a launcher's variables in this worker's environment fails here, not by the next test
    that runs ``train`` in this process: that train took itself for the orphan of an ended launcher and SIGKILLed
    the worker ("node down: Not properly terminated"), losing the test's name. Set up before ``monkeypatch`` and
    so checked after it has undone what it set."""
    from shardtune.cli.launch import LAUNCHER_PID, STOP_REPORT

    before = {name: os.environ.get(name) for name in (LAUNCHER_PID, STOP_REPORT)}
    yield
    after = {name: os.environ.pop(name, None) for name in before}
    os.environ.update({name: value for name, value in before.items() if value is not None})  # for the next test
    assert after == before, f"the test left the launcher's variables in this process's environment: {after}"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Each test counts models afresh and never writes into the user's ~/.cache."""
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
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


@pytest.fixture(autouse=True)
def restore_logging():
    """``train`` in this process sets up logging and warning filters as a training process does: undo it, after
    every test. A test that ran ``shardtune train`` in-process under capsys left the shardtune logger writing to
    that test's closed capture, so a later test's warning came out as "--- Logging error ---" (test_plot, when a
    worker ran it after such a test)."""
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


SESSION_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    """The session's environment, before any fixture (module- and session-scoped fixtures run before the autouse
    one above): no training job traces itself at its end (seconds each; the test of that feature turns it back on
    with monkeypatch), and the cache is a temporary folder, never the user's ~/.cache. Under pytest-xdist (``make
    test`` runs two workers on two cores) each worker computes on one thread, and so does every process it
    starts: two workers of two threads each would contend for the two cores."""
    import tempfile

    os.environ["SHARDTUNE_PREDICT_MEMORY"] = "0"
    os.environ["SHARDTUNE_CACHE"] = config.stash[SESSION_CACHE] = tempfile.mkdtemp(prefix="shardtune-test-cache-")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config):
    import shutil

    if SESSION_CACHE in config.stash:
        shutil.rmtree(config.stash[SESSION_CACHE], ignore_errors=True)


# The files that take the longest (measured with --durations; together about half the suite's work), longest first.
# ``make test`` hands whole files to two workers in the order they are collected; alphabetically the longest,
# test_trace_formula, came near the end and left one worker running it alone for minutes while the other idled.
LONGEST_FIRST = ("test_trace_formula", "test_resume", "test_gguf", "test_trace", "test_families", "test_peft_variants",
                 "test_train_equivalence", "test_deepspeed", "test_pure_bf16", "test_cli_errors")


def pytest_collection_modifyitems(session, config, items):
    """The longest files first (``LONGEST_FIRST``), each file's tests in their own order: the two workers then end
    within a short file of each other. Every worker collects the same order, as pytest-xdist requires."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
