"""The kernel terms of the step (planner.kernels), each against numbers worked out by hand."""

from __future__ import annotations

import pytest
from test_throughput import LLAMA_7B, llama  # noqa: E402

from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import (
    DeviceRates,
    attention_flops,
    block_forward_bytes,
    block_weights,
    elementwise_bytes,
    gemm,
    gemm_seconds,
    matmul_fraction,
    ops_per_micro_step,
    weight_cast_bytes,
)
from planner.throughput import calibration_terms, estimate_throughput

A100 = DeviceRates(gemm=312e12 * 0.869, bandwidth=2039e9 * 0.8, op_seconds=1e-6)


def test_mamf_fractions_per_device():
    # stas00/ml-engineering MAMF table: A100 SXM 271.2 / 312, H100 SXM 794.5 / 989
    assert matmul_fraction(get_gpu("a100-80gb"), TrainConfig().precision) == 0.869
    assert matmul_fraction(get_gpu("h100-80gb"), TrainConfig().precision) == 0.803
    assert matmul_fraction(get_gpu("l40"), TrainConfig().precision) == 0.80  # not in the table
    assert matmul_fraction(get_gpu("a10g"), TrainConfig(precision="fp32").precision) == 0.75
    assert matmul_fraction(get_gpu("cpu"), TrainConfig().precision) == 1.0


def test_a_large_gemm_is_math_and_a_lora_product_is_memory():
    # 8192 tokens x 4096 -> 4096 at 16 bits:
    #   FLOPs 2 x 8192 x 4096 x 4096 = 274,877,906,944 -> / 271.128 TFLOP/s = 1.01384 ms
    #   bytes (8192 x 4096 + 4096 x 4096 + 8192 x 4096) x 2 = 167,772,160 -> / 1631.2 GB/s = 0.10285 ms
    big = gemm(8192, 4096, 4096, elem=2)
    assert big.flops == 274_877_906_944 and big.bytes == 167_772_160
    assert gemm_seconds(8192, 4096, 4096, rates=A100, elem=2) == pytest.approx(274_877_906_944 / 271.128e12
                                                                               + 167_772_160 / 1631.2e9, rel=1e-12)
    # LoRA's A: 8192 tokens x 4096 -> 16: FLOPs 2 x 8192 x 16 x 4096 = 1,073,741,824 (3.96 us);
    # bytes (8192 x 4096 + 4096 x 16 + 8192 x 16) x 2 = 67,502,080 (41.4 us): ten times its math
    lora_a = gemm(8192, 16, 4096, elem=2)
    assert lora_a.flops == 1_073_741_824 and lora_a.bytes == 67_502_080
    assert lora_a.bytes / A100.bandwidth > 10 * lora_a.flops / A100.gemm


def test_causal_flash_halves_attention_and_eager_does_not():
    # Llama-2-7B, 2048 tokens: forward 4 x 32 x 2048 x 32 x 128 x 2048 tokens = 2,199,023,255,552 FLOPs
    forward = 4 * 32 * 2048 * 32 * 128 * 2048
    flash_total, flash_fwd = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, attention="flash"), 2048)
    # causal half, weighted by 1 / 0.70 (FlashAttention-2 at 0.70 of the GEMM rate)
    assert flash_fwd == pytest.approx(forward / 2 / 0.70, rel=1e-12) and flash_total == pytest.approx(3 * flash_fwd)
    eager_total, eager_fwd = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, attention="eager"), 2048)
    assert eager_fwd == forward and eager_total == 3 * forward  # full product at the GEMM rate
    # a padded batch: SDPA's masked (memory-efficient) kernel, the full product at 0.5 of the GEMM rate
    _, masked = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, packing=False), 2048)
    assert masked == pytest.approx(forward / 0.5, rel=1e-12)


