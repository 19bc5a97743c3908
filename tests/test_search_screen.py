"""The search's screen finds, per combination, what a scan of every split finds.

``_fit_and_miss`` bisects the accumulating splits instead of evaluating each; these tests compare
it with ``totals_by_split`` (every split evaluated, the exact reference the timeline tests pin)
on requests that exercise each branch: fits at every split, at none, host RAM over --cpu-mem,
one split only, the cpu profile (no caching allocator) and many GPUs."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.gpus import get_gpu
from planner.search import MemoryMemo, SearchSpace, _combinations, _fit_and_miss, safety_margin, totals_by_split

GiB = 1024**3


def _scan(totals, usable, cpu_mem):
    """The reference: walk the splits in order, keep the last that fits and the first smallest miss."""
    fit = miss = None
    for i, (total, host) in enumerate(totals):
        if total > usable or host > cpu_mem:
            if miss is None or total < miss[0]:
                miss = (total, i)
        else:
            fit = (total, i)
    return fit, miss


REQUESTS = [
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, 4096, 1, 24 * GiB),   # the bench request
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, 4096, 1, 1 * GiB),    # offload over host RAM
    ("meta-llama/Llama-2-7b-hf", "t4", 1, 2048, 1, 64 * GiB),      # one split only
    ("Qwen/Qwen2.5-1.5B", "cpu", 12, 512, 1, 8 * GiB),             # no caching allocator
    ("mistralai/Mistral-7B-v0.1", "a100-80gb", 64, 2048, 4, 256 * GiB),
    ("gpt2", "h100", 48, 1024, 1, 64 * GiB),                       # everything fits
]
#: (some split fits, some split misses) per combination, by request
OUTCOMES: dict[int, set] = {}


@pytest.mark.parametrize("n", range(len(REQUESTS)))
def test_screen_equals_a_scan_of_every_split(n):
    model_id, gpu_name, batch, seq, gpus, cpu_mem = REQUESTS[n]
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    memo = MemoryMemo(model, gpu)
    space = SearchSpace(cpu_mem_bytes=cpu_mem)
    outcomes = set()
    for base, splits in _combinations(model=model, gpu=gpu, target_batch=batch, seq_len=seq, gpus=gpus, space=space):
        expected = _scan(totals_by_split(model=model, config=base, gpu=gpu, splits=splits, memo=memo), usable, cpu_mem)
        got = _fit_and_miss(model=model, config=base, gpu=gpu, splits=splits, memo=memo, usable=usable, cpu_mem=cpu_mem)
        assert got == expected, base.label()
        outcomes.add((expected[0] is not None, expected[1] is not None))
    OUTCOMES[n] = outcomes


def test_the_requests_cover_every_outcome():
    """Combinations that fit at every split, at some, and at none were all compared."""
    if len(OUTCOMES) < len(REQUESTS):
        for n in range(len(REQUESTS)):
            test_screen_equals_a_scan_of_every_split(n)
    assert set().union(*OUTCOMES.values()) == {(True, False), (True, True), (False, True)}


def test_a_plan_the_replay_finds_too_large_gives_way_to_its_next_smaller_split():
    """QLoRA r8 on Llama-2-7b at seq 4096, micro-batch 4 x 8: the screen's flat allocator overhead
    says it fits an A10G (about 20.0 GiB of 21.4 usable), the allocator replay says it does not
    (about 22.3 GiB). The plan shown is the same configuration at micro-batch 2 x 16, not nothing."""
    from planner.config import TrainConfig
    from planner.memory import estimate_memory
    from planner.search import MemoryMemo, _next_smaller_split, _replayed_plans

    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    memo = MemoryMemo(model, gpu)
    big = TrainConfig(method="qlora", precision="bf16-mixed", micro_batch=4, grad_accum=8, seq_len=4096, grad_ckpt=True,
                      lora_r=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    [(screened, _)] = totals_by_split(model=model, config=big, gpu=gpu, splits=[(4, 8)], memo=memo)
    assert screened <= usable < estimate_memory(model=model, config=big, gpu=gpu).process_total_bytes
    item = _next_smaller_split(big, model=model, gpu=gpu, memo=memo)
    assert (item[0].micro_batch, item[0].grad_accum) == (2, 16)
    [plan] = _replayed_plans([(big, None, screened)], model=model, gpu=gpu, usable=usable, top_k=1, memo=memo)
    assert plan.config == big.with_split(micro_batch=2, grad_accum=16)
    assert plan.memory.process_total_bytes <= usable
    # micro-batch 1 has no smaller split
    assert _next_smaller_split(big.with_split(micro_batch=1, grad_accum=32), model=model, gpu=gpu, memo=memo) is None
