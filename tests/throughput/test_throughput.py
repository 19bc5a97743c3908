"""The analytical throughput model against numbers derived by hand.

Models are built here (a llama-like ModelSpec from hidden/layers/vocab/intermediate) so the
tests do not depend on the catalog. Reference model: Llama-2-7B's shape.

    per layer:  q, k, v, o   4 x 4096 x 4096   =  67,108,864
                gate, up, down 3 x 4096 x 11008 = 135,266,304
                                                 -----------
                                                 202,375,168 weights
    32 layers:                                 6,476,005,376
    lm_head (32000 x 4096):                      131,072,000
    N (matmul weights per token):              6,607,077,376
    attention forward per token: 4 x L x T x H x Q = 4 x 32 x 2048 x 32 x 128 = 1,073,741,824 (T=2048)
"""

from __future__ import annotations

import pytest

from planner.config import TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import get_gpu
from planner.kernels import (
    FLASH_FRACTION_OF_GEMM,
    FP32_MATMUL_FRACTION,
    GPU_OP_SECONDS,
    elementwise_bytes,
    ops_per_micro_step,
)
from planner.memory import trainable_params
from planner.modelspec import LinearKind, LinearSpec, ModelSpec
from planner.throughput import (
    MEMORY_BANDWIDTH_EFFICIENCY,
    bandwidth_efficiency,
    estimate_throughput,
    flops_per_token,
    link_gbs,
)

N_LAYERS_7B = 6_476_005_376
N_HEAD_7B = 131_072_000
N_7B = 6_607_077_376
ATTN_FWD_7B_2048 = 1_073_741_824
PARAMS_7B = 6_738_415_616  # matmuls + embeddings (131,072,000) + norms (32 x 8192 + 4096)
LORA_R16_ALL_LINEAR_7B = 39_976_960  # 32 x 16 x (4 x 8192 + 3 x 15104)

A100_BF16 = 312e12 * 0.869  # datasheet dense bf16 x the A100's MAMF fraction (planner.kernels)
A100_HBM = 2039e9 * 0.80  # a100-80gb bandwidth x memory efficiency

# GEMM operand bytes per token at 2048 tokens (16-bit): each linear (in x out) reads its input
# (in), writes its output (out) and reads its weight once per micro-step (in x out / 2048 per token):
#   per layer: 4 x (4096 + 4096) + 3 x (4096 + 11008) = 32,768 + 45,312 = 78,080 elements per token
#   x 32 layers = 2,498,560; head: 4096 + 32000 = 36,096 => 2,534,656 elements per token
#   weights: N_7B / 2048 per token
GEMM_IO_7B_2048 = (2_534_656 + N_7B / 2048) * 2  # bytes per token per GEMM pass


def llama(*, hidden: int, layers: int, vocab: int, intermediate: int, heads: int, kv_heads: int | None = None,
          sliding_window: int | None = None) -> ModelSpec:
    kv_heads = kv_heads or heads
    head_dim = hidden // heads

    def lin(name, n_in, n_out, kind):
        return LinearSpec(name=name, in_features=n_in, out_features=n_out, bias=False, kind=kind)

    linears = (
        lin("q_proj", hidden, heads * head_dim, LinearKind.ATTN_IN),
        lin("k_proj", hidden, kv_heads * head_dim, LinearKind.ATTN_IN),
        lin("v_proj", hidden, kv_heads * head_dim, LinearKind.ATTN_IN),
        lin("o_proj", heads * head_dim, hidden, LinearKind.ATTN_OUT),
        lin("gate_proj", hidden, intermediate, LinearKind.MLP_IN),
        lin("up_proj", hidden, intermediate, LinearKind.MLP_IN),
        lin("down_proj", intermediate, hidden, LinearKind.MLP_OUT),
    )
    return ModelSpec(
        id=f"test/llama-{hidden}x{layers}", model_type="llama", is_encoder=False, hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, vocab_size=vocab, max_seq_len=4096, layer_linears=linears,
        layer_norm_params=2 * hidden, embedding_params=vocab * hidden, final_norm_params=hidden,
        head_params=vocab * hidden, tied_embeddings=False, hidden_act="silu", gated_mlp=True, norm="rmsnorm",
        sliding_window=sliding_window,
    )


