"""The replay's shortcuts that keep its answers (planner/memory/allocator.py): a run of frees freed in one
``free_blocks`` call, and an event shape's stretches of equal requests worked out once."""

from __future__ import annotations

import pytest

from planner.memory.allocator import AllocatorConfig, CachingAllocator, ReplayPrefixes, replay
from planner.memory.timeline import Event

MiB = 2**20
BIG = 1 << 40


def _ev(op: str, ident: int, nbytes: int) -> Event:
    return Event(op, "x", nbytes, 1, ident, "")


# 30 MiB: a 30 MiB segment (>= kMinLargeAlloc: rounded to 2 MiB), freed and cached; two 10 MiB requests split it
# (each leaves > kSmallSize): 10 + 10 allocated, 10 cached at its end; both freed, the second merges with the first
# before it and the 10 after it: the whole 30 MiB segment again, which the last 30 MiB request takes
EVENTS = [_ev("alloc", 1, 30 * MiB), _ev("free", 1, 30 * MiB), _ev("alloc", 2, 10 * MiB), _ev("alloc", 3, 10 * MiB),
          _ev("free", 2, 10 * MiB), _ev("free", 3, 10 * MiB), _ev("alloc", 4, 30 * MiB)]


def test_a_run_of_frees_is_one_free_blocks_call_and_merges_as_one_at_a_time(monkeypatch):
    calls: list[int] = []
    free_blocks = CachingAllocator.free_blocks

    def counted(self, blocks):
        calls.append(len(blocks))
        free_blocks(self, blocks)

    monkeypatch.setattr(CachingAllocator, "free_blocks", counted)
    trace: list[int] = []
    r = replay(EVENTS, capacity=BIG, trace=trace)
    assert calls == [1, 2]  # free 1 before alloc 2; frees 2 and 3 together before alloc 4 (one at a time: 3 calls)
    # no second segment: the merged 30 MiB block holds the last request, as freeing one at a time leaves it
    assert r.peak_reserved == 30 * MiB and r.allocated_peak == 30 * MiB
    assert trace == [0] + [30 * MiB] * len(EVENTS)
    one_at_a_time = CachingAllocator(capacity=BIG)
    one_at_a_time.free(one_at_a_time.malloc(30 * MiB))
    blocks = [one_at_a_time.malloc(10 * MiB), one_at_a_time.malloc(10 * MiB)]
    for block in blocks:
        one_at_a_time.free(block)
    assert one_at_a_time.cached_keys(False) == [(30 * MiB, 0)]
    one_at_a_time.malloc(30 * MiB)
    assert one_at_a_time.peak_reserved == r.peak_reserved


def test_a_run_of_frees_at_the_end_of_a_prefix_is_freed_in_the_state_kept_there():
    # the first replay keeps its state after frees 2 and 3 (a fork at 6); the second takes it and asks 30 MiB:
    # the merged segment holds it (left allocated, it would open a second segment: 60 MiB)
    prefixes = ReplayPrefixes()
    first = prefixes.replay(EVENTS, (6,), capacity=BIG, config=AllocatorConfig(), streams=(), freed={1, 2, 3})
    again = prefixes.replay(EVENTS[:6] + [_ev("alloc", 5, 30 * MiB)], (6,), capacity=BIG, config=AllocatorConfig(),
                            streams=(), freed={1, 2, 3})
    assert first.peak_reserved == again.peak_reserved == 30 * MiB


def test_an_event_shapes_stretches_are_worked_out_once(monkeypatch):
    a = CachingAllocator(capacity=BIG)
    made: list[tuple] = []
    stretches = CachingAllocator._stretches

    def counted(self, nbytes, tensors):
        made.append((nbytes, tensors))
        return stretches(self, nbytes, tensors)

    monkeypatch.setattr(CachingAllocator, "_stretches", counted)
    for _ in range(3):
        a.malloc_tensors(3 * MiB + 1, 3)
        a.malloc_tensors(8 * MiB + 512, (0, 4 * MiB, 4 * MiB, 0, 512))
    assert made == [(3 * MiB + 1, 3), (8 * MiB + 512, (0, 4 * MiB, 4 * MiB, 0, 512))]
    # 3 MiB + 1 in three: two of 1 MiB, the last 1 MiB + 1; the tuple: its stretches of equal sizes, none of 0 bytes
    assert [(plan[0], count) for plan, count in a._takes[3 * MiB + 1, 3]] == [(MiB, 2), (MiB + 1, 1)]
    assert [(plan[0], count) for plan, count in a._takes[8 * MiB + 512, (0, 4 * MiB, 4 * MiB, 0, 512)]] == [
        (4 * MiB, 2), (512, 1)]


def test_an_exception_inside_a_free_is_not_followed_by_freeing_the_run_again(monkeypatch):
    """The service's watchdog raises ShuttingDown asynchronously in a planning thread, so it can land inside
    ``free_blocks`` with the pools half updated; the replay must let it through, not free the run again on
    that state (it did once: KeyError from the pools, a 500 in place of the 503)."""
    calls: list[int] = []

    class Interrupted(Exception):
        pass

    def interrupted(self, blocks):
        calls.append(len(blocks))
        raise Interrupted

    monkeypatch.setattr(CachingAllocator, "free_blocks", interrupted)
    with pytest.raises(Interrupted):
        replay(EVENTS, capacity=BIG)
    assert calls == [1]  # free 1, interrupted; nothing freed after it
