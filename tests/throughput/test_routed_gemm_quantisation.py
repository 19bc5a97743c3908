"""The expert loop's GEMMs pay for whole tiles and whole waves (planner.kernels.routed_gemm_flops over
planner.moe_loop.loop_gemms): a cost per call, priced by hand on a small Mixtral on an A100."""

from __future__ import annotations

from planner.catalog import spec_from_config
from planner.catalog.modern import per_expert_layout
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import micro_step, routed_gemm_waste
from planner.moe_loop import loop_gemms
from planner.throughput import ThroughputMemo, step_breakdown

# H = 2,048, I = 4,096, E = 4 experts, k = 2, 2 blocks: one 4,096-token sequence sends 2,048 rows to each expert
SMALL = dict(model_type="mixtral", hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
CONFIG = TrainConfig(method="lora", lora_targets=("q_proj",), grad_ckpt=True, experts_loop=True,
                     precision="bf16-mixed", micro_batch=1, seq_len=4096)
TILE = 256 * 128 * 2  # FLOPs per inner element of a 256 x 128 tile


def _specs():
    fused = spec_from_config(SMALL, model_id="mixtral", source="test")
    return fused, per_expert_layout(fused)


def test_a_routed_gemm_wastes_half_a_wave_and_half_a_tile_row():
    # A100: 108 SMs. Out 14,336 (Mixtral's w1), inner 4,096: half a wave (54 tiles) and half a row of
    # ceil(14,336 / 256) = 56 tiles (28) = 82 tiles of 256 x 128 x 2 x 4,096 FLOPs = 22.0 GFLOP, 81 us at the
    # A100's 312 TFLOPS x 0.869
    waste = routed_gemm_waste(14_336, 4_096, 108)
    assert waste == 82 * TILE * 4_096 == 22_011_707_392
    assert round(waste / (312e12 * 0.869) * 1e6) == 81


def test_the_loop_lists_each_experts_forward_recompute_and_input_gradient():
    fused, loop = _specs()
    assert loop_gemms(fused, CONFIG) == ()  # grouped stacks: no per-expert GEMMs
    # w1 and w3 (2,048 -> 4,096) and w2 (4,096 -> 2,048), 4 experts x 2 blocks = 8 calls each: forward (out, inner),
    # its recompute, the input gradient (in, out); 4,096 tokens x 2 / 4 experts = 2,048 rows an expert
    up, down = [(8, 4096, 2048, False, 2048), (8, 4096, 2048, True, 2048), (8, 2048, 4096, False, 2048)], \
        [(8, 2048, 4096, False, 2048), (8, 2048, 4096, True, 2048), (8, 4096, 2048, False, 2048)]
    assert sorted(loop_gemms(loop, CONFIG)) == sorted(up * 2 + down)
    assert all(not gemm[3] for gemm in loop_gemms(loop, CONFIG.replace(grad_ckpt=False)))


def test_the_waste_is_fixed_per_micro_step_and_split_with_the_recompute():
    _, loop = _specs()
    a100 = get_gpu("a100-80gb")
    # 2,048 rows: 16 token tiles; out 4,096 is 16 output tiles (256 tiles >= 108: a wave and more), out 2,048 is 8
    # (128). Per call: out 4,096 over 2,048 wastes 54 + 8 = 62 tiles x 2,048, out 2,048 over 4,096 54 + 4 = 58 x 4,096.
    # Each of w1, w3, w2 has one of each outside the recompute (forward and input gradient), 8 calls; the recompute
    # runs w1 and w3 (out 4,096 over 2,048) and w2 (out 2,048 over 4,096) again
    wide, narrow = 62 * TILE * 2048, 58 * TILE * 4096
    outside, recompute = 3 * 8 * (wide + narrow), 8 * (2 * wide + narrow)
    for micro_batch in (1, 4):
        config = CONFIG.replace(micro_batch=micro_batch)
        plain, priced = micro_step(loop, config), micro_step(loop, config, a100)
        assert priced.gemm[0] - plain.gemm[0] == outside == 573_378_134_016
        assert priced.recompute[0] - plain.recompute[0] == recompute == 257_698_037_760


def test_gemms_under_a_wave_devices_without_an_sm_count_and_the_grouped_layout_price_none():
    fused, loop = _specs()
    a100 = get_gpu("a100-80gb")
    # 1,024 tokens: 512 rows an expert, 4 token tiles x 16 or 8 output tiles = 64 or 32 < 108: cuBLAS tiles smaller
    short = CONFIG.replace(seq_len=1024)
    assert micro_step(loop, short, a100).gemm[0] == micro_step(loop, short).gemm[0]
    for name in ("mi300x", "a10g", "cpu"):
        assert micro_step(loop, CONFIG, get_gpu(name)).gemm[0] == micro_step(loop, CONFIG).gemm[0]
    assert micro_step(fused, CONFIG, a100).gemm[0] == micro_step(fused, CONFIG).gemm[0]


def test_the_search_memo_prices_it_as_the_breakdown_does():
    _, loop = _specs()
    a100 = get_gpu("a100-80gb")
    memo = ThroughputMemo(loop, a100)
    assert memo.breakdown(CONFIG) == step_breakdown(model=loop, config=CONFIG, gpu=a100)