LLAMA_7B = llama(hidden=4096, layers=32, vocab=32000, intermediate=11008, heads=32)


def cfg(**kw) -> TrainConfig:
    # the fused AdamW, the one the search plans: its update is the 7 passes the hand figures count
    base = dict(micro_batch=1, seq_len=2048, optimizer="adamw_fused")
    return TrainConfig(**(base | kw))


def test_reference_model_counts():
    assert LLAMA_7B.params_total == PARAMS_7B
    assert trainable_params(LLAMA_7B, cfg()) == PARAMS_7B
    assert trainable_params(LLAMA_7B, cfg(method="lora", lora_r=16)) == LORA_R16_ALL_LINEAR_7B


def test_full_finetune_flops_and_compute_time_on_a100():
    est = estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=get_gpu("a100-80gb"))
    # 6N per token (Kaplan 2020) + 3 x attention forward (PaLM appendix B), 2048 tokens
    linear = 6 * N_7B * 2048  # 81,187,766,796,288
    attention = 3 * ATTN_FWD_7B_2048 * 2048  # 6,597,069,766,656
    assert est.flops_per_step == linear + attention == 87_784_836_562_944
    # the GEMMs: their FLOPs at the achieved rate + three passes (forward, dX, dW) of their operands
    io = 3 * GEMM_IO_7B_2048 * 2048 / A100_HBM  # 3 x (5.07 MB + 6.45 MB) x 2048 / 1631 GB/s = 43.4 ms
    assert est.breakdown_s["compute"] == pytest.approx(linear / A100_BF16 + io, rel=1e-12)  # 0.299 + 0.043 s
    # SDPA on a packed batch is causal flash: half the product, at 0.70 of the GEMM rate, and its backward
    # is 2.5 forwards (it recomputes the scores), not the model FLOPs' 2: 3.5 / 3 of the attention FLOPs
    #   6,597,069,766,656 x 3.5 / 3 / 2 / (271.128e12 x 0.70) = 20.28 ms
    assert est.breakdown_s["attention"] == pytest.approx(
        attention * 3.5 / 3 / 2 / (A100_BF16 * FLASH_FRACTION_OF_GEMM), rel=1e-12)
    assert est.breakdown_s["attention"] == pytest.approx(0.02028, rel=1e-3)
    assert est.breakdown_s["recompute"] == est.breakdown_s["dequant"] == 0
    # elementwise: the blocks' ops and the loss, + AMP's fp32 weights cast (6 B) and their gradients
    # accumulated (18 B) per layer weight
    assert est.breakdown_s["elementwise"] == pytest.approx(
        (elementwise_bytes(LLAMA_7B, cfg(), 2048) + N_LAYERS_7B * 24) / A100_HBM, rel=1e-12)
    assert est.breakdown_s["overhead"] == pytest.approx(ops_per_micro_step(LLAMA_7B, cfg()) * GPU_OP_SECONDS, rel=1e-12)
    assert est.breakdown_s["comm"] == est.breakdown_s["offload"] == 0
    # AdamW fp32: 28 B per parameter over 80% of 2039 GB/s
    assert est.breakdown_s["optimizer"] == pytest.approx(PARAMS_7B * 28 / A100_HBM, rel=1e-12)  # 0.1157 s
    assert est.step_s == pytest.approx(sum(est.breakdown_s.values()), rel=1e-12)
    assert est.tokens_per_s == pytest.approx(2048 / est.step_s, rel=1e-12)
    assert set(est.breakdown_s) == {"compute", "attention", "recompute", "elementwise", "dequant", "optimizer",
                                    "overhead", "comm", "offload"}


