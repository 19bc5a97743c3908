"""The host's dispatch as a floor under a GPU micro-step (planner/kernels.py ``host_op_seconds``, ``host_excess``;
planner/throughput.py ``_step_parts``): eager PyTorch issues each kernel from one host thread, so a micro-step takes
at least its ops x the host seconds per op; where its kernels are longer the step is the device's, unchanged.

Hand figures: a block is 135 counted ops (``OPS_PER_BLOCK``), 180 under checkpointing (its forward again: x 4/3).
Host seconds per counted op on a GPU = the framework's (``HOST_OP_SECONDS``: fp32 / pure 16-bit 6.5 us, under
autocast 10.9 us; checkpointed non-reentrant 11.7 / 16.0 us, reentrant 8.1 / 12.6 us) + the CUDA path's 6 us
(``CUDA_OP_HOST_SECONDS``).
"""

from __future__ import annotations

import pytest
from test_throughput import LLAMA_7B, llama  # noqa: E402

from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import CPU_OP_SECONDS, GPU_OP_SECONDS, host_excess, host_op_seconds
from planner.throughput import ThroughputMemo, step_breakdown

#: two blocks of width 64 at 16 tokens: each kernel is nanoseconds of work, the host's dispatch is milliseconds
TINY = llama(hidden=64, layers=2, vocab=256, intermediate=128, heads=2)
MICRO = ("compute", "attention", "recompute", "elementwise", "overhead")  # the parts a micro-step's kernels fill


def tiny(**kw) -> TrainConfig:
    return TrainConfig(**({"micro_batch": 1, "seq_len": 16, "precision": "bf16", "optimizer": "adamw_fused"} | kw))


def micro_seconds(parts: dict[str, float]) -> float:
    return sum(parts[k] for k in MICRO)


@pytest.mark.parametrize(("kw", "per_op", "ops"), [
    ({}, 6.5e-6 + 6e-6, 2 * 135),  # pure bf16, no autocast: 270 x 12.5 us = 3.375 ms
    ({"precision": "bf16-mixed"}, 10.9e-6 + 6e-6, 2 * 135),  # autocast: 270 x 16.9 us = 4.563 ms
    ({"precision": "bf16-mixed", "grad_ckpt": True}, 16.0e-6 + 6e-6, 2 * 180),  # 360 x 22 us = 7.92 ms
    ({"precision": "bf16-mixed", "grad_ckpt": True, "reentrant_ckpt": True}, 12.6e-6 + 6e-6, 2 * 180),  # 6.696 ms
    ({"precision": "fp32", "grad_accum": 4}, 6.5e-6 + 6e-6, 2 * 135),  # four micro-steps of 3.375 ms
])
def test_a_tiny_model_on_a_gpu_takes_its_hosts_dispatch(kw, per_op, ops):
    a100 = get_gpu("a100-80gb")
    config = tiny(**kw)
    assert host_op_seconds(a100, config) == pytest.approx(per_op, rel=1e-12)
    parts = step_breakdown(model=TINY, config=config, gpu=a100)
    # the micro-steps' kernels and gaps together are the host's time: the device waits for it
    assert micro_seconds(parts) == pytest.approx(config.grad_accum * ops * per_op, rel=1e-12)
    # the device's own time (its kernels and the 1 us gaps) is far below
    device = sum(parts[k] for k in MICRO[:4]) + config.grad_accum * ops * GPU_OP_SECONDS
    assert device < 0.2 * micro_seconds(parts)
    # the floor lands in overhead; the kernels' parts are the device's
    assert parts["overhead"] == pytest.approx(config.grad_accum * ops * per_op - sum(parts[k] for k in MICRO[:4]),
                                              rel=1e-12)
    assert ThroughputMemo(TINY, a100).breakdown(config) == parts  # the search's memo: the same floats


def test_a_7b_model_on_a_gpu_is_the_devices_and_the_host_floor_does_not_move_it():
    # Llama-2-7B at 2048 tokens: 32 x 135 = 4,320 ops x 16.9 us = 73 ms of host time per micro-step, against
    # ~0.6 s of kernels: the overhead part is the 1 us gap per op alone
    a100 = get_gpu("a100-80gb")
    config = TrainConfig(micro_batch=1, seq_len=2048, optimizer="adamw_fused")
    parts = step_breakdown(model=LLAMA_7B, config=config, gpu=a100)
    assert 4320 * host_op_seconds(a100, config) == pytest.approx(0.073, rel=1e-2)
    assert micro_seconds(parts) > 5 * 0.073
    assert parts["overhead"] == pytest.approx(4320 * GPU_OP_SECONDS, rel=1e-12)


def test_the_cpu_profile_has_no_separate_host():
    # the CPU runs its kernels itself: its per-op host time is in the overhead part already (CPU_OP_SECONDS)
    cpu = get_gpu("cpu")
    assert host_op_seconds(cpu, tiny()) == 0.0
    assert step_breakdown(model=TINY, config=tiny(), gpu=cpu)["overhead"] == pytest.approx(270 * CPU_OP_SECONDS, rel=1e-12)


def test_a_scheme_that_casts_the_model_runs_without_autocast():
    # FSDP2's MixedPrecisionPolicy and DeepSpeed compute on 16-bit parameters of their own, no autocast:
    # the pure 16-bit host cost per op
    a100 = get_gpu("a100-80gb")
    assert host_op_seconds(a100, TrainConfig(gpus=2, sharding="fsdp2", precision="bf16-mixed")) == \
        host_op_seconds(a100, TrainConfig(precision="bf16")) == pytest.approx(12.5e-6, rel=1e-12)
    assert host_op_seconds(a100, TrainConfig(precision="bf16-mixed")) == pytest.approx(16.9e-6, rel=1e-12)


def test_host_excess_is_the_hosts_time_beyond_the_devices():
    assert host_excess(3.0, 5.0) == 2.0
    assert host_excess(5.0, 3.0) == 0.0
