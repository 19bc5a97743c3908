"""The allocator replay's side streams (``planner.memory.allocator.replay``'s ``streams``): a caching
allocator per stream, as PyTorch's reuses a freed block only for a request of its own stream
(c10/cuda/CUDACachingAllocator.cpp: ``BlockComparatorSize`` orders a pool by stream first,
``get_free_block`` looks up the request's stream only); and where each scheme says its keys are
allocated (``ShardingSpec.streams``), checked against the torch source it cites."""

from __future__ import annotations

import os

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.allocator import RECORDED, AllocatorConfig, _Replaying, replay
from planner.memory.estimate import device_timeline, estimate_memory
from planner.memory.timeline import Event
from planner.sharding import SCHEMES

MiB = 1024**2
BIG = 2**40
#: ``a`` and ``b`` on one side stream, ``g`` on another, ``x`` on the default stream
STREAMS = (("a", "s1"), ("b", "s1"), ("g", "s2"))
#: 100 MiB requests: a large request of 10 MiB or more opens a segment of its size rounded to
#: 2 MiB (CUDACachingAllocator.cpp get_allocation_size), so each new segment is 100 MiB exactly
EVENTS = [
    Event("alloc", "a", 100 * MiB, 1, 1, "s1"),
    Event("free", "a", 100 * MiB, 1, 1, "s1"),
    Event("alloc", "g", 100 * MiB, 1, 2, "s2"),   # s1's cached block is not s2's: a segment of its own
    Event("free", "g", 100 * MiB, 1, 2, "s2"),
    Event("alloc", "b", 100 * MiB, 1, 3, "s1"),   # a's freed block, the same stream's: no new segment
    Event("alloc", "x", 100 * MiB, 1, 4, "default"),  # neither side's cached block: a third segment
    Event("alloc", "g", 60 * MiB, 1, 5, "s2"),    # carved from s2's cached 100 MiB block (split: 40 MiB > 1 MiB left)
]