def test_lora_flops_and_is_faster_than_full():
    lora_cfg = cfg(method="lora", lora_r=16)
    fl = flops_per_token(model=LLAMA_7B, config=lora_cfg)
    # frozen base: forward + activation grads = 4N; adapters A and B: 6 x r x (in + out) per layer
    assert fl.linear == 4 * N_7B + 6 * LORA_R16_ALL_LINEAR_7B
    assert fl.attention == 3 * ATTN_FWD_7B_2048
    gpu = get_gpu("a100-80gb")
    full = estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=gpu)
    lora = estimate_throughput(model=LLAMA_7B, config=lora_cfg, gpu=gpu)
    assert lora.step_s < full.step_s
    assert lora.breakdown_s["optimizer"] == pytest.approx(LORA_R16_ALL_LINEAR_7B * 28 / A100_HBM, rel=1e-12)


def test_lora_named_targets_and_unknown_target():
    # q_proj, v_proj only: 32 x 16 x (8192 + 8192) = 8,388,608 adapter weights
    config = cfg(method="lora", lora_r=16, lora_targets=("q_proj", "v_proj"))
    assert trainable_params(LLAMA_7B, config) == 8_388_608
    with pytest.raises(InvalidConfigError, match="--lora-targets c_attn not found in"):
        estimate_throughput(model=LLAMA_7B, config=cfg(method="lora", lora_targets=("c_attn",)), gpu=get_gpu("a10g"))


def test_checkpointing_adds_one_third_of_the_layer_compute():
    gpu = get_gpu("a100-80gb")
    plain = estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=gpu)
    ckpt = estimate_throughput(model=LLAMA_7B, config=cfg(grad_ckpt=True), gpu=gpu)
    # one more forward of the decoder layers: 2 x N_layers of the 6 x N_layers (the head is not recomputed)
    # plus one attention forward, 1 of the fused kernel's 3.5 (forward + a 2.5x backward); the layers'
    # operands once more
    layer_compute = 6 * N_LAYERS_7B * 2048 / A100_BF16
    layer_io = (2_498_560 + N_LAYERS_7B / 2048) * 2 * 2048 / A100_HBM
    assert ckpt.breakdown_s["recompute"] == pytest.approx(
        layer_compute / 3 + layer_io + plain.breakdown_s["attention"] / 3.5, rel=1e-12)
    # and the blocks' elementwise forward again (elementwise: 1 + 2 -> 1 + 2 + 1 forwards' worth,
    # plus the loss and the fp32 weights' casts once more)
    assert ckpt.step_s - plain.step_s == pytest.approx(
        ckpt.breakdown_s["recompute"] + ckpt.breakdown_s["elementwise"] - plain.breakdown_s["elementwise"]
        + ckpt.breakdown_s["overhead"] - plain.breakdown_s["overhead"], rel=1e-9)
    assert ckpt.flops_per_step == plain.flops_per_step  # model FLOPs exclude recomputation


@pytest.mark.parametrize(
    ("optimizer", "precision", "bytes_per_param"),
    [
        ("adamw_fused", "bf16-mixed", 28),  # r p g m v (4 x 4) + w p m v (3 x 4)
        ("adamw_fused", "bf16", 14),  # the same 7 tensors in 2 bytes
        # torch's unasked path on CUDA (foreach): planner.kernels.ADAMW_SINGLE_TENSOR_PASSES, 20 passes
        ("adamw", "bf16-mixed", 80),
        ("adamw", "bf16", 40),
        ("adamw_8bit", "bf16-mixed", 4 + 4 + 1 + 1 + 4 + 1 + 1 + 4 * 4 / 256),  # = 16.0625
        ("paged_adamw_8bit", "bf16-mixed", 16.0625),
        ("sgd", "bf16-mixed", 20),  # r p g buf + w p buf
        ("adafactor", "bf16-mixed", 64),  # 16 fp32 passes
    ],
)
def test_optimizer_term(optimizer, precision, bytes_per_param):
    est = estimate_throughput(model=LLAMA_7B, config=cfg(optimizer=optimizer, precision=precision), gpu=get_gpu("a100-80gb"))
    # bitsandbytes waits for the device after each of the 291 tensors: its 4 host calls a tensor (one a kernel,
    # 2.4 us each + 6 us for the launch) add to the update (tests/throughput/test_optimizer_step_host.py); the
    # others' dispatch is far under their bytes
    host = 291 * (4 * 2.4e-6 + 6e-6) if "8bit" in optimizer else 0.0
    assert est.breakdown_s["optimizer"] == pytest.approx(PARAMS_7B * bytes_per_param / A100_HBM + host, rel=1e-12)


