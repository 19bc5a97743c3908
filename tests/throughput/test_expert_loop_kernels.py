"""What transformers 4's per-expert MoE loop adds to a micro-step's kernels (planner.moe_loop, read by
planner.kernels), by hand on a tiny Mixtral: the same GEMM FLOPs, the gathers' bytes and the loop's ops."""

from __future__ import annotations

from planner.catalog import spec_from_config
from planner.catalog.modern import per_expert_layout
from planner.config import TrainConfig
from planner.kernels import OPS_PER_QUANTIZED, micro_step, ops_per_micro_step

# H = 64, I = 96, E = 4 experts, k = 2, 2 blocks
TINY = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)


def _specs():
    fused = spec_from_config(TINY, model_id="mixtral", source="test")
    return fused, per_expert_layout(fused)


def test_the_loop_keeps_the_flops_and_adds_the_gathers_bytes():
    fused, loop = _specs()
    config = TrainConfig(method="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), micro_batch=2,
                         seq_len=32, precision="bf16-mixed")
    a, b = micro_step(fused, config), micro_step(loop, config.replace(experts_loop=True))
    assert b.gemm[0] == a.gemm[0]  # the T·k routed rows either way
    # per token and block: 7 elements x H = 64 x k = 2 slots, 2 B each (bf16), in the forward and once more in
    # LoRA's backward (frozen weights: dX only), and w1 and w3 each reading the routed row where the fused
    # gate_up read it once (64 more elements a slot): 2 blocks x 2 passes x (1,792 + 256) B x 64 tokens
    assert b.gemm[1] - a.gemm[1] == 2 * 2 * (7 * 64 * 2 * 2 + 64 * 2 * 2) * 64 == 524_288


def test_the_loop_adds_its_eager_ops():
    fused, loop = _specs()
    config = TrainConfig(method="lora", lora_targets=("q_proj",), grad_ckpt=True, experts_loop=True)
    # per expert: 12 forward ops, twice with the recompute, and 18 backward (the syncs drain apart: test_moe_elementwise):
    # 4 x (12 x 2 + 18) = 168 per block, 2 blocks; the layout's other ops are the fused one's but for its
    # three expert linears listed in place of two stacks (none adapted here)
    assert ops_per_micro_step(loop, config) - ops_per_micro_step(fused, config) == 2 * 4 * (12 * 2 + 18)
    # QLoRA: each expert's w1, w3, w2 dequantise (2 ops each forward and backward, 3 passes with the
    # recompute: 3 // 2 of the pair); the layout lists them once, E - 1 = 3 more of each: 3 x 3 x 2 x 3 // 2 = 27
    # per block; and w1/w3/w2 in place of gate_up/down: one more listed linear, 2 x 3 // 2 = 3 per block
    q = config.replace(method="qlora")
    assert ops_per_micro_step(loop, q) - ops_per_micro_step(fused, q) == 2 * (168 + 27 + OPS_PER_QUANTIZED * 3 // 2)
