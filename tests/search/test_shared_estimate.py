"""``shared_estimate`` is ``estimate_memory``: inside ``shared_terms`` it reuses the timeline and the
allocator replay other devices computed, and every estimate must equal the one made from scratch,
on devices of other kernels, workspaces and memory, on budgets where the allocator runs out and
must release its cache (the replay of unlimited memory does not hold there), and with the
allocator settings that change what it does when full."""

from __future__ import annotations

import contextlib

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.allocator import UNLIMITED, AllocatorConfig, replay
from planner.memory.estimate import device_timeline
from planner.search import _SHARED_TERMS, _Estimated, shared_estimate, shared_terms

GiB = 1024**3
#: sm90 (32 MiB workspaces) and not, 16 to 80 GiB, PCIe and NVLink, and the CPU profile
GPUS = ("a10g", "l4", "t4", "h100", "a100-80gb", "rtx4090", "cpu")
CONFIGS = [
    TrainConfig(method="lora", precision="bf16-mixed", micro_batch=4, seq_len=1024, lora_r=16),
    TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=2048, grad_ckpt=True),
    TrainConfig(method="full", precision="bf16-mixed", micro_batch=2, seq_len=1024, gpus=2, zero=2),
    TrainConfig(method="qlora", precision="bf16-mixed", micro_batch=8, seq_len=512, lora_r=32,
                alloc_conf="max_split_size_mb:128"),
    TrainConfig(method="full", precision="bf16", micro_batch=4, seq_len=1024, alloc_conf="expandable_segments:True"),
]


