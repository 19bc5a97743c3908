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


def test_a_plan_that_fills_the_device_says_so_and_one_that_does_not_is_silent():
    """fms-acceleration's Mistral-7B full fine-tuning on one A100-80GB (fp16, micro-batch 8, 4,096 tokens,
    checkpointed, FlashAttention): the replay fills the device at the second step's loss (77.96 GiB reserved)
    and holds 68.11 GiB after its release; at micro-batch 4 it never fills."""
    from planner.catalog import resolve_model
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory

    model, gpu = resolve_model("mistralai/Mistral-7B-v0.1"), get_gpu("a100-80gb")
    config = TrainConfig(method="full", precision="fp16", optimizer="adamw", micro_batch=8, grad_accum=1,
                         seq_len=4096, grad_ckpt=True, attention="flash")
    filled = estimate_memory(model=model, config=config, gpu=gpu)
    said = [a for a in filled.assumptions if "reaches the memory the plan is replayed within" in a]
    assert len(said) == 1 and "num_alloc_retries" in said[0]
    assert filled.peak_reserved_bytes / 2**30 < 77.96 - 5  # the reserve after the release, not at the fill
    assert not [a for a in estimate_memory(model=model, config=config.replace(micro_batch=4), gpu=gpu).assumptions
                if "reaches the memory the plan is replayed within" in a]
