"""A model of PyTorch's CUDA caching allocator: what ``torch.cuda.max_memory_reserved`` reports for a sequence of
allocations and frees.

Tensor bytes alone (``max_memory_allocated``) understate what a training job takes from the GPU. The caching
allocator rounds every request up to a multiple of 512 bytes and serves it from the smallest cached free block that
is large enough, splitting off the rest. When no cached block fits it asks the driver for a new segment: 2 MiB for
requests up to 1 MiB (the small pool), 20 MiB for requests under 10 MiB, and the request rounded up to 2 MiB above
that. Freed blocks merge with free neighbours in their segment but stay cached: during training nothing goes back
to the driver, so the reserved total only grows. A long-lived tensor created in a hole that activations left (AdamW's
states, made lazily after the first backward) can split a segment for good and force later steps into new ones.

Each stream has its own pools: a block freed by one stream's work is only reused by that stream (FSDP2 allocates
its all-gather and reduce-scatter buffers on streams of their own). The rules are those of
``c10/cuda/CUDACachingAllocator.cpp`` with its default configuration (no ``max_split_size_mb``, no
``expandable_segments``, no garbage-collection threshold); the constants below are its constants. Not modelled: a
freed block that another stream still uses waits for that stream's work before it can be reused.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

MIB = 2**20
MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_SIZE = 1 * MIB  # requests up to this size come from the small pool
SMALL_BUFFER = 2 * MIB  # segment size of the small pool
MIN_LARGE_ALLOC = 10 * MIB  # large requests below this size get a LARGE_BUFFER segment
LARGE_BUFFER = 20 * MIB
ROUND_LARGE = 2 * MIB  # larger requests get a segment of their size rounded up to this
# cuBLAS takes its workspace from the caching allocator, one per handle and stream: the forward runs on the Python
# thread, backward on autograd's device thread, each with its own handle. 32 MiB is the Hopper (sm90) default of
# CUBLAS_WORKSPACE_CONFIG; older GPUs use about 8 MiB.
CUBLAS_WORKSPACE_BYTES = 32 * MIB
CUBLAS_WORKSPACES = 2


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out for a request of ``nbytes``."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The cudaMalloc size of a new segment for a (rounded) request that no cached block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    stream: int = 0
    allocated: bool = False
    prev: _Block | None = None  # neighbours in the same segment
    next: _Block | None = None


class CachingAllocatorModel:
    """Replays allocations and frees; ``peak_reserved`` and ``peak_allocated`` are what the CUDA allocator's
    ``max_memory_reserved`` and ``max_memory_allocated`` would report.

    ``capacity`` (bytes, optional): when a new segment would take the reserved total above it, the allocator first
    returns every wholly free cached segment to the driver and retries, as PyTorch does before it raises an
    out-of-memory error; ``out_of_memory`` says whether even that was not enough.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.segments = 0
        self.out_of_memory = False
        # (stream, small) -> the sorted (size, addr) of its free blocks
        self._pools: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._free_at: dict[int, _Block] = {}
        self._live: dict[object, _Block] = {}
        self._next_addr = 0

    # -- the pools ---------------------------------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        insort(self._pools.setdefault((block.stream, block.small), []), (block.size, block.addr))
        self._free_at[block.addr] = block

    def _remove(self, block: _Block) -> None:
        pool = self._pools[(block.stream, block.small)]
        del pool[bisect_left(pool, (block.size, block.addr))]
        del self._free_at[block.addr]

    def _best_fit(self, size: int, small: bool, stream: int) -> _Block | None:
        """The smallest cached free block of the pool that holds ``size`` (the lowest address among equals)."""
        pool = self._pools.get((stream, small), [])
        i = bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = self._free_at[pool[i][1]]
        self._remove(block)
        return block

    def _new_segment(self, size: int, small: bool, stream: int) -> _Block:
        nbytes = segment_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self.release_cached()
            self.out_of_memory |= self.reserved + nbytes > self.capacity
        block = _Block(self._next_addr, nbytes, small, stream)
        self._next_addr += nbytes
        self.reserved += nbytes
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    # -- the allocator's interface -----------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int, stream: int = 0) -> None:
        """Allocate ``nbytes`` for ``key`` on ``stream`` (a zero-byte request holds no block, as in PyTorch)."""
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small, stream) or self._new_segment(size, small, stream)
        remaining = block.size - size
        # The small pool splits off any remainder; the large pool only one that could serve a large request.
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        """Return ``key``'s block to its pool, merged with free neighbours; the segment stays reserved."""
        block = self._live.pop(key, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._remove(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and not nxt.allocated:
            self._remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._insert(block)

    def resize(self, key: object, nbytes: int, stream: int = 0) -> None:
        """A storage resized in place: the new block is allocated before the old one is freed (the data is copied)."""
        old = self._live.pop(key, None)
        self.malloc(key, nbytes, stream)
        if old is not None:
            self._live[_Retired(key)] = old
            self.free(_Retired(key))

    def release_cached(self) -> None:
        """Return every wholly free segment to the driver (``torch.cuda.empty_cache``)."""
        for pool in self._pools.values():
            for size, addr in list(pool):
                block = self._free_at[addr]
                if block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved -= block.size
                    self.segments -= 1

    def replay(self, events: Iterable[tuple]) -> CachingAllocatorModel:
        """Apply ``(key, nbytes)`` or ``(key, nbytes, stream)`` events: a new key allocates, a known key with another
        size resizes, 0 frees."""
        for key, nbytes, *stream in events:
            if nbytes == 0:
                self.free(key)
            elif key in self._live:
                self.resize(key, nbytes, *stream)
            else:
                self.malloc(key, nbytes, *stream)
        return self


@dataclass(frozen=True)
class _Retired:
    """The key of a block a resize replaced, for the moment between the new block's allocation and its free."""

    key: object
