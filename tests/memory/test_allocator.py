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
    assert sorted(k[0] for k in a.cached_keys(False)) == [5 * MiB, 40 * MiB]


def test_freed_neighbours_merge_back_into_one_block():
    a = allocator()
    p, q = a.malloc(8 * MiB), a.malloc(8 * MiB)  # both from one 20 MiB segment (8 + 8 + 4)
    assert a.reserved == 20 * MiB
    a.free(p)
    a.free(q)
    assert [k[0] for k in a.cached_keys(False)] == [20 * MiB]  # merged into the whole segment


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


def test_each_pool_grows_its_own_expandable_segment():
    """An expandable segment grows at its own end (PyTorch reserves each one a virtual address
    range of its own, CUDACachingAllocator.cpp ExpandableSegment), so a pool's segment growing in
    place never runs into the other pool's blocks. Hand-derived: 30 MiB maps two 20 MiB pages of
    the large pool (10 MiB left free at its end); 1 KiB maps a 2 MiB page of the small pool; 10 MiB
    + 1 KiB takes the free 10 MiB end and one more large page (62 MiB reserved), leaving its
    remainder at 40 MiB + 1 KiB of the large segment. (With one address counter for both pools
    the small page lay at 40 MiB, its remainder at 40 MiB + 1 KiB too, and the two cached blocks
    collided.) Freed, each pool holds one cached block: 60 MiB and 2 MiB."""
    a = allocator("expandable_segments:True")
    blocks = [a.malloc(30 * MiB), a.malloc(1024), a.malloc(10 * MiB + 1024)]
    assert a.reserved == a.peak_reserved == 62 * MiB
    large = a.cached_keys(False)
    assert [size for size, _ in large] == [20 * MiB - 1024] and len(a.cached_keys(True)) == 1
    for block in blocks:
        a.free(block)
    assert [size for size, _ in a.cached_keys(False)] == [60 * MiB]
    assert [size for size, _ in a.cached_keys(True)] == [2 * MiB]
    assert a.allocated == 0 and a.reserved == 62 * MiB
    a.release_cached_blocks()  # both pools' free pages unmapped
    assert a.reserved == 0


def test_with_expandable_segments_no_oversize_block_is_released_only_free_pages_unmapped():
    """max_split_size_mb with expandable segments: release_available_cached_blocks skips blocks
    of an expandable segment (CUDACachingAllocator.cpp), so a request the device cannot map
    unmaps the free pages at each segment's end (release_cached_blocks) and retries.
    Hand-derived, on 60 MiB: 30 MiB maps 40 MiB of the large pool; 1 KiB a 2 MiB small page
    (42 MiB); the 30 MiB freed leaves a free 40 MiB end; 50 MiB would map one more 20 MiB page
    (62 MiB > 60): the 40 MiB free end is unmapped (2 MiB left), and 50 MiB needs three new pages,
    60 MiB, more than the 58 MiB left: out of memory, with 2 MiB reserved. 30 MiB then maps 40."""
    a = allocator("max_split_size_mb:21,expandable_segments:True", capacity=60 * MiB)
    big = a.malloc(30 * MiB)
    a.malloc(1024)
    a.free(big)
    assert a.reserved == 42 * MiB and [size for size, _ in a.cached_keys(False)] == [40 * MiB]
    with pytest.raises(OutOfMemory):
        a.malloc(50 * MiB)
    assert a.reserved == 2 * MiB and a.cached_keys(False) == []
    a.malloc(30 * MiB)
    assert a.reserved == 42 * MiB


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


def _one_by_one(self, nbytes, tensors, freed=True):
    """An event as one malloc per tensor, each its own block (the straightforward replay)."""
    if isinstance(tensors, tuple):
        return [self.malloc(size) for size in tensors]
    if tensors == 1:
        return [self.malloc(nbytes)] if nbytes > 0 else []
    each = nbytes // tensors
    last = nbytes - each * (tensors - 1)
    blocks = [self.malloc(each) for _ in range(tensors - 1)] if each > 0 else []
    return blocks + ([self.malloc(last)] if last > 0 else [])


