"""The CUDA caching allocator model, rule by rule, on allocation sequences derived by hand from
c10/cuda/CUDACachingAllocator.cpp (constants: kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer
2 MiB, kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB)."""

from __future__ import annotations

import pytest

from planner.errors import InvalidConfigError
from planner.memory.allocator import (
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    replay,
    round_size,
)
from planner.memory.timeline import Event

MiB = 1024**2
BIG = 1 << 40


def allocator(conf: str = "", capacity: int = BIG) -> CachingAllocator:
    return CachingAllocator(capacity=capacity, config=AllocatorConfig.parse(conf))


@pytest.mark.parametrize("request_, rounded", [(1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024), (1025, 1536)])
def test_requests_round_to_512_bytes(request_, rounded):
    assert round_size(request_) == rounded


@pytest.mark.parametrize("size, segment", [
    (512, 2 * MiB), (MiB, 2 * MiB),  # small pool: 2 MiB segments, up to and including 1 MiB
    (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),  # 1-10 MiB: a 20 MiB segment
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (11 * MiB, 12 * MiB),  # >= 10 MiB: up to 2 MiB
])
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment


def test_small_requests_share_a_2mib_segment():
    a = allocator()
    blocks = [a.malloc(1000) for _ in range(4)]  # 4 x 1024 B out of one 2 MiB segment
    assert a.reserved == 2 * MiB
    assert a.allocated == 4 * 1024
    assert len({b.segment for b in blocks}) == 1


def test_a_1mib_request_is_small_and_one_byte_more_is_large():
    a = allocator()
    a.malloc(MiB)
    assert a.reserved == 2 * MiB  # small pool
    a.malloc(MiB + 1)  # rounds to MiB + 512: large pool, a 20 MiB segment
    assert a.reserved == 2 * MiB + 20 * MiB


def test_small_blocks_split_when_512_bytes_remain():
    a = allocator()
    first = a.malloc(MiB)  # a 2 MiB segment, remainder 1 MiB >= 512: split
    assert first.size == MiB
    second = a.malloc(MiB - 512)  # from the cached 1 MiB, leaving exactly 512 (= kMinBlockSize): split
    assert second.size == MiB - 512 and a.cached == 512
    last = a.malloc(512)  # the last 512: nothing remains
    assert a.reserved == 2 * MiB and last.size == 512 and a.cached == 0


def test_large_blocks_split_only_when_more_than_1mib_remains():
    a = allocator()
    block = a.malloc(19 * MiB)  # 20 MiB segment, remainder exactly 1 MiB: not > kSmallSize, no split
    assert block.size == 20 * MiB
    b = allocator()
    block = b.malloc(19 * MiB - 512)  # remainder 1 MiB + 512 > 1 MiB: split
    assert block.size == 19 * MiB - 512
    assert b.cached == MiB + 512


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = allocator()
    x, y = a.malloc(40 * MiB), a.malloc(30 * MiB)  # two segments, 40 and 30 MiB
    a.free(x)
    a.free(y)
    reuse = a.malloc(25 * MiB)  # fits both: the 30 MiB block is the best fit, split 25 + 5
    assert reuse.size == 25 * MiB and a.reserved == 70 * MiB
    assert sorted(k[0] for k in a._keys[False]) == [5 * MiB, 40 * MiB]


def test_freed_neighbours_merge_back_into_one_block():
    a = allocator()
    p, q = a.malloc(8 * MiB), a.malloc(8 * MiB)  # both from one 20 MiB segment (8 + 8 + 4)
    assert a.reserved == 20 * MiB
    a.free(p)
    a.free(q)
    assert [k[0] for k in a._keys[False]] == [20 * MiB]  # merged into the whole segment


def test_max_split_size_blocks_are_not_split_and_small_requests_skip_them():
    a = allocator("max_split_size_mb:64")
    big = a.malloc(100 * MiB)  # >= 64 MiB: its own 100 MiB segment
    a.free(big)
    a.malloc(30 * MiB)  # below the limit: may not take the oversize 100 MiB block -> new segment
    assert a.reserved == 130 * MiB


def test_oversize_requests_take_cached_blocks_only_within_20mib():
    a = allocator("max_split_size_mb:64")
    a.free(a.malloc(100 * MiB))
    a.malloc(81 * MiB)  # 100 < 81 + 20: reuses the cached 100 MiB block whole (no split)
    assert a.reserved == 100 * MiB and a.allocated == 100 * MiB
    b = allocator("max_split_size_mb:64")
    b.free(b.malloc(100 * MiB))
    b.malloc(80 * MiB)  # 100 >= 80 + 20: not allowed, a new 80 MiB segment
    assert b.reserved == 180 * MiB


def test_without_max_split_size_a_large_cached_block_is_split_for_a_small_request():
    a = allocator()
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)
    assert a.reserved == 100 * MiB


def test_cached_blocks_are_freed_and_the_request_retried_before_out_of_memory():
    a = allocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))  # 60 MiB cached
    a.malloc(70 * MiB)  # the cached 60 is too small; 60 + 70 > 100: release it, retry
    assert a.reserved == 70 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(40 * MiB)  # 70 in use, nothing cached, 70 + 40 > 100


def test_expandable_segments_grow_by_pages_and_split_at_512_bytes():
    a = allocator("expandable_segments:True")
    a.malloc(30 * MiB)  # large pool pages are 20 MiB: 40 MiB mapped
    assert a.reserved == 40 * MiB
    a.malloc(15 * MiB)  # 10 MiB free at the end: map one more page
    assert a.reserved == 60 * MiB
    b = allocator()
    b.malloc(30 * MiB)
    b.malloc(15 * MiB)  # without: a 30 MiB and a 16 MiB segment
    assert b.reserved == 46 * MiB


def test_replay_reports_reserve_and_fragmentation_at_the_peak():
    def ev(op, ident, nbytes, tensors=1):
        return Event(op, "x", nbytes, tensors, ident, "")

    events = [ev("alloc", 1, 30 * MiB), ev("alloc", 2, 5 * MiB), ev("free", 1, 30 * MiB), ev("alloc", 3, 12 * MiB)]
    r = replay(events, capacity=BIG)
    # 30 MiB segment + 20 MiB segment for the 5 MiB; the 12 MiB request reuses the freed 30 MiB block
    assert r.allocated_peak == 35 * MiB and r.reserved_at_peak == 50 * MiB and r.peak_reserved == 50 * MiB
    assert r.fragmentation == 15 * MiB
    tight = replay(events, capacity=40 * MiB)
    assert tight.out_of_memory and tight.peak_reserved == 50 * MiB


def test_alloc_conf_parsing():
    conf = AllocatorConfig.parse("max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6")
    assert (conf.max_split_size, conf.expandable_segments) == (128 * MiB, True)
    assert conf.spelling() == "max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.6"
    assert AllocatorConfig.parse(None).spelling() == ""
    for bad in ("max_split_size_mb:20", "max_split_size_mb:x", "expandable_segments:yes", "nonsense:1", "max_split_size_mb"):
        with pytest.raises(InvalidConfigError):
            AllocatorConfig.parse(bad)