def _budgets(model, config, gpu) -> list[int]:
    """The device's memory, and budgets around the step's allocated peak: where the allocator
    has to release cached blocks to go on, and where nothing it releases makes room."""
    peak = device_timeline(model=model, config=config, gpu=gpu).peak
    return [peak // 2, int(peak * 1.02) + 2 * GiB, int(peak * 1.1) + 2 * GiB, gpu.memory_bytes]


@pytest.mark.parametrize(("model_id", "configs"), [("meta-llama/Llama-3.2-1B", CONFIGS), ("t5-large", CONFIGS[:2]),
                                                  pytest.param("Qwen/Qwen3-30B-A3B", CONFIGS[:1],
                                                               marks=pytest.mark.slow)])  # (an MoE: a minute)
def test_a_shared_estimate_is_the_estimate_made_from_scratch(model_id, configs):
    model = resolve_model(model_id)
    cases = [(config, get_gpu(name), budget) for config in configs for name in GPUS
             for budget in _budgets(model, config, get_gpu(name))]
    alone = [estimate_memory(model=model, config=config, gpu=gpu, budget=budget) for config, gpu, budget in cases]
    with shared_terms(model):
        shared = [shared_estimate(model=model, config=config, gpu=gpu, budget=budget) for config, gpu, budget in cases]
        kept = [e for e in _SHARED_TERMS.get().timelines.values() if isinstance(e, _Estimated)]
    assert shared == alone
    assert any(e.clean for e in kept)  # (a replay was reused)
    assert any("runs out of device memory" in " ".join(e.assumptions) for e in alone)


@pytest.mark.parametrize("conf", [None, "max_split_size_mb:128", "expandable_segments:True"])
def test_the_replay_of_unlimited_memory_is_the_replay_on_any_capacity_its_peak_reserve_fits(conf):
    """What ``shared_estimate`` reuses (its docstring has the argument from the allocator's code)."""
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a10g")
    config = TrainConfig(method="full", precision="bf16", micro_batch=4, seq_len=1024, alloc_conf=conf)
    timeline = device_timeline(model=model, config=config, gpu=gpu)
    settings = AllocatorConfig.parse(conf)
    unlimited = replay(timeline.events, capacity=UNLIMITED, config=settings, streams=config.sharding.spec.streams(config))
    for capacity in (unlimited.peak_reserved, unlimited.peak_reserved + 511, unlimited.peak_reserved + 3 * GiB):
        trace, again = [], []
        found = replay(timeline.events, capacity=capacity, config=settings, streams=config.sharding.spec.streams(config), trace=trace)
        replay(timeline.events, capacity=UNLIMITED, config=settings, streams=config.sharding.spec.streams(config), trace=again)
        assert (found, trace) == (unlimited, again)


@pytest.mark.parametrize("shared", [False, True])
def test_dropping_is_none_exactly_where_the_estimate_is_over_the_budget_because_the_replay_ran_out(shared):
    """``shared_estimate(dropping=True)``: None where the replay on the budget runs out (the
    estimate made from scratch says so and its process total is over the budget, the argument in
    ``allocator.replay``), else the estimate itself."""
    model = resolve_model("meta-llama/Llama-3.2-1B")
    cases = [(config, get_gpu(name), budget) for config in CONFIGS for name in ("a10g", "t4", "cpu")
             for budget in _budgets(model, config, get_gpu(name))]
    alone = [estimate_memory(model=model, config=config, gpu=gpu, budget=budget) for config, gpu, budget in cases]
    with shared_terms(model) if shared else contextlib.nullcontext():
        dropping = [shared_estimate(model=model, config=config, gpu=gpu, budget=budget, dropping=True)
                    for config, gpu, budget in cases]
    for (_, _, budget), whole, found in zip(cases, alone, dropping):
        ran_out = "runs out of device memory" in " ".join(whole.assumptions)
        assert found == (None if ran_out else whole)
        assert not ran_out or whole.process_total_bytes > budget
    assert None in dropping


@pytest.mark.parametrize("conf", [None, "max_split_size_mb:128", "expandable_segments:True"])
def test_a_replay_not_measured_is_none_where_the_measured_one_ran_out(conf):
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a10g")
    config = TrainConfig(method="full", precision="bf16", micro_batch=4, seq_len=1024, alloc_conf=conf)
    timeline = device_timeline(model=model, config=config, gpu=gpu)
    settings, streams = AllocatorConfig.parse(conf), config.sharding.spec.streams(config)
    outcomes = set()
    for capacity in (timeline.peak // 2, timeline.peak, timeline.peak + GiB, timeline.peak + 4 * GiB):
        measured = replay(timeline.events, capacity=capacity, config=settings, streams=streams)
        found = replay(timeline.events, capacity=capacity, config=settings, streams=streams, measure=False)
        assert found == (None if measured.out_of_memory else measured)
        assert not measured.out_of_memory or measured.peak_reserved > capacity
        outcomes.add(found is None)
    assert outcomes == {True, False}


def test_a_plan_dropped_stops_its_timeline_where_the_replays_shared_ran_out(monkeypatch):
    """Inside ``sharing_prefixes``, a plan that differs from a dropped one in the optimizer only and
    runs out in the same first step is dropped without the rest of its timeline
    (``known_to_run_out``): every answer is the estimate made from scratch, None where that ran out."""
    from planner.memory import timeline as timelines
    from planner.memory.allocator import sharing_prefixes

    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("a10g")
    configs = [TrainConfig(method="qlora", precision="bf16-mixed", micro_batch=8, seq_len=1024, lora_r=16,
                           grad_accum=4, grad_ckpt=True, optimizer=optimizer)
               for optimizer in ("adamw_fused", "adamw_8bit", "adafactor", "sgd", "paged_adamw_8bit")]
    peak = device_timeline(model=model, config=configs[0], gpu=gpu).peak
    abandoned = []
    made = timelines.step_timeline

    def counted(**kwargs):
        found = made(**kwargs)
        abandoned.append(found is None)
        return found

    monkeypatch.setattr("planner.search.step_timeline", counted)
    for budget in (peak // 2, int(peak * 0.9), int(peak * 1.02) + 2 * GiB, gpu.memory_bytes):
        alone = [estimate_memory(model=model, config=config, gpu=gpu, budget=budget) for config in configs]
        with sharing_prefixes():
            dropping = [shared_estimate(model=model, config=config, gpu=gpu, budget=budget, dropping=True)
                        for config in configs]
        for whole, found in zip(alone, dropping):
            ran_out = "runs out of device memory" in " ".join(whole.assumptions)
            assert found == (None if ran_out else whole)
    assert any(abandoned) and not all(abandoned)
