"""Issue 12, items 2, 7 and 8: each reproduction of the issue as a test.

Host RAM for offload is the node's (every rank's share plus a stated reserve), the default
--cpu-mem is the catalog's standard machine (never the planning machine unless it is the node),
the ranking policy is explicit (--prefer), plans near the edge rank after the others, each plan
says what it trades away, and the plans shown are distinct."""

from __future__ import annotations

import pytest

from planner.config import Method, Offload, Precision
from planner.errors import InvalidConfigError, NothingFitsError
from planner.gpus import get_gpu, standard_node
from planner.planning import MAX_GPUS_PER_NODE, SuggestRequest, make_plan
from planner.results import MemoryEstimate
from planner.host import HOST_PER_PROCESS, host_reserve, node_ram_needed
from planner.search import SearchSpace
from planner.tradeoffs import Prefer, fidelity_tier, is_pure_16bit, near_edge, trade_offs
from planner.units import GiB, MiB

MISTRAL, QWEN15, GEMMA9, LLAMA3 = "mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-1.5B", "google/gemma-2-9b", "meta-llama/Meta-Llama-3-8B"


@pytest.fixture
def no_local_ram(monkeypatch):
    """The planning machine's RAM must not be read: reading it fails the test."""
    import planner.gpus

    def refuse() -> int:
        raise AssertionError("this machine's RAM was read for a plan of another node")

    monkeypatch.setattr(planner.gpus, "physical_ram_bytes", refuse)


# ---- item 2: host RAM of the node ------------------------------------------------------------


def test_host_reserve_and_budget_by_hand():
    # 192 GiB node (AWS g5.12xlarge), 4 ranks: 4% of 192 GiB = 7.68 GiB for the kernel and
    # hypervisor + 4 x 2 GiB for the training processes = 15.68 GiB kept; each rank may offload
    # (192 - 15.68) / 4 = 44.08 GiB
    assert HOST_PER_PROCESS == 2 * GiB
    assert host_reserve(192 * GiB, 4) == int(0.04 * 192 * GiB) + 8 * GiB
    assert SearchSpace(cpu_mem_bytes=192 * GiB).offload_budget(4) == (192 * GiB - host_reserve(192 * GiB, 4)) // 4
    # the smallest node that holds 4 ranks of 10 GiB: R - 0.04 R - 8 GiB >= 40 GiB -> R = 48 GiB / 0.96 = 50 GiB
    need = node_ram_needed(10 * GiB, 4)
    assert need - host_reserve(need, 4) >= 40 * GiB
    assert abs(need - 50 * GiB) <= 1


def test_multi_gpu_offload_counts_every_rank_against_cpu_mem():
    """The issue: 4 x A10G, Mistral full, --cpu-mem 32GiB proposed ZeRO-3 offload at 27 GiB, one
    rank's figure. The node needs every rank's share: nothing fits, and the message says so."""
    with pytest.raises(NothingFitsError) as err:
        make_plan(SuggestRequest(model=MISTRAL, gpu="a10g", target_batch=32, gpus=4, method="full", cpu_mem_bytes=32 * GiB))
    message = str(err.value)
    assert "of host RAM on the node (4 ranks x" in message and "kept for the OS and 4 training processes" in message
    assert "try --cpu-mem" in message


def test_offload_plans_fit_the_node_after_the_reserve():
    planned = make_plan(SuggestRequest(model=MISTRAL, gpu="a10g", target_batch=32, gpus=4, method="full", cpu_mem_bytes=192 * GiB))
    offloaded = [p for p in planned.result.plans if p.memory.cpu_bytes]
    assert offloaded, "192 GiB holds the ZeRO-3 offload of 4 ranks"
    for p in offloaded:
        assert p.memory.cpu_bytes * 4 + host_reserve(192 * GiB, 4) <= 192 * GiB


def test_default_host_ram_is_the_standard_node_not_this_machine(no_local_ram):
    """The issue: a T4 plan spent 23 of this machine's 23.5 GiB. Now it plans for AWS g4dn.xlarge
    (1 x T4, 16 GiB) without reading this machine's RAM."""
    planned = make_plan(SuggestRequest(model=QWEN15, gpu="t4", target_batch=16, seq_len=1024))
    assert planned.host_bytes == 16 * GiB and "g4dn.xlarge" in planned.host_source
    budget = 16 * GiB - host_reserve(16 * GiB, 1)
    assert all(p.memory.cpu_bytes <= budget for p in planned.result.plans)
    # four A10Gs: AWS g5.12xlarge, 192 GiB
    assert standard_node(get_gpu("a10g"), 4).ram_bytes == 192 * GiB
    assert standard_node(get_gpu("a100-40gb"), 8).ram_bytes == 1152 * GiB


