"""transformers <= 4.45's causal-LM loss (``TrainConfig.loss_shift``): the model's forward upcasts the
logits, keeps them, makes a contiguous copy of all but each sequence's last position for the
cross-entropy, and its backward fills a zero gradient of the whole logits
(``planner.memory.activations.shifted_loss``). The terms by hand, the timeline's events in that
order, and the default (transformers 5's ForCausalLMLoss) left as it was."""

from __future__ import annotations

from operator import sub

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.activations import (
    log_softmax_bytes,
    logits_backward_transient,
    logits_forward_transient,
    manual_loop_logits,
    shifted_loss,
    shifted_loss_events,
)
from planner.memory.dtypes import mode_of
from planner.memory.parameters import trained
from planner.memory.shapes import dims_of
from planner.memory.step import batch_line, batch_totals
from planner.memory.timeline import step_timeline
from planner.request import check_for_model

LLAMA3_VOCAB = 128256


def test_the_terms_by_hand():
    """Llama-3.1-8B, LoRA, bf16-mixed, 2 x 2048 tokens: 2 x 2047 shifted positions. The forward's
    end holds the last hidden state (fp32, 4096 x 4096 x 4: the frozen head keeps no copy of it),
    the fp32 logits (4096 x V x 4) and their shifted copy (4094 x V x 4) beside the fp32
    log-probabilities of the shifted positions and their int64 labels; the loss' backward two
    fp32 gradients of the shifted copy; a hand-written loop keeps the fp32 logits (transformers
    5 keeps the head's bf16 output)."""
    model = resolve_model("meta-llama/Llama-3.1-8B")
    config = TrainConfig(method="lora", micro_batch=2, seq_len=2048, loss_shift=True)
    dims, mode = dims_of(model, config), mode_of(config)
    e, shifted = 4096, 4094
    assert log_softmax_bytes(dims, mode, shift=True) == shifted * (LLAMA3_VOCAB * 4 + 8)
    assert logits_forward_transient(dims, mode, config) == e * 4096 * 4 + (e + shifted) * LLAMA3_VOCAB * 4
    # full fine-tuning in pure bf16: the head saves its input, the hidden state itself (lm_head/input)
    pure = TrainConfig(micro_batch=2, seq_len=2048, precision="bf16", loss_shift=True)
    assert shifted_loss(dims, mode_of(pure), pure).hidden == 0
    # under autocast the head saves its bf16 cast: the fp32 hidden state is a tensor of its own
    assert shifted_loss(dims, mode, config.replace(method="full", lora_r=None, lora_targets=None)).hidden == e * 4096 * 4
    assert logits_backward_transient(dims, mode, config) == 2 * shifted * LLAMA3_VOCAB * 4
    assert manual_loop_logits(dims, mode, config) == e * LLAMA3_VOCAB * 4
    assert manual_loop_logits(dims, mode, config.replace(loss_shift=False)) == e * LLAMA3_VOCAB * 2
    loss = shifted_loss(dims, mode, config)
    assert (loss.head, loss.logits, loss.shifted) == (e * LLAMA3_VOCAB * 2, e * LLAMA3_VOCAB * 4,
                                                     shifted * LLAMA3_VOCAB * 4)
    # a model that shifts without upcasting (GPT-2, BLOOM in 4.x) in a 16-bit loss: no cast, all bf16
    low = shifted_loss(dims, mode, config.replace(loss_upcast=False))
    assert (low.head, low.logits, low.shifted) == (0, e * LLAMA3_VOCAB * 2, shifted * LLAMA3_VOCAB * 2)
    # an fp32 head's logits are upcast by nothing
    fp32 = TrainConfig(precision="fp32", loss_shift=True)
    assert shifted_loss(dims, mode_of(fp32), fp32).head == 0


def _loss_tensors(events):
    """The signed sizes of the loss' tensors (the logits-sized ones), in order."""
    keys = {"logits/transient", "activations/loss/log_softmax"}
    out = []
    for ev in events:
        if ev.key in keys:
            sizes = ev.tensors if isinstance(ev.tensors, tuple) else (ev.nbytes,)
            out += [size if ev.op == "alloc" else -size for size in sizes]
    return out


