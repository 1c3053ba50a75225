"""``shardtune.dist.shutdown`` leaves no process group for interpreter exit to destroy.

A gloo group destroyed during interpreter finalisation can abort the process ("terminate called without an active
exception") after the run's work is done: one rank exits with SIGABRT and the launch fails. Test workers that
prepared data on 2 ranks and ended with a bare ``destroy_process_group`` aborted so in 15 of 60 runs; ending with
``shutdown`` (reference cycles collected first, every group released), in 0 of 60. The data pipeline's long-wait
group used to outlive ``destroy_process_group`` in a module global; ``shutdown`` now releases it, and a later job in
the same process makes its own.
"""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardtune.dist import long_wait_group, shutdown


@pytest.fixture
def store(tmp_path):
    return lambda name: dist.FileStore(str(tmp_path / name), 1)


def test_shutdown_releases_the_long_wait_group_so_its_threads_end_before_exit(store):
    dist.init_process_group("gloo", store=store("a"), rank=0, world_size=1)
    try:
        group = long_wait_group(timedelta(hours=8))
        assert long_wait_group(timedelta(hours=8)) is group  # made once: making it is a collective
        assert long_wait_group(timedelta(hours=1)) is not group
        summed = torch.tensor([1.0, 2.0])
        dist.all_reduce(summed, group=group)
        assert summed.tolist() == [1.0, 2.0]  # a working group of the one rank
        released = weakref.ref(group)
        del group
        gc.collect()
        assert released() is not None  # still held for the next prepare_datasets of this run
    finally:
        shutdown()
    assert released() is None and not dist.is_initialized()
    # a later job in the same process gets a live group of its own world, not the destroyed one
    dist.init_process_group("gloo", store=store("b"), rank=0, world_size=1)
    try:
        assert dist.get_world_size(long_wait_group(timedelta(hours=8))) == 1
    finally:
        shutdown()
