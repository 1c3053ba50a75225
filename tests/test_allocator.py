"""The CUDA caching allocator model: each rule on a sequence whose reserved total follows from that rule by hand.

The figures below are derived from c10/cuda/CUDACachingAllocator.cpp's documented behaviour (512-byte rounding,
2 MiB small segments, 20 MiB segments for 1-10 MiB requests, 2 MiB rounding above, best fit, splitting, merging of
free neighbours, nothing returned to the driver), not from running the model.
"""

import pytest

from shardtune.memory.allocator import CachingAllocatorModel, round_size, segment_size

KIB, MIB = 2**10, 2**20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 700 * KIB + 1)] == [512, 512, 1024, 700 * KIB + 512]
    assert segment_size(512) == segment_size(MIB) == 2 * MIB  # the small pool
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB + 512) == 12 * MIB


def test_small_requests_are_packed_into_2_mib_segments():
    a = CachingAllocatorModel()
    for i in range(3):  # 700 KiB each: two fit one 2 MiB segment (648 KiB left), the third needs another
        a.malloc(i, 700 * KIB)
    assert (a.reserved, a.segments, a.allocated) == (4 * MIB, 2, 2100 * KIB)


def test_medium_requests_share_20_mib_segments():
    a = CachingAllocatorModel()
    for i in range(5):  # four 5 MiB blocks fill one 20 MiB segment exactly; the fifth opens a second
        a.malloc(i, 5 * MIB)
    assert (a.reserved, a.segments, a.allocated) == (40 * MIB, 2, 25 * MIB)


def test_a_large_remainder_of_one_mib_or_less_is_not_split_off():
    a = CachingAllocatorModel()
    a.malloc("x", 11 * MIB + 1)  # rounded to 11 MiB + 512; its 12 MiB segment keeps the 1 MiB - 512 rest with it
    assert (a.reserved, a.allocated) == (12 * MIB, 12 * MIB)


def test_pools_do_not_share_blocks():
    a = CachingAllocatorModel()
    a.malloc("small", 512 * KIB)
    a.free("small")
    a.malloc("large", 3 * MIB // 2)  # the cached 2 MiB small segment cannot serve a large request
    assert a.reserved == 22 * MIB


def test_a_long_lived_block_in_a_cached_hole_forces_a_new_segment():
    a = CachingAllocatorModel()
    a.malloc("activations", 12 * MIB)
    a.free("activations")
    a.malloc("state", 4 * MIB)  # best fit: the cached 12 MiB block, split into 4 used + 8 free
    a.malloc("activations", 12 * MIB)  # 8 MiB is too small: a second 12 MiB segment
    assert (a.reserved, a.peak_allocated, a.segments) == (24 * MIB, 16 * MIB, 2)


@pytest.mark.parametrize("order", ["ba", "ab"], ids=["into-the-next", "into-the-previous"])
def test_freed_neighbours_merge_and_best_fit_reuses_them(order):
    a = CachingAllocatorModel()
    for key in "abc":  # 4 MiB each from one 20 MiB segment: 8 MiB stays free at its end
        a.malloc(key, 4 * MIB)
    for key in order:  # the second merges with the first, whichever side it is on: 8 MiB free at the start
        a.free(key)
    a.malloc("d", 8 * MIB)
    a.malloc("e", 8 * MIB)  # the two 8 MiB blocks serve both; nothing new is reserved
    assert (a.reserved, a.segments, a.allocated) == (20 * MIB, 1, 20 * MIB)
    a.malloc("f", 512)
    assert a.reserved == 22 * MIB  # a small request never takes large-pool memory


def test_without_merging_the_same_requests_would_not_fit():
    a = CachingAllocatorModel()
    for key in "abc":
        a.malloc(key, 4 * MIB)
    a.free("a")
    a.free("c")  # two separate free blocks: 4 MiB at the start, 12 MiB (c + the tail) at the end
    a.malloc("d", 10 * MIB)  # fits only c merged with the tail (unmerged, 4 + 8 MiB: a 10 MiB segment of its own)
    a.malloc("e", 8 * MIB)  # the 4 MiB and 2 MiB left are not adjacent: a new 20 MiB segment
    assert (a.reserved, a.segments) == (40 * MIB, 2)  # unmerged: 30 MiB (e would take the 8 MiB tail)


def test_resize_holds_the_old_and_new_blocks_at_once():
    a = CachingAllocatorModel()
    a.replay([("w", 10 * MIB), ("w", 12 * MIB), ("w", 0)])
    assert (a.peak_allocated, a.allocated, a.reserved) == (22 * MIB, 0, 22 * MIB)


@pytest.mark.parametrize("capacity, out_of_memory", [(40 * MIB, False), (30 * MIB, False), (28 * MIB, True)])
def test_at_capacity_wholly_free_segments_go_back_to_the_driver(capacity, out_of_memory):
    a = CachingAllocatorModel(capacity=capacity)
    a.malloc("a", 20 * MIB)
    a.free("a")  # a whole free 20 MiB segment stays cached
    a.malloc("b", 30 * MIB)  # above 40 MiB: the cached segment is released first; above 30 MiB even that fails
    assert a.reserved == 30 * MIB and a.out_of_memory is out_of_memory
    assert a.peak_reserved == 30 * MIB
    # only a wholly free segment goes: one that holds a live block keeps its free rest, reserved
    b = CachingAllocatorModel(capacity=capacity)
    b.malloc("live", 4 * MIB)  # a 20 MiB segment, 16 MiB of it free
    b.malloc("c", 30 * MIB)  # nothing wholly free to give back: the 30 MiB segment comes on top, past capacity
    assert (b.reserved, b.segments, b.out_of_memory) == (50 * MIB, 2, True)
    b.malloc("rest", 16 * MIB)  # the kept free rest serves it
    assert b.reserved == 50 * MIB


def test_each_stream_reuses_only_its_own_freed_blocks():
    a = CachingAllocatorModel()
    a.malloc("gathered", 12 * MIB, stream=1)  # an all-gather buffer on FSDP2's all-gather stream
    a.free("gathered")
    a.malloc("activation", 12 * MIB)  # the default stream cannot take the cached block
    a.malloc("next gather", 12 * MIB, stream=1)  # the all-gather stream can
    assert (a.reserved, a.segments) == (24 * MIB, 2)
    assert CachingAllocatorModel().replay([("x", 12 * MIB, 1), ("x", 0, 0), ("y", 12 * MIB, 0)]).reserved == 24 * MIB