def test_zero_partitions_the_optimizer_and_adds_the_master_copy():
    # ZeRO-2 on 8 GPUs: each steps 1/8; DeepSpeed's fp32 master adds 4 B read + 2 B write => 34 B
    est = estimate_throughput(model=LLAMA_7B, config=cfg(zero=2, gpus=8), gpu=get_gpu("a100-80gb"))
    assert est.breakdown_s["optimizer"] == pytest.approx(PARAMS_7B / 8 * 34 / A100_HBM, rel=1e-12)


def test_ddp_allreduce_on_8_gpus():
    est = estimate_throughput(model=LLAMA_7B, config=cfg(gpus=8, grad_accum=4), gpu=get_gpu("a100-80gb"))
    # ring all-reduce of fp32 grads once per step: 2 x 7/8 x P x 4 B over NVLink3, 300 GB/s line rate x 0.8
    # of it as payload (NVLINK_PAYLOAD_FRACTION) = 240 GB/s
    assert est.breakdown_s["comm"] == pytest.approx(2 * 7 / 8 * PARAMS_7B * 4 / 240e9, rel=1e-12)  # 0.197 s
    assert est.tokens_per_s == pytest.approx(1 * 4 * 8 * 2048 / est.step_s, rel=1e-12)


def test_zero3_comm_on_8_gpus():
    gpu = get_gpu("a100-80gb")
    est = estimate_throughput(model=LLAMA_7B, config=cfg(zero=3, gpus=8, grad_accum=2), gpu=gpu)
    # per micro-step: all-gather 16-bit params for forward and backward + reduce-scatter 16-bit grads,
    # each 7/8 of the full tensor: 7/8 x 2 B x (2P + P); two micro-steps
    expected = 2 * (7 / 8 * 2 * (2 * PARAMS_7B + PARAMS_7B)) / 240e9  # NVLink3's 300 GB/s x 0.8
    assert est.breakdown_s["comm"] == pytest.approx(expected, rel=1e-12)  # 0.295 s
    ckpt = estimate_throughput(model=LLAMA_7B, config=cfg(zero=3, gpus=8, grad_accum=2, grad_ckpt=True), gpu=gpu)
    # the recompute gathers the parameters a third time
    assert ckpt.breakdown_s["comm"] == pytest.approx(2 * (7 / 8 * 2 * (3 * PARAMS_7B + PARAMS_7B)) / 240e9, rel=1e-12)


def test_collectives_move_payload_at_80_percent_of_nvlinks_line_rate():
    # NCCL's lead: 25 GB/s per NVLink "converts to ~20GB/s effective bandwidth with a 128B payload size"
    # (nvidia/nccl-tests #149): A100 300 -> 240 GB/s, H100 450 -> 360 GB/s; PCIe entries are effective rates
    # already (planner.gpus: ~80% of raw), MI300X's xGMI is not NVLink: both as catalogued
    assert link_gbs(get_gpu("a100-80gb")) == pytest.approx(240.0)
    assert link_gbs(get_gpu("h100-80gb")) == pytest.approx(360.0)
    assert link_gbs(get_gpu("a10g")) == get_gpu("a10g").interconnect_gbs == 25.0
    assert link_gbs(get_gpu("mi300x")) == get_gpu("mi300x").interconnect_gbs
    est = estimate_throughput(model=LLAMA_7B, config=cfg(gpus=8), gpu=get_gpu("h100-80gb"))
    assert any("at 360 GB/s per direction" in line and "80% of its 450 GB/s line rate" in line
               for line in est.assumptions)