def test_two_side_streams_reuse_only_their_own_blocks():
    trace: list[int] = []
    r = replay(EVENTS, capacity=BIG, trace=trace, streams=STREAMS)
    # by hand: s1 100, + s2 100, s1 reuses, + default 100, s2 carves its cached block
    assert [t // MiB for t in trace] == [0, 100, 100, 200, 200, 200, 300, 300]
    assert r.peak_reserved == 300 * MiB
    # live bytes peak at the end: b 100 + x 100 + g 60, while 300 MiB are reserved
    assert (r.allocated_peak, r.reserved_at_peak, r.fragmentation) == (260 * MiB, 300 * MiB, 40 * MiB)


def test_one_pool_for_both_side_streams_or_none_reuses_more():
    # every side key on one stream: a's block serves g and then b, x opens a second segment and the
    # last g a third, of 60 MiB (no cached block left): 200 MiB reserved before it, 260 with it
    one_side = replay(EVENTS, capacity=BIG, streams=tuple((key, "side") for key, _ in STREAMS))
    # no side stream: the same blocks, all in the default pool
    none = replay(EVENTS, capacity=BIG)
    assert one_side.peak_reserved == none.peak_reserved == 260 * MiB
    assert one_side.allocated_peak == none.allocated_peak == 260 * MiB


#: FSDP1's unshard stream as the timeline draws it: the running unit's gather (100 MiB) and the root
#: with the unit gathered ahead (200 MiB) in forward, the running unit's freed at the loss and gathered
#: again for backward, both freed at its end, then the next step's forward
GATHERS = [
    Event("alloc", "u", 100 * MiB, 1, 1, "forward"),
    Event("alloc", "h", 200 * MiB, 1, 2, "forward"),
    Event("free", "u", 100 * MiB, 1, 1, "loss"),
    Event("alloc", "u", 100 * MiB, 1, 3, "backward"),
    Event("free", "u", 100 * MiB, 1, 3, "end of backward"),
    Event("free", "h", 200 * MiB, 1, 2, "end of backward"),
    Event("alloc", "u", 100 * MiB, 1, 4, "step 2: forward"),
    Event("alloc", "h", 200 * MiB, 1, 5, "step 2: forward"),
]


def test_a_recorded_stream_takes_a_freed_block_back_after_its_next_allocation():
    """FSDP1 frees a gathered unit with record_stream on the compute stream, and the rate limiter
    makes it reusable only by the unshard after next (planner/sharding/fsdp1.py): by hand, the
    backward's gather finds the forward's block still out and opens a third segment (100 + 200 +
    100 MiB); after it that block is back, and the next step's forward gathers into the first and
    second segments (the third, freed at the end of backward, is out for one allocation), so the
    reserve stays 400 MiB; without the rule the backward reuses the forward's block: 300 MiB."""
    recorded = (("u", "s" + RECORDED), ("h", "s" + RECORDED))
    trace: list[int] = []
    r = replay(GATHERS, capacity=BIG, trace=trace, streams=recorded)
    assert [t // MiB for t in trace] == [0, 100, 300, 300, 400, 400, 400, 400, 400]
    assert (r.peak_reserved, r.allocated_peak) == (400 * MiB, 300 * MiB)  # the block out is not allocated
    assert replay(GATHERS, capacity=BIG, streams=(("u", "s"), ("h", "s"))).peak_reserved == 300 * MiB


def test_a_full_device_syncs_the_recorded_blocks_back_before_it_releases_segments():
    """CUDACachingAllocator.cpp release_cached_blocks: ``synchronize_and_free_events`` first, so
    on a device that cannot hold a third segment the backward's gather takes the forward's block
    (synced back), not a new one: 300 MiB reserved, where an unbounded device reserves 400."""
    recorded = (("u", "s" + RECORDED), ("h", "s" + RECORDED))
    r = replay(GATHERS, capacity=350 * MiB, streams=recorded)
    assert (r.peak_reserved, r.out_of_memory) == (300 * MiB, "")


def test_a_copy_keeps_the_blocks_a_recorded_stream_holds_out():
    recorded = (("u", "s" + RECORDED), ("h", "s" + RECORDED))
    state = _Replaying(BIG, AllocatorConfig(), recorded)
    state.advance(GATHERS[:3], {1, 2, 3}, None)  # the forward's unit freed, out of the pool
    copy = state.copy()
    for replaying in (state, copy):
        replaying.advance(GATHERS[3:], {1, 2, 3}, None)
        assert replaying.result().peak_reserved == 400 * MiB


def test_the_assumptions_name_the_unshard_stream_by_its_name():
    model = resolve_model("meta-llama/Llama-2-7b-hf")
    text = " ".join(estimate_memory(model=model, config=_config("fsdp1"), gpu=get_gpu("a100-80gb")).assumptions)
    assert "on the unshard stream" in text and RECORDED not in text


def test_a_copy_keeps_each_stream_once():
    state = _Replaying(BIG, AllocatorConfig(), STREAMS)
    state.advance(EVENTS[:5], {1, 2}, None)
    copy = state.copy()
    assert copy.sides["a"] is copy.sides["b"] is not copy.sides["g"]
    assert copy.sides["a"] is not state.sides["a"]
    for one in (state, copy):
        one.advance(EVENTS[5:], {1, 2}, None)
    assert copy.result() == state.result() == replay(EVENTS, capacity=BIG, streams=STREAMS)


def _config(scheme: str, gpus: int = 2, **changes) -> TrainConfig:
    return TrainConfig(**({"method": "full", "precision": "bf16", "gpus": gpus, "sharding": scheme, "micro_batch": 2,
                           "seq_len": 1024, "grad_ckpt": True} | changes))


def test_fsdp1_gathers_on_its_unshard_stream_and_reduces_on_its_post_backward_stream():
    """torch 2.13 torch/distributed/fsdp: ``_unshard`` allocates the padded unsharded flat
    parameter on the unshard stream (_runtime_utils.py:304-306 -> _flat_param.py:1408); the
    post-backward hook makes the reduce-scatter output, the sharded gradient, on the post-backward
    stream (_runtime_utils.py:755, l.901); one rank runs NO_SHARD (_init_utils.py:430-433), all on
    the default stream."""
    fsdp1 = SCHEMES["fsdp1"]
    assert fsdp1.streams(_config("fsdp1")) == (
        ("fsdp2/gathered_unit", "unshard" + RECORDED), ("fsdp2/root_and_gather_buffer", "unshard" + RECORDED),
        ("gradients", "post_backward"))
    assert fsdp1.streams(_config("fsdp1", gpus=1)) == ()


def test_fsdp2_reduces_into_its_reduce_scatter_stream_and_copies_out_on_the_default_one():
    """torch 2.13 torch/distributed/fsdp/_fully_shard: the reduce-scatter output (the sharded
    gradients are its views) is allocated in the reduce-scatter stream (_fsdp_collectives.py:611-612,
    l.704); the copy-out's unsharded parameters (_fsdp_param_group.py:463 -> _fsdp_param.py:823-825)
    and the reduce-scatter input (_fsdp_collectives.py:597) on the default stream."""
    assert SCHEMES["fsdp2"].streams(_config("fsdp2", precision="bf16-mixed")) == (("gradients", "reduce_scatter"),)


def test_only_zero3_and_fsdp_have_side_streams():
    assert SCHEMES["zero3"].streams(None) == (("zero3/overflow_check", "reduce"),)
    for name in ("none", "ddp", "zero1", "zero2"):
        assert SCHEMES[name].streams(None) == (), name


_TORCH = "/".join(("torch", "distributed", "fsdp"))
#: the lines the declarations cite (planner/sharding/fsdp1.py, fsdp2.py ``_STREAMS``), in torch 2.13
CITED = [
    ("_runtime_utils.py", 304, "stream(unshard_stream)"),
    ("_runtime_utils.py", 755, "stream(state._post_backward_stream)"),
    ("_runtime_utils.py", 901, "new_sharded_grad = torch.empty_like(chunks[0])"),
    ("_runtime_utils.py", 926, "flat_param._saved_grad_shard = sharded_grad"),
    ("_flat_param.py", 1408, "_alloc_storage(unsharded_flat_param"),
    ("_flat_param.py", 1708, "flat_param.grad = flat_param._saved_grad_shard"),
    ("_init_utils.py", 433, "switching to use `NO_SHARD`"),
    ("_runtime_utils.py", 298, "event = state._free_event_queue.dequeue_if_needed()"),
    ("_runtime_utils.py", 303, "event.synchronize()"),
    ("_runtime_utils.py", 325, "free_event.record()"),
    ("_flat_param.py", 1818, "_no_dispatch_record_stream("),
    ("_flat_param.py", 1819, "unsharded_flat_param, self._device_handle.current_stream()"),
    ("_limiter_utils.py", 15, "self._max_num_inflight_all_gathers = 2"),
    ("_fully_shard/_fsdp_collectives.py", 336, "stream(all_gather_copy_in_stream)"),
    ("_fully_shard/_fsdp_collectives.py", 597, "reduce_scatter_input = reduce_scatter_comm.allocate("),
    ("_fully_shard/_fsdp_collectives.py", 611, "stream(reduce_scatter_stream)"),
    ("_fully_shard/_fsdp_collectives.py", 612, "reduce_output = reduce_scatter_comm.allocate("),
    ("_fully_shard/_fsdp_collectives.py", 704, "new_sharded_grad = torch.as_strided("),
    ("_fully_shard/_fsdp_param_group.py", 463, "foreach_all_gather_copy_out("),
    ("_fully_shard/_fsdp_param.py", 825, "alloc_storage(tensor)"),
]


@pytest.mark.parametrize("path,line,text", CITED)
def test_the_cited_torch_lines_say_so(path, line, text):
    import torch

    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"the lines are torch 2.13's, this is {torch.__version__}")
    source = os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp", *path.split("/"))
    with open(source) as f:
        lines = f.read().splitlines()
    assert text in lines[line - 1], (f"{_TORCH}/{path}:{line}", lines[line - 1])


def test_the_streamed_keys_are_in_the_steps_they_are_declared_for():
    # every key a scheme puts on a side stream is allocated by its 2-GPU step (no dead declaration)
    model = resolve_model("meta-llama/Llama-3.2-1B")
    for config in (_config("fsdp1"), _config("fsdp2", precision="bf16-mixed"),
                   _config("zero3", precision="fp16-mixed")):
        timeline = device_timeline(model=model, config=config, gpu=get_gpu("a100-80gb"))
        made = {event[1] for event in timeline.events}
        streams = config.sharding.spec.streams(config)
        assert streams and {key for key, _ in streams} <= made, (config.sharding.scheme, made)


def test_fsdp1s_gradients_cannot_take_the_activations_blocks():
    # full fine-tuning on 2 ranks: the sharded gradients and the gathered units in pools of their
    # own reserve more than the one default pool, never less; the live bytes are the same
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a100-80gb")
    config = _config("fsdp1")
    timeline = device_timeline(model=model, config=config, gpu=gpu)
    apart = replay(timeline.events, capacity=BIG, streams=config.sharding.spec.streams(config))
    together = replay(timeline.events, capacity=BIG)
    assert apart.allocated_peak == together.allocated_peak == timeline.peak
    assert apart.peak_reserved > together.peak_reserved
    estimate = estimate_memory(model=model, config=config, gpu=gpu)
    assert estimate.peak_reserved_bytes == apart.peak_reserved
    assert any("gradients on the post_backward stream" in line for line in estimate.assumptions)
