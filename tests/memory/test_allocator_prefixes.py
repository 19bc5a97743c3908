"""``ReplayPrefixes``: a replay that resumes from the state another replay kept at a fork point of
its timeline (``Timeline.forks``) gives what the whole replay gives, every field, on plans of
other models, methods, ZeRO stages, checkpointing and allocator settings, on budgets where the
allocator runs out; and a copy of a replay under way replays on as the original does."""

from __future__ import annotations

import dataclasses

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.allocator import AllocatorConfig, OutOfMemory, ReplayPrefixes, _Replaying, replay
from planner.memory.estimate import device_timeline, replay_capacity

GiB = 1024**3
LORA = dict(method="lora", precision="bf16", micro_batch=2, seq_len=1024, lora_r=8, grad_accum=4, grad_ckpt=True)
QLORA = dict(method="qlora", precision="bf16-mixed", micro_batch=4, seq_len=512, lora_r=16)
#: in pairs that part at a fork: the optimizer only (the first step's optimizer step), the
#: weights' precision (the model states), and plans that share nothing
CONFIGS = [
    TrainConfig(**LORA, optimizer="adamw_fused"),
    TrainConfig(**LORA, optimizer="adamw_8bit"),
    TrainConfig(**QLORA, optimizer="adamw_fused"),
    TrainConfig(**{**QLORA, "precision": "bf16"}, optimizer="adamw_fused"),
    TrainConfig(**QLORA, optimizer="adamw_8bit"),
    TrainConfig(**{**QLORA, "alloc_conf": "max_split_size_mb:128"}, optimizer="adamw_8bit"),
    TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=1024, grad_ckpt=True),
    TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=1024, grad_ckpt=True, optimizer="adamw_8bit"),
    TrainConfig(method="full", precision="bf16-mixed", micro_batch=2, seq_len=1024, gpus=2, zero=2),
    TrainConfig(method="full", precision="bf16-mixed", micro_batch=2, seq_len=1024, gpus=2, zero=3),
    TrainConfig(method="full", precision="bf16", micro_batch=4, seq_len=1024, alloc_conf="expandable_segments:True"),
    TrainConfig(method="full", precision="bf16", micro_batch=4, seq_len=1024, optimizer="adamw_8bit",
                alloc_conf="expandable_segments:True"),
    # FSDP1 on 2 GPUs: two side streams' pools (unshard, post-backward), a pair parting at the optimizer
    TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=1024, grad_ckpt=True, gpus=2, sharding="fsdp1"),
    TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=1024, grad_ckpt=True, gpus=2, sharding="fsdp1",
                optimizer="sgd"),
    # FSDP2: the reduce-scatter stream's pool
    TrainConfig(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=1024, lora_r=8, gpus=2, sharding="fsdp2"),
]


def _whole(timeline, config, capacity):
    return replay(timeline.events, capacity=capacity, config=AllocatorConfig.parse(config.alloc_conf),
                  streams=config.sharding.spec.streams(config))


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"])
@pytest.mark.parametrize("share", [1.0, 0.55])
def test_resumed_replays_are_the_whole_replays(model_id, share, monkeypatch):
    model, gpu = resolve_model(model_id), get_gpu("a10g")
    plans = []
    for config in CONFIGS:
        timeline = device_timeline(model=model, config=config, gpu=gpu)
        # the device's memory, and a budget at about half the step's peak: the allocator runs out
        budget = gpu.memory_bytes if share == 1.0 else int(timeline.peak * share)
        plans.append((config, timeline, replay_capacity(timeline, config, gpu, budget)))
    expected = [_whole(timeline, config, capacity) for config, timeline, capacity in plans]
    replayed = _counting_advances(monkeypatch)
    prefixes, got = ReplayPrefixes(), []
    for config, timeline, capacity in plans:
        replayed.append(0)
        got.append(replay(timeline.events, capacity=capacity, config=AllocatorConfig.parse(config.alloc_conf),
                          streams=config.sharding.spec.streams(config), forks=timeline.forks, prefixes=prefixes))
    assert [dataclasses.asdict(r) for r in got] == [dataclasses.asdict(r) for r in expected]
    assert any(r.out_of_memory for r in got) == (share < 1)
    # the second of a pair that differs in the optimizer only resumed at the first step's optimizer step
    lora, lora_8bit = plans[0][1], plans[1][1]
    assert lora.events[:lora.forks[-1]] == lora_8bit.events[:lora.forks[-1]]
    if share == 1.0:
        assert replayed[1] == len(lora_8bit.events) - lora.forks[-1]
        assert replayed[0] == len(lora.events)


