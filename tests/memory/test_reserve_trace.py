"""A checkpointed block's forward in the step's timeline: the tensors it makes and frees
(``timeline._forward_mlp`` in every block, ``timeline._forward_locals`` one by one in the last
block of the first forward), which change no peak but the allocator's cache, against sizes worked
out by hand and against a real forward's allocations (c10's CPU allocator events)."""

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


def _most_alive(events, size: int) -> int:
    live, most = set(), 0
    for ev in events:
        if ev.nbytes == size:
            (live.add if ev.op == "alloc" else live.discard)(ev.ident)
            most = max(most, len(live))
    return most


def test_the_last_block_of_the_first_forward_makes_and_frees_the_mlp_tensors_in_order():
    """MistralMLP.forward ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: gate(x), act(gate) (gate
    freed), up(x), the product (act and up freed), then the product freed once down_proj ran: each
    a tensor of tokens x intermediate_size fp32, 2048 * 14336 * 4 = 112 MiB, three alive at most.
    Drawn so in the last block of the run's first step; every other block of the two steps
    makes the three as one event and frees them."""
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    timeline = step_timeline(model=model, config=TrainConfig(**LORA, grad_ckpt=True), kernels=get_gpu("a100-80gb").kernels)
    unit = 2048 * 14336 * 4
    events = _forward_mlp_events(timeline)
    one_by_one = [ev for ev in events if ev.where == "step 1: forward block 2"]
    assert {ev.nbytes for ev in one_by_one} == {unit} and {ev.tensors for ev in one_by_one} == {1}
    assert [ev.op for ev in one_by_one] == ["alloc", "alloc", "free", "alloc", "alloc", "free", "free", "free"]
    assert _most_alive(one_by_one, unit) == 3
    together = [(ev.where, ev.op, ev.tensors) for ev in events if ev not in one_by_one]
    assert together == [(where, op, (unit,) * 3) for where in ("step 1: forward block 1", "forward block 1",
                                                                "forward block 2") for op in ("alloc", "free")]


def test_without_checkpointing_the_forward_saves_them_instead():
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    timeline = step_timeline(model=model, config=TrainConfig(**LORA), kernels=get_gpu("a100-80gb").kernels)
    # the saved act(gate), up(x) and product, made in the forward and freed in backward only
    assert [ev.op for ev in _forward_mlp_events(timeline)] == ["alloc"] * 4
    assert not [ev for ev in timeline.events if ev.key == "activations/block_locals"]


def test_the_forward_locals_change_no_peak():
    """The forward's locals stay under the step's peak (Timeline.peak asserts no point exceeds the
    moments): the same peak as without them, reached at the same moment."""
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    config = TrainConfig(**LORA, grad_ckpt=True)
    timeline = step_timeline(model=model, config=config, kernels=get_gpu("a100-80gb").kernels)
    locals_ = [i for i, ev in enumerate(timeline.events) if ev.key == "activations/block_locals"]
    assert locals_
    curve = timeline.curve()
    assert max(curve) == timeline.peak == curve[timeline.marks[timeline.peak_phase]]
    assert max(curve[i + 1] for i in locals_) < timeline.peak


def test_qlora_dequantises_each_weight_in_the_first_forwards_last_block():
    """bitsandbytes 0.50.2 dequantises a 4-bit weight whole past 1536 tokens in forward (backends/cuda/
    ops.py l.954-967): q and o 4096 x 4096, k and v 4096 x 1024, gate, up and down 4096 x 14336, fp16
    (2 bytes) for fp16-mixed: 32, 8, 8, 32, 112, 112, 112 MiB, drawn in the last block of the
    first forward."""
    model = spec_from_config(MISTRAL, model_id="mistral-2l", source="test")
    config = TrainConfig(method="qlora", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                         precision="fp16-mixed", seq_len=2048, micro_batch=1, grad_ckpt=True)
    timeline = step_timeline(model=model, config=config, kernels=get_gpu("a100-80gb").kernels)
    MiB = 1024**2
    forward = [ev.nbytes for ev in timeline.events if ev.where == "step 1: forward block 2" and ev.op == "alloc"]
    # 112 MiB: the three MLP weights in fp16, and the fp32 (k-bit upcast) 2048 x 14336 tensors of as many bytes:
    # gate's and up's outputs cast back to their fp32 input's dtype (``.to(inp_dtype)``), act(gate), the product
    assert forward.count(112 * MiB) == 3 + 4
    assert forward.count(56 * MiB) == 2 + 1  # gate's and up's fp16 outputs, down's fp16 cast of the product
    # at 1024 tokens bitsandbytes' own kernel reads the 4-bit weight: no weight dequantised (the MLP's
    # fp32 tensors are 1024 x 14336 x 4 B = 56 MiB)
    short = step_timeline(model=model, config=config.replace(seq_len=1024), kernels=get_gpu("a100-80gb").kernels)
    assert 112 * MiB not in [ev.nbytes for ev in short.events if ev.where == "step 1: forward block 2"]