def test_pcie_gpus_communicate_over_pcie():
    est = estimate_throughput(model=LLAMA_7B, config=cfg(method="lora", gpus=4), gpu=get_gpu("a10g"))
    # LoRA adapters only, fp32 grads, PCIe gen4 effective 25 GB/s
    assert est.breakdown_s["comm"] == pytest.approx(2 * 3 / 4 * LORA_R16_ALL_LINEAR_7B * 4 / 25e9, rel=1e-12)


def test_offload_optimizer_adds_the_transfers_and_cpu_adam():
    gpu = get_gpu("a100-80gb")
    est = estimate_throughput(model=LLAMA_7B, config=cfg(zero=2, offload="optimizer", grad_accum=2), gpu=gpu)
    # bf16 grads device->host every micro-step (2 x 2 B x P) + bf16 params back once (2 B x P), PCIe gen4 25 GB/s
    assert est.breakdown_s["offload"] == pytest.approx((2 * 2 * PARAMS_7B + 2 * PARAMS_7B) / 25e9, rel=1e-12)  # 1.62 s
    # CPU Adam: 28 B + 2 B for the bf16 copy per parameter at 25 GB/s of host DRAM
    assert est.breakdown_s["optimizer"] == pytest.approx(PARAMS_7B * 30 / 25e9, rel=1e-12)  # 8.09 s
    on_device = estimate_throughput(model=LLAMA_7B, config=cfg(zero=2, grad_accum=2), gpu=gpu)
    assert est.breakdown_s["compute"] == on_device.breakdown_s["compute"]
    assert est.step_s > on_device.step_s


def test_offload_params_streams_weights_every_pass():
    gpu = get_gpu("a100-80gb")
    est = estimate_throughput(model=LLAMA_7B, config=cfg(zero=3, offload="optimizer+params"), gpu=gpu)
    # grads out (2 B x P) + params in for the forward and the backward (2 x 2 B x P); no copy back
    assert est.breakdown_s["offload"] == pytest.approx((2 * PARAMS_7B + 2 * 2 * PARAMS_7B) / 25e9, rel=1e-12)


def test_qlora_dequantisation_is_memory_bound():
    gpu = get_gpu("a10g")
    est = estimate_throughput(model=LLAMA_7B, config=cfg(method="qlora", precision="bf16-mixed"), gpu=gpu)
    # every 4-bit layer weight: read 0.5 B + double-quantised constants (1 B per 64 + 4 B per 64 x 256),
    # write 2 B bf16; forward and backward
    per_weight = 0.5 + 1 / 64 + 4 / 16384 + 2  # 2.515869140625 B
    expected = N_LAYERS_7B * per_weight * 2 / (600e9 * 0.80)  # 67.9 ms
    assert est.breakdown_s["dequant"] == pytest.approx(expected, rel=1e-12)
    ckpt = estimate_throughput(model=LLAMA_7B, config=cfg(method="qlora", grad_ckpt=True), gpu=gpu)
    assert ckpt.breakdown_s["dequant"] == pytest.approx(expected * 3 / 2, rel=1e-12)
    lora = estimate_throughput(model=LLAMA_7B, config=cfg(method="lora"), gpu=gpu)
    # beside the dequantisation: the fp32 residual stream of peft's k-bit preparation (more
    # elementwise bytes) and two dequantisation kernels per quantised linear
    extra = (est.breakdown_s["elementwise"] - lora.breakdown_s["elementwise"]
             + est.breakdown_s["overhead"] - lora.breakdown_s["overhead"])
    assert extra > 0 and est.breakdown_s["overhead"] - lora.breakdown_s["overhead"] == pytest.approx(
        32 * 7 * 2 * GPU_OP_SECONDS, rel=1e-9)
    assert est.step_s == pytest.approx(lora.step_s + expected + extra, rel=1e-9)


