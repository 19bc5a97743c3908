"""torch.compile's step (``TrainConfig.compile``, planner.kernels): Inductor's fused kernels against eager's ops,
each worked out by hand on a small Llama block."""

from __future__ import annotations

import pytest
from test_throughput import llama  # noqa: E402

from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import (
    CUDA_OP_HOST_SECONDS,
    block_forward_bytes,
    compiled_block_forward_bytes,
    elementwise_bytes,
    host_op_seconds,
    ops_per_micro_step,
)
from planner.memory import estimate_memory
from planner.throughput import estimate_throughput, step_breakdown

#: hidden 64, 4 heads of 16 (2 KV heads), intermediate 128, vocab 100, 2 blocks
TINY = llama(hidden=64, layers=2, vocab=100, intermediate=128, heads=4, kv_heads=2)


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**({"method": "full", "precision": "bf16", "micro_batch": 1, "seq_len": 8} | kw))


def test_a_compiled_block_moves_one_read_and_write_per_fusion_group():
    # pure bf16: a 2-byte stream and 2-byte activations
    # eager (per token, forward): two RMSNorms at 36 B and two residual adds at 6 B per hidden element
    # (64 x 84 = 5,376), rotary at 28 B on q and k ((4 + 2) x 16 x 28 = 2,688), SiLU x up at 10 B (128 x 10 = 1,280)
    assert block_forward_bytes(TINY, cfg()) == 5376 + 2688 + 1280 == 9344
    # compiled: two residual-add + RMSNorm groups, each reading the stream and the branch output and writing
    # the stream and the normed output (2 x 64 x 8 = 1,024); rotary reads q and k once and writes them once
    # (96 x 4 = 384); SiLU x up reads gate and up and writes the product (128 x 6 = 768)
    assert compiled_block_forward_bytes(TINY, cfg(compile=True)) == 1024 + 384 + 768 == 2176
    # the micro-step: forward + backward (2x) over 2 blocks, plus the loss per logit: eager 24 B, compiled 3
    # passes of the bf16 logits (6 B)
    assert elementwise_bytes(TINY, cfg(), 1) == 9344 * 3 * 2 + 100 * 24 == 58464
    assert elementwise_bytes(TINY, cfg(compile=True), 1) == 2176 * 3 * 2 + 100 * 6 == 13656
    # bf16-mixed full fine-tuning keeps fp32 weights, so the stream is fp32: the groups read and write it at 4 B
    # (2 x 64 x (4 + 4 + 2 + 2) = 1,536), and the casts of the normed output to 16 bits are fused into them
    assert compiled_block_forward_bytes(TINY, cfg(precision="bf16-mixed", compile=True)) == 1536 + 384 + 768


def test_a_compiled_micro_step_launches_its_fused_kernels_and_gemms():
    # eager: 135 ops per block per micro-step
    assert ops_per_micro_step(TINY, cfg()) == 2 * 135
    # compiled, full fine-tuning: per block 4 fused kernels forward, 7 backward, 7 linears x (forward, input and
    # weight gradient), attention forward and backward: 34; the model's own 8 (8 such blocks: 280, the count the
    # output code of a compiled 8-layer LlamaForCausalLM has on the CPU, bench/compile_cpu.py kernels)
    assert ops_per_micro_step(TINY, cfg(compile=True)) == 2 * 34 + 8 == 76
    eight = llama(hidden=64, layers=8, vocab=100, intermediate=128, heads=4, kv_heads=2)
    assert ops_per_micro_step(eight, cfg(compile=True)) == 280
    # LoRA on q and v: the frozen base has no weight gradients (backward 7 + 7 + 1) and each adapter launches 8
    # kernels (6 GEMMs, the scale-and-add and its gradient); checkpointing runs the forward's 4 + 7 + 1 again
    lora = cfg(method="lora", lora_targets=("q_proj", "v_proj"), compile=True, grad_ckpt=True)
    assert ops_per_micro_step(TINY, lora) == 2 * ((4 + 7 + 1) * 2 + (7 + 7 + 1) + 2 * 8) + 8 == 118


def test_each_compiled_kernel_costs_its_host_call_and_launch():
    gpu = get_gpu("a100-80gb")
    # measured: 8.2 us per kernel of a compiled fp32 step, 16.9 under autocast, plus the CUDA launch
    assert host_op_seconds(gpu, cfg(compile=True)) == pytest.approx(8.2e-6 + CUDA_OP_HOST_SECONDS)
    assert host_op_seconds(gpu, cfg(precision="bf16-mixed", compile=True)) == pytest.approx(16.9e-6 + CUDA_OP_HOST_SECONDS)
    assert host_op_seconds(gpu, cfg()) == pytest.approx(6.5e-6 + CUDA_OP_HOST_SECONDS)


def test_compile_prices_only_the_elementwise_work_and_the_kernels_and_says_the_memory_is_eagers():
    model = llama(hidden=4096, layers=32, vocab=128256, intermediate=14336, heads=32, kv_heads=8)
    gpu = get_gpu("rtx4090")
    eager = cfg(method="lora", micro_batch=2, seq_len=2048, grad_ckpt=True)
    compiled = eager.replace(compile=True)
    before, after = (step_breakdown(model=model, config=c, gpu=gpu) for c in (eager, compiled))
    # GEMMs, attention, their recompute and the optimizer are eager's (extern kernels)
    for part in ("compute", "attention", "recompute", "optimizer"):
        assert after[part] == before[part], part
    # Llama 3.1 8B, LoRA r16 all-linear, bf16: 0.85 s of eager elementwise work, 0.30 s fused
    assert after["elementwise"] == pytest.approx(0.302, abs=0.001) and before["elementwise"] == pytest.approx(0.847, abs=0.001)
    assert after["overhead"] <= before["overhead"]
    estimate = estimate_throughput(model=model, config=compiled, gpu=gpu)
    assert estimate.tokens_per_s > estimate_throughput(model=model, config=eager, gpu=gpu).tokens_per_s
    assert any("torch.compile" in a and "upper bound" in a for a in estimate.assumptions)
    # the memory model has no compiled term: the same bytes (the plan says they are a bound)
    assert (estimate_memory(model=model, config=compiled, gpu=gpu).peak_allocated_bytes
            == estimate_memory(model=model, config=eager, gpu=gpu).peak_allocated_bytes)
