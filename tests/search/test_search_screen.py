"""The search's screen finds, per combination, what a scan of every split finds.

``_fit_and_miss`` (``MemoryMemo.fit_and_miss``) bisects the accumulating splits instead of evaluating each; these tests compare
it with ``totals_by_split`` (every split evaluated, the exact reference the timeline tests pin)
on requests that exercise each branch: fits at every split, at none, host RAM over --cpu-mem,
one split only, the cpu profile (no caching allocator) and many GPUs."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Precision
from planner.gpus import get_gpu
from planner.search import MemoryMemo, SearchSpace, _combinations, safety_margin, totals_by_split

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
        got = memo.fit_and_miss(base, splits, usable=usable, cpu_mem=cpu_mem)
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
    """QLoRA r8 on Llama-2-7b at seq 4096, micro-batch 4 x 8, on an A10G: allocated peak 18.57 GiB,
    with the 0.5 GiB context 19.07 GiB. Handed to the replay with 19.5 GiB usable, the allocator
    cannot place its step there (it reserves 20.06 GiB on the whole device: the blocks its step
    needs do not fit in 19.0 GiB even with every cached segment released), so the replay finds
    it too large; the plan shown is the same configuration at micro-batch 2 x 16, not nothing.
    (On the A10G's own 21.4 GiB usable it fits: the replay places each tensor at its size.)"""
    from planner.config import TrainConfig
    from planner.memory import estimate_memory
    from planner.ranking import _next_smaller_split, _replayed_plans
    from planner.search import MemoryMemo

    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    usable = int(19.5 * 2**30)
    memo = MemoryMemo(model, gpu)
    big = TrainConfig(method="qlora", precision="bf16-mixed", micro_batch=4, grad_accum=8, seq_len=4096, grad_ckpt=True,
                      lora_r=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    [(screened, _)] = totals_by_split(model=model, config=big, gpu=gpu, splits=[(4, 8)], memo=memo)
    memory = estimate_memory(model=model, config=big, gpu=gpu, budget=usable)
    assert memory.peak_allocated_bytes + int(gpu.cuda_context_bytes) <= usable < memory.process_total_bytes
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
    # litgpt's loss: 16-bit, in pieces
    dict(method="lora", precision="bf16", lora_r=8, loss_upcast=False, loss_chunks=4, loop="manual"),
    # the eval pass (planner/memory/evaluation.py; not modelled for encoder-decoders, no generation
    # for encoders: those are skipped)
    dict(method="full", precision="bf16-mixed", eval_batch=4, generate_tokens=16),
    dict(method="lora", precision="fp32", lora_r=8, eval_batch=2, eval_seq_len=64),
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
                    if "eval_batch" in recipe and (model.is_encoder_decoder
                                                   or (model.is_encoder and recipe.get("generate_tokens"))):
                        continue
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
    ``batch_moments`` of ``batch_terms`` (the breakdowns estimate_memory shows), and
    ``activations.step_activations`` (one context per block kind) gives what the separate
    functions give, on the CUDA and CPU kernels."""
    from planner.config import Method
    from planner.memory.activations import (
        block_backward_terms,
        model_level_terms,
        recompute_end_terms,
        step_activations,
    )
    from planner.memory.dtypes import mode_of
    from planner.memory.parameters import trained
    from planner.memory.saved import activation_breakdown, recompute_bytes
    from planner.memory.shapes import dims_of
    from planner.memory.step import batch_moments, batch_terms, batch_totals

    checked = 0
    for config in _shortcut_configs(model):
        targets = trained(model, config).target_names if config.method is not Method.FULL else None
        for gpu in ("a10g", "cpu"):
            kernels = get_gpu(gpu).kernels
            assert batch_totals(model, config, kernels, targets) == batch_moments(
                batch_terms(model, config, kernels, targets).sizes()), (config.label(), gpu)
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


def test_largest_peak_is_the_last_peak_whose_total_is_usable():
    """``reserve.largest_peak``: its total is usable and one byte more is not, below and above the
    static bytes (where the fragmentation's share starts), at the edge where only the fixed part
    fits, and -1 when not even that fits. Hand-derived case: fixed 100, static 1,000, usable
    2,150: a peak of 2,000 totals 2,000 + 100 + int(0.05 x 1,000) = 2,150, and 2,001 totals 2,151."""
    from planner.memory.reserve import largest_peak, process_total

    assert largest_peak(2_150, static=1_000, fixed=100) == 2_000
    assert largest_peak(99, static=1_000, fixed=100) == -1
    assert largest_peak(100, static=1_000, fixed=100) == 0
    assert largest_peak(1_100, static=1_000, fixed=100) == 1_000  # the static bytes: no fragmentation yet
    for static in (0, 1, 7 * GiB + 12_345, 20 * GiB):
        for fixed in (0, 1_234_567, 2 * GiB + 1):
            for usable in (fixed, fixed + static, fixed + static + 19, 21 * GiB + 333, 22 * GiB, 80 * GiB - 1):
                peak = largest_peak(usable, static=static, fixed=fixed)
                assert peak >= 0 and process_total(peak, static=static, fixed=fixed) <= usable
                assert process_total(peak + 1, static=static, fixed=fixed) > usable


#: requests whose spaces hold every key rule: QLoRA over precisions, ZeRO-1/2 on one GPU and on
#: two, offload, a model with a tied head (gpt2), the CPU (no paging, no caching allocator)
KEY_REQUESTS = [("meta-llama/Llama-2-7b-hf", "a10g", 1), ("gpt2", "t4", 2), ("Qwen/Qwen2.5-1.5B", "cpu", 1),
                ("microsoft/phi-2", "h100", 1)]


@pytest.mark.parametrize("model_id,gpu_name,gpus", KEY_REQUESTS)
def test_configurations_of_one_static_key_have_equal_terms(model_id, gpu_name, gpus):
    """The memo's static key (``search._static_key``) leaves out what the static terms do not read
    (the precision beyond a weight's bytes and DeepSpeed's communication dtype, ZeRO-2 against
    ZeRO-1 on one GPU): every configuration of every precision that shares a key has the same
    ``static_terms``, computed directly, and the keys do merge configurations (else the test
    would prove nothing)."""
    from planner.config import Precision
    from planner.memory.states import static_terms
    from planner.search import _static_key

    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=512 * GiB, precisions=tuple(Precision))
    first: dict[tuple, tuple] = {}
    merged = 0
    for base, _ in _combinations(model=model, gpu=gpu, target_batch=4 * gpus, seq_len=256, gpus=gpus, space=space):
        terms = static_terms(model, base, gpu.kernels)
        key = _static_key(base)
        if key in first:
            assert terms == first[key][1], (base.label(), first[key][0].label())
            merged += first[key][0].precision != base.precision or first[key][0].zero != base.zero
        else:
            first[key] = (base, terms)
    assert merged


@pytest.mark.parametrize("model_id,gpu_name,gpus", KEY_REQUESTS)
def test_the_keys_the_screen_makes_are_the_memo_keys(model_id, gpu_name, gpus):
    """``_screen`` looks a combination's terms up by its knobs' prefixes with the adapter variant's
    rank and targets (and checkpointing) appended: those are ``_static_key`` and ``_batch_key`` of
    the combination, for every precision, method, sharding and adapter variant."""
    from planner.config import Precision
    from planner.search import _batch_key, _rows, _static_key

    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=512 * GiB, precisions=tuple(Precision))
    rows = _rows(model=model, gpu=gpu, target_batch=4 * gpus, seq_len=256, gpus=gpus, space=space)
    checked = 0
    for row in rows:
        for v, lora in enumerate(row.variants):
            for knobs in row.knobs:
                base = knobs.variant(lora, v == 0)
                ckpt = base.with_split(micro_batch=base.micro_batch, grad_accum=1, grad_ckpt=True)
                assert knobs.static_prefix + lora == _static_key(base) == _static_key(ckpt), base.label()
                assert knobs.batch_prefix + lora + (False,) == _batch_key(base), base.label()
                assert knobs.batch_prefix + lora + (True,) == _batch_key(ckpt), base.label()
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("n", [0, 1, 4])
def test_the_screen_shares_results_only_between_equal_terms(n):
    """``_screen`` screens once per value of the terms (the memo hands out one object per value):
    its fitting plans and each family's closest miss are what screening every combination with a
    memo of its own finds; after the fits come, in their order, the near-the-edge fits' largest
    safe splits, what a scan of every smaller split finds."""
    from planner.search import _rows, _screen, family_label, safe_bound

    model_id, gpu_name, batch, seq, gpus, cpu_mem = REQUESTS[n]
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    space = SearchSpace(cpu_mem_bytes=cpu_mem, precisions=tuple(Precision))
    combinations = list(_combinations(model=model, gpu=gpu, target_batch=batch, seq_len=seq, gpus=gpus, space=space))
    rows = _rows(model=model, gpu=gpu, target_batch=batch, seq_len=seq, gpus=gpus, space=space)
    fitting, closest, searched = _screen(rows, combinations[0][1], model=model, gpu=gpu, memo=MemoryMemo(model, gpu),
                                         usable=usable, cpu_mem=cpu_mem)
    fits, misses = [], {}
    for base, splits in combinations:
        fit, miss = MemoryMemo(model, gpu).fit_and_miss(base, splits, usable=usable, cpu_mem=cpu_mem)
        if fit is not None:
            fits.append((base.with_split(micro_batch=splits[fit[1]][0], grad_accum=splits[fit[1]][1]), fit[0]))
        if miss is not None and (family_label(base) not in misses or miss[0] < misses[family_label(base)][0]):
            misses[family_label(base)] = (miss[0], base.with_split(micro_batch=splits[miss[1]][0], grad_accum=splits[miss[1]][1]))
    safes = []
    for config, total in fits:
        if total <= safe_bound(config.method, gpu) or config.micro_batch == 1:
            continue
        per_device = config.micro_batch * config.grad_accum
        smaller = [(m, per_device // m) for m in range(config.micro_batch - 1, 0, -1) if per_device % m == 0]
        for (micro, accum), (safe, _) in zip(smaller, totals_by_split(model=model, config=config, gpu=gpu,
                                                                       splits=smaller)):
            if safe <= safe_bound(config.method, gpu):
                safes.append((config.with_split(micro_batch=micro, grad_accum=accum), safe))
                break
    assert [(config, total) for config, _, total, _ in fitting] == fits + safes
    assert safes or n == 1  # (the offload request's fits are far from the edge)
    assert closest == misses
    assert searched == sum(len(splits) for _, splits in combinations)


def test_the_fixed_bytes_of_a_device_are_its_part_plus_the_paged_states():
    """``_screen_tables`` shares a search's static terms with another device's where the two add
    the same fixed bytes without paged states: it takes ``peak_independent`` to be the device's
    part plus the paged bytes, whatever they are."""
    from planner.memory.reserve import peak_independent

    model = resolve_model("meta-llama/Llama-2-7b-hf")
    for name in ("a10g", "h100", "mi300x", "cpu"):
        gpu = get_gpu(name)
        for gpus in (1, 2, 8):
            part = peak_independent(model, gpu, paged=0, gpus=gpus)
            assert [peak_independent(model, gpu, paged=p, gpus=gpus) - part for p in (1, 4096, 3 * GiB)] == [1, 4096, 3 * GiB]


def test_searches_sharing_their_screens_answer_as_each_alone():
    """Inside ``shared_terms`` searches of the same rows share batch lines (kernels alike), static
    terms (fixed bytes alike: a10g, l4, l40s and a40 at one GPU) and screenings (budgets alike: l40s
    and a40 have the same memory), and rows (the same space at each GPU count); every answer,
    its misses and its candidate count included, is the one the search gives alone."""
    import dataclasses

    from planner import search
    from planner.ranking import suggest

    model = resolve_model("meta-llama/Llama-2-7b-hf")
    # every precision but fp8, which only l4 and l40s have: with it their rows would differ from the
    # others' and l40s could not share a40's screenings
    space = SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(p for p in Precision if p is not Precision.FP8))
    runs = [(name, gpus) for gpus in (1, 2) for name in ("a10g", "l4", "l40s", "a40")]

    def answers():
        out = []
        for name, gpus in runs:
            s = dataclasses.replace(space, cpu_mem_bytes=space.cpu_mem_bytes * gpus)
            out.append(suggest(model=model, gpu=get_gpu(name), target_batch=16, seq_len=1024, gpus=gpus, space=s,
                               top_k=3).to_dict())
        return out

    alone = answers()
    with search.shared_terms(model):
        together = answers()
        shared = search._SHARED_TERMS.get()
        kinds = [key[0] for key in shared.screens]
        rows = len(shared.rows)
    assert together == alone
    assert rows == 2  # one per GPU count
    # per GPU count: one table of batch lines; static terms for fewer fixed parts than devices;
    # screenings for fewer budgets than devices (l40s and a40 alike)
    assert kinds.count("lines") == 2 and kinds.count("static") < len(runs) and kinds.count("screened") < len(runs)