def _replays_both_ways(timeline, config, gpu, monkeypatch):
    from planner.memory.allocator import CachingAllocator
    from planner.memory.estimate import replay_timeline

    fast, trace_fast = replay_timeline(timeline, config, gpu, trace := []), list(trace)
    with monkeypatch.context() as m:
        m.setattr(CachingAllocator, "malloc_tensors", _one_by_one)
        slow = replay_timeline(timeline, config, gpu, trace := [])
    return fast, trace_fast, slow, trace


@pytest.mark.parametrize("model_id, gpu_name, batch, seq", [
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, 4096),
    ("Qwen/Qwen2.5-1.5B", "t4", 16, 1024),
    ("gpt2", "h100", 8, 1024),
])
def test_malloc_tensors_is_malloc_in_a_row(model_id, gpu_name, batch, seq, monkeypatch):
    """The replay's path (runs of adjacent tensors as one block, nothing kept for tensors never
    freed, many equal tensors carved or given new segments at once) gives the same reserve after
    every event as one malloc per tensor, on the timelines of a sample of the search's
    candidates, with and without max_split_size_mb."""
    import itertools

    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.memory.timeline import step_timeline
    from planner.search import SearchSpace, enumerate_configs

    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    configs = list(enumerate_configs(model=model, gpu=gpu, target_batch=batch, seq_len=seq, gpus=1,
                                     space=SearchSpace(cpu_mem_bytes=64 << 30)))
    for config in itertools.islice(configs, 0, None, max(1, len(configs) // 25)):
        for conf in (None, "max_split_size_mb:64"):
            cfg = config.replace(alloc_conf=conf) if conf else config
            timeline = step_timeline(model=model, config=cfg, kernels=gpu.kernels)
            fast, trace_fast, slow, trace_slow = _replays_both_ways(timeline, cfg, gpu, monkeypatch)
            assert fast == slow and trace_fast == trace_slow, cfg.label()


def test_malloc_tensors_by_hand():
    """Three 700 KiB tensors, then two: 700 KiB rounds to 716,800 B; a 2 MiB segment holds two
    (2,097,152 - 2 x 716,800 = 663,552 B stay cached, too small for a third), so three take two
    segments with 663,552 and 1,380,352 B cached, the first two side by side (one block of the
    event); the next two: the 1,380,352 B remainder holds one (663,552 left), the other opens a
    third segment."""
    from planner.memory.allocator import CachingAllocator

    a = CachingAllocator(capacity=1 << 30)
    blocks = a.malloc_tensors(3 * 700 * 1024, 3)
    assert [b.size for b in blocks] == [2 * 716_800, 716_800] and a.reserved == 2 * 2 * MiB
    assert sorted(k[0] for k in a.cached_keys(True)) == [663_552, 1_380_352]
    more = a.malloc_tensors(2 * 700 * 1024, 2)
    assert [b.size for b in more] == [716_800] * 2
    assert a.reserved == 3 * 2 * MiB and a.allocated == 5 * 716_800
    assert sorted(k[0] for k in a.cached_keys(True)) == [663_552, 663_552, 1_380_352]
    for b in blocks + more:
        a.free(b)
    assert a.allocated == 0 and sorted(k[0] for k in a.cached_keys(True)) == [2 * MiB] * 3


def test_tensors_never_freed_keep_no_block_and_place_the_rest_alike():
    """An event never freed (the model states) gets no block; the cached blocks around it, the
    reserve and what is allocated are those of the same event made block by block."""
    from planner.memory.allocator import CachingAllocator

    kept, plain = CachingAllocator(capacity=1 << 40), CachingAllocator(capacity=1 << 40)
    for nbytes, tensors in [(30 * 700 * 1024, 30), (5 * 46 * MiB + 7, 5), (3 * MiB, 1), (40 * 3 * MiB, 40)]:
        assert kept.malloc_tensors(nbytes, tensors, freed=False) == []
        plain.malloc_tensors(nbytes, tensors)
        _assert_same_state(kept, plain)
    # a kept tensor cut right after a freed one: freeing that one must not merge across it
    for request in (300 * 1024, 3 * MiB):
        freed_kept, freed_plain = kept.malloc_tensors(request, 1), plain.malloc_tensors(request, 1)
        kept.malloc_tensors(request, 1, freed=False)
        plain.malloc_tensors(request, 1)
        for a, blocks in ((kept, freed_kept), (plain, freed_plain)):
            for block in blocks:
                a.free(block)
        _assert_same_state(kept, plain)


def _state(a, split=True):
    """Everything of an allocator a later malloc or free can see: reserve, peak, allocated, and
    each cached block's key (size, address) and whether it is split (release_cached_blocks frees
    unsplit ones; ``split=False`` leaves that out, for speed)."""
    keys = [a.cached_keys(small) for small in (False, True)]
    if split:  # each block cached under its own key, in its own pool
        by_addr = {block.addr: block for block in a._cached.values()}
        for small, pool in enumerate(keys):
            assert all(by_addr[addr].size == size and by_addr[addr].small == small for size, addr in pool)
        assert len(a._cached) == len(by_addr) == len(keys[0]) + len(keys[1])
        # two free blocks are never next to each other (free merges them; the replay's batches
        # of requests from one bucket rely on it)
        assert all(n is None or n.allocated for b in a._cached.values() for n in (b.prev, b.next))
    by_addr = {block.addr: block for block in a._cached.values()} if split else {}
    return (a.reserved, a.peak_reserved, a.allocated, keys,
            split and [[by_addr[addr].is_split() for _, addr in pool] for pool in keys])


def _assert_same_state(a, b, where=""):
    assert _state(a) == _state(b), where


def _events_both_ways(events, capacity, conf):
    """The events on two allocators, the replay's path and one malloc per tensor, compared after
    every event; the index of the event that ran out of memory (both must), else None."""
    from planner.memory.allocator import CachingAllocator, OutOfMemory

    fast, slow = (CachingAllocator(capacity=capacity, config=AllocatorConfig.parse(conf)) for _ in range(2))
    freed = {ev.ident for ev in events if ev.op == "free"}
    live_fast, live_slow = {}, {}
    for n, ev in enumerate(events):
        if ev.op == "alloc":
            try:
                live_slow[ev.ident] = _one_by_one(slow, ev.nbytes, ev.tensors)
            except OutOfMemory:
                with pytest.raises(OutOfMemory):
                    fast.malloc_tensors(ev.nbytes, ev.tensors, freed=ev.ident in freed)
                return n
            live_fast[ev.ident] = fast.malloc_tensors(ev.nbytes, ev.tensors, freed=ev.ident in freed)
        else:
            for blocks, a in ((live_fast.pop(ev.ident), fast), (live_slow.pop(ev.ident), slow)):
                for block in blocks:
                    a.free(block)
        split = n % 16 == 0 or n == len(events) - 1
        assert _state(fast, split) == _state(slow, split), f"event {n}: {ev}"
    return None


def _sampled_cases(n_per: int):
    """(model, gpu, config) over several of the catalog's models and the search's knobs (methods,
    precisions, checkpointing, ZeRO stages, splits), each with an allocator setting."""
    import random

    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.search import SearchSpace, enumerate_configs

    rng = random.Random(11)
    confs = [None, "max_split_size_mb:64", "max_split_size_mb:21", "expandable_segments:True",
             "max_split_size_mb:64,expandable_segments:True"]
    for model_id in ("meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-1.5B", "gpt2", "mistralai/Mixtral-8x7B-v0.1",
                     "t5-large", "microsoft/phi-2", "google/gemma-2-9b"):
        model = resolve_model(model_id)
        for gpu_name in ("a10g", "t4", "h100-80gb"):
            gpu = get_gpu(gpu_name)
            configs = list(enumerate_configs(model=model, gpu=gpu, target_batch=16, seq_len=min(1024, model.max_seq_len),
                                             gpus=rng.choice([1, 2]), space=SearchSpace(cpu_mem_bytes=1 << 40)))
            for config in rng.sample(configs, min(n_per, len(configs))):
                conf = rng.choice(confs)
                yield model, gpu, config.replace(alloc_conf=conf) if conf else config


@pytest.mark.parametrize("model, gpu, config", [pytest.param(*case, id=f"{case[0].id}-{case[1].name}-{case[2].label()}")
                                                for case in _sampled_cases(3)])
def test_the_replay_matches_malloc_one_tensor_at_a_time_event_by_event(model, gpu, config, monkeypatch):
    """After every event of the step, on the device's memory and on one 64 MiB short of the
    step's peak reserve (so releases and out-of-memory retries run), the replay's allocator holds
    exactly the cached blocks, reserve and allocation of one malloc and one block per tensor; and
    estimate_memory gives every field the same."""
    from planner.memory.allocator import CachingAllocator
    from planner.memory.estimate import estimate_memory
    from planner.memory.timeline import step_timeline

    timeline = step_timeline(model=model, config=config, kernels=gpu.kernels)
    capacity = gpu.memory_bytes - int(gpu.cuda_context_bytes) - timeline.outside_allocator
    peak = replay(timeline.events, capacity=1 << 64, config=AllocatorConfig.parse(config.alloc_conf)).peak_reserved
    for cap in (capacity, 1 << 64, max(peak - 64 * MiB, MiB)):
        _events_both_ways(timeline.events, cap, config.alloc_conf)
    fast = estimate_memory(model=model, config=config, gpu=gpu)
    with monkeypatch.context() as m:
        m.setattr(CachingAllocator, "malloc_tensors", _one_by_one)
        assert estimate_memory(model=model, config=config, gpu=gpu) == fast


# --- the replay's grain: the tensors an event is made of (planner/memory/timeline.py Grains) ------------

def test_tensors_given_by_size_are_placed_in_order():
    """An event given as sizes (a tuple) is malloc of each size in order: 112, 112, 32 and 8 MiB
    (>= kMinLargeAlloc, no cached block) each open a segment rounded up to kRoundLarge, 2 MiB:
    112 + 112 + 32 + 8 = 264 MiB; the blocks of adjacent equal tensors are one run."""
    a = allocator()
    blocks = a.malloc_tensors(264 * MiB, (112 * MiB, 112 * MiB, 32 * MiB, 8 * MiB))
    # 8 MiB < kMinLargeAlloc: a 20 MiB kLargeBuffer segment, split (12 MiB left > kSmallSize)
    assert a.reserved == (112 + 112 + 32 + 20) * MiB and a.allocated == 264 * MiB
    assert [b.size for b in blocks] == [112 * MiB, 112 * MiB, 32 * MiB, 8 * MiB]
    assert a.cached_keys(False) == [(12 * MiB, blocks[-1].addr + 8 * MiB)]
    with pytest.raises(AssertionError):  # the sizes must sum to the event's bytes
        a.malloc_tensors(100 * MiB, (60 * MiB, 60 * MiB))


def test_gradients_carved_from_a_cached_logits_block_open_no_segment():
    """The cause of the over-predicted reserve, by hand. Mistral-7B at batch 4 x 4096 tokens:
    log_softmax's fp32 output is one tensor of 4 x 4096 x 32000 x 4 B = 2000 MiB (one segment of
    2000 MiB: a multiple of 2 MiB). Freed, it is one cached 2000 MiB block; a block's gradients
    (down, up, gate 4096 x 14336 x 2 B = 112 MiB; o, q 32 MiB; k, v 8 MiB: 416 MiB) are each best
    fit by it and split off its front (the remainder > kSmallSize): no new segment, the reserve
    stays 2000 MiB.
    Cut into 16 equal 125 MiB pieces (the old grain: bytes over one hidden state, 128 MiB), it is
    16 segments of 126 MiB (125 rounded up to 2 MiB) = 2016 MiB, freed as 16 separate cached
    blocks (no two in one segment: they never merge); the gradients as 3 equal shares of
    145,402,538 B (rounded up to 512 B: 283,990 x 512 = 145,402,880 B, segment 140 MiB) fit none: 3 new segments,
    2016 + 420 = 2436 MiB."""
    grads = (112 * MiB,) * 3 + (32 * MiB,) * 2 + (8 * MiB,) * 2
    whole = allocator()
    whole.free_blocks(whole.malloc_tensors(2000 * MiB, 1))
    whole.malloc_tensors(416 * MiB, grads)
    assert whole.reserved == 2000 * MiB and whole.cached_keys(False) == [(1584 * MiB, 416 * MiB)]
    pieces = allocator()
    pieces.free_blocks(pieces.malloc_tensors(2000 * MiB, 16))
    assert pieces.reserved == 16 * 126 * MiB
    pieces.malloc_tensors(416 * MiB, 3)
    assert round_size(416 * MiB // 3) == 283_990 * 512 and allocation_size(283_990 * 512) == 140 * MiB
    assert pieces.reserved == (16 * 126 + 3 * 140) * MiB


def test_the_loss_path_is_logits_sized_tensors():
    """whole_tensors: the forward's logits (16-bit, L/2) and their fp32 upcast (L) as two tensors,
    the smaller first; log_softmax's int64 labels (8 B a token) before its fp32 output."""
    from planner.memory.timeline import shares, whole_tensors

    L = 4 * 4096 * 32000 * 4
    assert whole_tensors(L // 2 + L, L) == (L // 2, L)
    assert whole_tensors(2 * L, L) == (L, L)
    assert whole_tensors(L + 4 * 4096 * 8, L) == (4 * 4096 * 8, L)
    # shares: bytes in proportion to element counts, the last takes the remainder
    assert shares((3, 1), 100) == (75, 25) and shares((1, 1, 1), 10) == (3, 3, 4) and shares((), 10) is None


def test_the_timeline_gives_gradients_their_parameters_shapes():
    """Full fine-tuning of Llama-2-7B (h 4096, intermediate 11008, 32 heads = 32 kv heads): the
    last block's backward makes its MLP output projection's gradient first (4096 x 11008 x 2 B in
    bf16), then the rest in backward order: up, gate (11008 x 4096), o, v, k, q (4096 x 4096),
    then the two RMSNorm weights (4096). The optimizer's states come at the first step (torch's
    lazy state initialization), not with the weights."""
    from planner.catalog import resolve_model
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.memory.timeline import step_timeline

    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a100-80gb")
    config = TrainConfig(method="full", precision="bf16", micro_batch=1, seq_len=512, grad_ckpt=True)
    events = step_timeline(model=model, config=config, kernels=gpu.kernels).events
    grads = [ev for ev in events if ev.key == "gradients" and ev.op == "alloc" and ev.where.startswith("backward")]
    mlp, attn = 4096 * 11008 * 2, 4096 * 4096 * 2
    assert grads[0].tensors == (mlp,)  # the down projection, before the block's other gradients
    assert grads[1].tensors == (mlp, mlp) + (attn,) * 4 + (4096 * 2,) * 2
    assert all(ev.tensors == grads[0].tensors + grads[1].tensors for ev in grads[2:])
    states = [ev.where for ev in events if ev.key == "optimizer_states"]
    assert states == ["step 1: optimizer step"]
    logits = next(ev for ev in events if ev.key == "activations/loss/log_softmax")
    assert logits.tensors == (512 * 8, 512 * 32000 * 4)  # the int64 labels, the fp32 log-probabilities


def _gemma2_qlora_events():
    """Gemma-2-9B QLoRA on an A10G (the litgpt-gemma2-9b-qlora row of bench/published.py): r 16 on
    every linear, lora_dropout 0.1, batch 1 x 512 tokens."""
    from planner.catalog import resolve_model
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.memory.timeline import step_timeline

    model, gpu = resolve_model("google/gemma-2-9b"), get_gpu("a10g")
    config = TrainConfig(method="qlora", precision="bf16", micro_batch=1, seq_len=512, lora_r=16,
                         lora_targets=("all-linear",), lora_dropout=0.1)
    return step_timeline(model=model, config=config, kernels=gpu.kernels).events


def test_the_weights_are_their_parameters_tensors():
    """Gemma-2-9B (h 3584, vocab 256000, tied head, 42 layers of 4 RMSNorms, q 3584x4096, k and v
    3584x2048, o 4096x3584, gate/up/down 3584x14336) under QLoRA: bitsandbytes quantises the 7
    linears of each layer (294 tensors, in proportion to their elements); the rest stays fp32
    after prepare_model_for_kbit_training: the 256000 x 3584 x 4 B = 3,670,016,000 B (3500 MiB)
    embedding and 42 x 4 + 1 = 169 norms of 3584 x 4 = 14,336 B.
    Replayed: the embedding is one 3500 MiB segment (a multiple of kRoundLarge); the norms are
    small requests (<= kSmallSize), 146 to a 2 MiB kSmallBuffer segment (146 x 14,336 =
    2,093,056 B, 4,096 B left), the other 23 in a second: 3504 MiB. Cut into the 381 equal pieces
    a model-state component was (42 x (7 + 2) + 3), each is 3,672,438,784 / 381 -> 9,638,946 B,
    rounded to 18,827 x 512 = 9,639,424 B < kMinLargeAlloc: a 20 MiB kLargeBuffer segment, whose
    split leaves 11,332,096 B, which the next piece splits (1,692,672 B > kSmallSize left, cached
    and never fitting another): two pieces a segment, 191 segments, 3820 MiB."""
    from planner.memory.timeline import shares

    events = _gemma2_qlora_events()
    unquantized = next(ev for ev in events if ev.key == "weights/unquantized")
    assert unquantized.nbytes == 3_670_016_000 + 169 * 14_336
    assert unquantized.tensors == (3_670_016_000,) + (14_336,) * 169
    nf4 = next(ev for ev in events if ev.key == "weights/nf4")
    layer = (3584 * 4096, 3584 * 2048, 3584 * 2048, 4096 * 3584) + (3584 * 14336,) * 3
    assert nf4.tensors == shares(layer * 42, nf4.nbytes) and len(nf4.tensors) == 294

    real = allocator()
    real.malloc_tensors(unquantized.nbytes, unquantized.tensors, freed=False)
    assert real.reserved == (3500 + 2 + 2) * MiB
    pieces = allocator()
    pieces.malloc_tensors(unquantized.nbytes, 381, freed=False)
    assert round_size(unquantized.nbytes // 381) == 18_827 * 512 and allocation_size(18_827 * 512) == 20 * MiB
    assert pieces.reserved == 191 * 20 * MiB


def test_lora_dropout_masks_and_copies_are_tensors_of_their_own():
    """peft keeps, per adapted linear, dropout's bool mask (1 B an element on CUDA) and the
    dropped fp32 copy lora_A saves: in Gemma-2-9B's second block at 512 tokens, for q, k and v
    (input 3584) 1.75 MiB and 7 MiB each, o (input 4096) 2 and 8 MiB, gate and up 1.75 and 7, down
    (input 14336) 7 and 28 MiB; the first block's q, k and v keep no mask (their input needs no
    gradient). Not 14 equal pieces of the 88.75 MiB.
    Replayed by hand from an empty cache (MiB): 1.75 opens a 20 MiB segment A (18.25 left), 7
    (11.25), 1.75 (9.5), 7 (2.5 > kSmallSize: split), 1.75 takes A's 2.5 whole (0.75 would be
    left); 7 opens B (13), 2 (11), 8 (3), 1.75 (1.25 left, split); 7 fits no cached block: C
    (13), 1.75's best fit is C (B's 1.25 is too small; 11.25 left), 7 (4.25); 7 opens D; 28 >=
    kMinLargeAlloc: its own 28 MiB segment. 4 x 20 + 28 = 108 MiB."""
    events = _gemma2_qlora_events()
    blocks = [ev for ev in events if ev.key == "lora/dropout" and ev.op == "alloc"]
    m = 512 * 3584  # a 3584-wide input's elements
    q_k_v, o, down = (m, 4 * m) * 3, (512 * 4096, 512 * 4096 * 4), (512 * 14336, 512 * 14336 * 4)
    assert blocks[0].tensors == (4 * m,) * 3 + o + (m, 4 * m) * 2 + down
    assert blocks[1].tensors == q_k_v + o + (m, 4 * m) * 2 + down
    a = allocator()
    a.malloc_tensors(blocks[1].nbytes, blocks[1].tensors)
    # (the third q/k/v mask holds A's 2.5 MiB whole: 0.75 MiB more allocated than requested)
    assert a.reserved == 108 * MiB and a.allocated == blocks[1].nbytes + 768 * 1024 == 93_061_120 + 786_432
