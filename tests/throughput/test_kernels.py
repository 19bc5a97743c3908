"""The kernel terms of the step (planner.kernels), each against numbers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
from test_throughput import LLAMA_7B, llama  # noqa: E402

from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import (
    CPU_BERNOULLI_SECONDS_PER_ELEMENT,
    CPU_FLASH_FRACTION_OF_GEMM,
    CPU_MATH_FRACTION_OF_GEMM,
    DeviceRates,
    adapter_flop_weight,
    attention_flops,
    block_forward_bytes,
    block_weights,
    draw_bytes,
    dropout_draws,
    elementwise_bytes,
    gemm,
    gemm_seconds,
    matmul_fraction,
    ops_per_micro_step,
    stream_cast_elements,
    weight_cast_bytes,
)
from planner.sharding import Sharding
from planner.throughput import calibration_terms, estimate_throughput

A100 = DeviceRates(gemm=312e12 * 0.869, bandwidth=2039e9 * 0.8, op_seconds=1e-6)


def test_mamf_fractions_per_device():
    # stas00/ml-engineering MAMF table: A100 SXM 271.2 / 312, H100 SXM 794.5 / 989
    assert matmul_fraction(get_gpu("a100-80gb"), TrainConfig().precision) == 0.869
    assert matmul_fraction(get_gpu("h100-80gb"), TrainConfig().precision) == 0.803
    # zzc0721/torch-performance-test-data database.md, best square torch matmul over the catalog's dense peak:
    #   RTX A6000 bf16 123.34 / 154.8 = 0.7968 -> 0.797; V100-SXM2-16GB fp16 94.84 / 125 = 0.7587 -> 0.759;
    #   L40S 269.15 / 362.05 = 0.7434 -> 0.743; T4 fp16 41.91 / 65 = 0.6448 -> 0.645
    assert matmul_fraction(get_gpu("rtx-a6000"), TrainConfig().precision) == 0.797
    assert matmul_fraction(get_gpu("v100-16gb"), TrainConfig(precision="fp16-mixed").precision) == 0.759
    assert matmul_fraction(get_gpu("l40s"), TrainConfig().precision) == 0.743
    assert matmul_fraction(get_gpu("t4"), TrainConfig(precision="fp16-mixed").precision) == 0.645
    # half-rate FP32-accumulate cards reach their rated peak: RTX 4090 170.06 / 165.2 = 1.029 (capped at 1.0);
    # the L40 at half its die's rate (181.05 = 568 tensor cores x 2.49 GHz x 128, the 4090's 128 per clock)
    assert matmul_fraction(get_gpu("rtx4090"), TrainConfig().precision) == 1.0
    assert matmul_fraction(get_gpu("l40"), TrainConfig().precision) == 1.0
    assert 181.05e12 / (568 * 2.49e9) == pytest.approx(128, rel=0.001)
    assert 165.2e12 / (512 * 2.52e9) == pytest.approx(128, rel=0.001)
    assert matmul_fraction(get_gpu("a40"), TrainConfig().precision) == 0.80  # in neither table
    assert matmul_fraction(get_gpu("a10g"), TrainConfig(precision="fp32").precision) == 0.75
    # fp32 on CUDA cores, the same table's fp32 column: V100 14.06 / 15.7 = 0.8955 -> 0.896 (one FMA per core per
    # clock is reached); RTX 4090 55.01 / 82.6 = 0.6660 -> 0.666 (its dual-issue second datapath is not)
    assert matmul_fraction(get_gpu("v100-16gb"), TrainConfig(precision="fp32").precision) == 0.896
    assert matmul_fraction(get_gpu("rtx4090"), TrainConfig(precision="fp32").precision) == 0.666
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
    # causal half, weighted by 1 / 0.70 (FlashAttention-2 at 0.70 of the GEMM rate); its backward
    # recomputes S = QK^T: 2.5 forwards (flash-attention's benchmark counts bwd as 2.5 x fwd), 3.5 in all
    assert flash_fwd == pytest.approx(forward / 2 / 0.70, rel=1e-12) and flash_total == pytest.approx(3.5 * flash_fwd)
    eager_total, eager_fwd = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, attention="eager"), 2048)
    assert eager_fwd == forward and eager_total == 3 * forward  # full product at the GEMM rate, backward 2x
    # a padded batch: SDPA's masked (memory-efficient) kernel, the full product at 0.5 of the GEMM rate
    _, masked = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, packing=False), 2048)
    assert masked == pytest.approx(forward / 0.5, rel=1e-12)
    # a padded batch under flash: transformers unpads it into the varlen kernel, causal all the same
    _, padded_flash = attention_flops(LLAMA_7B, TrainConfig(seq_len=2048, attention="flash", packing=False), 2048)
    assert padded_flash == pytest.approx(forward / 2 / 0.70, rel=1e-12)


def test_block_elementwise_bytes_by_hand():
    # Llama-2-7B block forward per token at 16 bits (pure bf16):
    #   hidden 4096 x (2 RMSNorms x 36 + residuals 12) = 4096 x 84 = 344,064
    #   rotary (32 + 32 heads) x 128 x 28 = 229,376
    #   SwiGLU 11008 x 10 = 110,080                       => 683,520 B
    assert block_forward_bytes(LLAMA_7B, TrainConfig(precision="bf16")) == 683_520
    # fp32 activations: twice
    assert block_forward_bytes(LLAMA_7B, TrainConfig(precision="fp32")) == 2 * 683_520
    # bf16-mixed (torch AMP, fp32 weights): the fp32 RMSNorm weights make the norms and residuals fp32;
    # the projections return bf16, so rotary and SwiGLU stay 16-bit: 344,064 x 2 + 229,376 + 110,080
    assert block_forward_bytes(LLAMA_7B, TrainConfig()) == 2 * 344_064 + 229_376 + 110_080 == 1_027_584
    # QLoRA: peft's k-bit preparation makes the stream fp32 and bitsandbytes returns the projections
    # in their input's dtype, so rotary and SwiGLU run fp32 too: every term doubles
    assert block_forward_bytes(LLAMA_7B, TrainConfig(method="qlora")) == 2 * 683_520


def test_casts_between_the_fp32_stream_and_16_bits():
    # AMP: q, k, v, gate and up each cast the fp32 normed input: 32 layers x 5 x 4096 = 655,360 per token
    assert stream_cast_elements(LLAMA_7B, TrainConfig()) == 32 * 5 * 4096 == 655_360
    # QLoRA: Linear4bit casts its input in and its output back for q, k, v, gate, up and down (o_proj
    # reads the 16-bit attention output): ins 5 x 4096 + 11008 = 31,488, outs 3 x 4096 + 2 x 11008 +
    # 4096 = 38,400, x 32 layers = 2,236,416
    assert stream_cast_elements(LLAMA_7B, TrainConfig(method="qlora")) == 32 * (31_488 + 38_400) == 2_236_416
    # 16-bit weights (pure bf16, LoRA's frozen base, ZeRO's 16-bit model weights) and fp32: no casts
    for config in (TrainConfig(precision="bf16"), TrainConfig(method="lora"), TrainConfig(zero=2, gpus=2),
                   TrainConfig(precision="fp32")):
        assert stream_cast_elements(LLAMA_7B, config) == 0


def test_micro_step_elementwise_bytes_by_hand():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    # block forward per token (16-bit weights): 64 x 84 + (4 + 4) x 16 x 28 + 256 x 10 = 5,376 + 3,584 + 2,560
    # = 11,520 B
    assert block_forward_bytes(tiny, TrainConfig(precision="bf16")) == 11_520
    lora = TrainConfig(method="lora", lora_r=8, seq_len=128)
    # per token: 2 blocks x 11,520 x (forward 1 + backward 2) = 69,120; loss 1000 x 24 = 24,000;
    # adapters on all 7 linears per block (no dropout): outputs x 14 + inputs x 6:
    #   outs 4 x 64 + 2 x 256 + 64 = 832, ins 4 x 64 + 2 x 64 + 256 = 640 -> 832 x 14 + 640 x 6 = 15,488,
    #   + peft's fp32 copy of each adapter's input and its gradient cast back: 640 x (6 + 6) = 7,680; x 2 blocks
    per_token = 69_120 + 24_000 + 2 * (15_488 + 7_680)
    assert per_token == 139_456
    # a LoRA dropout drops each adapter's fp32 copy: 10 B x 2 (fp32) per input element: 2 x 640 x 20 = 25,600
    dropped = TrainConfig(method="lora", lora_r=8, seq_len=128, lora_dropout=0.1)
    assert elementwise_bytes(tiny, dropped, 128) - elementwise_bytes(tiny, lora, 128) == 25_600 * 128
    assert elementwise_bytes(tiny, lora, 128) == per_token * 128
    # full fine-tuning, bf16-mixed: the fp32 weights cast per forward (6 B) and the gradients
    # accumulated (18 B): 2 x 65,536 weights x 24 B = 3,145,728 B, on top of, per token: the fp32
    # stream's blocks 2 x (64 x 84 x 2 + 3,584 + 2,560) x 3 = 101,376, the loss 24,000 and the casts of
    # q, k, v, gate and up's inputs 2 layers x 5 x 64 x 6 B x (forward + backward) = 7,680: 133,056
    full = TrainConfig(seq_len=128)
    assert elementwise_bytes(tiny, full, 128) == (101_376 + 24_000 + 7_680) * 128 == 133_056 * 128
    assert block_weights(tiny) == 2 * 65_536
    assert weight_cast_bytes(full, block_weights(tiny)) == 2 * 65_536 * 24
    # with checkpointing the recompute casts again: 6 + 6 + 18 = 30 B per weight
    assert weight_cast_bytes(TrainConfig(seq_len=128, grad_ckpt=True), 131_072) == 131_072 * 30
    # no casts: LoRA's frozen 16-bit base, pure bf16, or ZeRO's own fp32 master copy (16-bit model weights)
    for config in (lora, TrainConfig(precision="bf16"), TrainConfig(zero=2, gpus=2)):
        assert weight_cast_bytes(config, 131_072) == 0
    # FSDP2 at bf16-mixed gathers each unit in bf16 and runs it without autocast: no weight casts and a 16-bit
    # stream, per token the blocks 2 x (64 x 84 + 3,584 + 2,560) x 3 = 69,120 and the loss 24,000 = 93,120
    fsdp2 = TrainConfig(seq_len=128, gpus=2, sharding=Sharding("fsdp2", "none"))
    assert weight_cast_bytes(fsdp2, 131_072) == 0
    assert elementwise_bytes(tiny, fsdp2, 128) == (69_120 + 24_000) * 128 == 93_120 * 128


def test_eager_attention_moves_its_scores():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    sdpa = elementwise_bytes(tiny, TrainConfig(seq_len=128), 128)
    eager = elementwise_bytes(tiny, TrainConfig(seq_len=128, attention="eager"), 128)
    # per token: 2 layers x 4 heads x 128 keys x 30 passes x 4 B = 122,880 B: under AMP the mask, in the
    # fp32 model's dtype, promotes the scores to fp32; with 16-bit weights they stay 2 B (61,440 B)
    assert eager - sdpa == 122_880 * 128
    pure = TrainConfig(seq_len=128, precision="bf16")
    assert (elementwise_bytes(tiny, TrainConfig(seq_len=128, precision="bf16", attention="eager"), 128)
            - elementwise_bytes(tiny, pure, 128)) == 61_440 * 128


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
        # the A10G's large GEMMs reach the 70 TFLOPS the catalog takes from a measured matmul (1.0); bandwidth 0.80
        assert m / 1.0 + b / 0.80 + c == pytest.approx(step, rel=1e-12)


def test_peft_fp32_adapters_under_pure_16_bit_cost_fp32_gemms_and_the_promoted_add():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    cpu, a100 = get_gpu("cpu"), get_gpu("a100-80gb")
    pure = TrainConfig(method="lora", lora_r=8, seq_len=128, precision="bf16")
    mixed = TrainConfig(method="lora", lora_r=8, seq_len=128, precision="bf16-mixed")
    # the adapters multiply in fp32 without autocast: the precision's rate over fp32's
    assert adapter_flop_weight(cpu, pure) == pytest.approx(0.415 / 0.19)
    # A100: bf16 312 x 0.869 = 271.1 TFLOP/s over fp32 19.5 x 0.984 = 19.19 (its measured fp32 matmul) = 14.13
    assert adapter_flop_weight(a100, pure) == pytest.approx(312 * 0.869 / (19.5 * 0.984))
    assert adapter_flop_weight(a100, mixed) == 1.0 and adapter_flop_weight(None, pure) == 1.0
    assert adapter_flop_weight(a100, TrainConfig(seq_len=128, precision="bf16")) == 1.0  # full: no adapters
    # outputs per token: 4 x 64 + 2 x 256 + 64 = 832 elements x 2 blocks; per element 44 B (fp32 scale, the
    # add into fp32, the cast back, and their gradients) instead of autocast's 14 (the rest alike: no fp32
    # stream in either): (44 - 14) x 1,664 = 49,920 B; 8 B more where the add promotes by copy (the CPU)
    assert elementwise_bytes(tiny, pure, 1, a100) - elementwise_bytes(tiny, mixed, 1, a100) == 49_920
    assert elementwise_bytes(tiny, pure, 1, cpu) - elementwise_bytes(tiny, pure, 1, a100) == 8 * 1_664
    assert elementwise_bytes(tiny, mixed, 1, cpu) == elementwise_bytes(tiny, mixed, 1)


def test_the_cpu_prices_sdpa_at_its_measured_fractions():
    cfg = TrainConfig(seq_len=256, precision="bf16")
    # forward product per token: 4 x 2 layers x 256 keys x 4 heads x 16 = 131,072 FLOPs
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    product = 4 * 2 * 256 * 4 * 16
    total, _ = attention_flops(tiny, cfg, 1, get_gpu("cpu"))
    # the flash kernel, causal: half the product, forward + 2.5 x backward, at the CPU's fraction
    assert total == pytest.approx(3.5 * product / 2 / CPU_FLASH_FRACTION_OF_GEMM)
    assert attention_flops(tiny, cfg, 1)[0] == pytest.approx(3.5 * product / 2 / 0.70)  # no device: the GPUs'
    # attention dropout sends the CPU's SDPA down the math path: the whole product, its backward twice
    dropped = dataclasses.replace(tiny, attn_dropout=0.1)
    assert attention_flops(dropped, cfg, 1, get_gpu("cpu"))[0] == pytest.approx(3 * product / CPU_MATH_FRACTION_OF_GEMM)
    assert attention_flops(dropped, cfg, 1, get_gpu("a100-80gb"))[0] == pytest.approx(3.5 * product / 2 / 0.70)


def test_the_cpu_prices_its_serial_dropout_draw(monkeypatch):
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    dropped = dataclasses.replace(tiny, hidden_dropout=0.1, attn_dropout=0.1, embedding_dropout=0.1)
    sdpa = TrainConfig(seq_len=128)
    # per token: two hidden dropouts x 64 x 2 blocks = 256, the embeddings' 64 once; SDPA's own draw is in its
    # measured math-path rate
    assert dropout_draws(dropped, sdpa) == 320 and dropout_draws(tiny, sdpa) == 0
    # eager attention drops its probabilities: 2 layers x 4 heads x 128 keys = 1,024 more
    eager = TrainConfig(seq_len=128, attention="eager")
    assert dropout_draws(dropped, eager) == 1_344
    # checkpointing's recompute redraws the blocks' (not the embeddings'): (256 + 1,024) x 2 + 64
    assert dropout_draws(dropped, TrainConfig(seq_len=128, attention="eager", grad_ckpt=True)) == 2_624
    # LoRA dropout on every linear: each adapter drops its own input, per block q, k, v, o, gate, up 64 and
    # down 256 = 640, x 2 blocks; none without it
    lora = TrainConfig(seq_len=128, method="lora")
    assert dropout_draws(dropped, dataclasses.replace(lora, lora_dropout=0.05)) == 320 + 1_280
    assert dropout_draws(dropped, lora) == 320
    # the CPU's 5.9 ns per element as bytes at its measured 37 GB/s: 218.3 B; nothing on the GPUs
    assert CPU_BERNOULLI_SECONDS_PER_ELEMENT == 5.9e-9
    assert draw_bytes(get_gpu("cpu")) == pytest.approx(218.3, rel=1e-12)
    assert draw_bytes(get_gpu("a100-80gb")) == 0.0 and draw_bytes(None) == 0.0
    cpu, a100 = get_gpu("cpu"), get_gpu("a100-80gb")
    assert elementwise_bytes(dropped, sdpa, 512, cpu) - elementwise_bytes(dropped, sdpa, 512, a100) == \
        pytest.approx(320 * 512 * 218.3, rel=1e-12)
    # in the step: 320 x 512 tokens x 5.9 ns = 0.967 ms more elementwise time than the same model without the draw
    config = TrainConfig(seq_len=256, micro_batch=2)
    with_draw = estimate_throughput(model=dropped, config=config, gpu=cpu).breakdown_s["elementwise"]
    monkeypatch.setattr("planner.kernels.CPU_BERNOULLI_SECONDS_PER_ELEMENT", 0.0)
    free_draw = estimate_throughput(model=dropped, config=config, gpu=cpu).breakdown_s["elementwise"]
    assert with_draw - free_draw == pytest.approx(320 * 512 * 5.9e-9, rel=1e-9)
