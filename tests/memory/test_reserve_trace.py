"""A checkpointed block's forward in the step's timeline: the MLP tensors it makes and frees
(``timeline._forward_locals``), which change no peak but the allocator's cache, against sizes
worked out by hand and against a real forward's allocations (c10's CPU allocator events)."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.timeline import step_timeline

#: Mistral-7B-v0.1's shapes (planner/data/model_catalog.json) with two layers
MISTRAL = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
               rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False)
LORA = dict(method="lora", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), precision="fp32",
            seq_len=2048, micro_batch=1, loss_shift=True)


def _forward_mlp_events(timeline) -> list:
    return [ev for ev in timeline.events
            if "forward block" in ev.where and ev.key == "activations/mlp/intermediate"]


def test_each_checkpointed_block_forward_makes_and_frees_three_intermediate_tensors():
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    timeline = step_timeline(model=model, config=TrainConfig(**LORA, grad_ckpt=True), kernels=get_gpu("a100-80gb").kernels)
    unit = 2048 * 14336 * 4  # tokens x intermediate_size x fp32: 112 MiB
    events = _forward_mlp_events(timeline)
    # the run's first step and the measured step, two blocks each: an allocation and its free a block
    assert [(ev.op, ev.tensors) for ev in events] == [("alloc", (unit,) * 3), ("free", (unit,) * 3)] * 4
    assert {ev.where for ev in events} == {"step 1: forward block 1", "step 1: forward block 2",
                                           "forward block 1", "forward block 2"}


def test_without_checkpointing_the_forward_saves_them_instead():
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    timeline = step_timeline(model=model, config=TrainConfig(**LORA), kernels=get_gpu("a100-80gb").kernels)
    # the saved act(gate), up(x) and product, made in the forward and freed in backward only
    assert [ev.op for ev in _forward_mlp_events(timeline)] == ["alloc"] * 4


def test_the_forward_locals_change_no_peak():
    """The forward's point stays under the moments (Timeline.peak asserts it): the same peak as the
    step's moments give, a forward's three 112 MiB tensors on top of the checkpoints."""
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    timeline = step_timeline(model=model, config=TrainConfig(**LORA, grad_ckpt=True), kernels=get_gpu("a100-80gb").kernels)
    curve = timeline.curve()
    first = next(i for i, ev in enumerate(timeline.events) if _forward_mlp_events(timeline)[0] is ev)
    assert curve[first + 1] - curve[first] == 3 * 2048 * 14336 * 4
    assert max(curve) == timeline.peak > curve[first + 1]


def test_a_real_checkpointed_forward_holds_as_many_intermediate_tensors():
    """A real forward of a small Mistral under checkpointing as the worker sets it (workers/train.py
    _apply_training_setup), on the CPU: the
    most tensors of the MLP's intermediate size alive at once in c10's allocator events is what
    the timeline draws in each block's forward."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from workers.probes import AllocatorStream

    small = dict(MISTRAL, hidden_size=256, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, sliding_window=1024)
    tokens, batch = 128, 2
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**small))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # the worker's
    model.train()
    ids = torch.randint(0, small["vocab_size"], (batch, tokens))
    stream = AllocatorStream()
    stream.start()
    model(input_ids=ids, labels=ids).loss.detach()
    stream.stop()
    unit = batch * tokens * 1536 * 4
    live, most = set(), 0
    for _, _, size, ptr in stream.events:
        if size == unit:
            live.add(ptr)
            most = max(most, len(live))
        elif size == -unit:
            live.discard(ptr)
    spec = spec_from_config(small, model_id="small-mistral", source="test")
    config = TrainConfig(method="full", precision="fp32", seq_len=tokens, micro_batch=batch, grad_ckpt=True)
    drawn = _forward_mlp_events(step_timeline(model=spec, config=config, kernels=get_gpu("cpu").kernels))[0]
    assert most == 3
    assert drawn.tensors == (unit,) * most
