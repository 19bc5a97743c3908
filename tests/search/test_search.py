"""The configuration search: enumeration invariants, ranking, rejections and NothingFitsError."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Method, Offload, Precision
from planner.errors import InvalidConfigError, NothingFitsError
from planner.gpus import get_gpu
from planner.ranking import SPEED_TIE, suggest
from planner.search import SearchSpace, enumerate_configs
from planner.tradeoffs import fidelity_tier, near_edge

GiB = 1024**3
LLAMA7B = "meta-llama/Llama-2-7b-hf"


@pytest.fixture(scope="module")
def llama7b():
    return resolve_model(LLAMA7B)


@pytest.fixture(scope="module")
def a10g():
    return get_gpu("a10g")


@pytest.fixture(scope="module")
def llama7b_a10g(llama7b, a10g):
    """The README request: Llama-2-7b on one A10G, batch 32, seq 2048, 64 GiB host RAM."""
    return suggest(model=llama7b, gpu=a10g, target_batch=32, seq_len=2048, space=SearchSpace(cpu_mem_bytes=64 * GiB), top_k=1000)


def test_target_batch_must_split_over_the_gpus(llama7b, a10g):
    with pytest.raises(InvalidConfigError, match="cannot be split over 2 GPUs"):
        list(enumerate_configs(model=llama7b, gpu=a10g, target_batch=7, seq_len=512, gpus=2, space=SearchSpace()))
    with pytest.raises(InvalidConfigError):
        suggest(model=llama7b, gpu=a10g, target_batch=7, seq_len=512, gpus=2)


@pytest.mark.parametrize("target, gpus", [(32, 1), (12, 2), (7, 1), (24, 8)])
def test_every_config_reaches_the_target_batch(llama7b, a10g, target, gpus):
    configs = list(enumerate_configs(model=llama7b, gpu=a10g, target_batch=target, seq_len=512, gpus=gpus, space=SearchSpace()))
    assert configs
    assert all(c.micro_batch * c.grad_accum * c.gpus == target and c.gpus == gpus for c in configs)
    # every divisor of the per-device batch is tried as a micro-batch
    per_device = target // gpus
    assert {c.micro_batch for c in configs} == {d for d in range(1, per_device + 1) if per_device % d == 0}


def test_no_bf16_on_t4(llama7b):
    t4 = get_gpu("t4")
    configs = list(enumerate_configs(model=llama7b, gpu=t4, target_batch=4, seq_len=512, gpus=1, space=SearchSpace()))
    precisions = {c.precision for c in configs}
    # T4 (compute capability 7.5) has no bf16: fp32 and fp16, mixed and pure (pure fp16 LoRA is
    # the usual T4 recipe: 16-bit frozen base, fp32 adapters)
    assert precisions == {Precision.FP32, Precision.FP16_MIXED, Precision.FP16}
    # where bf16 runs, it replaces fp16 (same memory and rate, no loss scaling)
    a10g_precisions = {c.precision for c in enumerate_configs(model=llama7b, gpu=get_gpu("a10g"), target_batch=4, seq_len=512, gpus=1, space=SearchSpace())}
    assert a10g_precisions == {Precision.FP32, Precision.BF16_MIXED, Precision.BF16}


def test_a_space_of_every_precision_on_t4_skips_bf16_with_a_warning(llama7b):
    """A library caller's space may name precisions the GPU cannot run (every precision, on a
    T4): they are skipped with a warning, not predicted at a rate of zero (this raised
    ZeroDivisionError); a space of none the GPU runs is refused with the fix."""
    t4 = get_gpu("t4")
    with pytest.warns(UserWarning, match="cannot run bf16-mixed, bf16"):
        result = suggest(model=llama7b, gpu=t4, target_batch=8, seq_len=512,
                         space=SearchSpace(cpu_mem_bytes=64 * GiB, precisions=tuple(Precision)), top_k=20)
    shown = {p.config.precision for p in result.plans}
    assert shown and not shown & {Precision.BF16, Precision.BF16_MIXED}
    assert Precision.FP16 in shown
    with pytest.raises(InvalidConfigError, match="no bf16 support .* use fp16 .or fp32."):
        suggest(model=llama7b, gpu=t4, target_batch=8, seq_len=512, space=SearchSpace(precisions=(Precision.BF16,)))


def test_searches_at_least_5000_configurations(llama7b_a10g):
    assert llama7b_a10g.searched >= 5000


def test_plans_fit_and_are_ranked_by_tier_then_speed(llama7b_a10g):
    plans = llama7b_a10g.plans
    assert [p.rank for p in plans] == list(range(1, len(plans) + 1))
    for p in plans:
        assert p.fits
        assert p.memory.process_total_bytes <= llama7b_a10g.usable_bytes
    capacity = llama7b_a10g.request.gpu_memory_bytes
    edge = [near_edge(p.config, p.memory, capacity=capacity) for p in plans]
    # the plans that are not near the edge come first, then those that are not exotic (offload
    # pinning over half the node's 64 GiB: planner.ranking EXOTIC_HOST_SHARE; FSDP2's CPU offload
    # fits full fine-tuning with Adafactor that way), each group in fidelity order
    from planner.ranking import EXOTIC_HOST_SHARE

    exotic = [p.memory.cpu_bytes * p.config.gpus > EXOTIC_HOST_SHARE * 64 * 2**30 for p in plans]
    keys = [(e, x, fidelity_tier(p.config)) for e, x, p in zip(edge, exotic, plans)]
    assert keys == sorted(keys)
    for (ka, a), (kb, b) in zip(zip(keys, plans), zip(keys[1:], plans[1:])):
        if ka == kb:
            # within 2% of speed (SPEED_TIE) the usual recipe (AdamW, mixed precision) goes first
            assert a.throughput.tokens_per_s >= b.throughput.tokens_per_s * (1 - 2 * SPEED_TIE)


def test_on_one_gpu_a_speed_tie_goes_to_the_plan_without_deepspeed(llama7b_a10g):
    """The README request: the LoRA plans with and without ZeRO-1 (+offload) are predicted equally
    fast; the one without DeepSpeed is ranked first, and no same-speed ZeRO plan precedes a plain
    one with the same optimizer."""
    plans = llama7b_a10g.plans
    assert plans[0].config.zero == 0 and plans[0].config.offload is Offload.NONE
    for i, a in enumerate(plans):
        for b in plans[i + 1:]:
            tie = b.throughput.tokens_per_s >= a.throughput.tokens_per_s * (1 - SPEED_TIE / 2)
            capacity = llama7b_a10g.request.gpu_memory_bytes
            same_risk = near_edge(a.config, a.memory, capacity=capacity) == near_edge(b.config, b.memory, capacity=capacity)
            if tie and same_risk and a.config.method is b.config.method and a.config.optimizer is b.config.optimizer:
                assert not (a.config.zero > 0 and b.config.zero == 0), (a.config.label(), b.config.label())


def test_ranking_full_before_lora_before_qlora_when_all_fit():
    """gpt2 (124M) on an 80 GB A100: every method fits, so all three tiers appear, in order."""
    gpt2 = resolve_model("gpt2")
    result = suggest(model=gpt2, gpu=get_gpu("a100-80gb"), target_batch=8, seq_len=512, top_k=1000,
                     space=SearchSpace(allow_offload=False))
    methods = [p.config.method for p in result.plans]
    assert {Method.FULL, Method.LORA, Method.QLORA} <= set(methods)
    # tiers: full with fp32 master weights (0) > LoRA (1) > QLoRA (2) > full in pure 16-bit (3)
    tiers = [fidelity_tier(p.config) for p in result.plans]
    assert tiers == sorted(tiers) and set(tiers) == {0, 1, 2, 3}
    assert result.plans[0].config.method is Method.FULL
    for a, b in zip(result.plans, result.plans[1:]):
        if fidelity_tier(a.config) == fidelity_tier(b.config):
            # within 2% of speed (SPEED_TIE) the usual recipe (AdamW, mixed precision) goes first
            assert a.throughput.tokens_per_s >= b.throughput.tokens_per_s * (1 - 2 * SPEED_TIE)
    assert result.rejected == ()  # the best tier fits: nothing more faithful to explain


def test_full_finetuning_of_llama7b_on_a10g_is_rejected_with_reasons(llama7b_a10g):
    # only FSDP2's CPU offload (shards, gradients and states in 50 GiB of the 64 GiB host, with
    # Adafactor) brings full fine-tuning onto the 24 GB card
    assert all(p.config.method is not Method.FULL or p.config.sharding.label() == "fsdp2+offload:cpu"
               for p in llama7b_a10g.plans)
    full = [r for r in llama7b_a10g.rejected if r.family.startswith("full,")]
    assert full
    assert any(r.family == "full, bf16-mixed, adamw_fused" for r in full)
    for r in full:
        assert r.reason and "\n" not in r.reason
        assert "GiB" in r.reason
        assert r.config is not None and r.config["method"] == "full"


def test_no_offload_removes_offload_configs(llama7b, a10g):
    space = SearchSpace(allow_offload=False)
    configs = list(enumerate_configs(model=llama7b, gpu=a10g, target_batch=8, seq_len=512, gpus=1, space=space))
    assert configs and all(c.offload is Offload.NONE for c in configs)
    with_offload = list(enumerate_configs(model=llama7b, gpu=a10g, target_batch=8, seq_len=512, gpus=1, space=SearchSpace()))
    assert {c.offload for c in with_offload} == set(Offload)
    result = suggest(model=llama7b, gpu=a10g, target_batch=8, seq_len=512, space=space, top_k=1000)
    assert all(p.config.offload is Offload.NONE and p.memory.cpu_bytes == 0 for p in result.plans)
    assert result.request.constraints["offload"] is False


def test_offload_plans_respect_the_host_ram_bound(llama7b_a10g):
    for p in llama7b_a10g.plans:
        assert p.memory.cpu_bytes <= 64 * GiB


def test_nothing_fits_names_the_closest_miss():
    model = resolve_model("meta-llama/Llama-3.1-70B")
    t4 = get_gpu("t4")
    with pytest.raises(NothingFitsError) as err:
        suggest(model=model, gpu=t4, target_batch=8, seq_len=2048, space=SearchSpace(methods=(Method.FULL,), allow_offload=False))
    message = str(err.value)
    assert err.value.exit_code == 3
    assert "\n" not in message
    assert "meta-llama/Llama-3.1-70B" in message and "t4" in message
    assert "the closest, full," in message  # the closest miss is named by its label
    assert "--method qlora" in message and "offload" in message  # and what to try


def test_bad_request_values(llama7b, a10g):
    with pytest.raises(InvalidConfigError, match="--target-batch"):
        suggest(model=llama7b, gpu=a10g, target_batch=0, seq_len=512)
    with pytest.raises(InvalidConfigError, match="--seq-len"):
        suggest(model=llama7b, gpu=a10g, target_batch=8, seq_len=llama7b.max_seq_len + 1)
    with pytest.raises(InvalidConfigError, match="--top-k"):
        suggest(model=llama7b, gpu=a10g, target_batch=8, seq_len=512, top_k=0)


def test_request_records_what_was_asked(llama7b_a10g, a10g):
    req = llama7b_a10g.request
    assert (req.model_id, req.gpu, req.gpu_count, req.target_batch, req.seq_len) == (LLAMA7B, "a10g", 1, 32, 2048)
    assert req.gpu_memory_bytes == a10g.memory_bytes
    assert llama7b_a10g.usable_bytes == a10g.memory_bytes - llama7b_a10g.safety_margin_bytes
