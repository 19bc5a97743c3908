"""FSDP1's retained layer-input gradients drawn where the run makes them (planner/memory/timeline.py
``_retained_backward``, planner/memory/step.py ``retention``): under transformers 4's reentrant checkpoint
each frozen layer's backward leaves its input gradient, and its detached checkpoint input stays with
it, until FSDP1's ``_finalize_params`` at the end of backward (planner/sharding/fsdp1.py
``retained_input_gradients``). A 5-layer Llama-shaped model, LoRA under FSDP1 on 2 GPUs, by hand."""

from __future__ import annotations

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.parameters import trained
from planner.memory.states import static_terms
from planner.memory.step import PHASES, RETAINED_KEY, batch_terms, first_block_gradients, moment_breakdowns, static_sizes
from planner.memory.timeline import step_timeline

LAYERS, HIDDEN, SEQ, MICRO = 5, 256, 128, 2
MODEL = spec_from_config(dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                              rms_norm_eps=1e-5, tie_word_embeddings=False), model_id="small/llama5", source="test")
#: one layer-input gradient and one checkpoint: micro-batch x sequence x hidden in the fp16 residual
#: stream, 2 x 128 x 256 x 2 B = 131,072 B each
G = C = MICRO * SEQ * HIDDEN * 2
CKPT = "activations/checkpoints"
KERNELS = get_gpu("a100-80gb").kernels


def _config(**changes) -> TrainConfig:
    fields = dict(method="lora", precision="fp16", gpus=2, sharding="fsdp1", micro_batch=MICRO, seq_len=SEQ,
                  grad_ckpt=True, lora_r=8, lora_targets=("q_proj", "v_proj"), reentrant_ckpt=True)
    return TrainConfig(**(fields | changes))


def _step(timeline):
    """The measured step's events (after the run's first step), with their indices."""
    return list(enumerate(timeline.events))[timeline.start:]


def test_one_gradient_per_layer_as_backward_passes_it_freed_at_the_end():
    timeline = step_timeline(model=MODEL, config=_config(), kernels=KERNELS)
    step = _step(timeline)
    made = [(i, ev) for i, ev in step if ev.key == RETAINED_KEY and ev.op == "alloc"]
    # one each, in backward's order: layer 5's first (the last block, the first backward reaches) down to layer 1's
    assert [ev.where for _, ev in made] == [f"backward block {k}" for k in (5, 4, 3, 2, 1)]
    assert all(ev.nbytes == G and ev.tensors == 1 for _, ev in made)
    for i, ev in made:  # each after its block's recompute and backward ran and freed their transients
        block = [e for _, e in step if e.where == ev.where]
        recomputed = [e for e in block if e.key == "activations/recompute"]
        assert [e.op for e in recomputed] == ["alloc", "free", "alloc", "free"]  # its two instants
        assert block[-1] is ev
    end = timeline.marks["backward_end"]
    freed = [(i, ev) for i, ev in step if ev.key in (RETAINED_KEY, CKPT) and ev.op == "free"]
    # every layer's gradient and checkpoint freed after the end of backward's mark, layer by layer (FSDP1's
    # final callback, unit by unit), none before
    assert len(freed) == 2 * LAYERS and all(i >= end and ev.where == "end of backward" for i, ev in freed)
    assert [ev.key for _, ev in freed] == [CKPT, RETAINED_KEY] * LAYERS


def test_live_bytes_at_the_marks_by_hand():
    """Against the same run without the reentrant checkpoint (nothing retained), the moments hold:
    at the first layer's recompute and backward (where both marks stand) the 4 gradients of layers
    5..2 less the incoming one its own terms count, 3 x 131,072 = 393,216 B more; at the end of
    backward every layer's gradient and checkpoint, 5 x 131,072 + 5 x 131,072 = 1,310,720 B more."""
    on = step_timeline(model=MODEL, config=_config(), kernels=KERNELS)
    off = step_timeline(model=MODEL, config=_config(reentrant_ckpt=False), kernels=KERNELS)
    at = lambda timeline, name: timeline.curve()[timeline.marks[name]]  # noqa: E731
    for name in ("first_block_recompute", "first_block_backward"):
        assert at(on, name) - at(off, name) == 3 * G == 393_216
        assert on.events[on.marks[name] - 1].where == "backward block 1"
        assert on.live_at(on.marks[name])[RETAINED_KEY] == 4 * G
    assert at(on, "backward_end") - at(off, "backward_end") == 5 * G + 5 * C == 1_310_720
    live = on.live_at(on.marks["backward_end"])
    assert live[RETAINED_KEY] == 5 * G and live[CKPT] == 5 * C
    assert CKPT not in off.live_at(off.marks["backward_end"])
    assert on.peak == at(on, "first_block_backward")
    # the other moments are the run's without it
    for name in set(PHASES) - {"first_block_recompute", "first_block_backward", "backward_end"}:
        assert at(on, name) == at(off, name), name


def test_every_mark_holds_what_the_moment_lists_by_key():
    config = _config()
    t = trained(MODEL, config)
    static = static_terms(MODEL, config, KERNELS, t)
    head, down = first_block_gradients(MODEL, config, static.gradients, t)
    sizes = static_sizes(static, accumulating=False, head_grads=head, down_grads=down)
    moments = moment_breakdowns(static.resident, sizes, batch_terms(MODEL, config, KERNELS), config.sharding.spec)
    timeline = step_timeline(model=MODEL, config=config, kernels=KERNELS)
    for name in PHASES:
        assert timeline.live_at(timeline.marks[name]) == moments[name], name
    # with accumulation: the last micro-step holds every gradient, the walk is the same
    accumulating = step_timeline(model=MODEL, config=_config(micro_batch=1, grad_accum=2), kernels=KERNELS)
    live = accumulating.live_at(accumulating.marks["backward_end"])
    assert live[RETAINED_KEY] == 5 * G // 2 and live[CKPT] == 5 * C // 2
