"""The setup the estimator's tests check their figures at: one row of 2048 tokens per GPU, bf16 mixed precision,
gradient checkpointing (the estimator's assumptions before it read ``shardtune train``'s defaults). Each test
states its own changes to it, by the config's keys (``Setup.with_``)."""

from shardtune.memory.setup import Setup

CHECKED_AT = {"per_device_train_batch_size": 1, "max_seq_len": 2048, "gradient_checkpointing": True,
              "mixed_precision": "bf16"}


def checked_setup(**changes) -> Setup:
    """``CHECKED_AT`` with ``changes`` (config keys, ``method``, ``num_gpus``, ``num_nodes``, ``loss``)."""
    return Setup.of(**(CHECKED_AT | changes))


# The same on the command line of ``shardtune estimate``.
CHECKED_AT_ARGS = ["--batch-size", "1", "--seq-len", "2048", "--gradient-checkpointing", "--mixed-precision", "bf16"]


def load_estimate_cuda_bench():
    """bench/estimate_cuda.py as a module (it is a script, not part of the package), loaded afresh."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "estimate_cuda", Path(__file__).resolve().parents[1] / "bench" / "estimate_cuda.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
