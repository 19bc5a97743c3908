"""transformers <= 4.45's causal-LM loss (``loss_shift``) in a real CPU run against the model.

The worker runs the causal LM's forward as transformers 4.45's models did, the loss in it (the
decoder, the head, ``logits.float()`` returned in the outputs, ``logits[..., :-1, :].contiguous()``,
the cross-entropy on that copy: workers/train.py ``_install_shifted_copy_loss``). c10's CPU
allocator reports every allocation and free at its exact size, so the measured step shows the
loss' logits-sized tensors in the order they were made, which is what the allocator replay of a
GPU plan is given (``activations.shifted_loss_events``), and the peak the model predicts.

Sizes (tiny llama: hidden 128, vocab 2000; 2 x 96 tokens, 2 x 95 shifted positions): the head's
bf16 output 192 x 2000 x 2 = 768,000 B, its fp32 upcast (and SliceBackward's gradient) 1,536,000 B,
the shifted copy (the log-probabilities, each gradient of the loss) 190 x 2000 x 4 = 1,520,000 B;
no other tensor of the step has these sizes (the head's weight is 2000 x 128: 512,000 B in bf16,
1,024,000 B in fp32).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from planner.catalog import spec_from_config  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.gpus import get_gpu  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.memory.activations import shifted_loss_events  # noqa: E402
from planner.memory.dtypes import mode_of  # noqa: E402
from planner.memory.shapes import dims_of  # noqa: E402
from planner.results import RunOutcome  # noqa: E402
from workers import run_in_process  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2000, max_position_embeddings=256)
SPEC = spec_from_config(LLAMA, model_id="tiny-llama", source="test")


def _measure(**settings):
    config = TrainConfig(micro_batch=2, seq_len=96, precision="bf16-mixed", loss_shift=True, **settings)
    measurement, details = run_in_process(model_config=LLAMA, config=config)
    assert measurement.outcome is RunOutcome.OK, measurement.error
    return config, measurement, details


def _error(config, measured: int) -> float:
    predicted = estimate_memory(model=SPEC, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
    return 100 * (predicted - measured) / measured


def _measured_loss_tensors(details) -> list[int]:
    """The signed steps of the run's allocated bytes that are the logits-sized tensors of this model's loss (the
    head's bf16 output 768,000 B, its fp32 upcast 1,536,000 B, the shifted copy 1,520,000 B), in order."""
    curve = [bytes_live for _t, bytes_live in details["memory_events"]]
    sizes = {768_000, 1_536_000, 1_520_000}
    return [b - a for a, b in zip(curve, curve[1:]) if abs(b - a) in sizes]


def _expected_loss_tensors(config) -> list[int]:
    """The signed sizes ``shifted_loss_events`` makes and frees, the labels (int64) left out."""
    forward, backward = shifted_loss_events(dims_of(SPEC, config), mode_of(config), config)
    live: dict[str, tuple[int, ...]] = {}
    out = []
    for op, tensor, _key, sizes in forward + backward:
        if op == "alloc":
            live[tensor] = tuple(size for size in sizes if size % 2000 == 0 and size)
            out += live[tensor]
        elif op == "free":
            out += [-size for size in live.pop(tensor)]
    return out


def test_the_loss_tensors_are_made_in_the_replays_order_and_the_peak_is_predicted():
    """The HF Trainer's loop (the outputs die at the loss): the measured step's logits-sized
    allocations and frees are ``shifted_loss_events``' one for one, and the peak (the end of the
    loss' forward: the last hidden state, the fp32 logits, their shifted copy and the
    log-probabilities) is predicted within 0.5 % (measured when written: 18,109,644 B, predicted
    18,109,508, -0.001 %; transformers 5's loss is predicted at -0.37 %, its peak at the loss'
    backward)."""
    config, measurement, details = _measure()
    measured = _measured_loss_tensors(details)
    assert measured == _expected_loss_tensors(config)
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5


def test_a_hand_written_loop_keeps_the_fp32_logits():
    """``outputs = model(**batch); outputs.loss.backward()``: transformers 4.45 returns the upcast
    logits, so the loop keeps 192 x 2000 x 4 B, not the head's bf16 output, through backward and
    into the next forward. Predicted within 0.5 % (when written: 19,645,648 B, predicted 19,645,508,
    -0.001 %); with transformers 5's loss (the bf16 logits kept) the prediction is under by more
    than 2 % (when written: -4.2 %)."""
    config, measurement, _ = _measure(loop="manual")
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5
    assert _error(config.replace(loss_shift=False), measurement.peak_allocated_bytes) < -2


def test_the_eval_forward_holds_the_logits_their_copy_and_the_log_probabilities():
    """The eval pass after the step (16 x 96 tokens, no_grad; planner.memory.evaluation): at the
    loss the last hidden state, the fp32 logits, their shifted copy and the log-probabilities of
    the shifted positions. Predicted within 0.5 % (when written: 48,213,084 B, predicted 48,211,412,
    -0.003 %; with transformers 5's loss -12.2 %)."""
    config, measurement, details = _measure(eval_batch=16)
    assert details["peak_phase"] == "eval"
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5
    assert _error(config.replace(loss_shift=False), measurement.peak_allocated_bytes) < -5
