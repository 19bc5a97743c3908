"""The reserve a run holds once the device filled and the caching allocator released its cache
(planner/memory/allocator.py ``Replay.peak_reserved``, ``Replay.filled``)."""

from __future__ import annotations

from planner.memory.allocator import replay
from planner.memory.timeline import Event

MiB = 2**20
BIG = 1 << 60


def _ev(op: str, ident: int, nbytes: int) -> Event:
    return Event(op, "x", nbytes, 1, ident, "")


EVENTS = [_ev("alloc", 1, 50 * MiB), _ev("free", 1, 50 * MiB), _ev("alloc", 2, 30 * MiB), _ev("alloc", 3, 40 * MiB),
          _ev("free", 2, 30 * MiB), _ev("free", 3, 40 * MiB), _ev("alloc", 4, 70 * MiB), _ev("free", 4, 70 * MiB)]


def test_a_filled_device_reports_the_reserve_after_the_release():
    # 50 MiB: a 50 MiB segment, freed and cached; 30 MiB splits it (the 20 MiB left > kSmallSize); 40 MiB fits
    # no cached block: a 40 MiB segment, 90 reserved, 70 live (the step's allocated peak); both freed (the
    # 30 merges back into its whole 50 MiB segment); 70 MiB fits neither and 90 + 70 > 100: release_cached_blocks
    # frees both segments, then a 70 MiB one: 70 reserved while 70 MiB, the peak again, is live
    r = replay(EVENTS, capacity=100 * MiB)
    assert r.filled == 90 * MiB  # the reserve when the device filled
    assert r.peak_reserved == 70 * MiB  # what the run holds after the release
    assert r.allocated_peak == 70 * MiB and not r.out_of_memory


def test_a_device_that_never_fills_reports_its_largest_reserve():
    # with room the cached 90 MiB stay: 90 + 70 = 160 MiB, no release
    r = replay(EVENTS, capacity=BIG)
    assert r.filled == 0 and r.peak_reserved == 160 * MiB


def test_a_release_after_the_peak_reports_the_largest_reserve():
    # the same events, then the release happens once the 90 MiB of live tensors (the step's allocated
    # peak) are gone: 60 MiB live at most after it, less than before, so what follows the release is no
    # step's whole; the reserve reported is the largest, 90 MiB, and the filled one is kept beside it
    events = [_ev("alloc", 1, 30 * MiB), _ev("alloc", 2, 30 * MiB), _ev("alloc", 3, 30 * MiB),
              _ev("free", 1, 30 * MiB), _ev("free", 2, 30 * MiB), _ev("free", 3, 30 * MiB),
              _ev("alloc", 4, 40 * MiB), _ev("alloc", 5, 20 * MiB)]
    # 90 MiB cached in three 30 MiB segments; 40 MiB fits none: 90 + 40 > 100, all three released, 40 MiB;
    # then 20 MiB (>= kMinLargeAlloc): a 20 MiB segment, 60 MiB reserved
    r = replay(events, capacity=100 * MiB)
    assert r.filled == 90 * MiB and r.peak_reserved == 90 * MiB