def test_a_real_checkpointed_forward_makes_the_tensors_drawn():
    """A real forward of a small Mistral with LoRA on q, k, v, o under checkpointing as the worker
    sets it (workers/train.py _apply_training_setup), on the CPU: c10's allocator events of the
    hidden-, kv- and intermediate-sized tensors (and rotary's halves) are the timeline's blocks'
    forward locals and checkpoints, and four more: the embedding's output and the final norm's
    three (pow, the scaled fp32 state, the weight's product)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from collections import Counter

    from workers.probes import AllocatorStream

    small = dict(MISTRAL, hidden_size=256, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, sliding_window=1024)
    tokens, batch = 128, 2
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**small))
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=list(LORA["lora_targets"]), lora_dropout=0.0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # the worker's
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, small["vocab_size"], (batch, tokens))
    stream = AllocatorStream()
    stream.start()
    model(input_ids=ids, labels=ids).loss.detach()
    stream.stop()
    e = batch * tokens
    # hidden e*256*4, kv e*128*4 (= hidden / 2: rotary's q half too), intermediate e*1536*4, rotary's k half e*64*4
    sizes = {e * 256 * 4: "hidden", e * 128 * 4: "half", e * 1536 * 4: "intermediate", e * 64 * 4: "quarter"}
    real = Counter(sizes[size] for _, _, size, _ in stream.events if size in sizes)
    spec = spec_from_config(small, model_id="small-mistral", source="test")
    config = TrainConfig(**dict(LORA, seq_len=tokens, micro_batch=batch), grad_ckpt=True)
    timeline = step_timeline(model=spec, config=config, kernels=get_gpu("cpu").kernels)
    drawn = Counter(sizes[ev.nbytes] for ev in timeline.events
                    if ev.op == "alloc" and ev.where.startswith("step 1: forward block") and ev.nbytes in sizes)
    # the last block's locals, one by one; the first block's are as many (drawn there as one event of the MLP's)
    last = Counter(sizes[ev.nbytes] for ev in timeline.events if ev.op == "alloc" and ev.nbytes in sizes
                   and ev.where == "step 1: forward block 2" and ev.key != "activations/checkpoints")
    assert real == drawn + last + Counter(hidden=4)
    assert real == Counter(hidden=48, half=26, intermediate=8, quarter=2)


def test_the_locals_are_drawn_one_by_one_once_whatever_the_layers_and_steps():
    """The replay's cost: the forward's locals one by one in one block of one forward, so a deeper
    model or more micro-steps add the one-event MLP draw of each block (two events: its alloc and
    free), not a block's program."""
    config = TrainConfig(**LORA, grad_ckpt=True)
    kernels = get_gpu("a100-80gb").kernels

    def timeline(layers: int, accum: int = 1):
        model = spec_from_config(dict(MISTRAL, num_hidden_layers=layers), model_id=f"mistral-{layers}l", source="test")
        return step_timeline(model=model, config=config.replace(grad_accum=accum), kernels=kernels)

    def one_by_one(t) -> list:
        return [ev.where for ev in t.events if ev.key == "activations/block_locals"]

    two, four, accumulating = timeline(2), timeline(4), timeline(2, accum=2)
    assert set(one_by_one(two)) == {"step 1: forward block 2"} and set(one_by_one(four)) == {"step 1: forward block 4"}
    assert len(one_by_one(two)) == len(one_by_one(four)) == len(one_by_one(accumulating)) > 0
    # two more blocks in each of the two steps' forwards: 2 x 2 one-event MLP draws (alloc and free) and the
    # blocks' own terms, as without the locals
    mlp = [ev for ev in four.events if ev.key == "activations/mlp/intermediate" and ev.tensors != 1]
    assert len(mlp) == 2 * (4 + 3)