def test_precision_picks_the_peak_and_the_default_utilization():
    # the FLOPs of the GEMMs at the precision's peak x its large-GEMM fraction, + the operands
    a10g = get_gpu("a10g")
    fp32 = estimate_throughput(model=LLAMA_7B, config=cfg(precision="fp32"), gpu=a10g)
    io32 = 3 * 2 * GEMM_IO_7B_2048 * 2048 / (600e9 * 0.8)  # fp32 operands: twice the 16-bit bytes
    assert fp32.breakdown_s["compute"] == pytest.approx(6 * N_7B * 2048 / (31.2e12 * FP32_MATMUL_FRACTION) + io32, rel=1e-12)
    t4 = estimate_throughput(model=LLAMA_7B, config=cfg(precision="fp16-mixed"), gpu=get_gpu("t4"))
    io16 = 3 * GEMM_IO_7B_2048 * 2048 / (320e9 * 0.8)
    # the T4's measured fp16 matmul: 41.91 of its 65 TFLOPS (zzc0721/torch-performance-test-data) = 0.645
    assert t4.breakdown_s["compute"] == pytest.approx(6 * N_7B * 2048 / (65e12 * 0.645) + io16, rel=1e-12)


def test_bf16_on_t4_is_refused():
    with pytest.raises(InvalidConfigError, match="T4 has no bf16 support"):
        estimate_throughput(model=LLAMA_7B, config=cfg(precision="bf16-mixed"), gpu=get_gpu("t4"))


def test_utilization_override_and_validation():
    gpu = get_gpu("h100-80gb")
    default = estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=gpu)
    given = estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=gpu, utilization=0.803 / 2)
    # half the large-GEMM efficiency: the FLOP-only attention takes twice as long
    assert given.breakdown_s["attention"] == pytest.approx(default.breakdown_s["attention"] * 2, rel=1e-12)
    assert given.breakdown_s["optimizer"] == default.breakdown_s["optimizer"]  # memory bound: unchanged
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(InvalidConfigError, match="utilization"):
            estimate_throughput(model=LLAMA_7B, config=cfg(), gpu=gpu, utilization=bad)


def test_sliding_window_caps_the_attention_context():
    windowed = llama(hidden=4096, layers=32, vocab=32000, intermediate=11008, heads=32, sliding_window=512)
    fl = flops_per_token(model=windowed, config=cfg())
    assert fl.attention == 3 * 4 * 32 * 512 * 32 * 128


def test_only_flash_reads_fewer_keys_in_a_sliding_layer():
    """flash-attn takes the window (window_size) and skips the keys outside it; SDPA gets a materialised
    window mask and eager adds one to the whole score matrix: both compute every key."""
    from planner.kernels import _attention_layers

    windowed = llama(hidden=4096, layers=32, vocab=32000, intermediate=11008, heads=32, sliding_window=512)
    assert _attention_layers(windowed, cfg(attention="flash")) == ((32, 32, 128, 512),)
    assert _attention_layers(windowed, cfg(attention="sdpa")) == ((32, 32, 128, 2048),)
    assert _attention_layers(windowed, cfg(attention="eager")) == ((32, 32, 128, 2048),)


def test_gpt_oss_alternates_sliding_and_full_layers():
    """gpt-oss-20b (configuration_gpt_oss.py: layer_types sliding, full, ... over 24 layers; window 128; 64
    heads of 64): under flash 12 layers read 128 keys and 12 the whole 4096; SDPA, which the model lacks, runs
    eager (OpenAI's recipe) over every key of all 24."""
    from planner.catalog import resolve_model
    from planner.kernels import _attention_layers

    oss = resolve_model("openai/gpt-oss-20b")
    assert [(n, view.sliding_attention) for n, _, view in oss.block_kinds] == [(12, True), (12, False)]
    flash = cfg(attention="flash", seq_len=4096, precision="bf16")
    assert sorted(_attention_layers(oss, flash)) == [(12, 64, 64, 128), (12, 64, 64, 4096)]
    assert _attention_layers(oss, cfg(attention="sdpa", seq_len=4096, precision="bf16")) == ((24, 64, 64, 4096),)


