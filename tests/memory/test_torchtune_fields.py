"""torchtune's recipe settings as request fields (planner/request.py ``optimizer_in_bwd``,
``loss_chunks``) reach the memory core's terms (tests/memory/test_recipe_terms.py checks the terms
themselves), and ``TrainConfig`` refuses what torchtune's recipes refuse."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.errors import InvalidConfigError, UnsupportedError
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.states import static_terms
from planner.memory.step import moment_breakdowns
from planner.memory.timeline import _step_parts

LLAMA31_8B_PARAMS = 8_030_261_248
EMBEDDING = 128256 * 4096  # the largest tensor of untied Llama-3.1-8B (its head is the same size)
#: torchtune's llama3_1/8B_full_single_device.yaml as the planner reads it (bf16, PagedAdamW8bit,
#: checkpointing, batch 2), at 2048 tokens
TORCHTUNE_8B = {"method": "full", "precision": "bf16", "optimizer": "paged_adamw_8bit", "micro_batch": 2,
                "seq_len": 2048, "grad_ckpt": True}


def _moments(config: TrainConfig) -> dict[str, int]:
    parts = _step_parts(resolve_model("meta-llama/Llama-3.1-8B"), config, get_gpu("a100-80gb").kernels)
    return {name: sum(live.values()) for name, live in moment_breakdowns(
        parts.static.resident, parts.sizes, parts.batch, config.sharding.spec).items()}


def test_the_optimizer_in_backward_keeps_the_largest_gradient_alone():
    """bf16 gradients: every one is 2 x 8,030,261,248 bytes; with the optimizer in backward only
    the embedding's (or the head's) 2 x 128256 x 4096 is alive, so the end of backward (every
    gradient made) holds exactly the difference less."""
    model, kernels = resolve_model("meta-llama/Llama-3.1-8B"), get_gpu("a100-80gb").kernels
    plain, in_bwd = TrainConfig(**TORCHTUNE_8B), TrainConfig(**TORCHTUNE_8B, optimizer_in_bwd=True)
    assert model.params_total == LLAMA31_8B_PARAMS
    assert static_terms(model, plain, kernels).gradients == 2 * LLAMA31_8B_PARAMS
    assert static_terms(model, in_bwd, kernels).gradients == 2 * EMBEDDING
    assert static_terms(model, in_bwd, kernels).optimizer_gradients == 2 * EMBEDDING
    a, b = _moments(plain), _moments(in_bwd)
    assert a["backward_end"] - b["backward_end"] == 2 * (LLAMA31_8B_PARAMS - EMBEDDING)


def test_foreach_adamw_in_backward_steps_one_tensor_at_a_time():
    """torch's foreach AdamW copies every second moment (``_foreach_sqrt``); one optimizer per
    parameter copies one tensor's: the largest, 128256 x 4096 bf16."""
    model, kernels = resolve_model("meta-llama/Llama-3.1-8B"), get_gpu("a100-80gb").kernels
    config = {**TORCHTUNE_8B, "optimizer": "adamw"}
    assert static_terms(model, TrainConfig(**config), kernels).optimizer_step == 2 * LLAMA31_8B_PARAMS
    assert static_terms(model, TrainConfig(**config, optimizer_in_bwd=True), kernels).optimizer_step == 2 * EMBEDDING


def test_a_chunked_loss_field_shrinks_the_loss_transients():
    """8 chunks of 2 x 2048 tokens: the forward holds the whole bf16 logits and one 512-token
    piece's fp32 upcast (4096 x 128256 x 2 + 512 x 128256 x 4), where one chunk upcasts all."""
    model, gpu = resolve_model("meta-llama/Llama-3.1-8B"), get_gpu("a100-80gb")
    config = TrainConfig(**TORCHTUNE_8B, optimizer_in_bwd=True, loss_chunks=8)
    assert _step_parts(model, config, gpu.kernels).batch.forward_logits == 4096 * 128256 * 2 + 512 * 128256 * 4
    assert _step_parts(model, config.replace(loss_chunks=1), gpu.kernels).batch.forward_logits == 4096 * 128256 * 6
    whole = estimate_memory(model=model, config=config.replace(loss_chunks=1), gpu=gpu)
    assert estimate_memory(model=model, config=config, gpu=gpu).peak_allocated_bytes < whole.peak_allocated_bytes


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"grad_accum": 2}, InvalidConfigError, "--grad-accum 1"),
    ({"method": "lora"}, InvalidConfigError, "LoRA recipe"),
    ({"sharding": "zero2", "gpus": 2}, UnsupportedError, "one device"),
    ({"sharding": "fsdp2", "gpus": 2}, UnsupportedError, "one device"),
])
def test_the_optimizer_in_backward_is_refused_where_torchtune_refuses_it(changes, error, words):
    with pytest.raises(error, match=words):
        TrainConfig(**{**TORCHTUNE_8B, "optimizer_in_bwd": True, **changes})
    with pytest.raises(InvalidConfigError, match="--grad-accum 1"):  # the search's fast copy checks it too
        TrainConfig(**TORCHTUNE_8B, optimizer_in_bwd=True).with_split(micro_batch=1, grad_accum=2)


def test_a_chunked_loss_is_refused_with_a_fused_one():
    with pytest.raises(InvalidConfigError, match="--fused-ce"):
        TrainConfig(method="lora", loss_chunks=8, fused_ce=True)


def test_the_payload_keeps_its_bytes_at_the_defaults_and_carries_the_settings():
    assert "optimizer_in_bwd" not in TrainConfig().to_dict() and "loss_chunks" not in TrainConfig().to_dict()
    config = TrainConfig(**TORCHTUNE_8B, optimizer_in_bwd=True, loss_chunks=8)
    payload = config.to_dict()
    assert payload["version"] == 3 and payload["optimizer_in_bwd"] is True and payload["loss_chunks"] == 8
    assert TrainConfig.from_dict(payload) == config


def test_the_search_refuses_the_optimizer_in_backward_in_one_line():
    """The search splits the batch with accumulation and gives every method one recipe: it says
    so rather than plan a split torchtune refuses; the chunked loss it searches like any recipe."""
    from planner import request

    values = {**request.recipe_of(TrainConfig()), "optimizer_in_bwd": True}
    with pytest.raises(UnsupportedError, match="the search does not take --optimizer-in-bwd"):
        request.recipe_for(values, adapters=False, qlora=False)
    chunked = {**request.recipe_of(TrainConfig()), "loss_chunks": 8}
    assert request.recipe_for(chunked, adapters=True, qlora=False)["loss_chunks"] == 8
