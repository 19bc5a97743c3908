"""The other policy's first plan settled before its rounds end (``planner.ranking._Settling``) is the
first plan its rounds end with: ``_replayed_plans(first=True)`` against the same call made in full,
over requests whose alternatives replay many plans that run out, and the property of the throughput
model the settling reads (a paged plan is fastest with no paging)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Precision
from planner.estimation import default_seq_len
from planner.gpus import get_gpu
from planner.ranking import _exotic, _plan_facts, _ranking, _replayed_plans, _Settling
from planner.search import SearchSpace, screen
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
