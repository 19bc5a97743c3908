"""PyTorch's CUDA caching allocator, replayed on the predicted allocations of a step.

A model of c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch, read at commit eb42ad6e) for one
device and one stream (``replay`` runs one per stream the step allocates on); each rule cites the
code it follows:

* ``round_size``: every request is rounded up to a multiple of kMinBlockSize = 512 bytes
  (``constexpr size_t kMinBlockSize = 512``; roundup_power2_divisions is not modelled).
* ``get_pool``: requests <= kSmallSize = 1 MiB go to the small pool, the rest to the large one.
* ``get_allocation_size``: a new small segment is kSmallBuffer = 2 MiB; a large request under
  kMinLargeAlloc = 10 MiB gets a kLargeBuffer = 20 MiB segment; larger ones are rounded up to
  kRoundLarge = 2 MiB.
* ``get_free_block``: best fit, the smallest cached block >= the request (``lower_bound`` on a
  set ordered by size, then address); with ``max_split_size_mb`` a request below the limit does
  not take a block at or above it, and a request at or above it only takes a block smaller than
  request + kLargeBuffer.
* ``should_split``: a found block is split when the remainder is >= kMinBlockSize (small pool,
  or any pool with expandable segments), or, in the large pool, when the request is below
  max_split_size and the remainder > kSmallSize; ``free_block`` merges a freed block with free
  neighbours of its segment.
* ``malloc``: when no cached block fits, ``alloc_block`` asks for a new segment; if the device is
  full, ``release_available_cached_blocks`` frees cached oversize blocks (max_split_size set)
  and ``release_cached_blocks`` frees every cached, unsplit segment, retrying after each; then
  the allocation fails (out of memory).
* ``expandable_segments:True`` (Note [Expandable Segments]): one segment per pool that grows by
  pages (2 MiB in the small pool, 20 MiB in the large one) instead of a segment per request.

Only the caching allocator's reserve is modelled: the CUDA context and memory outside the
allocator (paged optimizer states) are added by the caller.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import groupby, repeat
from typing import Iterator

from planner.errors import InvalidConfigError
from planner.sharding.spec import RECORDED

MiB = 1024**2
kMinBlockSize = 512
kSmallSize = 1 * MiB
kSmallBuffer = 2 * MiB
kLargeBuffer = 20 * MiB
kMinLargeAlloc = 10 * MiB
kRoundLarge = 2 * MiB
#: no max_split_size_mb: PyTorch's default is std::numeric_limits<size_t>::max()
UNLIMITED = 1 << 64


def stream_name(stream: str) -> str:
    """A stream's name as the assumptions print it (without ``RECORDED``)."""
    return stream.removesuffix(RECORDED)

#: PYTORCH_CUDA_ALLOC_CONF keys PyTorch accepts that do not change what this replay predicts
#: (c10/cuda/CUDAAllocatorConfig.cpp parseArgs). garbage_collection_threshold among them: malloc
#: and get_free_block act on it only under ``set_fraction`` (CUDACachingAllocator.cpp:
#: ``if (set_fraction && garbage_collection_threshold() > 0.0) garbage_collect_cached_blocks``),
#: which torch.cuda.set_per_process_memory_fraction sets and a training recipe does not call.
_IGNORED_KEYS = frozenset({
    "garbage_collection_threshold", "roundup_power2_divisions", "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "max_non_split_rounding_mb", "backend",
})


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings the replay follows."""

    max_split_size_mb: int | None = None
    """Blocks this large or larger are never split (None: PyTorch's default, unlimited)."""
    expandable_segments: bool = False
    """Segments grow by pages instead of one segment per request."""
    ignored: tuple[str, ...] = ()
    """Settings accepted (PyTorch knows them) but not modelled, as the user wrote them."""

    @property
    def max_split_size(self) -> int:
        return UNLIMITED if self.max_split_size_mb is None else self.max_split_size_mb * MiB

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """``max_split_size_mb:128,expandable_segments:True`` as PYTORCH_CUDA_ALLOC_CONF takes it."""
        fields: dict = {}
        ignored = []
        for item in (text or "").replace(" ", "").split(","):
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or not value:
                raise InvalidConfigError(f"--alloc-conf {item!r}: write key:value, e.g. max_split_size_mb:128")
            if key == "max_split_size_mb":
                fields[key] = _max_split(value)
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise InvalidConfigError(f"--alloc-conf expandable_segments:{value}: use True or False")
                fields[key] = value == "True"
            elif key in _IGNORED_KEYS:
                ignored.append(item)
            else:
                raise InvalidConfigError(
                    f"--alloc-conf: unknown setting {key!r}: use max_split_size_mb, expandable_segments or another "
                    "PYTORCH_CUDA_ALLOC_CONF key")
        return cls(**fields, ignored=tuple(ignored))

    def spelling(self) -> str:
        """The canonical PYTORCH_CUDA_ALLOC_CONF string ('' for the defaults)."""
        parts = []
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts + list(self.ignored))


def _max_split(value: str) -> int:
    """CUDAAllocatorConfig::parseMaxSplitSize: megabytes, more than kLargeBuffer (20 MiB)."""
    try:
        mb = int(value)
    except ValueError:
        raise InvalidConfigError(f"--alloc-conf max_split_size_mb:{value}: give whole megabytes, e.g. 128") from None
    if mb <= kLargeBuffer // MiB:
        raise InvalidConfigError(f"--alloc-conf max_split_size_mb:{mb} is too small: PyTorch needs more than 20")
    return mb


