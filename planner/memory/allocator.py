"""PyTorch's CUDA caching allocator, replayed on the predicted allocations of a step.

A model of c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch, read at commit eb42ad6e) for one
device and one stream; each rule cites the code it follows:

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

import bisect
from dataclasses import dataclass

from planner.errors import InvalidConfigError

MiB = 1024**2
kMinBlockSize = 512
kSmallSize = 1 * MiB
kSmallBuffer = 2 * MiB
kLargeBuffer = 20 * MiB
kMinLargeAlloc = 10 * MiB
kRoundLarge = 2 * MiB
#: no max_split_size_mb: PyTorch's default is std::numeric_limits<size_t>::max()
UNLIMITED = 1 << 64

#: PYTORCH_CUDA_ALLOC_CONF keys PyTorch accepts that do not change what this replay predicts
#: (c10/cuda/CUDAAllocatorConfig.cpp parseArgs).
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
    """A piece of a segment: allocated or cached."""

    __slots__ = ("size", "addr", "small", "allocated", "prev", "next", "segment")

    def __init__(self, size: int, addr: int, small: bool, segment: int) -> None:
        self.size, self.addr, self.small, self.segment = size, addr, small, segment
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Its place in a pool: ordered by size, then address (BlockComparatorSize)."""
        return (self.size, self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class OutOfMemory(Exception):
    """The replay could not place a request even after freeing every cached segment."""


class CachingAllocator:
    """One device's caching allocator (one stream), on a device of ``capacity`` bytes."""

    def __init__(self, *, capacity: int, config: AllocatorConfig = AllocatorConfig()) -> None:
        self.capacity, self.config = capacity, config
        self.max_split = config.max_split_size
        # cached blocks by (size, addr), per pool: [large, small] (indexed by ``small``)
        self._keys: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        self._cached: dict[tuple[int, int], Block] = {}
        self.reserved = self.peak_reserved = self.allocated = 0
        self._addr = 0
        self._tails: dict[bool, Block] = {}  # expandable segments: each pool's last block

    # -- the pools ----------------------------------------------------------------------------
    # (the replay makes thousands of these per plan shown: the key is built inline, not by the
    # ``Block.key`` property)
    def _insert(self, block: Block) -> None:
        key = (block.size, block.addr)
        bisect.insort(self._keys[block.small], key)
        self._cached[key] = block

    def _remove(self, block: Block) -> None:
        key = (block.size, block.addr)
        keys = self._keys[block.small]
        del keys[bisect.bisect_left(keys, key)]
        del self._cached[key]

    def _get_free_block(self, size: int, small: bool) -> Block | None:
        """Best fit with get_free_block's max_split_size rules."""
        keys = self._keys[small]
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        key = keys[i]
        block = self._cached[key]
        if size < self.max_split and block.size >= self.max_split:
            return None  # do not return an oversized block for a large request
        if size >= self.max_split and block.size >= size + kLargeBuffer:
            return None  # an oversize request is only rounded up within kLargeBuffer
        del keys[i]
        del self._cached[key]
        return block

    # -- segments -----------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> Block | None:
        if self.reserved + size > self.capacity:
            return None
        block = Block(size, self._addr, small, segment=self._addr)
        self._addr += size
        self._grow(size)
        return block

    def _grow(self, size: int) -> None:
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _expand(self, size: int, small: bool) -> Block | None:
        """An expandable segment maps more pages at its end (2 MiB small, 20 MiB large)."""
        page = kSmallBuffer if small else kLargeBuffer
        tail = self._tails.get(small)
        free_tail = tail is not None and not tail.allocated
        need = size - (tail.size if free_tail else 0)
        grow = page * ((need + page - 1) // page)
        if self.reserved + grow > self.capacity:
            return None
        self._grow(grow)
        if free_tail:
            self._remove(tail)
            tail.size += grow
            return tail
        block = Block(grow, self._addr, small, segment=-1 if small else -2)
        self._addr += grow
        if tail is not None:
            tail.next, block.prev = block, tail
        self._tails[small] = block
        return block

    def _alloc_block(self, size: int, small: bool) -> Block | None:
        if self.config.expandable_segments:
            return self._expand(size, small)
        return self._new_segment(allocation_size(size), small)


    # -- releasing cached memory ------------------------------------------------------------------
    def _release(self, block: Block) -> None:
        self._remove(block)
        self.reserved -= block.size

    def release_available_cached_blocks(self, size: int, small: bool) -> bool:
        """Free one cached oversize block >= max(size, max_split_size), or the largest oversize
        ones until enough is freed (only with max_split_size_mb set)."""
        if self.max_split == UNLIMITED:
            return False
        keys = self._keys[small]
        target = max(size, self.max_split)
        i = bisect.bisect_left(keys, (target, -1))
        if i < len(keys):
            self._release(self._cached[keys[i]])
            return True
        freed = 0
        while keys and freed < target and keys[-1][0] >= self.max_split:
            block = self._cached[keys[-1]]
            freed += block.size
            self._release(block)
        return freed >= target

    def release_cached_blocks(self) -> bool:
        """Free every cached block that is a whole segment; unmap an expandable segment's free
        tail pages."""
        for small in (True, False):
            for key in list(self._keys[small]):
                block = self._cached[key]
                if not block.is_split() and block.segment >= 0:
                    self._release(block)
            tail = self._tails.get(small)
            if tail is not None and not tail.allocated:
                page = kSmallBuffer if small else kLargeBuffer
                unmapped = tail.size // page * page
                if unmapped:
                    self._remove(tail)
                    tail.size -= unmapped
                    self.reserved -= unmapped
                    if tail.size:
                        self._insert(tail)
                    else:
                        self._tails[small] = tail.prev
                        if tail.prev is not None:
                            tail.prev.next = None
        return True

    # -- malloc and free ----------------------------------------------------------------------
    def malloc(self, request: int) -> Block:
        """Allocate ``request`` bytes (raises ``OutOfMemory``)."""
        size = kMinBlockSize * ((request + kMinBlockSize - 1) // kMinBlockSize) or kMinBlockSize  # round_size
        small = size <= kSmallSize
        block = self._get_free_block(size, small)
        if block is None:
            block = (self._alloc_block(size, small)
                     or (self.release_available_cached_blocks(size, small) and self._alloc_block(size, small))
                     or (self.release_cached_blocks() and self._alloc_block(size, small)))
        if not block:
            raise OutOfMemory(f"{request} bytes with {self.reserved} reserved of {self.capacity}")
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        return block

    def malloc_many(self, request: int, count: int) -> list[Block]:
        """``count`` mallocs of ``request`` bytes in a row, as ``malloc`` makes them (a model's
        weights, a LoRA optimizer's states: hundreds of equal tensors). While no cached block of
        the pool can hold the request, each malloc opens a segment and the next ones best-fit its
        remainder, the only cached block large enough: that carving is done here in one pass;
        every other case goes through ``malloc``."""
        size = kMinBlockSize * ((request + kMinBlockSize - 1) // kMinBlockSize) or kMinBlockSize
        if self.config.expandable_segments:
            return [self.malloc(request) for _ in range(count)]
        small = size <= kSmallSize
        keys, segment_size, out = self._keys[small], allocation_size(size), []
        while len(out) < count:
            if (keys and keys[-1][0] >= size) or self.reserved + segment_size > self.capacity:
                out.append(self.malloc(request))  # a cached block may fit, or the device is full
                continue
            segment = self._new_segment(segment_size, small)
            assert segment is not None
            out += self._carve(segment, size, count - len(out))
        return out

    def _carve(self, block: Block, size: int, most: int) -> list[Block]:
        """Up to ``most`` blocks of ``size`` from the front of the free ``block``, each split off as
        ``_split`` does when ``_should_split`` says so, else taking the block whole; what remains
        is cached."""
        out = []
        while len(out) < most and block.size >= size:
            if self._should_split(block, size):
                front = self._split_front(block, size)
            else:
                front, block = block, None
            front.allocated = True
            self.allocated += front.size
            out.append(front)
            if block is None:
                return out
        self._insert(block)
        return out

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.max_split and remaining > kSmallSize

    def _split(self, block: Block, size: int) -> Block:
        """alloc_found_block: the request takes the front, the remainder stays cached."""
        front = self._split_front(block, size)
        self._insert(block)
        return front

    @staticmethod
    def _split_front(block: Block, size: int) -> Block:
        """A new block of ``size`` at the front of ``block``, linked before it; ``block`` keeps the
        rest (and is not cached here)."""
        front = Block(size, block.addr, block.small, block.segment)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size -= size
        return front

    def free(self, block: Block) -> None:
        """free_block: merge with free neighbours of the segment, then cache."""
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._remove(neighbour)
            if neighbour is block.prev:
                block.addr = neighbour.addr
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
                if self._tails.get(block.small) is neighbour:
                    self._tails[block.small] = block
            block.size += neighbour.size
        self._insert(block)

    @property
    def cached(self) -> int:
        """Reserved but not allocated."""
        return self.reserved - self.allocated


@dataclass(frozen=True)
class Replay:
    """What the allocator did over a step's events."""

    peak_reserved: int
    """The largest reserve over the step (``torch.cuda.max_memory_reserved``)."""
    reserved_at_peak: int
    """The reserve when live tensor bytes peak."""
    allocated_peak: int
    """The largest live tensor bytes (as requested, before rounding)."""
    out_of_memory: str = ""
    """Where the replay ran out of device memory ('' if it did not)."""

    @property
    def fragmentation(self) -> int:
        """Reserved but not holding tensor bytes at the peak: rounding and cached free pieces."""
        return self.reserved_at_peak - self.allocated_peak


def _malloc_event(allocator: CachingAllocator, nbytes: int, tensors: int) -> list[Block]:
    """The blocks of one event: ``tensors`` equal tensors of ``nbytes`` in all (the last takes
    the remainder of the division), in order."""
    if tensors == 1:
        return [allocator.malloc(nbytes)] if nbytes > 0 else []
    each = nbytes // tensors
    last = nbytes - each * (tensors - 1)
    blocks = allocator.malloc_many(each, tensors - 1) if each > 0 else []
    return blocks + ([allocator.malloc(last)] if last > 0 else [])


def replay(events, *, capacity: int, config: AllocatorConfig = AllocatorConfig(),
           trace: list[int] | None = None) -> Replay:
    """Replay ``events`` (``planner.memory.timeline.Event``: alloc/free of ``tensors`` equal
    tensors) on a caching allocator of ``capacity`` bytes. When the device runs out, the replay
    is repeated without the limit, so the reserve it would need is known, and says where.
    ``trace``: gets the reserve before the first event and after each."""
    allocator = CachingAllocator(capacity=capacity, config=config)
    if trace is not None:
        trace[:] = [0]
    live: dict[int, list[Block]] = {}
    requested = peak = reserved_at_peak = 0
    for ev in events:
        if ev.op == "alloc":
            try:
                live[ev.ident] = _malloc_event(allocator, ev.nbytes, ev.tensors)
            except OutOfMemory:
                if capacity >= UNLIMITED:
                    raise
                again = replay(events, capacity=UNLIMITED, config=config, trace=trace)
                return Replay(peak_reserved=again.peak_reserved, reserved_at_peak=again.reserved_at_peak,
                              allocated_peak=again.allocated_peak, out_of_memory=ev.where or "the step")
            requested += ev.nbytes
            if requested > peak:
                peak, reserved_at_peak = requested, allocator.reserved
        else:
            for block in live.pop(ev.ident, []):
                allocator.free(block)
            requested -= ev.nbytes
        if trace is not None:
            trace.append(allocator.reserved)
    return Replay(peak_reserved=allocator.peak_reserved, reserved_at_peak=reserved_at_peak, allocated_peak=peak)


__all__ = ["AllocatorConfig", "CachingAllocator", "OutOfMemory", "Replay", "allocation_size", "replay", "round_size"]
