"""The expert loop's GEMMs pay for whole tiles and whole waves (planner.kernels.routed_gemm_flops over
planner.moe_loop.loop_gemms): a cost per call, priced by hand on a tiny Mixtral on an A100."""

from __future__ import annotations

from planner.catalog import spec_from_config
from planner.catalog.modern import per_expert_layout
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import micro_step, routed_gemm_waste
from planner.moe_loop import loop_gemms
from planner.throughput import ThroughputMemo, step_breakdown

# H = 64, I = 96, E = 4 experts, k = 2, 2 blocks
TINY = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
CONFIG = TrainConfig(method="lora", lora_targets=("q_proj",), grad_ckpt=True, experts_loop=True,
                     precision="bf16-mixed", micro_batch=2, seq_len=32)


def _specs():
    fused = spec_from_config(TINY, model_id="mixtral", source="test")
    return fused, per_expert_layout(fused)


def test_a_routed_gemm_wastes_half_a_wave_and_half_a_tile_row():
    # A100: 108 SMs, 256 x 128 tiles. Out 14,336 (Mixtral's w1), inner 4,096: half a wave (54 tiles) and half a row
    # of ceil(14,336 / 256) = 56 tiles (28) = 82 tiles of 256 x 128 x 2 x 4,096 FLOPs = 22.0 GFLOP, 81 us at the
    # A100's 312 TFLOPS x 0.869
    waste = routed_gemm_waste(14_336, 4_096, 108)
    assert waste == 82 * 256 * 128 * 2 * 4_096 == 22_011_707_392
    assert round(waste / (312e12 * 0.869) * 1e6) == 81


def test_the_loop_lists_each_experts_forward_recompute_and_input_gradient():
    fused, loop = _specs()
    assert loop_gemms(fused, CONFIG) == ()  # grouped stacks: no per-expert GEMMs
    # w1 and w3 (64 -> 96) and w2 (96 -> 64), 4 experts x 2 blocks = 8 calls each: forward (out, inner), its
    # recompute, the input gradient (in, out)
    assert sorted(loop_gemms(loop, CONFIG)) == sorted(
        [(8, 96, 64, False), (8, 96, 64, True), (8, 64, 96, False)] * 2 + [(8, 64, 96, False), (8, 64, 96, True),
                                                                         (8, 96, 64, False)])
    assert all(not recompute for *_, recompute in loop_gemms(loop, CONFIG.replace(grad_ckpt=False)))


def test_the_waste_is_fixed_per_micro_step_and_split_with_the_recompute():
    _, loop = _specs()
    a100 = get_gpu("a100-80gb")
    # per call, 54.5 tiles (half of 108 and half of the one-tile row) of 256 x 128 x 2 x inner: inner 64 is
    # 228,589,568 FLOPs, inner 96 342,884,352. Outside the recompute each of w1, w3, w2 has one of each
    # (forward and input gradient), 8 calls: 3 x 8 x 571,473,920; the recompute w1 and w3 at inner 64 and w2 at 96
    outside = 3 * 8 * (228_589_568 + 342_884_352)
    recompute = 8 * (2 * 228_589_568 + 342_884_352)
    for micro_batch in (1, 4):
        config = CONFIG.replace(micro_batch=micro_batch)
        plain, priced = micro_step(loop, config), micro_step(loop, config, a100)
        assert priced.gemm[0] - plain.gemm[0] == outside == 13_715_374_080
        assert priced.recompute[0] - plain.recompute[0] == recompute == 6_400_507_904


def test_devices_without_an_sm_count_and_the_grouped_layout_price_none():
    fused, loop = _specs()
    for name in ("mi300x", "a10g", "cpu"):
        assert micro_step(loop, CONFIG, get_gpu(name)).gemm[0] == micro_step(loop, CONFIG).gemm[0]
    a100 = get_gpu("a100-80gb")
    assert micro_step(fused, CONFIG, a100).gemm[0] == micro_step(fused, CONFIG).gemm[0]


def test_the_search_memo_prices_it_as_the_breakdown_does():
    _, loop = _specs()
    a100 = get_gpu("a100-80gb")
    memo = ThroughputMemo(loop, a100)
    assert memo.breakdown(CONFIG) == step_breakdown(model=loop, config=CONFIG, gpu=a100)
