"""The memory model against real training runs on the CPU, in CI.

``bench/accuracy.py`` holds the model to 40 configurations of realistic small models (minutes);
this test holds it to the same techniques on two tiny models (seconds), so a change to the model
or to the libraries that breaks the agreement fails the suite instead of waiting for the next
benchmark run. The bounds are the issue's CPU target with a margin: every configuration within
4%, the median within 1% (measured when written: median 0.01%, largest 0.45%, ZeRO-2 with
offload on gpt2).

The measured peak is c10's CPU allocator's (workers.probes): it also sees what kernels allocate
below the dispatcher, such as bitsandbytes' CPU 8-bit step (20 B per element of the largest
tensor it steps; the llama adamw_8bit and gpt2 ZeRO-1 adamw_8bit cases below hold it: 5,120,000 B
and 13,711,360 B).
"""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("torch")

from planner.catalog import spec_from_config  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.gpus import get_gpu  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.results import RunOutcome  # noqa: E402
from workers import run_in_process  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2000, max_position_embeddings=256)
#: gpt2 has attention dropout (the CPU's math attention path) and Python GELU
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=2000, n_positions=256)

CASES = [
    (LLAMA, dict(precision="fp32")),
    (LLAMA, dict()),
    (LLAMA, dict(method="lora")),
    (LLAMA, dict(method="qlora", grad_ckpt=True)),
    (LLAMA, dict(optimizer="adafactor")),
    (LLAMA, dict(optimizer="adamw_8bit")),
    (LLAMA, dict(grad_accum=2)),
    (GPT2, dict()),
    (GPT2, dict(method="lora", lora_targets=("c_attn",))),
    (LLAMA, dict(zero=1)),
    # gpt2 ties its embedding to the head: two partial gradients at the end of backward
    (GPT2, dict(precision="fp32", optimizer="sgd", micro_batch=1, seq_len=32)),
    # ZeRO's gradient flattening before an optimizer whose own step adds nothing visible
    (GPT2, dict(zero=1, optimizer="adamw_8bit", micro_batch=1, seq_len=32)),
    (GPT2, dict(zero=2, offload="optimizer")),
    (LLAMA, dict(zero=3)),
    # the eval pass after the step (planner/memory/evaluation.py): the eval forward's logits, and
    # generation's KV cache (240 new tokens on 8-token prompts)
    (LLAMA, dict(eval_batch=8)),
    (LLAMA, dict(method="lora", eval_batch=64, eval_seq_len=8, generate_tokens=240)),
]


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    """label -> error % against the allocator's peak."""
    out = {}
    for arch, changes in CASES:
        config = TrainConfig(**(dict(micro_batch=2, seq_len=64, precision="bf16-mixed") | changes))
        measurement, _details = run_in_process(model_config=arch, config=config)
        assert measurement.outcome is RunOutcome.OK, measurement.error
        spec = spec_from_config(arch, model_id=f"tiny-{arch['model_type']}", source="test")
        predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
        measured = measurement.peak_allocated_bytes
        out[f"{arch['model_type']} {config.label()}"] = 100 * (predicted - measured) / measured
    return out


@pytest.mark.slow
def test_every_technique_within_4_percent(errors):
    off = {label: round(err, 2) for label, err in errors.items() if abs(err) > 4}
    assert not off, off


@pytest.mark.slow
def test_median_error_within_1_percent(errors):
    assert statistics.median(abs(e) for e in errors.values()) <= 1, errors


#: QLoRA without the k-bit upcast (planner/memory/dtypes.py ``_qlora_16bit``): the worker skips
#: prepare_model_for_kbit_training, so the embeddings, norms and head stay bf16
NO_UPCAST = [(LLAMA, dict(method="qlora", kbit_upcast=False)), (LLAMA, dict(method="qlora", grad_ckpt=True,
                                                                              kbit_upcast=False))]


@pytest.mark.slow
def test_qlora_without_the_kbit_upcast_within_4_percent():
    off = {}
    for arch, changes in NO_UPCAST:
        config = TrainConfig(**(dict(micro_batch=2, seq_len=64, precision="bf16-mixed") | changes))
        measurement, _details = run_in_process(model_config=arch, config=config)
        assert measurement.outcome is RunOutcome.OK, measurement.error
        spec = spec_from_config(arch, model_id=f"tiny-{arch['model_type']}", source="test")
        predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
        error = 100 * (predicted - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes
        if abs(error) > 4:
            off[config.label()] = round(error, 2)
    assert not off, off


def test_a_16_bit_loss_within_4_percent():
    """A 16-bit loss (``loss_upcast`` False: the worker computes the cross-entropy on the logits as
    the head makes them, as emit's train.py does): bf16 log-probabilities and loss gradients, no
    fp32 copy. At 2 x 64 tokens of a 2000-word vocabulary its loss tensors are 256,000 B each, a
    few percent of the peak, so the bound tells the two dtypes apart."""
    config = TrainConfig(micro_batch=2, seq_len=64, precision="bf16-mixed", loss_upcast=False)
    measurement, _details = run_in_process(model_config=LLAMA, config=config)
    assert measurement.outcome is RunOutcome.OK, measurement.error
    spec = spec_from_config(LLAMA, model_id="tiny-llama", source="test")
    predicted = {upcast: estimate_memory(model=spec, config=config.replace(loss_upcast=upcast),
                                         gpu=get_gpu("cpu")).peak_allocated_bytes for upcast in (False, True)}
    error = 100 * (predicted[False] - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes
    assert abs(error) <= 4, round(error, 2)
    # (measured when written: -0.01 %, 14,970,600 B; the fp32 loss's terms would be +4.4 %)
    assert 100 * (predicted[True] - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes > 2
