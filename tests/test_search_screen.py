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


# ---- the memo's shortcuts against the memory model's direct evaluation ------------------------------
#: models of every block shape in the catalog: llama (RMSNorm, gated, GQA), gpt2 (LayerNorm, dropout,
#: tied, python gelu), phi-2 (parallel block), mixtral (MoE), t5 (encoder-decoder), bert (encoder),
#: opt (relu), phi-3 (fused qkv), falcon (parallel, fused qkv), a one-layer llama
SHORTCUT_MODELS = ["meta-llama/Llama-2-7b-hf", "gpt2", "microsoft/phi-2", "mistralai/Mixtral-8x7B-v0.1", "t5-large",
                   "bert-base-uncased", "facebook/opt-1.3b", "microsoft/Phi-3-mini-4k-instruct", "tiiuae/falcon-7b"]
SHORTCUT_RECIPES = [
    dict(method="full", precision="bf16-mixed"), dict(method="full", precision="fp32"), dict(method="full", precision="fp16"),
    dict(method="lora", precision="bf16-mixed", lora_r=8), dict(method="lora", precision="bf16", lora_r=64),
    dict(method="lora", precision="fp32", lora_r=16, lora_dropout=0.1),
    dict(method="lora", precision="fp16-mixed", lora_r=16, lora_dropout=0.05, loop="manual", use_cache=True),
    dict(method="qlora", precision="bf16-mixed", lora_r=32), dict(method="qlora", precision="fp32", lora_r=8, packing=False),
    dict(method="qlora", precision="bf16", lora_r=16, fused_ce=True, lora_dropout=0.1),
    dict(method="lora", precision="bf16-mixed", lora_r=8, attention="eager", packing=False),
    dict(method="full", precision="bf16-mixed", zero=2, fused_ce=True, loop="manual"),
    dict(method="lora", precision="bf16-mixed", lora_r=16, zero=3, gpus=2),
]


def _shortcut_configs(model):
    """Each recipe, with LoRA on every linear and on the attention projections only, with and
    without checkpointing, at micro-batches 1 and 3 (a recipe the model refuses is skipped)."""
    from planner.config import ALL_LINEAR, TrainConfig
    from planner.errors import PlannerError
    from planner.search import attention_targets

    for recipe in SHORTCUT_RECIPES:
        targets = [(ALL_LINEAR,), attention_targets(model)] if recipe["method"] != "full" else [None]
        for lora_targets in targets:
            for ckpt in (False, True):
                for micro in (1, 3):
                    try:
                        yield TrainConfig(micro_batch=micro, seq_len=min(256, model.max_seq_len), grad_ckpt=ckpt,
                                          lora_targets=lora_targets, **recipe)
                    except PlannerError:
                        continue


def _shortcut_models():
    import dataclasses

    models = [resolve_model(m) for m in SHORTCUT_MODELS]
    return models + [dataclasses.replace(models[0], num_layers=1, id="llama-one-block")]


@pytest.mark.parametrize("model", _shortcut_models(), ids=lambda m: m.id)
def test_the_memos_batch_totals_are_the_sums_of_batch_terms(model):
    """``step.batch_totals`` (the memo's per-micro-batch moments from the terms' sums) equals
    ``phase_totals`` of ``batch_terms`` (the breakdowns estimate_memory shows), and
    ``activations.step_activations`` (one context per block kind) gives what the separate
    functions give, on the CUDA and CPU kernels."""
    from planner.config import Method
    from planner.memory.activations import (
        activation_breakdown, block_backward_terms, model_level_terms, recompute_bytes, recompute_end_terms,
        step_activations,
    )
    from planner.memory.dtypes import mode_of
    from planner.memory.parameters import trained
    from planner.memory.shapes import dims_of
    from planner.memory.step import batch_phase_totals, batch_terms, batch_totals

    checked = 0
    for config in _shortcut_configs(model):
        if config.lora_dropout and (model.is_moe or model.is_encoder_decoder):
            continue  # input_needs_grad knows no router / cross-attention linear (a known gap)
        targets = trained(model, config).target_names if config.method is not Method.FULL else None
        for gpu in ("a10g", "cpu"):
            kernels = get_gpu(gpu).kernels
            assert batch_totals(model, config, kernels, targets) == batch_phase_totals(
                batch_terms(model, config, kernels, targets)), (config.label(), gpu)
            if model.is_encoder_decoder:
                continue
            step = step_activations(model, config, kernels, targets)
            dims = dims_of(model, config)
            assert step.saved() == activation_breakdown(model, config, kernels=kernels, targets=targets)
            assert step.saved_bytes() == sum(step.saved().values())
            assert step.level == model_level_terms(model, config, dims, mode_of(config), kernels)
            assert step.recompute == recompute_bytes(model, config, kernels, targets)
            assert step.block_backward == block_backward_terms(model, config, kernels, targets)
            assert step.recompute_end == recompute_end_terms(model, config, kernels, targets)
            checked += 1
    assert checked or model.is_encoder_decoder


def test_the_screens_process_total_is_the_reserves():
    """``reserve.process_total`` (the peak-independent part added once per configuration) gives
    ``reserved_and_total``'s process total to the byte, over peaks around and far from the static
    bytes and with paged states."""
    from planner.memory.reserve import peak_independent, process_total, reserved_and_total

    for model_id in ("meta-llama/Llama-2-7b-hf", "gpt2", "t5-large"):
        model = resolve_model(model_id)
        for gpu_name in ("a10g", "t4", "h100"):
            gpu = get_gpu(gpu_name)
            for paged in (0, 123_456_789):
                fixed = peak_independent(model, gpu, paged=paged)
                for static in (0, 7 * GiB + 12_345):
                    for peak in (0, 1, static - 1, static, static + 1, static + 21, 3 * GiB + 7, 19 * GiB + 333):
                        peak = max(peak, 0)
                        assert process_total(peak, static=static, fixed=fixed) == reserved_and_total(
                            model, gpu, peak=peak, static=static, paged=paged)[1]