def test_unknown_node_needs_cpu_mem_for_offload(no_local_ram):
    """No standard machine holds an RTX 4090: offload plans are refused with a reason that asks
    for --cpu-mem."""
    planned = make_plan(SuggestRequest(model="Qwen/Qwen2.5-14B", gpu="rtx4090", target_batch=16))
    assert planned.host_bytes == 0 and planned.host_source == ""
    assert all(p.config.offload is Offload.NONE for p in planned.result.plans)
    host_reasons = [r.reason for r in planned.result.rejected if "host RAM" in r.reason]
    assert host_reasons and all("pass --cpu-mem" in r for r in host_reasons)


def test_the_cpu_profile_and_gpu_auto_plan_for_this_machine(monkeypatch):
    import planner.gpus

    monkeypatch.setattr(planner.gpus, "physical_ram_bytes", lambda: 7 * GiB)
    planned = make_plan(SuggestRequest(model="gpt2", gpu="cpu", target_batch=4, seq_len=128))
    assert (planned.host_bytes, planned.host_source) == (7 * GiB, "this machine's RAM")
    local = make_plan(SuggestRequest(model="gpt2", gpu="a10g", target_batch=4, seq_len=128, local_node=True))
    assert local.host_bytes == 7 * GiB


def test_gpus_are_bounded_by_one_node():
    with pytest.raises(InvalidConfigError, match=f"at most {MAX_GPUS_PER_NODE}"):
        make_plan(SuggestRequest(model="gpt2", gpu="a10g", target_batch=1 << 20, gpus=1_000_000))


# ---- item 7: the plans shown ------------------------------------------------------------------


def test_pure_fp16_lora_is_searched_on_a_t4():
    """The issue: on a T4 with --no-offload, plan 1 had 511 MiB of headroom while pure fp16 LoRA
    (16-bit frozen base, fp32 adapters) fits with GiBs to spare; auto now searches it."""
    planned = make_plan(SuggestRequest(model=QWEN15, gpu="t4", target_batch=16, seq_len=1024, allow_offload=False))
    top = planned.result.plans[0]
    assert top.config.method is Method.LORA and top.config.precision is Precision.FP16
    assert planned.result.usable_bytes - top.memory.process_total_bytes > 3 * GiB
    assert fidelity_tier(top.config) == 1  # LoRA in pure fp16 keeps fp32 adapters: not the pure-16-bit tier


def test_prefer_decides_lora_with_offload_against_a_faster_qlora():
    """The issue: gemma-2-9b on an L4, batch 8: LoRA with ZeRO-3 offload (613 tokens/s) ranked
    above QLoRA (821). --prefer fidelity keeps LoRA first and names the faster plan under the
    table; --prefer speed puts QLoRA first and names the LoRA plan."""
    base = dict(model=GEMMA9, gpu="l4", target_batch=8, cpu_mem_bytes=64 * GiB)
    fidelity = make_plan(SuggestRequest(**base)).result
    speed = make_plan(SuggestRequest(**base, prefer="speed")).result
    assert fidelity.plans[0].config.method is Method.LORA and fidelity.plans[0].config.offload is not Offload.NONE
    assert speed.plans[0].config.method is Method.QLORA
    assert speed.plans[0].throughput.tokens_per_s > fidelity.plans[0].throughput.tokens_per_s
    assert fidelity.alternative is not None and fidelity.alternative.config == speed.plans[0].config
    assert speed.alternative is not None and speed.alternative.config == fidelity.plans[0].config
    assert (fidelity.request.constraints["prefer"], speed.request.constraints["prefer"]) == ("fidelity", "speed")
    assert fidelity.to_dict()["other_policy_best"]["config"]["method"] == "qlora"


def test_unknown_policy_is_one_clear_error():
    with pytest.raises(InvalidConfigError, match=r"--prefer must be one of fidelity\|speed, got 'fast'"):
        make_plan(SuggestRequest(model="gpt2", gpu="a10g", target_batch=8, prefer="fast"))


def test_pure_bf16_full_finetuning_ranks_last_and_says_why():
    """The issue: pure bf16 with 8-bit AdamW (no fp32 master) ranked first for Llama-3-8B on an
    H100 without a word about its convergence risk."""
    result = make_plan(SuggestRequest(model=LLAMA3, gpu="h100", target_batch=32, top_k=20)).result
    assert not is_pure_16bit(result.plans[0].config)
    for p in result.plans:
        notes = " ".join(trade_offs(p.config, p.memory, usable=result.usable_bytes))
        if p.config.method is Method.FULL and is_pure_16bit(p.config):
            assert "no fp32 master" in notes and "Zamirai" in notes
    tiers = [fidelity_tier(p.config) for p in result.plans]
    assert tiers == sorted(tiers)


def test_pure_fp16_full_finetuning_says_it_overflows():
    result = make_plan(SuggestRequest(model="Qwen/Qwen2.5-0.5B", gpu="t4", target_batch=16, seq_len=1024, method="full",
                                      precision="fp16", cpu_mem_bytes=64 * GiB)).result
    for p in result.plans:
        assert any("no loss scaling" in n for n in trade_offs(p.config, p.memory, usable=result.usable_bytes))
    assert all(p["trade_offs"] for p in result.to_dict()["plans"])