def test_cpu_profile_estimate():
    tiny = llama(hidden=64, layers=2, vocab=1000, intermediate=256, heads=4)
    cpu = get_gpu("cpu")
    # torch.optim.AdamW as planner measure's worker builds it by default: the CPU's single-tensor path
    est = estimate_throughput(model=tiny, config=cfg(seq_len=128, micro_batch=2, precision="fp32", optimizer="adamw"),
                              gpu=cpu)
    # per layer 4 x 64 x 64 + 3 x 64 x 256 = 65,536 weights; x2 layers + head 64,000 = 195,072; the
    # CPU profile's rate is its measured GEMM rate (fraction 1.0); fp32 operands: per layer
    # 4 x (64 + 64) + 3 x (64 + 256) = 1,472 elements per token, x2 + head 1,064 = 4,008, and the
    # weights once per pass, 3 passes x 4 B, at the profile's 37 GB/s as measured (an achieved rate: no 0.8
    # datasheet efficiency on top, unlike the GPUs')
    assert MEMORY_BANDWIDTH_EFFICIENCY == 0.8 and bandwidth_efficiency(cpu) == 1.0
    io = 3 * (4_008 * 256 + 195_072) * 4 / 37e9
    assert est.breakdown_s["compute"] == pytest.approx(6 * 195_072 * 256 / 0.19e12 + io, rel=1e-12)
    # torch.optim.AdamW's single-tensor path on the CPU: 20 element passes x 4 B = 80 B per parameter, plus
    # 24 us of host time per tensor: embedding, 2 x (7 linears + 2 norms), final norm, head = 21 tensors; no
    # tensor reaches glibc's 32 MiB mmap threshold (the largest, 64,000 fp32 weights, is 256 kB): no page faults
    assert est.breakdown_s["optimizer"] == pytest.approx(
        tiny.params_total * 80 / 37e9 + 21 * 24e-6, rel=1e-12
    )
    # fp32 (no autocast): 9 us per op, 2 blocks x 135 ops
    assert est.breakdown_s["overhead"] == pytest.approx(2 * 135 * 9e-6, rel=1e-12)
    assert any("MFU default" in a for a in est.assumptions)


def test_cpu_page_faults_of_tensors_past_the_mmap_threshold():
    # a 50,000 x 384 vocabulary: the embedding and the untied head are 19,200,000 fp32 weights (76.8 MB), past
    # glibc's 32 MiB (33,554,432 B) mmap threshold, so c10's CPU allocator maps each such tensor in afresh.
    # bf16-mixed full fine-tuning, 1 x 64 tokens, per micro-step:
    #   logits 64 x 50,000 = 3,200,000 x 4 B = 12.8 MB: under the threshold, none
    #   the head under AMP: its bf16 copy 38.4 MB, its bf16 gradient 38.4 MB and the fp32 buffer the CPU's bf16
    #   matmul computes it into (KernelProfile.mm_fp32_buffer) 76.8 MB, that gradient cast to fp32 76.8 MB = 230.4 MB
    #   the embedding's dense fp32 gradient 76.8 MB (untied: no sum of two partials); block weights <= 1.5 MB
    #   => 307,200,000 B
    # per step: single-tensor AdamW's two temporaries (sqrt, /) of the embedding and of the head: 4 x 76.8 MB
    from planner.kernels import CPU_FIRST_TOUCH_SECONDS_PER_BYTE
    from planner.throughput import fresh_bytes

    import dataclasses

    from planner.gpus import cpu_kernels

    # an AMX CPU's bf16 matmul holds the fp32 buffer (planner.gpus.bf16_matmul_fp32_buffer), this AMD EPYC's not
    amx = dataclasses.replace(get_gpu("cpu"), kernels=cpu_kernels(amx=True))
    no_amx = dataclasses.replace(get_gpu("cpu"), kernels=cpu_kernels(amx=False))
    model = llama(hidden=384, layers=1, vocab=50_000, intermediate=1024, heads=6)
    config = cfg(precision="bf16-mixed", micro_batch=1, seq_len=64, optimizer="adamw")  # the single-tensor step
    assert fresh_bytes(model=model, config=config, gpu=amx) == (307_200_000, 307_200_000)
    assert fresh_bytes(model=model, config=config, gpu=no_amx) == (230_400_000, 307_200_000)  # no 76.8 MB buffer
    assert fresh_bytes(model=model, config=config, gpu=get_gpu("a100-80gb")) == (0.0, 0.0)  # caching allocator
    # 4 x 64 = 256 tokens: the fp32 logits (256 x 50,000 x 4 B = 51.2 MB) pass it too: bf16 output 25.6 MB (no),
    # logits.float() 51.2, log-softmax 51.2, nll gradient 51.2, log-softmax gradient 51.2 (yes), cast back 25.6 (no),
    # the matmul's fp32 buffer 51.2 (yes)
    bigger = cfg(precision="bf16-mixed", micro_batch=4, seq_len=64, optimizer="adamw")
    assert fresh_bytes(model=model, config=bigger, gpu=amx)[0] == 307_200_000 + 5 * 51_200_000
    assert fresh_bytes(model=model, config=bigger, gpu=no_amx)[0] == 230_400_000 + 4 * 51_200_000
    # 1 thread's 394 ps per byte over the 2 threads' 1.5x
    assert CPU_FIRST_TOUCH_SECONDS_PER_BYTE == pytest.approx(394e-12 / 1.5, rel=1e-12)
    cpu = estimate_throughput(model=model, config=config, gpu=amx).breakdown_s
    params = model.params_total
    tensors = 1 + 9 + 1 + 1
    assert cpu["optimizer"] == pytest.approx(params * 80 / 37e9 + 307_200_000 * 394e-12 / 1.5
                                             + tensors * 24e-6, rel=1e-12)