def test_the_timeline_replays_the_loss_in_its_order():
    """The step the moments are read from allocates and frees the loss' tensors in
    ``shifted_loss_events``' order: the last hidden state, the head's bf16 output, its fp32 upcast,
    the output freed, the shifted copy, the labels and log-probabilities; at the end of the forward
    the copy, the hidden state and the logits freed; in backward the two gradients of the shifted copy, the first and the saved
    log-probabilities freed, SliceBackward's gradient of the whole logits, the second freed, the
    upcast's backward in bf16, and both freed."""
    model = resolve_model("Qwen/Qwen2.5-0.5B")
    config = TrainConfig(method="lora", micro_batch=2, seq_len=512, loss_shift=True)
    dims, mode = dims_of(model, config), mode_of(config)
    e, s, v, h = 1024, 1022, model.vocab_size, model.hidden_size
    timeline = step_timeline(model=model, config=config, kernels=get_gpu("a100-80gb").kernels)
    assert _loss_tensors(timeline.events[timeline.start:]) == [
        e * h * 4, e * v * 2, e * v * 4, -e * v * 2, s * v * 4, s * 8, s * v * 4, -s * v * 4, -e * h * 4,  # forward
        -e * v * 4,
        s * v * 4, s * v * 4, -s * v * 4, -s * 8, -s * v * 4, e * v * 4, -s * v * 4, e * v * 2, -e * v * 4,
        -e * v * 2]
    forward, backward = shifted_loss_events(dims, mode, config)
    assert [op for op, *_ in forward].index("mark") == 6 and [op for op, *_ in backward].index("mark") == 2
    # the moments' totals are the walk's at their marks (step_timeline checks it as it builds), and
    # the loss' peak is the end of its forward: the logits, their copy and the log-probabilities
    assert timeline.peak_phase == "forward"


def test_the_default_is_transformers_5s_loss_and_payloads_keep_their_bytes():
    config = TrainConfig(method="lora", zero=2, gpus=2)
    assert config.loss_shift is False and "loss_shift" not in config.to_dict()
    assert config.to_dict()["version"] == 2
    shifted = config.replace(loss_shift=True)
    payload = shifted.to_dict()
    assert payload["loss_shift"] is True and payload["version"] == 3
    assert TrainConfig.from_dict(payload) == shifted
    assert "shifted-logits loss" in shifted.label()


@pytest.mark.parametrize("other", [dict(fused_ce=True), dict(loss_chunks=8)])
def test_it_is_refused_with_a_loss_of_its_own(other):
    with pytest.raises(InvalidConfigError, match="--loss-shift"):
        TrainConfig(method="lora", loss_shift=True, **other)


@pytest.mark.parametrize(("encoder", "encdec"), [(True, False), (False, True)])
def test_it_is_a_causal_lms_loss(encoder, encdec):
    with pytest.raises(InvalidConfigError, match="--loss-shift"):
        check_for_model(model_id="m", is_encoder=encoder, is_encoder_decoder=encdec, values={"loss_shift": True})
    check_for_model(model_id="m", is_encoder=False, values={"loss_shift": True})


@pytest.mark.parametrize("model_id", ["gpt2", "Qwen/Qwen2.5-0.5B", "mistralai/Mixtral-8x7B-v0.1"])
@pytest.mark.parametrize("settings", [
    {}, {"loop": "manual"}, {"grad_ckpt": True}, {"loss_upcast": False, "loop": "manual"}, {"precision": "fp32"},
    {"method": "qlora", "grad_accum": 2}, {"zero": 3, "gpus": 2}, {"eval_batch": 4, "eval_seq_len": 1},
    {"seq_len": 1}, {"seq_len": 2, "micro_batch": 3},
])
def test_every_step_builds_and_the_batch_line_is_affine(model_id, settings):
    """The timeline's own checks hold (each moment's total at its mark, no point between marks
    above the peak), one-token sequences included (no shifted position: the head's output beside
    its upcast is the forward's most), and the search's batch line is the totals at 1 and the
    increase to 2."""
    model = resolve_model(model_id)
    config = TrainConfig(**{"method": "lora", "micro_batch": 2, "seq_len": 256, **settings, "loss_shift": True})
    kernels = get_gpu("a100-80gb").kernels
    estimate = estimate_memory(model=model, config=config, gpu=get_gpu("a100-80gb"))
    assert estimate.peak_allocated_bytes > 0
    targets = trained(model, config).target_names
    one, two = (batch_totals(model, config.with_split(micro_batch=b, grad_accum=config.grad_accum), kernels, targets)
                for b in (1, 2))
    assert batch_line(model, config, kernels, targets) == (one, tuple(map(sub, two, one)))


def test_the_eval_forward_holds_the_shifted_loss():
    """The eval pass's loss forward under no_grad: the returned fp32 logits, their shifted copy and
    the log-probabilities of the shifted positions (transformers 5: the bf16 logits, their upcast
    and every position's log-probabilities), and the token ids with the shifted labels."""
    from planner.memory.evaluation import LOGITS, TOKENS, eval_parts

    model = resolve_model("meta-llama/Llama-3.1-8B")
    config = TrainConfig(method="lora", micro_batch=1, seq_len=512, eval_batch=4, eval_seq_len=1024, loss_shift=True)
    forward, _ = eval_parts(model, config, get_gpu("a100-80gb").kernels)
    e, s = 4096, 4092
    assert forward[LOGITS] == (e + 2 * s) * LLAMA3_VOCAB * 4
    assert forward[TOKENS] == (e + s) * 8
    default, _ = eval_parts(model, config.replace(loss_shift=False), get_gpu("a100-80gb").kernels)
    assert default[LOGITS] == e * LLAMA3_VOCAB * (2 + 4 + 4)
