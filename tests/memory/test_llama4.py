"""Llama 4: the MoE block whose experts run as a dense bmm over every token (planner/memory/moe.py
``_dense_expert_bytes``), the sigmoid router over the top-k logits, the weightless L2 q/k norm of the rotary
layers and the NoPE layers without it, against what autograd really keeps in a tiny Llama 4 (tests/memory/test_mla.py's
liveness count); the router LoRA cannot adapt, refused in one line."""

from __future__ import annotations

import pytest

from planner.catalog import check_plannable, resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import CPU_KERNELS
from support.models import LLAMA4_TINY

# a dense then an MoE layer (4 experts, top-1, a shared expert), twice; the last layer NoPE (every 4th): no rope and
# no qk norm there; chunked attention over 16 tokens in the rotary layers (s = 32: the mask is built)
TINY = LLAMA4_TINY
#: every nn.Linear but the router
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _saved_per_layer(raw: dict, precision: str, lora, attention: str) -> list[int]:
    """test_mla's liveness count per decoder layer at b = 2, s = 32 (Llama4ForCausalLM's layers sit under
    ``model.model``: get_decoder() is the causal LM itself)."""
    import torch
    from test_mla import held_per_layer
    from test_moe import tiny_model

    model, params = tiny_model(raw, precision, lora, attention)
    layers = next(m for n, m in model.named_modules() if n.endswith(".layers") and isinstance(m, torch.nn.ModuleList))
    return held_per_layer(model, params, layers, precision)


@pytest.mark.parametrize(("precision", "lora", "attention"), [
    ("bf16-mixed", None, "sdpa"), ("fp32", None, "sdpa"), ("bf16", None, "sdpa"), ("bf16-mixed", TARGETS, "sdpa"),
    ("fp32", TARGETS, "sdpa"), ("bf16", TARGETS, "sdpa"), ("bf16-mixed", ("q_proj", "v_proj"), "sdpa"),
    ("bf16-mixed", None, "eager"), ("bf16", None, "eager"),
])
def test_llama4_layers_match_what_autograd_saves(precision, lora, attention):
    """Every layer byte for byte but for what the model counts once or leaves out: the rotary layers' complex
    frequencies (s x head_dim / 2 complex64, one tensor every layer keeps) and the NoPE layer's temperature
    scales (s fp32). Eager attention: softmax in the scores' dtype, which the additive mask promotes to the
    residual's."""
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="llama4", source="test")
    check_plannable(spec)
    changes = dict(precision=precision, attention=attention)
    changes |= dict(method="lora", lora_r=4, lora_targets=lora) if lora else {}
    predicted = [sum(t.values()) for t in layer_terms(spec, TrainConfig(micro_batch=2, seq_len=32, **changes),
                                                      CPU_KERNELS)]
    measured = _saved_per_layer(TINY, precision, lora, attention)
    left_out = [32 * 8 * 8] * 3 + [32 * 4]
    assert predicted == [m - x for m, x in zip(measured, left_out)]


def test_dense_experts_by_hand():
    # bf16-mixed, full, T = 64 tokens, E = 4 experts (every token through each: 256 rows), H = 64, I = 32
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="llama4", source="test")
    moe = layer_terms(spec, TrainConfig(micro_batch=2, seq_len=32, precision="bf16-mixed"), CPU_KERNELS)[1]
    # per row: the repeated fp32 input 64*4, the bf16 score 2, the up bmm's bf16 input 64*2, gate_up 2*32*2, silu's
    # output 32*2, the down bmm's input 32*2
    assert moe["moe/experts"] == 256 * (256 + 2 + 128 + 128 + 64 + 64)
    # the router: the input's bf16 cast 64*64*2, topk's indices 64*8, sigmoid's fp32 result 64*4*4
    assert moe["moe/router"] == 8_192 + 512 + 1_024


def test_llama4_scout_plans_by_id_and_refuses_the_router():
    from planner.estimation import estimate_configuration
    from planner.gpus import get_gpu

    spec = resolve_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    check_plannable(spec)
    assert spec.routing is not None and spec.routing.dense_experts and spec.qk_norm == "l2"
    assert [(g.label, g.count, g.qk_norm) for g in spec.other_blocks] == [("moe nope", 12, "")]
    gpu = get_gpu("h100-80gb")
    for lora in ("all-linear", "router,q_proj"):
        with pytest.raises(InvalidConfigError, match="fails on llama4_text: all-linear wraps Llama4Router") as err:
            estimate_configuration(spec=spec, gpu=gpu, method="lora", lora_targets=lora, micro_batch=1, seq_len=512)
        assert "\n" not in str(err.value) and "use --lora-targets q_proj,k_proj,v_proj,o_proj," in str(err.value)
    answer, memory = estimate_configuration(spec=spec, gpu=gpu, method="lora", lora_targets=",".join(TARGETS),
                                            micro_batch=1, seq_len=512)
    assert answer["model"]["params"] == spec.params_total and memory.process_total_bytes > 0


def test_dense_experts_flops_by_hand():
    # the two MoE layers' experts compute every token: 4 experts, not top-1, x (gate_up 64 -> 64 + down 32 -> 64)
    import dataclasses

    from planner.kernels import _gemms

    spec = spec_from_config(TINY, model_id="llama4", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, precision="bf16-mixed")
    routed = dataclasses.replace(spec, routing=dataclasses.replace(spec.routing, dense_experts=False))
    extra = _gemms(spec, config)[0][0] - _gemms(routed, config)[0][0]
    assert extra == 2 * 2.0 * (4 - 1) * (64 * 64 + 32 * 64)
