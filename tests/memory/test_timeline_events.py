"""Invariants of the step's events as the allocator replay reads them: every event allocates or
frees a positive number of bytes, every free frees an allocation made before it, of the same
bytes, and each event's tensors add up to its bytes (``planner.memory.allocator`` places each)."""

from __future__ import annotations

import random

import pytest

from planner.catalog import resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.activations import block_backward_terms
from planner.memory.timeline import step_timeline
from planner.search import SearchSpace, enumerate_configs

#: phi-2's shapes (config.json of microsoft/phi-2: a plain fc1 -> gelu_new -> fc2 MLP), two layers
PHI2 = dict(model_type="phi", hidden_size=2560, intermediate_size=10240, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=51200, max_position_embeddings=2048, hidden_act="gelu_new",
            partial_rotary_factor=0.4, tie_word_embeddings=False)
#: the litgpt phi-2 LoRA row's settings (bench/published_rows.json litgpt-phi-2-lora): LoRA r8 on every
#: linear with dropout 0.05, bf16, no checkpointing
PHI2_LORA = dict(method="lora", lora_r=8, lora_targets="all-linear", lora_dropout=0.05, precision="bf16",
                 micro_batch=4, seq_len=512)


def _check(timeline) -> None:
    made: dict[int, int] = {}
    for ev in timeline.events:
        assert ev.nbytes > 0, ev
        sizes = ev.tensors if isinstance(ev.tensors, tuple) else None
        assert sizes is None and ev.tensors >= 1 or sum(sizes) == ev.nbytes, ev
        if ev.op == "alloc":
            assert ev.ident not in made, ev
            made[ev.ident] = ev.nbytes
        else:
            assert made.pop(ev.ident) == ev.nbytes, ev


def test_a_plain_mlp_with_lora_dropout_frees_the_released_tensors_and_allocates_the_gradients():
    """Without checkpointing the last block's backward releases what fc2 saved (its input, lora_B's
    input, its adapter's dropout mask and dropped copy) and makes its gradients: the gradients are
    fewer bytes than what is released (the delta -10,551,296 B at 2048 tokens), which was drawn as
    one allocation of negative size; now the released tensors are freed and the gradients allocated."""
    spec = spec_from_config(PHI2, model_id="phi2-2l", source="test")
    config = TrainConfig(**PHI2_LORA)
    terms = block_backward_terms(spec, config, get_gpu("a100-80gb").kernels)
    # 2048 tokens: fc2's input, the bf16 product 2048*10240*2 and peft's fp32 cast of it 2048*10240*(4 - 2)
    # (the adapter input term); lora_B's fp32 input 2048*8*4; the dropout's bool mask 2048*10240
    assert {k: v for k, v in terms.items() if v < 0} == {
        "mlp/intermediate": -(41_943_040 + 41_943_040), "lora/activations": -65_536, "lora/dropout": -20_971_520}
    released = 41_943_040 * 2 + 65_536 + 20_971_520
    grads = 2048 * 2560 * 2 + 2 * 2048 * 10240 * 2  # the output's gradient and gelu's two, bf16
    assert terms["block_backward"] == grads == 94_371_840
    assert grads - released == -10_551_296
    timeline = step_timeline(model=spec, config=config, kernels=get_gpu("a100-80gb").kernels)
    _check(timeline)
    mark = timeline.marks["first_block_backward"]
    before = [ev for ev in timeline.events[:mark] if ev.where == "backward block 2"]
    assert [ev.op for ev in before][-4:] == ["free", "free", "free", "alloc"]
    assert sum(ev.nbytes for ev in before[-4:-1]) == released


def _configs(model, gpu, rng: random.Random, n: int) -> list[TrainConfig]:
    configs = list(enumerate_configs(model=model, gpu=gpu, target_batch=8, seq_len=min(512, model.max_seq_len), gpus=2,
                                     space=SearchSpace(cpu_mem_bytes=1 << 40)))
    configs += [c.replace(grad_ckpt=False, lora_dropout=0.05) for c in configs[::4] if c.method.uses_adapters]
    return rng.sample(configs, min(n, len(configs)))


def _cases():
    rng = random.Random(25)
    models = [resolve_model(name) for name in ("meta-llama/Llama-2-7b-hf", "microsoft/phi-2", "mistralai/Mixtral-8x7B-v0.1",
                                               "t5-large")]
    for gpu_name in ("a100-80gb", "cpu"):
        gpu = get_gpu(gpu_name)
        for model in models:
            for config in _configs(model, gpu, rng, 25):
                yield pytest.param(model, gpu, config, id=f"{gpu_name}-{model.id}-{config.label()}")


@pytest.mark.parametrize("model, gpu, config", list(_cases()))
def test_no_event_has_a_negative_size(model, gpu, config):
    _check(step_timeline(model=model, config=config, kernels=gpu.kernels))