def test_a_copy_replays_on_as_the_original():
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a10g")
    for config in (CONFIGS[2], CONFIGS[5], CONFIGS[9], CONFIGS[10], CONFIGS[12], CONFIGS[14]):
        timeline = device_timeline(model=model, config=config, gpu=gpu)
        events, capacity = timeline.events, replay_capacity(timeline, config, gpu)
        freed = {event[4] for event in events if event[0] == "free"}
        for cut in (*timeline.forks, len(events) // 2):
            state = _Replaying(capacity, AllocatorConfig.parse(config.alloc_conf), config.sharding.spec.streams(config))
            state.advance(events[:cut], freed, None)
            copy = state.copy()
            for one in (state, copy):
                one.advance(events[cut:], freed, None)
            assert copy.result() == state.result() == _whole(timeline, config, capacity)
            for small in (True, False):
                assert copy.allocator.cached_keys(small) == state.allocator.cached_keys(small)
            assert (copy.allocator.reserved, copy.allocator.allocated) == (state.allocator.reserved,
                                                                           state.allocator.allocated)
            assert not set(map(id, copy.allocator._cached.values())) & set(map(id, state.allocator._cached.values()))
            # each side stream's allocator copied once, its keys sharing the copy as they share the original
            assert copy.sides.keys() == state.sides.keys()
            for key, side in state.sides.items():
                assert copy.sides[key] is not side
                assert [copy.sides[k] is copy.sides[key] for k in state.sides] == [
                    state.sides[k] is side for k in state.sides]
                assert [copy.sides[key].cached_keys(small) for small in (True, False)] == [
                    side.cached_keys(small) for small in (True, False)]
                assert copy.sides[key].reserved == side.reserved


@pytest.mark.parametrize("share", [1.0, 0.55])
def test_a_replay_of_events_replayed_before_or_of_a_prefix_that_ran_out_advances_no_event(share, monkeypatch):
    """The same timeline again (a fp16-mixed plan's is its bf16-mixed twin's), and a timeline that
    parts from one that ran out only after the event it ran out at (the optimizer's states, after a
    first step that does not fit), are answered from what the first came to."""
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a10g")
    first, second = CONFIGS[0], CONFIGS[1]  # (they part at the first step's optimizer step)
    timelines = [device_timeline(model=model, config=config, gpu=gpu) for config in (first, second)]
    capacity = replay_capacity(timelines[0], first, gpu, gpu.memory_bytes if share == 1.0 else timelines[0].peak // 2)
    expected = [_whole(timeline, config, capacity) for timeline, config in zip(timelines, (first, second))]
    replayed = _counting_advances(monkeypatch)
    prefixes = ReplayPrefixes()
    for timeline in (timelines[0], timelines[0], timelines[1]):
        replayed.append(0)
        got = replay(timeline.events, capacity=capacity, config=AllocatorConfig(), forks=timeline.forks,
                     prefixes=prefixes, measure=False)
        assert got == (None if expected[timeline is timelines[1]].out_of_memory else expected[timeline is timelines[1]])
    assert replayed[1] == 0
    if share < 1:
        assert replayed[2] == 0 and expected[0].out_of_memory and expected[1].out_of_memory
    else:
        assert replayed[2] == len(timelines[1].events) - timelines[0].forks[-1]


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"])
@pytest.mark.parametrize("share", [0.45, 0.55, 0.7])
def test_where_a_prefix_runs_out_does_not_read_what_the_rest_of_its_timeline_frees(model_id, share):
    """``ReplayPrefixes``' ran-out table is keyed by a prefix's events alone: replayed with the
    timeline's frees or with only those made inside the prefix (every allocation live at its end
    then never freed, the blocks ``malloc_tensors`` does not make), a prefix runs out at the same
    event, with the same reserve, or at none."""
    model, gpu = resolve_model(model_id), get_gpu("a10g")
    outcomes = set()
    for config in CONFIGS:
        timeline = device_timeline(model=model, config=config, gpu=gpu)
        capacity = replay_capacity(timeline, config, gpu, int(timeline.peak * share))
        settings, streams = AllocatorConfig.parse(config.alloc_conf), config.sharding.spec.streams(config)
        freed = {event[4] for event in timeline.events if event[0] == "free"}
        for fork in (*timeline.forks, len(timeline.events)):
            prefix = timeline.events[:fork]
            inside = {event[4] for event in prefix if event[0] == "free"}
            ran = []
            for frees in (freed, inside):
                state = _Replaying(capacity, settings, streams)
                try:
                    state.advance(prefix, frees, None)
                    ran.append((None, state.allocator.reserved, state.allocator.peak_reserved))
                except OutOfMemory as error:
                    ran.append((error.where, state.allocator.reserved, state.allocator.peak_reserved))
            assert ran[0] == ran[1], (config.label(), fork)
            outcomes.add(ran[0][0] is None)
    assert outcomes == {True, False}


def _counting_advances(monkeypatch) -> list[int]:
    """The events each replay advances through: the caller appends a 0 before each replay."""
    replayed: list[int] = []
    advance = _Replaying.advance

    def counted(self, events, *args):
        replayed[-1] += len(events)
        return advance(self, events, *args)

    monkeypatch.setattr(_Replaying, "advance", counted)
    return replayed
