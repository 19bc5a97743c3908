"""An MoE block's elementwise work and 4-bit weights, by hand on a tiny Mixtral (issue 21, the fms Mixtral rows):
the activation on each of a token's top-k routed rows, transformers 4's loop's full-size input gradient per expert,
and which weights QLoRA dequantises."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.catalog.modern import per_expert_layout
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import GATED_ACT_BYTES, act_elements, block_forward_bytes, elementwise_bytes
from planner.memory.dtypes import NF4_READ_BYTES
from planner.throughput import MEMORY_BANDWIDTH_EFFICIENCY, step_breakdown

# H = 64, I = 96, E = 4 experts, k = 2, 2 blocks
TINY = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
LORA = TrainConfig(method="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), micro_batch=2, seq_len=32,
                   precision="bf16-mixed")


def _spec(**over):
    return spec_from_config({**TINY, **over}, model_id="mixtral", source="test")


def test_the_activation_runs_on_each_routed_row():
    # a token's 2 routed rows each run act(gate) * up on I = 96 elements: 192 per block, not 96
    assert act_elements(_spec()) == 2 * 96
    assert act_elements(per_expert_layout(_spec())) == 2 * 96
    # against top-1 routing, one more row of the gated activation's 10 B an element (bf16: 2-byte activations)
    extra = block_forward_bytes(_spec(), LORA) - block_forward_bytes(_spec(num_experts_per_tok=1), LORA)
    assert extra == 96 * GATED_ACT_BYTES == 960
    # a dense model keeps its intermediate size
    dense = spec_from_config({k: v for k, v in TINY.items() if k not in ("num_local_experts", "num_experts_per_tok")}
                             | {"model_type": "mistral"}, model_id="mistral", source="test")
    assert act_elements(dense) == 96


def test_the_loops_backward_makes_a_full_size_input_gradient_per_expert():
    fused = _spec()
    loop = per_expert_layout(fused)
    # per token: 2 blocks x 4 experts x (a zero tensor written, then added into the input's gradient: read 2,
    # write 1) x H = 64, at the stream's 2 bytes (bf16-mixed LoRA: the norms' weights stay 16-bit)
    diff = elementwise_bytes(loop, LORA.replace(experts_loop=True), 1) - elementwise_bytes(fused, LORA, 1)
    assert diff == 2 * 4 * 4 * 64 * 2 == 4096
    fp32 = LORA.replace(precision="fp32")
    assert elementwise_bytes(loop, fp32.replace(experts_loop=True), 1) - elementwise_bytes(fused, fp32, 1) == 8192


def test_qlora_dequantises_the_nn_linear_weights_only():
    gpu = get_gpu("a100-80gb")
    config = TrainConfig(method="qlora", lora_targets=("q_proj",), micro_batch=1, seq_len=32, grad_ckpt=True,
                         precision="bf16-mixed")
    bandwidth = gpu.mem_bandwidth_gbs * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY
    per_weight = (NF4_READ_BYTES + 2) * 3  # read 4-bit, write 16-bit; forward, recompute and backward
    # transformers 5's layout: q 64x64, k and v 64x32, o 64x64 a block; its router and 3D expert stacks are not
    # nn.Linear and stay 16-bit (bitsandbytes replaces nn.Linear modules only)
    fused = step_breakdown(model=_spec(), config=config, gpu=gpu)["dequant"]
    assert fused * bandwidth == pytest.approx(2 * 12_288 * per_weight)
    # transformers 4's: the router (64x4) and the 4 experts' w1, w3 (64x96) and w2 (96x64) are nn.Linear too
    loop = step_breakdown(model=per_expert_layout(_spec()), config=config.replace(experts_loop=True), gpu=gpu)
    assert loop["dequant"] * bandwidth == pytest.approx(2 * (12_288 + 256 + 4 * 3 * 6_144) * per_weight)


def test_each_expert_sync_drains_the_queue_for_three_host_ops():
    from planner.throughput import _loop_drain_s

    gpu = get_gpu("a100-80gb")
    loop = per_expert_layout(_spec())
    config = LORA.replace(experts_loop=True, grad_ckpt=True)
    # 2 blocks x 4 experts x 2 forwards (the recompute's) = 16 syncs, each 3 ops of bf16 autocast under the
    # non-reentrant checkpoint: 16.0 us + the CUDA path's 6 us
    assert _loop_drain_s(loop, config, gpu) == pytest.approx(16 * 3 * 22e-6)
    # transformers 4's reentrant checkpoint (12.6 + 6 us), two micro-steps a step
    assert _loop_drain_s(loop, config.replace(reentrant_ckpt=True, grad_accum=2), gpu) == pytest.approx(2 * 16 * 3 * 18.6e-6)
    assert _loop_drain_s(_spec(), LORA.replace(grad_ckpt=True), gpu) == 0.0  # transformers 5's grouped_mm: no loop
    # the search's memo prices the same drain as step_breakdown
    from planner.throughput import ThroughputMemo

    assert ThroughputMemo(loop, gpu).breakdown(config) == step_breakdown(model=loop, config=config, gpu=gpu)


def test_transformers_439s_list_indexed_loop_adds_its_drains_and_list_conversions():
    """transformers 4.36-4.39's loop (experts_list_index) copies each expert's indices to the host and indexes with
    Python lists (4.39.3 modeling_mixtral.py l.866-877): by hand on the tiny Mixtral."""
    from planner.moe_loop import list_index_host
    from planner.throughput import _loop_drain_s

    gpu, cpu = get_gpu("a100-80gb"), get_gpu("cpu")
    loop = per_expert_layout(_spec())
    config = LORA.replace(experts_loop=True, grad_ckpt=True)
    listed = config.replace(experts_list_index=True)
    # 16 syncs (2 blocks x 4 experts x 2 forwards) x 7 more drained ops; routed slots: 2 x 32 tokens x k = 2 x 2 blocks
    # x 2 forwards = 512, each 16.3 ns (tolist) + 118.1 ns (the hidden states' list index) on a GPU, + 240.1 ns (the
    # routing weights' pair of lists, under the expert's GEMMs on a GPU) on the CPU profile
    assert list_index_host(loop, listed, cpu=False) == (112, pytest.approx(512 * 134.4e-9))
    assert list_index_host(loop, listed, cpu=True) == (112, pytest.approx(512 * 374.5e-9))
    assert list_index_host(loop, config, cpu=False) == (0, 0.0)
    # the drain: (16 x 3 + 112) ops x 22 us (bf16 autocast, non-reentrant checkpoint, CUDA path) + the conversions
    assert _loop_drain_s(loop, listed, gpu) == pytest.approx((16 * 3 + 112) * 22e-6 + 512 * 134.4e-9)
    assert _loop_drain_s(loop, listed.replace(grad_accum=3), gpu) == pytest.approx(3 * _loop_drain_s(loop, listed, gpu))
    # the CPU profile has no queue to drain (op time 0) but pays the conversions, all three, in turn
    assert _loop_drain_s(loop, listed, cpu) == pytest.approx(512 * 374.5e-9)
    # the step: exactly the drain's difference, in overhead
    a = step_breakdown(model=loop, config=config, gpu=gpu)
    b = step_breakdown(model=loop, config=listed, gpu=gpu)
    assert b["overhead"] - a["overhead"] == pytest.approx(112 * 22e-6 + 512 * 134.4e-9)
    assert {k: v for k, v in a.items() if k != "overhead"} == {k: v for k, v in b.items() if k != "overhead"}


def test_the_list_indexed_loop_needs_the_loop():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="--experts-list-index .* add --experts-loop"):
        TrainConfig(method="lora", experts_list_index=True)
    listed = LORA.replace(experts_loop=True, experts_list_index=True)
    assert TrainConfig.from_dict(listed.to_dict()) == listed
    assert listed.to_dict()["experts_list_index"] is True and "experts_list_index" not in LORA.to_dict()
    assert "list-indexed" in listed.label()
