"""transformers 4.46-4.48's causal-LM loss (``TrainConfig.loss_returns_head`` with ``loss_shift``): the
model returns the head's 16-bit logits and ``ForCausalLMLoss`` upcasts them and makes the shifted
contiguous copy (4.48.1 models/mistral/modeling_mistral.py l.848-852, loss/loss_utils.py l.36-47), so
the head's output is alive beside 4.45's tensors (``planner.memory.activations.shifted_loss``). The
terms by hand, the events' order, the payload kept for old plans, and a published row."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.activations import (
    logits_backward_transient,
    logits_forward_transient,
    manual_loop_logits,
    shifted_loss,
    shifted_loss_events,
)
from planner.memory.dtypes import mode_of
from planner.memory.shapes import dims_of

LLAMA3_VOCAB = 128256
CONFIG = TrainConfig(method="lora", micro_batch=2, seq_len=2048, loss_shift=True, loss_returns_head=True)


def test_the_terms_by_hand():
    """Llama-3.1-8B, LoRA, bf16-mixed, 2 x 2048 tokens: the end of the loss' forward holds 4.45's
    tensors (the fp32 last hidden state, the fp32 logits, their shifted copy) and the head's bf16
    output (4096 x V x 2); the backward is 4.45's; a hand-written loop keeps the bf16 logits."""
    model = resolve_model("meta-llama/Llama-3.1-8B")
    dims, mode = dims_of(model, CONFIG), mode_of(CONFIG)
    e, shifted = 4096, 4094
    old = CONFIG.replace(loss_returns_head=False)
    assert logits_forward_transient(dims, mode, CONFIG) == e * 4096 * 4 + (e * 2 + e * 4 + shifted * 4) * LLAMA3_VOCAB
    assert logits_forward_transient(dims, mode, CONFIG) - logits_forward_transient(dims, mode, old) == e * LLAMA3_VOCAB * 2
    assert logits_backward_transient(dims, mode, CONFIG) == logits_backward_transient(dims, mode, old)
    assert manual_loop_logits(dims, mode, CONFIG) == e * LLAMA3_VOCAB * 2
    assert manual_loop_logits(dims, mode, old) == e * LLAMA3_VOCAB * 4


def test_the_events_free_the_upcast_as_the_loss_function_returns_and_the_head_with_the_outputs():
    model = resolve_model("meta-llama/Llama-3.1-8B")
    dims, mode = dims_of(model, CONFIG), mode_of(CONFIG)
    forward, backward = shifted_loss_events(dims, mode, CONFIG)
    assert [(op, tensor) for op, tensor, _key, _sizes in forward] == [
        ("alloc", "hidden"), ("alloc", "head"), ("alloc", "logits"), ("alloc", "shifted"), ("alloc", "saved"),
        ("mark", ""), ("free", "logits"), ("free", "shifted"), ("free", "hidden"), ("free", "head")]
    assert backward == shifted_loss_events(dims, mode, CONFIG.replace(loss_returns_head=False))[1]
    loss = shifted_loss(dims, mode, CONFIG)
    live = sum(sum(sizes) for op, tensor, _key, sizes in forward[:5] if tensor != "saved")
    assert live == loss.forward


@pytest.mark.parametrize("settings", [{"precision": "fp32"}, {"loss_upcast": False}])
def test_where_the_loss_does_not_upcast_the_returned_logits_are_45s(settings):
    """``.float()`` of fp32 logits is the tensor itself; a 16-bit loss has no upcast: 4.45's path."""
    model = resolve_model("Qwen/Qwen2.5-0.5B")
    config = CONFIG.replace(**settings)
    dims, mode = dims_of(model, config), mode_of(config)
    assert not shifted_loss(dims, mode, config).head_returned
    assert shifted_loss_events(dims, mode, config) == shifted_loss_events(dims, mode, config.replace(loss_returns_head=False))


@pytest.mark.parametrize("settings", [{}, {"loop": "manual"}, {"grad_ckpt": True}, {"seq_len": 1},
                                      {"eval_batch": 4, "eval_seq_len": 64}, {"zero": 3, "gpus": 2}])
def test_every_step_builds_and_the_peak_is_not_below_45s(settings):
    """The timeline's own checks hold with the head's output kept (each moment's total at its mark)."""
    model = resolve_model("Qwen/Qwen2.5-0.5B")
    config = CONFIG.replace(micro_batch=2, seq_len=256).replace(**settings)
    gpu = get_gpu("a100-80gb")
    new = estimate_memory(model=model, config=config, gpu=gpu).peak_allocated_bytes
    old = estimate_memory(model=model, config=config.replace(loss_returns_head=False), gpu=gpu).peak_allocated_bytes
    assert new >= old


def test_it_needs_loss_shift_and_old_payloads_decode_as_before():
    with pytest.raises(InvalidConfigError, match="--loss-returns-head"):
        TrainConfig(method="lora", loss_returns_head=True)
    old = TrainConfig(method="lora", loss_shift=True)
    assert "loss_returns_head" not in old.to_dict()
    assert TrainConfig.from_dict({**old.to_dict()}).loss_returns_head is False
    payload = CONFIG.to_dict()
    assert payload["loss_returns_head"] is True and TrainConfig.from_dict(payload) == CONFIG
    assert "head's logits returned" in CONFIG.label()


def test_emit_writes_it():
    """emit's train.py runs it (its model's loss_function: tests/emit/test_loss_returns_head_emit.py)."""
    from planner.emit.settings import script_recipe, training_arguments

    assert "compute_loss_func" not in training_arguments(CONFIG, on_cpu=True)
    assert script_recipe(CONFIG)["loss_returns_head"] is True


def test_the_eval_forward_holds_the_bf16_logits_too():
    from planner.memory.evaluation import LOGITS, eval_parts

    model = resolve_model("meta-llama/Llama-3.1-8B")
    config = CONFIG.replace(micro_batch=1, seq_len=512, eval_batch=4, eval_seq_len=1024)
    kernels = get_gpu("a100-80gb").kernels
    new, _ = eval_parts(model, config, kernels)
    old, _ = eval_parts(model, config.replace(loss_returns_head=False), kernels)
    assert new[LOGITS] - old[LOGITS] == 4096 * LLAMA3_VOCAB * 2
