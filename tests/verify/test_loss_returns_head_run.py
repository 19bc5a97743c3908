"""transformers 4.46-4.48's causal-LM loss (``loss_shift`` with ``loss_returns_head``) in a real CPU run.

The installed transformers 5.24's llama forward is 4.48.1's mistral/llama forward where the loss is
concerned: the head's output returned as it is and ``self.loss_function(logits=logits, labels=labels,
...)`` called inside the forward (5.24 models/llama/modeling_llama.py ``LlamaForCausalLM.forward``;
4.48.1 models/mistral/modeling_mistral.py l.848-852). Only the loss function differs: 4.48.1's
``ForCausalLMLoss`` (loss/loss_utils.py l.32-48, ``fixed_cross_entropy`` l.24-29) upcasts the logits,
makes ``logits[..., :-1, :].contiguous()`` and ``labels[..., 1:].contiguous()`` and runs the
cross-entropy on them; 5.24's pads the labels instead. The worker sets the model's ``loss_function``
to those lines of 4.48.1 (planner/emit/causal_lm_loss.py ``causal_lm_loss_448``, which emit's
train.py sets alike; workers/train.py ``_install_loss_returning_head``), so the run is the
transformers 5 model, Trainer and allocator with 4.48.1's loss.

Sizes (tiny llama: hidden 128, vocab 2000; 2 x 96 tokens, 2 x 95 shifted positions): the head's
bf16 output 768,000 B, its fp32 upcast (and SliceBackward's gradient) 1,536,000 B, the shifted copy
(the log-probabilities, each gradient of the loss) 1,520,000 B.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from test_loss_shift_run import LLAMA, _error, _expected_loss_tensors, _measured_loss_tensors  # noqa: E402

from planner.config import TrainConfig  # noqa: E402
from planner.results import RunOutcome  # noqa: E402
from workers import run_in_process  # noqa: E402


@pytest.fixture
def measure():
    def run(**settings):
        config = TrainConfig(micro_batch=2, seq_len=96, precision="bf16-mixed", loss_shift=True,
                             loss_returns_head=True, **settings)
        measurement, details = run_in_process(model_config=LLAMA, config=config)
        assert measurement.outcome is RunOutcome.OK, measurement.error
        return config, measurement, details
    return run


def test_the_worker_sets_the_loss_as_the_models_loss_function():
    """The worker's model runs 4.48.1's loss through its own forward (``self.loss_function``)."""
    from planner.emit.causal_lm_loss import causal_lm_loss_448
    from workers.train import _prepared_model

    config = TrainConfig(micro_batch=2, seq_len=96, precision="bf16-mixed", loss_shift=True, loss_returns_head=True)
    model, _ = _prepared_model(model_config=dict(LLAMA), config=config, device="cpu", checkpoint_dir=None)
    assert model.loss_function is causal_lm_loss_448
    assert "forward" not in vars(model)  # the model's own forward, not the worker's 4.45 one


def test_a_model_whose_forward_runs_its_own_loss_is_refused():
    """A causal LM whose forward computes its own CrossEntropyLoss (as 5.24's BartForCausalLM,
    models/bart/modeling_bart.py): setting its loss_function would change nothing and 5.24's loss would
    run silently, so the worker refuses."""
    from planner.errors import InvalidConfigError
    from workers.train import _install_loss_returning_head

    class OwnLoss:
        def forward(self, logits, labels):
            import torch

            return torch.nn.CrossEntropyLoss()(logits, labels)

    with pytest.raises(InvalidConfigError, match="without --loss-returns-head"):
        _install_loss_returning_head(OwnLoss(), model_config=dict(LLAMA))


def test_the_head_logits_are_kept_beside_the_loss_in_the_replays_order(measure):
    """The HF Trainer's loop: the measured step's logits-sized allocations and frees are
    ``shifted_loss_events``' one for one (the head's bf16 output kept until compute_loss returns,
    the upcast freed as the loss function returns, before its copy), and the peak (the end of the
    loss' forward: the last hidden state, the bf16 and fp32 logits, the copy and the
    log-probabilities) is predicted within 0.5 %; 4.45's loss (the head's output freed once upcast)
    is under by its 768,000 B, more than 3 %."""
    config, measurement, details = measure()
    measured = _measured_loss_tensors(details)
    assert measured == _expected_loss_tensors(config)
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5
    assert _error(config.replace(loss_returns_head=False), measurement.peak_allocated_bytes) < -3


def test_a_hand_written_loop_keeps_the_bf16_logits(measure):
    """``outputs = model(**batch); outputs.loss.backward()``: 4.48 returns the head's bf16 logits,
    which the loop keeps through backward (as transformers 5's); predicted within 0.5 %."""
    config, measurement, _ = measure(loop="manual")
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5


def test_the_eval_forward_holds_the_bf16_logits_too(measure):
    """The eval pass (16 x 96 tokens, no_grad): at the loss the last hidden state, the bf16 and the
    fp32 logits, the shifted copy and the log-probabilities; within 0.5 %, 4.45's under by > 3 %."""
    config, measurement, details = measure(eval_batch=16)
    assert details["peak_phase"] == "eval"
    assert abs(_error(config, measurement.peak_allocated_bytes)) <= 0.5
    assert _error(config.replace(loss_returns_head=False), measurement.peak_allocated_bytes) < -3
