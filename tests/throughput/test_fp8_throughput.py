"""fp8's step time (planner/kernels.py ``fp8_work``/``fp8_seconds``, planner/throughput.py ``_with_fp8``): the
converted linears' GEMMs at the FP8 rate, the eager casts torchao runs at memory speed, their ops. Numbers by
hand on llama-8k (hidden 256, intermediate 688, 2 layers, k/v 128 wide, every block linear converted)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.kernels import (
    FP8_CAST_BYTES,
    FP8_OPS_PER_LINEAR,
    WEIGHT_CAST_BYTES,
    DeviceRates,
    fp8_seconds,
    fp8_work,
    host_op_seconds,
    ops_per_micro_step,
)
from planner.throughput import ThroughputMemo, step_breakdown

LLAMA_8K = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
LAYER_WEIGHTS = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 688  # 724,992
#: in + out of the seven linears of a layer: q 512, k 384, v 384, o 512, gate, up and down 944 each
LAYER_IO = 512 + 384 + 384 + 512 + 3 * 944  # 4,624
LAYER_OUT = 256 + 128 + 128 + 256 + 688 + 688 + 256  # 2,400


@pytest.fixture(scope="module")
def spec():
    return spec_from_config(LLAMA_8K, model_id="llama-8k", source="test")


@pytest.mark.parametrize("ckpt", [False, True])
def test_fp8_work_by_hand(spec, ckpt):
    work = fp8_work(spec, TrainConfig(precision="fp8", grad_ckpt=ckpt))
    assert work.flops == 3 * 2 * 2 * LAYER_WEIGHTS  # forward + backward (2x) of 2 layers
    assert work.recompute_flops == (2 * 2 * LAYER_WEIGHTS if ckpt else 0)
    # input, grad_output twice and input again per linear (2 x (in + out)); the recompute casts the inputs again
    assert work.cast_elements == 2 * 2 * LAYER_IO + (2 * (LAYER_IO - LAYER_OUT) if ckpt else 0)
    assert work.weight_elements == 2 * LAYER_WEIGHTS * (3 if ckpt else 2)
    assert work.amp_weight_casts == 2 * LAYER_WEIGHTS * WEIGHT_CAST_BYTES * (2 if ckpt else 1)
    assert work.ops == 2 * 7 * FP8_OPS_PER_LINEAR


def test_fp8_seconds_by_hand(spec):
    work = fp8_work(spec, TrainConfig(precision="fp8"))
    rates = DeviceRates(gemm=1e14, bandwidth=1e12, op_seconds=1e-6)
    gemm, recompute, casts, ops = fp8_seconds(work, rates, tokens=1000)
    # half the bf16 time of the converted GEMMs saved (FP8 twice the bf16 rate at the same fraction)
    assert gemm == pytest.approx(-work.flops * 1000 / 1e14 / 2)
    assert recompute == 0
    assert casts == pytest.approx(((4 * LAYER_IO * 1000 + 4 * LAYER_WEIGHTS) * FP8_CAST_BYTES
                                   - 2 * LAYER_WEIGHTS * WEIGHT_CAST_BYTES) / 1e12)
    assert ops == pytest.approx(2 * 7 * FP8_OPS_PER_LINEAR * 1e-6)


@pytest.mark.parametrize("ckpt", [False, True])
def test_the_step_adds_fp8_seconds_to_bf16_mixed_and_the_memo_agrees(spec, ckpt):
    gpu = get_gpu("h100-80gb")
    bf16 = TrainConfig(precision="bf16-mixed", micro_batch=4, seq_len=256, grad_accum=2, grad_ckpt=ckpt)
    fp8 = bf16.replace(precision="fp8")
    a, b = step_breakdown(model=spec, config=bf16, gpu=gpu), step_breakdown(model=spec, config=fp8, gpu=gpu)
    work = fp8_work(spec, fp8)
    deltas = {k: b[k] - a[k] for k in a}
    assert deltas["attention"] == deltas["optimizer"] == deltas["comm"] == 0
    assert deltas["compute"] < 0 and deltas["elementwise"] > 0 and deltas["overhead"] > 0
    assert (deltas["recompute"] < 0) == ckpt
    # two blocks at 1,024 tokens: the host's dispatch outlasts the kernels in both (planner.kernels.host_op_seconds),
    # so each micro-step is its ops x the host seconds per op, fp8's 2 x 7 x 60 eager ops among them (x 2 micro-steps)
    micro = ("compute", "attention", "recompute", "elementwise", "overhead")
    ops = ops_per_micro_step(spec, bf16)
    assert sum(a[k] for k in micro) == pytest.approx(2 * ops * host_op_seconds(gpu, bf16), rel=1e-12)
    assert sum(b[k] for k in micro) == pytest.approx(2 * (ops + work.ops) * host_op_seconds(gpu, fp8), rel=1e-12)
    assert ThroughputMemo(spec, gpu).breakdown(fp8) == b  # the search's memo: the same floats


def test_fp8_adds_its_ops_gaps_where_the_device_bounds_the_step():
    # Llama-3.1-8B at 4 x 2048 tokens: the kernels outlast the host, so fp8's ops add their 1 us gaps alone
    spec, gpu = resolve_model("meta-llama/Llama-3.1-8B"), get_gpu("h100-80gb")
    bf16 = TrainConfig(precision="bf16-mixed", micro_batch=4, seq_len=2048, grad_accum=2)
    a, b = (step_breakdown(model=spec, config=c, gpu=gpu) for c in (bf16, bf16.replace(precision="fp8")))
    assert b["overhead"] - a["overhead"] == pytest.approx(2 * fp8_work(spec, bf16.replace(precision="fp8")).ops * 1e-6)


def test_eager_fp8_is_predicted_slower_than_bf16_mixed_on_h100():
    # The HF Trainer runs torchao eager: each cast is ~6 kernels over the operand (35 B per element,
    # FP8_CAST_BYTES) where torch.compile fuses it to 6-8 B (torchao roofline_utils.py). torchao's +25% for
    # Llama 3 8B on 8 x H100 (docs/source/workflows/training.md) is with torch.compile; eager, the casts cost
    # more than the GEMMs save, so the search does not rank fp8 first for speed.
    spec, gpu = resolve_model("meta-llama/Llama-3.1-8B"), get_gpu("h100-80gb")
    bf16 = TrainConfig(precision="bf16-mixed", micro_batch=1, seq_len=8192, grad_ckpt=True)
    speedup = (sum(step_breakdown(model=spec, config=bf16, gpu=gpu).values())
               / sum(step_breakdown(model=spec, config=bf16.replace(precision="fp8"), gpu=gpu).values()))
    assert 0.5 < speedup < 0.9
