"""The reserve a run holds once the device filled and the caching allocator released its cache
(planner/memory/allocator.py ``Replay.peak_reserved``, ``Replay.filled``)."""

from __future__ import annotations

from planner.memory.allocator import replay
from planner.memory.timeline import Event

MiB = 2**20
BIG = 1 << 60


def _ev(op: str, ident: int, nbytes: int) -> Event:
    return Event(op, "x", nbytes, 1, ident, "")


EVENTS = [_ev("alloc", 1, 30 * MiB), _ev("alloc", 2, 30 * MiB), _ev("alloc", 3, 30 * MiB),
          _ev("free", 1, 30 * MiB), _ev("free", 2, 30 * MiB), _ev("alloc", 4, 40 * MiB),
          _ev("free", 3, 30 * MiB), _ev("free", 4, 40 * MiB)]


def test_a_filled_device_reports_the_reserve_after_the_release():
    # three 30 MiB tensors, each its own 30 MiB segment (>= kMinLargeAlloc, a multiple of 2 MiB): 90 MiB;
    # two freed stay cached (90 MiB reserved); a 40 MiB request fits no cached block and a 40 MiB segment
    # would make 130 > 100: release_cached_blocks frees the two cached segments (60 MiB), then 30 + 40 = 70
    r = replay(EVENTS, capacity=100 * MiB)
    assert r.filled == 90 * MiB  # the reserve when the device filled
    assert r.peak_reserved == 70 * MiB  # what the run holds after the release
    assert not r.out_of_memory


def test_a_device_that_never_fills_reports_its_largest_reserve():
    # with room the cached 60 MiB stay: 90 + 40 = 130 MiB, no release
    r = replay(EVENTS, capacity=BIG)
    assert r.filled == 0 and r.peak_reserved == 130 * MiB