def test_block_elementwise_bytes_by_hand():
    # Llama-2-7B block forward per token at 16 bits:
    #   hidden 4096 x (2 RMSNorms x 36 + residuals 12) = 4096 x 84 = 344,064
    #   rotary (32 + 32 heads) x 128 x 28 = 229,376
    #   SwiGLU 11008 x 10 = 110,080                       => 683,520 B
    assert block_forward_bytes(LLAMA_7B, TrainConfig()) == 683_520
    # fp32 activations: twice
    assert block_forward_bytes(LLAMA_7B, TrainConfig(precision="fp32")) == 2 * 683_520
    # QLoRA: the norms and residuals run fp32 (peft's k-bit preparation): 344,064 x 2 + the rest
    assert block_forward_bytes(LLAMA_7B, TrainConfig(method="qlora")) == 2 * 344_064 + 229_376 + 110_080


def test_micro_step_elementwise_bytes_by_hand():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    # block forward per token: 64 x 84 + (4 + 4) x 16 x 28 + 256 x 10 = 5,376 + 3,584 + 2,560 = 11,520 B
    assert block_forward_bytes(tiny, TrainConfig()) == 11_520
    lora = TrainConfig(method="lora", lora_r=8, seq_len=128)
    # per token: 2 blocks x 11,520 x (forward 1 + backward 2) = 69,120; loss 1000 x 24 = 24,000;
    # adapters on all 7 linears per block (no dropout): outputs x 14 + inputs x 6:
    #   outs 4 x 64 + 2 x 256 + 64 = 832, ins 4 x 64 + 2 x 64 + 256 = 640 -> 832 x 14 + 640 x 6 = 15,488 x 2 blocks
    per_token = 69_120 + 24_000 + 2 * 15_488
    assert elementwise_bytes(tiny, lora, 128) == per_token * 128
    # full fine-tuning, bf16-mixed: the fp32 weights cast per forward (6 B) and the gradients
    # accumulated (18 B): 2 x 65,536 weights x 24 B = 3,145,728 B, on top of 93,120 B per token
    full = TrainConfig(seq_len=128)
    assert elementwise_bytes(tiny, full, 128) == 93_120 * 128
    assert block_weights(tiny) == 2 * 65_536
    assert weight_cast_bytes(full, block_weights(tiny)) == 2 * 65_536 * 24
    # with checkpointing the recompute casts again: 6 + 6 + 18 = 30 B per weight
    assert weight_cast_bytes(TrainConfig(seq_len=128, grad_ckpt=True), 131_072) == 131_072 * 30
    # no casts: LoRA's frozen 16-bit base, pure bf16, or ZeRO's own fp32 master copy (16-bit model weights)
    for config in (lora, TrainConfig(precision="bf16"), TrainConfig(zero=2, gpus=2)):
        assert weight_cast_bytes(config, 131_072) == 0


def test_eager_attention_moves_its_scores():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    sdpa = elementwise_bytes(tiny, TrainConfig(seq_len=128), 128)
    eager = elementwise_bytes(tiny, TrainConfig(seq_len=128, attention="eager"), 128)
    # per token: 2 layers x 4 heads x 128 keys x 30 passes x 2 B = 61,440 B
    assert eager - sdpa == 61_440 * 128


def test_ops_per_micro_step():
    # 32 blocks x 135; checkpointing adds a forward (a third): 32 x 180
    assert ops_per_micro_step(LLAMA_7B, TrainConfig()) == 32 * 135
    assert ops_per_micro_step(LLAMA_7B, TrainConfig(grad_ckpt=True)) == 32 * 180
    # LoRA on all 7 linears: + 15 each
    assert ops_per_micro_step(LLAMA_7B, TrainConfig(method="lora")) == 32 * 135 + 32 * 7 * 15


def test_calibration_terms_add_up_to_the_step():
    """The calibration's split t = M / mfu + B / e + C, at the defaults, is the step itself."""
    gpu = get_gpu("a10g")
    for config in (TrainConfig(seq_len=512), TrainConfig(method="qlora", grad_ckpt=True, micro_batch=2, seq_len=256)):
        m, b, c = calibration_terms(model=LLAMA_7B, config=config, gpu=gpu)
        step = estimate_throughput(model=LLAMA_7B, config=config, gpu=gpu).step_s
        assert m / 0.80 + b / 0.80 + c == pytest.approx(step, rel=1e-12)