def test_llama4_expert_flops_scale_with_every_expert():
    # Llama4TextMoe repeats every token for every expert (modeling_llama4.py:169, hidden_states.repeat(E, 1)) and
    # runs two bmm over the E x T rows: its expert GEMMs count all 4 experts, not the top-1. support.models'
    # LLAMA4_TINY: hidden 64, q/o 64 x 64, k/v 64 x 32 => attention 12,288 weights per layer;
    #   dense layers (0, 2): SwiGLU 3 x 64 x 96 = 18,432 => 30,720
    #   MoE layers (1, 3): router 64 x 4 = 256, shared SwiGLU 3 x 64 x 32 = 6,144, per expert gate_up 64 x 64 +
    #   down 32 x 64 = 6,144, x 4 experts = 24,576 => 12,288 + 256 + 6,144 + 24,576 = 43,264 (top-1 only: 24,832)
    #   blocks 2 x 30,720 + 2 x 43,264 = 147,968; lm_head 256 x 64 = 16,384 => 164,352; full: 6 x per token
    from support.models import LLAMA4_TINY

    from planner.catalog import spec_from_config

    spec = spec_from_config(LLAMA4_TINY, model_id="tiny-llama4", source="test")
    fl = flops_per_token(model=spec, config=TrainConfig(method="full", precision="bf16-mixed", micro_batch=1, seq_len=32))
    assert fl.linear == 6 * 164_352


def test_memo_prices_the_cpu_host_terms_as_step_breakdown_does():
    # the search's memo and step_breakdown give the same floats on the CPU, page faults and AdamW's host time
    # included (a vocabulary past the mmap threshold; full and LoRA; logits past it at 4 x 64 tokens)
    from planner.throughput import ThroughputMemo, step_breakdown

    model = llama(hidden=384, layers=1, vocab=50_000, intermediate=1024, heads=6)
    cpu = get_gpu("cpu")
    memo = ThroughputMemo(model, cpu)
    for config in (cfg(precision="bf16-mixed", micro_batch=4, seq_len=64), cfg(precision="fp32", micro_batch=1, seq_len=64),
                   cfg(method="lora", lora_r=8, precision="bf16", micro_batch=4, seq_len=64, grad_accum=2)):
        parts = step_breakdown(model=model, config=config, gpu=cpu)
        assert memo.breakdown(config) == parts
        assert parts["elementwise"] > 0 and parts["optimizer"] > 0