def _precision_class(c) -> str:
    if c.precision is Precision.FP32:
        return "fp32"
    return "mixed" if c.precision.is_mixed and not (c.zero and c.method.uses_adapters) else "16-bit"


@pytest.mark.parametrize("request_", [
    dict(model=MISTRAL, gpu="a10g", target_batch=32, gpus=8, method="full"),
    dict(model="Qwen/Qwen2.5-14B", gpu="rtx4090", target_batch=16, cpu_mem_bytes=64 * GiB),
    dict(model="meta-llama/Llama-2-7b-hf", gpu="a10g", target_batch=32),
    dict(model=QWEN15, gpu="t4", target_batch=16, seq_len=1024, allow_offload=False),
])
def test_the_plans_shown_are_distinct(request_):
    """The issue: r8 beside r16, bf16-mixed beside fp16-mixed with the same numbers, ZeRO-1 on one
    GPU beside the same plan. One plan per (method, precision class, optimizer)."""
    plans = make_plan(SuggestRequest(**request_)).result.plans
    families = [(p.config.method, _precision_class(p.config), p.config.optimizer) for p in plans]
    assert len(families) == len(set(families))
    precisions = {p.config.precision for p in plans}
    assert not {Precision.BF16_MIXED, Precision.FP16_MIXED} <= precisions


def _memory(total: int, reserved_over_allocated: int) -> MemoryEstimate:
    return MemoryEstimate(peak_allocated_bytes=total - reserved_over_allocated - 512 * MiB,
                          peak_reserved_bytes=total - 512 * MiB, process_total_bytes=total, cpu_bytes=0, breakdown={})


def test_near_the_edge_is_headroom_below_the_allocators_expected_overhead():
    usable = 20 * GiB
    # 8.5 MiB left (the 8 x A10G plan) against 221 MiB the allocator keeps: near the edge
    assert near_edge(_memory(usable - int(8.5 * MiB), 221 * MiB), usable)
    # 393 MiB left against 221 MiB: not
    assert not near_edge(_memory(usable - 393 * MiB, 221 * MiB), usable)
    notes = trade_offs(__import__("planner.config", fromlist=["TrainConfig"]).TrainConfig(),
                       _memory(usable - 8 * MiB, 221 * MiB), usable=usable)
    assert notes[0].startswith("NEAR THE EDGE: 8 MiB left")


def test_plans_near_the_edge_rank_after_the_others():
    """QLoRA on an RTX 4090 for Qwen2.5-14B fitted by a few hundred MiB and ranked first."""
    result = make_plan(SuggestRequest(model="Qwen/Qwen2.5-14B", gpu="rtx4090", target_batch=16, prefer="speed")).result
    edges = [near_edge(p.memory, result.usable_bytes) for p in result.plans]
    assert edges == sorted(edges)
    if any(edges):
        assert not edges[0]


def test_the_prefer_option_round_trips_for_ray_jobs():
    assert SuggestRequest(model="gpt2", gpu="a10g", target_batch=8, prefer="speed").to_cli_args()[-2:] == ["--prefer", "speed"]
    assert "--prefer" not in SuggestRequest(model="gpt2", gpu="a10g", target_batch=8).to_cli_args()
    assert Prefer("speed") is Prefer.SPEED


# ---- item 8: one wording, exit codes ----------------------------------------------------------


def test_a_bad_method_reads_the_same_in_estimate_and_suggest(cli):
    est = cli("estimate", "-m", "gpt2", "-g", "a10g", "--method", "foo")
    sug = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--method", "foo", "--no-save")
    assert (est.code, sug.code) == (2, 2)
    assert "error: --method must be one of full|lora|qlora, got 'foo'" in est.err
    assert "error: --method must be one of auto|full|lora|qlora, got 'foo'" in sug.err


def test_suggest_prints_the_other_policy_and_the_node(cli):
    r = cli("suggest", "-m", GEMMA9, "-g", "l4", "-b", "8", "--cpu-mem", "64GiB", "--no-save")
    assert r.code == 0, r
    assert "ranked by fidelity" in r.out and "--prefer speed would rank first: qlora" in r.out
    assert "trade-offs:" in r.out
    r = cli("suggest", "-m", MISTRAL, "-g", "a10g", "-b", "32", "--gpus", "4", "--method", "full", "--no-save")
    assert r.code == 0, r
    assert "host RAM of the node 192 GiB (AWS g5.12xlarge" in r.out
    assert "on the node" in r.out  # plan 1's offload, per GPU and for the node
    big = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "64", "--gpus", "64", "--no-save")
    assert big.code == 2 and "more GPUs than one node holds" in big.err
