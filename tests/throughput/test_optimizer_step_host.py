"""The optimizer step's host dispatch on a GPU (planner/throughput.py ``_step_dispatch``): a per-tensor optimizer
issues its ops (``OptimizerModel.step_ops``) tensor by tensor from one Python thread, at
``OPTIMIZER_OP_HOST_SECONDS`` (2.4 us: torch's single-tensor AdamW on the CPU, 24 us for its 10 ops a tensor)
each, + ``CUDA_OP_HOST_SECONDS`` (6 us) for each that launches a kernel. The update takes the longer of that and its device bytes, or
their sum where the optimizer waits for the device after each tensor (bitsandbytes).

Hand figures on the planner's BERT-large (the HF single-GPU page's V100 rows): 387 trainable tensors, 147 of them
matrices (24 blocks x 6 weights, the word and position tables, the head), 335,174,458 parameters.
"""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.throughput import ThroughputMemo, _breakdown, _rates, _step_dispatch, step_breakdown

BERT = resolve_model("bert-large-uncased")
V100 = get_gpu("v100-16gb")
PARAMS = 335_174_458
OP, LAUNCH = 2.4e-6, 6e-6


def row(optimizer: str) -> TrainConfig:
    """hf-accum4-ckpt-fp16's settings: one 512-token sequence x 4, checkpointed, fp16 autocast (fp32 weights)."""
    return TrainConfig(method="full", precision="fp16-mixed", optimizer=optimizer, micro_batch=1, grad_accum=4,
                       seq_len=512, grad_ckpt=True, reentrant_ckpt=True, attention="eager")


def device_seconds(optimizer: str, bytes_per_param: float) -> float:
    return PARAMS * bytes_per_param / _rates(V100, row(optimizer).precision, None).kernels.bandwidth


@pytest.mark.parametrize(("optimizer", "ops", "launches", "device_bytes", "serial"), [
    # Adafactor: 147 x 26 + 240 x 16 = 7,662 ops, 147 x 24 + 240 x 16 = 7,368 kernels: 62.6 ms, against 16 fp32
    # passes (29.8 ms)
    ("adafactor", 147 * 26 + 240 * 16, 147 * 24 + 240 * 16, 16 * 4, False),
    # transformers' AdamW: 7 kernels a tensor, 2,709: 22.8 ms, under its 18 fp32 passes (33.5 ms): device-bound
    ("adamw_hf", 387 * 7, 387 * 7, 18 * 4, False),
    # bitsandbytes: 4 calls a tensor, one a kernel: 6.0 ms, then the device's update after each: they add
    ("adamw_8bit", 387 * 4, 387, 3 * 4 + 4 * (1 + 4 / 256), True),
    # the fused kernel: 2 ops, each a kernel per chunk of 36 tensors, 11 chunks: 0.14 ms, far under its 7 passes
    ("adamw_fused", 2, 2 * 11, 7 * 4, False),
])
def test_the_step_is_its_device_bytes_or_its_dispatch(optimizer, ops, launches, device_bytes, serial):
    config = row(optimizer)
    host = ops * OP + launches * LAUNCH
    assert _step_dispatch(BERT, config, V100) == (pytest.approx(host), serial)
    device = device_seconds(optimizer, device_bytes)
    expected = device + host if serial else max(device, host)
    parts = step_breakdown(model=BERT, config=config, gpu=V100)
    assert parts["optimizer"] == pytest.approx(expected)
    assert ThroughputMemo(BERT, V100).breakdown(config) == parts  # the search's figures are the same floats
    # calibrate fits device rates: its breakdown has the host floors off, the step's with the micro-steps'
    assert _breakdown(BERT, config, V100, None, 0, 0.0)["optimizer"] == pytest.approx(device)


def test_adafactor_is_host_bound_and_adamw_hf_is_not():
    assert 7662 * OP + 7368 * LAUNCH > device_seconds("adafactor", 64)  # 62.6 > 29.8 ms
    assert 2709 * (OP + LAUNCH) < device_seconds("adamw_hf", 72)  # 22.8 < 33.5 ms


def test_no_dispatch_under_offload_or_partitions():
    """DeepSpeed's CPU Adam steps on the host; a scheme that partitions the optimizer steps flat partitions of its
    own: neither is the per-tensor loop counted."""
    assert _step_dispatch(BERT, row("adafactor").replace(zero=2), V100) == (0.0, False)
    assert _step_dispatch(BERT, row("adamw").replace(zero=2, offload="optimizer"), V100) == (0.0, False)


def test_the_search_tells_optimizers_apart_by_their_dispatch():
    """``knob_class``: two plans equal but for the optimizer take equal step times only if their dispatch is too."""
    config = row("adafactor")
    assert ThroughputMemo(BERT, V100).knob_class(config)[-1] == _step_dispatch(BERT, config, V100)
