"""The other policy's first plan settled before its rounds end (``planner.ranking._Settling``) is the
first plan its rounds end with: ``_replayed_plans(first=True)`` against the same call made in full,
over requests whose alternatives replay many plans that run out, and the property of the throughput
model the settling reads (a paged plan is fastest with no paging)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Loop, Precision
from planner.estimation import default_seq_len
from planner.gpus import get_gpu
from planner.errors import PlannerError
from planner.ranking import (
    EXOTIC_WIN,
    ROUNDING,
    SPEED_TIE,
    _exotic,
    _plan_facts,
    _ranking,
    _replayed_plans,
    _Settling,
    _split_speed,
)
from planner.search import SearchSpace, divisors, screen
from planner.tradeoffs import Prefer

GiB = 1 << 30

#: (model, GPU, target batch, every precision): the bench request (its alternative replays 17 QLoRA plans at
#: micro-batch 8 that run out, bench/cli_speed.py), and others of other fits and shapes
REQUESTS = [
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, True),
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, False),
    ("meta-llama/Llama-2-7b-hf", "t4", 16, False),
    ("meta-llama/Llama-3.2-1B", "t4", 32, True),
    ("mistralai/Mistral-7B-v0.1", "l4", 8, False),
    ("Qwen/Qwen2.5-1.5B", "a10g", 64, False),
    ("gpt2", "t4", 32, True),
]


def _answers(model_id: str, gpu_name: str, batch: int, every: bool, prefer: Prefer) -> tuple:
    """The first plan of each policy's ``_replayed_plans`` in full, and with ``first`` (as ``suggest``
    asks for its alternative), each on fresh estimates; and whether the settling ended a call early."""
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(Precision) if every else None)
    s = screen(model=model, gpu=gpu, target_batch=batch, seq_len=default_seq_len(model), gpus=1, space=space)
    settled = []
    head = _Settling.head

    def watched(self, ranked, picks):
        found = head(self, ranked, picks)
        settled.append(found is not None)
        return found

    out = []
    for first in (False, True):
        facts = _plan_facts(gpu, _exotic(s.memo, node_ram=space.cpu_mem_bytes, usable=s.usable))
        _Settling.head = watched
        try:
            plans = _replayed_plans(_ranking(s.fitting, prefer, facts, speeds=s.speeds), model=model, gpu=gpu,
                                    usable=s.usable, top_k=3, prefer=prefer, memo=s.memo, facts=facts, speeds=s.speeds,
                                    first=first)
        finally:
            _Settling.head = head
        out.append(plans[0] if plans else None)
    return out[0], out[1], any(settled)


@pytest.mark.parametrize("n", range(len(REQUESTS)))
def test_the_first_plan_settled_is_the_first_plan_of_every_round(n):
    for prefer in Prefer:
        whole, first, settled = _answers(*REQUESTS[n], prefer)
        assert first == whole
        assert not settled or prefer is Prefer.SPEED  # (under fidelity the tiers' bars are read: never settled)
        if n == 0 and prefer is Prefer.SPEED:  # (the bench request's alternative: settled in its second round)
            assert settled


def test_a_paged_plan_is_fastest_with_no_paging():
    """``_Settling`` bounds a plan timed again with its replay's paging by its speed with none:
    ``ThroughputMemo.step_seconds`` only grows with the paged bytes on the host."""
    from planner.throughput import ThroughputMemo

    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    s = screen(model=model, gpu=gpu, target_batch=32, seq_len=2048, gpus=1,
               space=SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(Precision)))
    paged = [item[0] for item in s.fitting if item[3].terms.paged]
    assert paged
    speeds = ThroughputMemo(model, gpu)
    for config in paged[:40]:
        seconds = [speeds.step_seconds(config, host) for host in (0, 1, 1 << 20, 1 << 30, 8 << 30)]
        assert seconds == sorted(seconds), config.label()


#: recipe settings the step time reads (the adapters' dropout and the training loop, packing, the fused loss,
#: reentrant checkpointing, a chunked loss, the expert loop, as transformers 4.36-4.39 indexed it too), each with every
#: default besides, for ``test_a_step_never_takes_longer_at_a_larger_micro_batch``
RECIPES = [{}, {"lora_dropout": 0.1, "loop": Loop.MANUAL}, {"packing": False, "use_cache": True}, {"fused_ce": True},
           {"reentrant_ckpt": True}, {"loss_chunks": 8}, {"experts_loop": True},
           {"experts_loop": True, "experts_list_index": True}]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: "-".join(r) or "defaults")
def test_a_step_never_takes_longer_at_a_larger_micro_batch(recipe):
    """``planner.ranking._split_speed``'s order, which ``_Settling._bound`` reads to time a slot's
    largest splits only: at a fixed per-device batch, ``ThroughputMemo.step_seconds`` (no paging)
    never grows with the micro-batch, over the search's configurations of dense, MoE and small
    models on every catalog GPU (the CPU profile too) at 1, 2 and 8 GPUs."""
    from planner.gpus import list_gpus
    from planner.search import _combinations
    from planner.throughput import ThroughputMemo

    checked = 0
    for model_id in ("meta-llama/Llama-2-7b-hf", "mistralai/Mixtral-8x7B-v0.1", "gpt2"):
        model = resolve_model(model_id)
        for gpu in list_gpus():
            speeds = ThroughputMemo(model, gpu)
            for gpus in (1, 2, 8):
                try:
                    space = SearchSpace(cpu_mem_bytes=512 * GiB, precisions=tuple(Precision), **recipe)
                    combos = list(_combinations(model=model, gpu=gpu, target_batch=16 * gpus, seq_len=1024, gpus=gpus,
                                                space=space))
                except PlannerError:
                    continue  # (a precision the GPU cannot run, a setting the model does not take)
                for base, splits in combos[::11 if not recipe else 31]:
                    seconds = [speeds.step_seconds(base.with_split(micro_batch=m, grad_accum=a)) for m, a in splits]
                    checked += len(seconds)
                    assert all(later <= earlier * (1 + ROUNDING) for earlier, later in zip(seconds, seconds[1:])), \
                        (gpu.name, gpus, base.label(), seconds)
    assert checked > 10_000


def _bound_in_full(settling: _Settling, others: list[tuple], floor: float, bar: float, group: dict) -> bool:
    """``_Settling._bound`` by its definition: every plan's every smaller split timed (and its own, where
    it is a plan not near the edge with paged states), none left out by speed."""
    for f, main in others:
        item = f[0]
        config = item[0]
        paged = (item[3] if len(item) > 3 else settling._memo.static(config)).terms.paged
        top = config.micro_batch - (0 if main and paged else 1)
        per_device = config.micro_batch * config.grad_accum
        exotic = f[2] and (not config.sharding.offloaded or config.grad_accum > 1)
        for micro in (m for m in divisors(per_device) if m <= top):
            speed = _split_speed(settling._speeds, config, micro, per_device)
            if speed >= floor and (not exotic or speed > bar) and (micro == config.micro_batch or speed not in group.get(
                    config.with_split(micro_batch=micro, grad_accum=per_device // micro), ())):
                return True
    return False


@pytest.mark.parametrize("n", [0, 2, 3, 6])
def test_the_bound_leaves_out_no_split_that_joins(n):
    """``_Settling._bound`` times a slot's splits from the largest down, and none of a slot or a plan
    whose own speed is under the floor (``_split_speed``'s order): it answers as every split timed
    would, at the first group's floor of the request's ranking under ``speed`` and at lower floors
    (where plans join)."""
    model_id, gpu_name, batch, every = REQUESTS[n]
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(Precision) if every else None)
    s = screen(model=model, gpu=gpu, target_batch=batch, seq_len=default_seq_len(model), gpus=1, space=space)
    facts = _plan_facts(gpu, _exotic(s.memo, node_ram=space.cpu_mem_bytes, usable=s.usable))
    ranked = _ranking(s.fitting, Prefer.SPEED, facts, speeds=s.speeds)
    rows = ranked._by_speed
    top_floor = -rows[0][1] / (1 + SPEED_TIE)
    end = next((i for i, row in enumerate(rows) if row[0] != rows[0][0] or -row[1] < top_floor), len(rows))
    group: dict = {}
    for row in rows[:end]:
        group.setdefault(row[3][0][0], set()).add(row[3][5])
    others = [(row[3], row[0] < 8) for row in rows[end:]] + [(f, False) for f in ranked._near]
    settling = _Settling(None, speeds=s.speeds, memo=s.memo, replays={}, usable=s.usable, capacity=gpu.memory_bytes)
    bar = ranked._fastest[0] * (1 + EXOTIC_WIN)
    answers = set()
    for scale in (1.0, 0.99, 0.95, 0.8, 0.5):
        floor = top_floor * scale
        whole = _bound_in_full(settling, others, floor, bar, group)
        assert settling._bound(others, floor, bar, group) == whole, scale
        answers.add(whole)
        for other in others:  # (each plan alone: one that joins is not hidden by another that does)
            alone = _bound_in_full(settling, [other], floor, bar, group)
            assert settling._bound([other], floor, bar, group) == alone, (scale, other[0][0].label())
            answers.add(alone)
    assert answers == {False, True}  # (the floors both settle and do not)


@pytest.mark.parametrize("n", [0, 1, 3, 6])
def test_the_screens_speeds_are_the_step_times_the_bound_would_take(n):
    """``_Settling._bound`` reads the speeds the screen took with no paging (``MemoryMemo.speeds_at``, by the
    knob class the screen gave the plan's optimizer and sharding, its adapters, checkpointing and split) in
    place of ``_split_speed``: each is ``_split_speed`` of every fitting plan of that slot at that split."""
    model_id, gpu_name, batch, every = REQUESTS[n]
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(Precision) if every else None)
    s = screen(model=model, gpu=gpu, target_batch=batch, seq_len=default_seq_len(model), gpus=1, space=space)
    micro_of = {i: micro for micro, i in s.memo.split_index.items()}
    slots: dict = {}  # (row, knob class, variant, checkpointing) -> [(split index, speed)] with no paging
    for row_key, (speeds, _, _) in s.memo.speeds_at.items():
        for (timing, v, ckpt, split, paging), speed in speeds.items():
            if not paging:
                slots.setdefault((row_key, timing, v, ckpt), []).append((split, speed))
    checked = 0
    for item in s.fitting:
        config = item[0]
        row_key = (config.method, config.precision)
        speeds, variants, classes = s.memo.speeds_at[row_key]
        key = (row_key, classes[config.optimizer, config.sharding], variants[config.lora_r, config.lora_targets],
               int(config.grad_ckpt))
        per_device = config.micro_batch * config.grad_accum
        for split, speed in slots.get(key, ()):
            assert speed.tokens_per_s == _split_speed(s.speeds, config, micro_of[split], per_device), config.label()
            checked += 1
    assert checked > 100