def round_size(size: int) -> int:
    """CUDACachingAllocator.cpp round_size: up to a multiple of kMinBlockSize."""
    if size < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def allocation_size(size: int) -> int:
    """CUDACachingAllocator.cpp get_allocation_size: the segment a request that found no cached
    block makes."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


class Block:
    """A piece of a segment: allocated or cached (made by ``_block``). Its size and address are
    kept in ``units`` of kMinBlockSize (every block's size is a multiple: round_size), as are
    the allocator's: ints below 2**30 (a device under 512 GiB), which Python adds, compares
    and hashes fastest."""

    __slots__ = ("units", "at", "small", "allocated", "prev", "next", "segment")

    @property
    def size(self) -> int:
        """Bytes."""
        return self.units * kMinBlockSize

    @property
    def addr(self) -> int:
        """Bytes from the first segment's start."""
        return self.at * kMinBlockSize

    @property
    def key(self) -> tuple[int, int]:
        """Its place in a pool: ordered by size, then address (BlockComparatorSize)."""
        return (self.size, self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def _block(units: int, at: int, small: bool, segment: int, allocated: bool = False, prev: Block | None = None,
           next: Block | None = None) -> Block:  # noqa: A002 (the list's link)
    """A new Block. Block has no ``__init__``: the replay makes thousands, and a class call that
    runs a Python ``__init__`` costs half as much again as this (a Python call; ``Block()`` is
    all C). One assignment a field: a tuple assignment builds a tuple."""
    block = Block()
    block.units = units
    block.at = at
    block.small = small
    block.segment = segment
    block.allocated = allocated
    block.prev = prev
    block.next = next
    return block


# get_allocation_size's and should_split's sizes in units (see Block)
_SMALL_SIZE = kSmallSize // kMinBlockSize
_SMALL_BUFFER = kSmallBuffer // kMinBlockSize
_LARGE_BUFFER = kLargeBuffer // kMinBlockSize


def _units(request: int) -> int:
    """round_size, in units."""
    return (request + kMinBlockSize - 1) // kMinBlockSize or 1


def _segment_units(size: int) -> int:
    """allocation_size of ``size`` units, in units (segments are whole MiBs)."""
    return allocation_size(size * kMinBlockSize) // kMinBlockSize


class OutOfMemory(Exception):
    """The replay could not place a request even after freeing every cached segment."""

    where: str | None = None
    """The event's ``where``, when the default stream's allocator of ``replay`` ran out."""


def _ran_out(where: str) -> OutOfMemory:
    """The ``OutOfMemory`` of a replay that runs out at the event ``where``, as one of the same events
    did before (``ReplayPrefixes``). (Made here, not in a local of the frame that raises it: the
    traceback holds that frame, and a frame that holds its exception is a reference cycle, which
    keeps the replay's events and blocks for the cyclic garbage collector.)"""
    error = OutOfMemory(f"at {where}, as a replay of the same events before")
    error.where = where
    return error


class CachingAllocator:
    """One device's caching allocator (one stream), on a device of ``capacity`` bytes."""

    def __init__(self, *, capacity: int, config: AllocatorConfig = AllocatorConfig()) -> None:
        self.capacity, self.config = capacity, config
        # (sizes, addresses and the sums below in units of kMinBlockSize: see Block)
        self._room = capacity // kMinBlockSize  # (a reserve fits in it iff its bytes fit in capacity)
        self._max_split = config.max_split_size // kMinBlockSize
        # cached blocks, per pool ([large, small], indexed by ``small``), in BlockComparatorSize's
        # order (size, then address) as the pool's sizes, sorted, and a bucket per size of its
        # blocks' addresses, sorted: a step's blocks come in few sizes (a pool holds hundreds of
        # blocks of under ten sizes), so best fit and a free search a short list, not the pool
        self._sizes: tuple[list[int], list[int]] = ([], [])
        self._buckets: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._cached: dict[int, Block] = {}  # by address (a cached block's is its own)
        # Blocks a free merged into a neighbour, to be made again: the replay makes thousands
        # of blocks, and setting a spare's fields costs a third of making a Block
        self._spare: list[Block] = []
        self._reserved = self._peak_reserved = self._allocated = 0
        self._addr = 0
        self._tails: dict[bool, Block] = {}  # expandable segments: each pool's last block
        # the allocated neighbour that stands for every tensor never freed (``malloc_tensors``);
        # its own links and size mean nothing
        self._never_freed = _block(0, -1, False, -3, allocated=True)
        self._plans: dict[int, tuple] = {}  # _plan's, by request
        self._takes: dict[tuple, tuple] = {}  # _stretches', by the event's (nbytes, tensors)
        # blocks freed with record_stream, not yet back in the pool (``RECORDED`` streams: a list; None
        # elsewhere): allocated to the pools until ``release_recorded``
        self.recorded: list[Block] | None = None
        # times the device was full and the cache released (CUDACachingAllocator.cpp ``num_alloc_retries``)
        self.releases = 0

    def _copy(self, copied: dict[Block, Block]) -> CachingAllocator:
        """A copy of this allocator on the copies of its blocks (``copied``, by the original:
        ``_copy_blocks``), its pools in their order; no spare blocks (a spare's fields are all set
        when it is taken: ``_new_segment``, ``_front``)."""
        new = CachingAllocator.__new__(CachingAllocator)
        new.capacity, new.config, new._room, new._max_split = self.capacity, self.config, self._room, self._max_split
        new._sizes = (list(self._sizes[0]), list(self._sizes[1]))
        new._buckets = tuple({size: list(bucket) for size, bucket in buckets.items()} for buckets in self._buckets)
        new._cached = {addr: copied[block] for addr, block in self._cached.items()}
        new._spare = []
        new._reserved, new._peak_reserved, new._allocated = self._reserved, self._peak_reserved, self._allocated
        new._addr = self._addr
        new._tails = {small: copied[block] for small, block in self._tails.items()}
        new._never_freed = copied[self._never_freed]
        new._plans = {}  # (made again as its requests come: no dearer than copying them, measured)
        new._takes = {}  # (their plans hold this allocator's pools)
        new.recorded = None if self.recorded is None else [copied[block] for block in self.recorded]
        new.releases = self.releases
        return new

    def cached_keys(self, small: bool) -> list[tuple[int, int]]:
        """The cached blocks of a pool as (size, addr) in bytes, in best-fit order."""
        buckets = self._buckets[small]
        return [(size * kMinBlockSize, addr * kMinBlockSize)
                for size in self._sizes[small] for addr in buckets[size]]

    @property
    def reserved(self) -> int:
        """Bytes in segments (``torch.cuda.memory_reserved``)."""
        return self._reserved * kMinBlockSize

    @property
    def peak_reserved(self) -> int:
        return self._peak_reserved * kMinBlockSize

    @property
    def allocated(self) -> int:
        """Bytes in allocated blocks (requests rounded up)."""
        return self._allocated * kMinBlockSize

    # -- the pools ----------------------------------------------------------------------------
    def _insert(self, block: Block) -> None:
        bucket = self._buckets[block.small].get(block.units)
        if bucket is None:  # a size new to the pool
            self._buckets[block.small][block.units] = [block.at]
            insort(self._sizes[block.small], block.units)
        else:
            insort(bucket, block.at)
        self._cached[block.at] = block

    def _remove(self, block: Block) -> None:
        buckets = self._buckets[block.small]
        bucket = buckets[block.units]
        if len(bucket) == 1:  # the last of its size
            del buckets[block.units]
            sizes = self._sizes[block.small]
            del sizes[bisect_left(sizes, block.units)]
        else:
            del bucket[bisect_left(bucket, block.at)]
        del self._cached[block.at]

    def _limit(self, size: int) -> int:
        """get_free_block's max_split_size rules as a bound on sizes: a request below the limit
        does not take a block at or above it; one at or above it is only rounded up within
        kLargeBuffer."""
        if size < self._max_split:
            return self._max_split  # do not return an oversized block for a large request
        return size + _LARGE_BUFFER  # an oversize request is only rounded up within kLargeBuffer

    def _get_free_block(self, size: int, small: bool, limit: int = UNLIMITED) -> Block | None:
        """Best fit: the smallest cached block >= the request (the lowest address of the least
        size), if it is below ``limit`` (get_free_block's max_split_size rules, ``_limit``)."""
        sizes = self._sizes[small]
        i = bisect_left(sizes, size)
        if i == len(sizes) or sizes[i] >= limit:
            return None
        found = sizes[i]
        bucket = self._buckets[small][found]
        if len(bucket) == 1:  # the last of its size
            del self._buckets[small][found], sizes[i]
            return self._cached.pop(bucket[0])
        return self._cached.pop(bucket.pop(0))

    # -- segments -----------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> Block | None:
        reserved = self._reserved + size
        if reserved > self._room:
            return None
        if self._spare:
            block = self._spare.pop()
            block.units, block.at, block.small = size, self._addr, small
            block.segment, block.allocated, block.prev = self._addr, False, None
            block.next = None
        else:
            block = _block(size, self._addr, small, self._addr)
        self._addr += size
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
        return block

    def _grow(self, size: int) -> None:
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def _expand(self, size: int, small: bool) -> Block | None:
        """An expandable segment maps more pages at its end (2 MiB small, 20 MiB large). Each
        pool's segment has an address range of its own (CUDACachingAllocator.cpp
        ExpandableSegment reserves its virtual range up front and maps pages into it), its
        blocks end to end from the pool's base: the large pool's at 0, the small pool's above
        every address the large one can reach (its mapped pages never exceed the device), so a
        segment grown in place never overlaps the other pool's blocks."""
        page = _SMALL_BUFFER if small else _LARGE_BUFFER
        tail = self._tails.get(small)
        free_tail = tail is not None and not tail.allocated
        need = size - (tail.units if free_tail else 0)
        grow = page * ((need + page - 1) // page)
        if self._reserved + grow > self._room:
            return None
        self._grow(grow)
        if free_tail:
            self._remove(tail)
            tail.units += grow
            return tail
        at = tail.at + tail.units if tail is not None else self._room if small else 0
        block = _block(grow, at, small, segment=-1 if small else -2)
        if tail is not None:
            tail.next, block.prev = block, tail
        self._tails[small] = block
        return block

    def _alloc_block(self, size: int, small: bool) -> Block | None:
        if self.config.expandable_segments:
            return self._expand(size, small)
        return self._new_segment(_segment_units(size), small)

    def _alloc_or_release(self, size: int, small: bool, request: int) -> Block:
        """A new segment for a request no cached block holds; when the device is full, after
        releasing cached oversize blocks, then every cached segment (raises ``OutOfMemory``)."""
        block = self._alloc_block(size, small)
        if not block:
            self.releases += 1
            block = ((self.release_available_cached_blocks(size, small) and self._alloc_block(size, small))
                     or (self.release_cached_blocks() and self._alloc_block(size, small)))
        if not block:
            raise OutOfMemory(f"{request} bytes with {self.reserved} reserved of {self.capacity}")
        return block

    # -- releasing cached memory ------------------------------------------------------------------
    def _release(self, block: Block) -> None:
        self._remove(block)
        self._reserved -= block.units

    def release_available_cached_blocks(self, size: int, small: bool) -> bool:
        """Free one cached oversize block >= max(size, max_split_size), or the largest oversize
        ones until enough is freed (only with max_split_size_mb set). Blocks of an expandable
        segment are skipped (CUDACachingAllocator.cpp release_available_cached_blocks:
        ``if (!(*cur)->expandable_segment_) release_block``): with expandable segments every
        block is one, and their free pages are unmapped by ``release_cached_blocks`` instead."""
        if self.config.max_split_size_mb is None or self.config.expandable_segments:
            return False
        target = max(size, self._max_split)
        block = self._get_free_block(target, small)
        if block is not None:
            self._reserved -= block.units
            return True
        freed = 0
        sizes, buckets = self._sizes[small], self._buckets[small]
        while sizes and freed < target and sizes[-1] >= self._max_split:
            block = self._cached[buckets[sizes[-1]][-1]]  # the largest, at the highest address
            freed += block.units
            self._release(block)
        return freed >= target

    def release_cached_blocks(self) -> bool:
        """Free every cached block that is a whole segment; unmap an expandable segment's free
        tail pages. First the blocks freed with record_stream come back to the pool
        (CUDACachingAllocator.cpp release_cached_blocks: ``synchronize_and_free_events`` before
        ``release_blocks``)."""
        self.release_recorded()
        for small in (True, False):
            for block in [block for block in self._cached.values() if block.small == small]:
                if not block.is_split() and block.segment >= 0:
                    self._release(block)
            tail = self._tails.get(small)
            if tail is not None and not tail.allocated:
                page = _SMALL_BUFFER if small else _LARGE_BUFFER
                unmapped = tail.units // page * page
                if unmapped:
                    self._remove(tail)
                    tail.units -= unmapped
                    self._reserved -= unmapped
                    if tail.units:
                        self._insert(tail)
                    else:
                        self._tails[small] = tail.prev
                        if tail.prev is not None:
                            tail.prev.next = None
        return True

    # -- malloc and free ----------------------------------------------------------------------
    def malloc(self, request: int) -> Block:
        """Allocate ``request`` bytes (raises ``OutOfMemory``): one tensor, one block."""
        size = _units(request)  # round_size
        small = size <= _SMALL_SIZE
        block = self._get_free_block(size, small, self._limit(size)) or self._alloc_or_release(size, small, request)
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self._allocated += block.units
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.units - size
        if block.small or self.config.expandable_segments:
            return remaining >= 1  # (kMinBlockSize)
        return size < self._max_split and remaining > _SMALL_SIZE

    def _split(self, block: Block, size: int) -> Block:
        """alloc_found_block: the request takes the front, the remainder stays cached."""
        front = _block(size, block.at, block.small, block.segment, False, block.prev, block)
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.at += size
        block.units -= size
        self._insert(block)
        return front

    def free(self, block: Block) -> None:
        """free_block: merge with free neighbours of the segment, then cache."""
        self.free_blocks((block,))

    def free_blocks(self, blocks) -> None:
        """``free`` of each block in turn (the replay frees an event's blocks together), the
        commonest merge (with the remainder after it) and the insertion written out."""
        cached, all_buckets, all_sizes, spare, tails = self._cached, self._buckets, self._sizes, self._spare, self._tails
        freed = 0
        for block in blocks:
            block.allocated = False
            size = block.units
            freed += size
            prev, after = block.prev, block.next
            buckets = all_buckets[block.small]
            if prev is not None and not prev.allocated:
                self._remove(prev)
                size += prev.units
                block.at, block.prev = prev.at, prev.prev
                if prev.prev is not None:
                    prev.prev.next = block
                spare.append(prev)
            if after is not None and not after.allocated:
                bucket = buckets[after.units]  # ``_remove(after)``
                if len(bucket) == 1:
                    sizes = all_sizes[block.small]
                    del buckets[after.units], sizes[bisect_left(sizes, after.units)]
                else:
                    del bucket[bisect_left(bucket, after.at)]
                del cached[after.at]
                size += after.units
                block.next = after.next
                if after.next is not None:
                    after.next.prev = block
                if tails and tails.get(block.small) is after:  # (expandable segments)
                    tails[block.small] = block
                spare.append(after)
            block.units = size
            bucket = buckets.get(size)  # ``_insert(block)``
            if bucket is None:
                buckets[size] = [block.at]
                insort(all_sizes[block.small], size)
            else:
                insort(bucket, block.at)
            cached[block.at] = block
        self._allocated -= freed

    def free_recorded(self, blocks) -> None:
        """``free`` of blocks freed with ``record_stream``: on a ``RECORDED`` stream they wait
        (``recorded``) for ``release_recorded``; elsewhere they are freed now."""
        if self.recorded is None:
            self.free_blocks(blocks)
        else:
            self.recorded += blocks

    def release_recorded(self) -> None:
        """The blocks ``free_recorded`` kept, back in the pool (after the stream's next allocation)."""
        if self.recorded:
            blocks, self.recorded = self.recorded, []
            self.free_blocks(blocks)

    @property
    def cached(self) -> int:
        """Reserved but not allocated."""
        return self.reserved - self.allocated

    # -- the replay's path: one event's tensors --------------------------------------------------
    def malloc_tensors(self, nbytes: int, tensors: int | tuple[int, ...], freed: bool = True) -> list[Block]:
        """The blocks of one event: ``tensors`` equal tensors of ``nbytes`` in all (the last takes
        the remainder of the division), or, when ``tensors`` is a tuple, tensors of those sizes in
        that order (they sum to ``nbytes``), each placed in order exactly as ``malloc`` places it
        (raises ``OutOfMemory``). The replay frees an event's tensors together, so consecutive
        tensors that lie next to each other in a segment are one block (a run): freeing it merges
        the free neighbours that freeing them one by one merges. The tensors of an event never freed
        (``freed=False``: the model states) get no block: ``_never_freed`` stands for each, the
        allocated neighbour of the cached blocks beside it."""
        runs: list[Block] = []
        run = None if freed else self._never_freed
        for plan, count in self._takes.get((nbytes, tensors)) or self._stretches(nbytes, tensors):
            run = self._take(plan, count, run, runs)
        if freed and run is not None:
            runs.append(run)
        return runs

    def _stretches(self, nbytes: int, tensors: int | tuple[int, ...]) -> tuple[tuple[tuple, int], ...]:
        """An event's tensors as ``_take`` takes them, once per event shape (a step repeats a few dozen: each
        layer's): each stretch of equal sizes (found in C) as its request's ``_plan`` and how many; of ``tensors``
        equal tensors, all at once, or all but the last at once and the last (commonly the division leaves
        nothing). Tensors of no bytes take nothing."""
        if type(tensors) is tuple:
            assert sum(tensors) == nbytes, (tensors, nbytes)
            stretches = [(size, len(list(same))) for size, same in groupby(tensors)]
        else:
            each = nbytes // tensors
            last = nbytes - each * (tensors - 1)
            stretches = [(each, tensors)] if last == each else [(each, tensors - 1), (last, 1)]
        takes = self._takes[nbytes, tensors] = tuple(
            (self._plans.get(request) or self._plan(request), count) for request, count in stretches if request > 0)
        return takes

    def _plan(self, request: int) -> tuple:
        """What ``_take`` needs to know of a request, once per request size (the step's tensors
        come in few sizes): the request, its size (round_size), pool, get_free_block's limit, the
        least remainder should_split splits off, its new segment (get_allocation_size), and
        whether a new segment holds only it; its pool's sizes and buckets, whether segments
        are expandable, and the allocator's cached blocks and ``_never_freed`` (one tuple to unpack)."""
        size = _units(request)  # round_size
        small = size <= _SMALL_SIZE
        expandable = self.config.expandable_segments
        # should_split: a remainder of kMinBlockSize in the small pool and in an expandable
        # segment; more than kSmallSize in the large pool, and only below max_split_size
        least = 1 if small or expandable else _SMALL_SIZE + 1 if size < self._max_split else UNLIMITED
        segment = _segment_units(size)
        # a fresh segment holds one request: what a split leaves is smaller than the request
        one_each = not expandable and (segment - size < least or segment - size < size)
        plan = self._plans[request] = (request, size, small, self._limit(size), least, segment, one_each,
                                       self._sizes[small], self._buckets[small], expandable, self._cached,
                                       self._never_freed)
        return plan

    def _take(self, plan: tuple, count: int, run: Block | None, runs: list[Block]) -> Block | None:
        """``count`` mallocs of the request ``plan`` is of (``_plan``) joined to the open ``run`` (finished runs go to
        ``runs``); returns the run open after the last. ``malloc`` written out (the hot path); a
        block found is carved while its remainder holds the next request below get_free_block's
        limit: it is then that malloc's best fit (``_carve``)."""
        request, size, small, limit, least, segment, one_each, sizes, buckets, expandable, cached, never_freed = plan
        while count:
            i = bisect_left(sizes, size)
            if i < len(sizes) and (found := sizes[i]) < limit:  # get_free_block's best fit (``_get_free_block``)
                bucket = buckets[found]
                if len(bucket) == 1:
                    del buckets[found], sizes[i]
                    block = cached.pop(bucket[0])
                    bucket = None  # (none of its size left)
                else:
                    block = cached.pop(bucket.pop(0))
            else:
                bucket = None
                if one_each and count > 2:  # no cached block may be taken, by any of the requests left
                    count, run = self._fresh(size, segment, least, count, run, runs)
                    if not count:
                        break
                if expandable or not (block := self._new_segment(segment, small)):
                    block = self._alloc_or_release(size, small, request)
            count -= 1
            rest = block.units - size
            # what it leaves cached cannot hold the next request: that one's best fit is the bucket's next
            follow = bucket and count and (rest < size or rest < least)
            if rest < least:  # should_split says no: the request takes the whole block
                self._allocated += block.units
                run = self._join_whole(block, run, runs)
            else:
                prev = block.prev  # alloc_found_block's split: the request takes the front
                if prev is run and run is not None:  # right after the run (or both never freed)
                    run.units += size
                elif run is never_freed:  # the front lies between: never freed, like the run
                    if prev is not None:
                        prev.next = run
                    block.prev = run
                else:
                    if run is not None:
                        runs.append(run)
                    run = self._front(size, block, prev)
                self._allocated += size
                block.at += size
                block.units = rest
                if count and size <= rest < limit:  # the next requests, from what remains
                    count, run = self._carve(block, size, least, limit, count, run, runs)
                else:  # ``_insert(block)``, in the request's pool
                    into = buckets.get(rest)
                    if into is None:
                        buckets[rest] = [block.at]
                        insort(sizes, rest)
                    else:
                        insort(into, block.at)
                    cached[block.at] = block
            if follow:
                count, run = self._follow(bucket, block.small, size, least, count, run, runs)
        return run

    def _front(self, size: int, block: Block, prev: Block | None) -> Block:
        """alloc_found_block's split: the request's block, the front of ``block`` (a spare if
        there is one), between ``prev`` and it."""
        front = self._spare.pop() if self._spare else Block()  # (not ``_block``: its call is a third of the cost)
        front.units, front.at, front.small = size, block.at, block.small  # (three fields a statement: a longer
        front.segment, front.allocated, front.prev = block.segment, True, prev  # tuple assignment builds a tuple)
        front.next = block
        if prev is not None:
            prev.next = front
        block.prev = front
        return front

    def _carve(self, block: Block, size: int, least: int, limit: int, count: int, run: Block,
               runs: list[Block]) -> tuple[int, Block | None]:
        """The next of ``count`` requests of ``size`` taken from what remains of ``block`` after
        the last one split off its front (``run`` ends right before it): while it holds a request
        below get_free_block's limit it is that malloc's best fit (smaller than the best fit it
        was cut from, or a new segment when no cached block could be taken); each splits off its
        front while should_split leaves ``least``, then one takes it whole, or what remains is
        cached. Returns the requests left and the open run."""
        rest = block.units
        splits = min(count, (rest - least) // size) if rest - size >= least else 0
        count -= splits
        taken = splits * size
        rest -= taken
        self._allocated += taken
        run.units += taken  # (meaningless for _never_freed)
        block.at += taken
        block.units = rest
        if count and rest >= size:  # its split would leave less than ``least``: taken whole
            self._allocated += rest
            return count - 1, self._join_whole(block, run, runs)
        self._insert(block)
        return count, run

    def _follow(self, bucket: list[int], small: bool, size: int, least: int, count: int, run: Block | None,
                runs: list[Block]) -> tuple[int, Block | None]:
        """The requests after one that took a block of ``bucket`` and left cached less than a
        request: nothing else in the pool changed, so each one's best fit is the bucket's next
        address; up to ``count`` take them in order, at once. Each splits off its front as the
        first did or takes its block whole; none lies right after the run (two free blocks are
        never next to each other: ``free_blocks`` merges them). Returns the requests left and the
        open run."""
        taken = min(count, len(bucket))
        addrs = bucket[:taken]
        found = self._cached[addrs[0]].units
        if taken == len(bucket):  # the last of its size
            sizes = self._sizes[small]
            del self._buckets[small][found], sizes[bisect_left(sizes, found)]
        else:
            del bucket[:taken]
        blocks = list(map(self._cached.pop, addrs))
        never_freed, rest = self._never_freed, found - size
        if rest < least:  # taken whole
            self._allocated += taken * found
            for block in blocks:
                block.allocated = True
            if run is not never_freed:
                if run is not None:
                    runs.append(run)
                runs += blocks[:-1]
                run = blocks[-1]
            return count - taken, run
        self._allocated += taken * size
        if run is never_freed:
            for block in blocks:
                if block.prev is not None:
                    block.prev.next = run
                block.prev = run
                block.at += size
                block.units = rest
        else:
            if run is not None:
                runs.append(run)
            for block in blocks:
                runs.append(self._front(size, block, block.prev))
                block.at += size
                block.units = rest
            run = runs.pop()
        self._insert_all(rest, small, blocks)
        return count - taken, run

    def _insert_all(self, size: int, small: bool, blocks: list[Block]) -> None:
        """``_insert`` of blocks of one size, in address order."""
        addrs = [block.at for block in blocks]
        bucket = self._buckets[small].get(size)
        if bucket is None:
            self._buckets[small][size] = addrs
            insort(self._sizes[small], size)
        else:
            bucket += addrs
            if bucket[-len(addrs) - 1] > addrs[0]:
                bucket.sort()
        self._cached.update(zip(addrs, blocks))

    def _fresh(self, size: int, segment: int, least: int, count: int, run: Block | None,
               runs: list[Block]) -> tuple[int, Block | None]:
        """Requests of ``size`` that each open a new segment of ``segment`` units (no cached block
        may be taken and a segment's remainder cannot hold another): as many of ``count`` as the
        device holds, made at once. Each takes its segment's front (should_split: a remainder of
        at least ``least``, cached) or the whole segment. Returns the requests left and the open
        run (a new segment is never next to it)."""
        made = min(count, (self._room - self._reserved) // segment)
        if made <= 0:
            return count, run
        small, rest, start = size <= _SMALL_SIZE, segment - size, self._addr
        addrs = range(start, start + made * segment, segment)
        self._addr += made * segment
        self._reserved += made * segment
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._allocated += made * (size if rest >= least else segment)
        never_freed, fronts = self._never_freed, None
        if run is not never_freed:
            fronts = [Block() for _ in addrs]  # (made here, not by _block: a call each costs a third)
            for front, addr in zip(fronts, addrs):
                front.units = size if rest >= least else segment
                front.at = front.segment = addr
                front.small = small
                front.allocated = True
                front.prev = front.next = None
            if run is not None:
                runs.append(run)
            runs += fronts[:-1]
            run = fronts[-1]
        if rest >= least:
            # the remainders: cached, after their fronts (never freed: after _never_freed)
            rests = [Block() for _ in addrs]
            for remainder, addr, front in zip(rests, addrs, fronts or repeat(run)):
                remainder.units = rest
                remainder.at = addr + size
                remainder.small = small
                remainder.segment = addr
                remainder.allocated = False
                remainder.prev = front
                remainder.next = None
            if fronts:
                for front, remainder in zip(fronts, rests):
                    front.next = remainder
            # equal sizes, addresses above every cached block's: the end of their size's bucket
            new = [addr + size for addr in addrs]
            bucket = self._buckets[small].get(rest)
            if bucket is None:
                self._buckets[small][rest] = new
                insort(self._sizes[small], rest)
            else:
                bucket += new
            self._cached.update(zip(new, rests))
        return count - made, run

    def _join_whole(self, block: Block, run: Block | None, runs: list[Block]) -> Block | None:
        """The request takes all of ``block`` (not split): joined to ``run`` when it lies right
        after it, else the block is the new run."""
        if run is self._never_freed:
            block.allocated = True  # stays as the allocated neighbour of the blocks beside it
            return run
        if run is not None and block.prev is run:
            run.units += block.units
            run.next = after = block.next
            if after is not None:
                after.prev = run
            if self._tails.get(block.small) is block:
                self._tails[block.small] = run
            return run
        block.allocated = True
        if run is not None:
            runs.append(run)
        return block


@dataclass(frozen=True)
class Replay:
    """What the allocator did over a step's events."""

    peak_reserved: int
    """The largest reserve the run holds: over the step (``torch.cuda.max_memory_reserved``), or, where
    the device filled and the allocator released its cache to go on (``filled``), the largest after
    the last release, when the step's allocated peak comes again after it (the reserve then covers the
    step's largest moment; a release after it leaves too little of a step to read: the largest then,
    as without a release). The real allocator, when cudaMalloc fails, frees every cached unsplit segment
    and retries (CUDACachingAllocator.cpp ``malloc``: ``alloc_block`` ->
    ``release_available_cached_blocks`` -> ``release_cached_blocks``, counted in
    ``num_alloc_retries``): the reserve before that is the whole device for the instant the request
    failed, after it the run goes on from the flushed cache, which the following steps reuse
    (the steps after replay at the reserve the step reached after its release: Mistral-7B full
    fine-tuning at batch 8 on an A100 80GB, 68.11 GiB reserved after the release at the second
    step's loss, 68.35 at most over a third and a fourth step replayed on after it). A reading of
    the device over the run (nvidia-smi polled once a second) sees that, as fms-acceleration's
    batch-8 rows do: 72.6 and 71.3 GiB where batch 4, which never fills the device, reads 75.9 and
    75.5."""
    reserved_at_peak: int
    """The reserve when live tensor bytes peak."""
    allocated_peak: int
    """The largest live tensor bytes (as requested, before rounding)."""
    out_of_memory: str = ""
    """Where the replay ran out of device memory ('' if it did not)."""
    filled: int = 0
    """The reserve when the device filled and the cache was released (0 if it never filled)."""

    @property
    def fragmentation(self) -> int:
        """Reserved but not holding tensor bytes at the peak: rounding and cached free pieces."""
        return self.reserved_at_peak - self.allocated_peak


class _Replaying:
    """A replay under way (``replay``): the default stream's allocator, one allocator per side
    stream (``streams``: breakdown key -> stream name; the keys of a stream share its allocator),
    the live events' blocks and the peaks so far; ``copy`` is an independent copy, which replays on
    as this one does (``ReplayPrefixes``)."""

    __slots__ = ("allocator", "sides", "live", "requested", "peak", "reserved_at_peak", "side_reserved", "both_peak",
                 "releases", "settled", "reached")

    def __init__(self, capacity: int, config: AllocatorConfig, streams: tuple[tuple[str, str], ...] = ()) -> None:
        self.allocator = CachingAllocator(capacity=capacity, config=config)
        pools = {stream: CachingAllocator(capacity=capacity, config=config) for _, stream in streams}
        for stream, pool in pools.items():
            if stream.endswith(RECORDED):
                pool.recorded = []
        # by breakdown key: the hot loop asks one dict per event (empty on one stream: one test)
        self.sides: dict[str, CachingAllocator] = {key: pools[stream] for key, stream in streams}
        self.live: dict[int, list[Block]] = {}
        # (``requested`` and ``peak`` in bytes; the reserves in units, as the allocators keep theirs: see Block)
        self.requested = self.peak = self.reserved_at_peak = self.side_reserved = self.both_peak = 0
        self.releases, self.settled = 0, -1  # (``settled``: -1 until the default stream's cache is released)
        self.reached = False  # the allocated peak met again after the last release

    def advance(self, events, freed: set[int], trace: list[int] | None) -> None:
        """Replay ``events`` (raises ``OutOfMemory`` where the default stream's allocator does);
        ``freed``: the idents of every event the timeline frees."""
        allocator, sides, live = self.allocator, self.sides, self.live
        malloc, free = allocator.malloc_tensors, allocator.free_blocks
        requested, peak, reserved_at_peak = self.requested, self.peak, self.reserved_at_peak
        side_reserved, both_peak = self.side_reserved, self.both_peak
        releases, settled, reached = self.releases, self.settled, self.reached
        # the blocks of the default stream's frees since its last allocation: freed together before the next (a free
        # neither reads nor changes the reserve, so only an allocation can tell; one free_blocks call a run of frees,
        # about half as many: Llama-2-7B's ~690-event timelines free 340 times in 200 runs, zero_grad's 32 in one)
        pending: list[Block] = []
        try:
            # (the events unpacked: a named tuple's field by name is a slower lookup than by position)
            for op, key, nbytes, tensors, ident, where in events:
                if sides and key in sides:
                    side = sides[key]
                    before = side._reserved
                    if op == "alloc":
                        live[ident] = side.malloc_tensors(nbytes, tensors, ident in freed)
                        side.release_recorded()  # (freed before this request: reusable after it)
                        requested += nbytes
                    else:
                        side.free_recorded(live.pop(ident, ()))
                        requested -= nbytes
                    side_reserved += side._reserved - before  # (the side streams' reserves, summed)
                    both_peak = max(both_peak, allocator._reserved + side_reserved)
                    if requested >= peak:
                        if requested > peak:
                            peak, reserved_at_peak = requested, allocator._reserved + side_reserved
                        reached = settled >= 0
                    if settled >= 0:
                        settled = max(settled, allocator._reserved + side_reserved)
                    if trace is not None:
                        trace.append((allocator._reserved + side_reserved) * kMinBlockSize)
                    continue
                if op == "alloc":
                    if pending:
                        free(pending)
                        pending = []
                    try:
                        live[ident] = malloc(nbytes, tensors, ident in freed)
                    except OutOfMemory as error:
                        error.where = where
                        raise
                    requested += nbytes
                    if allocator.releases != releases:  # the device filled: the cache was released for this
                        releases, settled, reached = allocator.releases, allocator._reserved + side_reserved, False
                    if requested >= peak:
                        if requested > peak:
                            peak, reserved_at_peak = requested, allocator._reserved + side_reserved
                        reached = settled >= 0
                else:
                    pending += live.pop(ident, ())
                    requested -= nbytes
                    if trace is None:  # (a free leaves the reserve, so ``settled`` and ``both_peak``, as they were)
                        continue
                if settled >= 0:
                    settled = max(settled, allocator._reserved + side_reserved)
                if side_reserved:
                    both_peak = max(both_peak, allocator._reserved + side_reserved)
                if trace is not None:
                    trace.append((allocator._reserved + side_reserved) * kMinBlockSize)
            if pending:  # (the state kept at a fork holds the run's frees freed)
                free(pending)
        except OutOfMemory:
            if pending:  # (a side stream ran out: the state kept where it did holds them freed too)
                free(pending)
            raise
        finally:
            # Not the frees: any other exception may have stopped the allocator mid-update (the service's
            # watchdog raises ShuttingDown asynchronously in the planning thread, planner/service/budget.py),
            # and freeing the run again there would free some blocks twice (a KeyError in place of the 503).
            self.requested, self.peak, self.reserved_at_peak = requested, peak, reserved_at_peak
            self.side_reserved, self.both_peak = side_reserved, both_peak
            self.releases, self.settled, self.reached = releases, settled, reached

    def result(self) -> Replay:
        """The replay's figures; where the device filled, the reserve after the last release when the step's
        allocated peak came again after it (``Replay.peak_reserved``), else the largest."""
        before = max(self.allocator._peak_reserved, self.both_peak) * kMinBlockSize
        at_peak = self.reserved_at_peak * kMinBlockSize
        if self.settled < 0:
            return Replay(peak_reserved=before, reserved_at_peak=at_peak, allocated_peak=self.peak)
        return Replay(peak_reserved=self.settled * kMinBlockSize if self.reached else before, reserved_at_peak=at_peak,
                      allocated_peak=self.peak, filled=before)

    def copy(self) -> _Replaying:
        pools = list({id(side): side for side in self.sides.values()}.values())  # each stream's once
        roots = [block for runs in self.live.values() for block in runs]
        for allocator in [self.allocator, *pools]:
            roots += allocator._cached.values()
            roots += allocator._tails.values()
            roots += allocator.recorded or ()
            roots.append(allocator._never_freed)
        copied = _copy_blocks(roots)
        new = _Replaying.__new__(_Replaying)
        new.allocator = self.allocator._copy(copied)
        new_pools = {id(side): side._copy(copied) for side in pools}
        new.sides = {key: new_pools[id(side)] for key, side in self.sides.items()}
        new.live = {ident: [copied[block] for block in runs] for ident, runs in self.live.items()}
        new.requested, new.peak, new.reserved_at_peak = self.requested, self.peak, self.reserved_at_peak
        new.side_reserved, new.both_peak = self.side_reserved, self.both_peak
        new.releases, new.settled, new.reached = self.releases, self.settled, self.reached
        return new


def _copy_blocks(roots: list[Block]) -> dict[Block, Block]:
    """A copy of every block linked to ``roots`` (through ``prev`` and ``next``), by the original
    (a Block hashes by identity), its links to the copies."""
    copied: dict[Block, Block] = {}
    todo = list(roots)
    for block in todo:  # (the list grows as it is read: the blocks linked, not copied yet)
        if block in copied:
            continue
        new = copied[block] = Block()  # (three fields a statement: see _block)
        new.units, new.at, new.small = block.units, block.at, block.small
        new.segment, new.allocated = block.segment, block.allocated
        if block.prev is not None and block.prev not in copied:
            todo.append(block.prev)
        if block.next is not None and block.next not in copied:
            todo.append(block.next)
    for block, new in copied.items():
        prev, after = block.prev, block.next
        new.prev = None if prev is None else copied[prev]
        new.next = None if after is None else copied[after]
    return copied


class ReplayPrefixes:
    """The replays' states at their timelines' fork points (``Timeline.forks``), by what was
    replayed to reach each: the capacity, the allocator settings, the side streams' keys, the events
    before the fork and which of their allocations the timeline frees (a tensor never freed gets no
    block: ``malloc_tensors``). A replay whose timeline begins with the same events takes the state
    the first left there (a copy, made there: it replays on as the first's did) and replays only
    what follows. Each state is taken once, not copied again: a copy costs about a third of
    replaying up to the first step's optimizer step, and the plans shown share a prefix in pairs
    (Llama-2-7B on an A10G over every precision: two pairs of plans differ in the optimizer only
    and share 121 and 124 of about 390 events, and a QLoRA plan shares another's model states;
    the five replays took 45.0 M instructions, 39.6 M so, 42.8 M copying the state again for
    every replay that takes it). Lives for one search (``sharing_prefixes``).

    What a replay comes to is kept too, by the same key for its whole timeline (the events say
    which allocations are freed): its ``Replay``; or, where the default stream's allocator ran out
    of memory, where, by the key of the prefix it ran out in (up to the first fork after that
    event, or the whole timeline): a replay of events that begin with that prefix runs out at the
    same event. The plans a search drops because their replay runs out in the usable memory
    commonly differ in the optimizer only, which the first step's forward and backward do not
    read, and run out there (Llama-2-7B on an A10G, target batch 32: QLoRA at micro-batch 8 with
    four optimizers at two adapter ranks); over every precision a fp16-mixed plan's timeline is its
    bf16-mixed twin's, event for event.

    Whether a replay runs out within a prefix does not read which of its allocations are freed
    after it: a tensor never freed is placed as one freed later is (``malloc_tensors``), and until
    its free the allocator's segments, blocks and reserve are the same; so the ran-out table is
    keyed by the events alone, and a timeline can be asked about (``ran_out``) before it is whole
    (``planner.memory.timeline.step_timeline``'s ``abandon``)."""

    def __init__(self) -> None:
        self._states: dict[_Key, _Replaying] = {}
        self._replays: dict[_Key, Replay] = {}
        self._ran_out: dict[_Key, str] = {}  # the key of a prefix's events -> the ``where`` of the event it runs out at
        self._ran_out_lengths: set[int] = set()  # (the prefixes' event counts: most timelines asked about match none)

    def ran_out(self, events, forks, *, capacity: int, config: AllocatorConfig,
                streams: tuple[tuple[str, str], ...]) -> str | None:
        """Where a replay of a timeline that begins with ``events`` runs out, as a replay of the
        events up to one of ``forks`` ran out before (its ``where``), or None where none is known."""
        for fork in forks:
            if fork in self._ran_out_lengths:
                where = self._ran_out.get(_Key((capacity, config, streams, tuple(events[:fork]))))
                if where is not None:
                    return where
        return None

    def replay(self, events, forks: tuple[int, ...], *, capacity: int, config: AllocatorConfig,
               streams: tuple[tuple[str, str], ...], freed: set[int]) -> Replay:
        """The replay of ``events`` (raises ``OutOfMemory``) from the state kept at the last fork
        whose prefix was replayed before, keeping a copy of the state at each later fork; or what
        an earlier replay of the same events, or of a prefix that ran out, came to."""
        events = tuple(events)  # (a key)
        # each prefix's events (the ran-out table's key), then with which of their allocations are freed (the states')
        prefixes = [_Key((capacity, config, streams, events[:fork])) for fork in forks]
        prefixes.append(_Key((capacity, config, streams, events)))
        found = self._replays.get(prefixes[-1])  # (the whole timeline's events say what they free)
        if found is not None:
            return found
        for key in prefixes:
            where = self._ran_out.get(key)
            if where is not None:
                raise _ran_out(where)
        keys = [_Key((key, tuple([event[4] in freed for event in events[:fork] if event[0] == "alloc"])))
                for fork, key in zip(forks, prefixes)]
        state, done = None, 0
        for fork, key in zip(reversed(forks), reversed(keys)):
            state = self._states.pop(key, None)
            if state is not None:
                done = fork
                break
        else:
            state = _Replaying(capacity, config, streams)
        reaching = 0  # (the index in ``prefixes`` of the prefix being replayed)
        try:
            for reaching, (fork, key) in enumerate(zip(forks, keys)):
                if fork > done:
                    state.advance(events[done:fork], freed, None)
                    self._states[key] = state.copy()
                    done = fork
            reaching = len(forks)
            state.advance(events[done:] if done else events, freed, None)
        except OutOfMemory as error:
            if error.where is not None:  # (the default stream's: a side stream's is raised on, not kept)
                self._ran_out[prefixes[reaching]] = error.where
                self._ran_out_lengths.add(forks[reaching] if reaching < len(forks) else len(events))
            raise
        found = self._replays[prefixes[-1]] = state.result()
        return found


class _Key:
    """A key of ``ReplayPrefixes``' tables (a tuple that holds events), its hash worked out once: a
    tuple's is worked out again at every lookup, and a replay looks each of its keys up two or
    three times (a prefix of 300 events of Llama-2-7B hashes in about 20 us, its whole timeline in 45)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.value == other.value


_PREFIXES: ContextVar[ReplayPrefixes | None] = ContextVar("planner_replay_prefixes", default=None)


def shared_prefixes() -> ReplayPrefixes | None:
    """The ``ReplayPrefixes`` of the ``sharing_prefixes`` block this runs in, or None."""
    return _PREFIXES.get()


@contextmanager
def sharing_prefixes() -> Iterator[None]:
    """Within this block the replays share their common prefixes (``ReplayPrefixes``); leaving it
    drops the states kept."""
    token = _PREFIXES.set(ReplayPrefixes())
    try:
        yield
    finally:
        _PREFIXES.reset(token)


def replay(events, *, capacity: int, config: AllocatorConfig = AllocatorConfig(),
           trace: list[int] | None = None, streams: tuple[tuple[str, str], ...] = (),
           forks: tuple[int, ...] = (), prefixes: ReplayPrefixes | None = None, measure: bool = True) -> Replay | None:
    """Replay ``events`` (``planner.memory.timeline.Event``: alloc/free of ``tensors`` equal
    tensors) on a caching allocator of ``capacity`` bytes. When the device runs out, the replay
    is repeated without the limit, so the reserve it would need is known, and says where; with
    ``measure`` False it is not, and None is returned: for a caller that asks only whether the step
    runs in ``capacity`` (that repeat's peak reserve is over ``capacity``: the two replays are one
    up to the first room check that fails, where the repeat's reserve grows past it).
    ``trace``: gets the reserve before the first event and after each. ``streams``: (breakdown key,
    stream name) for the keys allocated on a side stream (``ShardingSpec.streams``), whose blocks only
    that stream's requests reuse (CUDACachingAllocator.cpp: ``BlockComparatorSize`` orders a pool by
    stream first and ``get_free_block`` takes a block of the request's stream only; an expandable
    segment is per stream too): a caching allocator per stream, each reserving beside the default
    stream's; the keys of one stream share its blocks; a stream named with ``RECORDED`` at its end
    takes each freed block back only after its next allocation. A side stream's allocator is not bounded by
    what the others reserve (it has the whole ``capacity``): a step that runs out only on the device
    the streams share is not found. ``forks`` (event counts,
    ascending) and ``prefixes``: the states kept there and what replays came to, shared with other
    replays (``ReplayPrefixes``; ``sharing_prefixes``' when none is given; none with a ``trace``)."""
    if prefixes is None:
        prefixes = _PREFIXES.get()
    freed = {event[4] for event in events if event[0] == "free"}  # (by position: see _Replaying.advance)
    try:
        if prefixes is not None and trace is None:
            return prefixes.replay(events, forks, capacity=capacity, config=config, streams=streams, freed=freed)
        if trace is not None:
            trace[:] = [0]
        state = _Replaying(capacity, config, streams)
        state.advance(events, freed, trace)
    except OutOfMemory as error:
        if capacity >= UNLIMITED or error.where is None:  # (a side stream's: not the step's to report)
            raise
        if not measure:
            return None
        again = replay(events, capacity=UNLIMITED, config=config, trace=trace, streams=streams, forks=forks,
                       prefixes=prefixes)
        return Replay(peak_reserved=again.peak_reserved, reserved_at_peak=again.reserved_at_peak,
                      allocated_peak=again.allocated_peak, out_of_memory=error.where or "the step")
    return state.result()


__all__ = ["RECORDED", "AllocatorConfig", "CachingAllocator", "OutOfMemory", "Replay", "ReplayPrefixes", "allocation_size",
           "replay", "round_size", "shared_prefixes", "sharing_prefixes", "stream_name"]
