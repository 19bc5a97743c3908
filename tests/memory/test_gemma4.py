"""Gemma 4: per-layer head sizes (a full-attention layer's ``global_head_dim`` and kv heads, no v_proj with
``attention_k_eq_v``), the weightless v_norm, Gemma4RMSNorm's two row statistics, the sliding layers' SDPA
mask and the soft-capped logits (planner/memory/activations.py, attention.py window_mask), against what
autograd really keeps in a tiny Gemma 4 (tests/memory/test_moe.py's technique, test_mla's liveness count)."""

from __future__ import annotations

import pytest
from test_mla import _saved_per_layer

from planner.catalog import check_plannable, resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import CPU_KERNELS

# two sliding layers (head dim 16, 2 kv heads), then a full-attention one (head dim 32, 1 kv head, k = v);
# s = 32 is longer than the window (16)
TINY = dict(model_type="gemma4_text", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, vocab_size=256, max_position_embeddings=128,
            sliding_window=16, hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0)


def _config(precision: str, lora) -> TrainConfig:
    changes = dict(precision=precision)
    if lora:
        changes |= dict(method="lora", lora_r=4, lora_targets=(lora,) if isinstance(lora, str) else lora)
    return TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", **changes)


@pytest.mark.parametrize(("precision", "lora"), [
    ("bf16-mixed", None), ("fp32", None), ("bf16-mixed", "all-linear"), ("fp32", "all-linear"),
    ("bf16-mixed", ("k_proj", "o_proj")),
])
def test_gemma4_layers_match_what_autograd_saves(precision, lora):
    """Each layer byte for byte but for what the model counts once or leaves out: the rotary cos/sin of the
    layer's type (2 x s x its head dim, fp32: the residual's dtype) and the 4 B ``layer_scalar`` buffer the
    in-place ``hidden_states *= self.layer_scalar`` keeps (modeling_gemma4.py:1417)."""
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="gemma4", source="test")
    measured, _ = _saved_per_layer(TINY, precision, lora, attention="sdpa")
    predicted = [sum(terms.values()) for terms in layer_terms(spec, _config(precision, lora), CPU_KERNELS)]
    rope = [2 * 32 * d * 4 for d in (16, 16, 32)]
    assert predicted == [m - r - 4 for m, r in zip(measured, rope)]


def test_gemma4_terms_by_hand():
    # T = 64 tokens, bf16-mixed, full. The full-attention layer (head dim 32, 4 q heads, 1 kv head):
    # q_norm fp32 input 64*128*4 + 2 row stats 64*4*4*2 + normed fp32 64*128*4 = 67,584; k_norm 64*32*4 +
    # 64*1*4*2 + 64*32*4 = 16,896; v_norm (no weight) 64*32*4 + 64*4*2 = 8,704
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="gemma4", source="test")
    sliding, _, full = layer_terms(spec, _config("bf16-mixed", None), CPU_KERNELS)
    assert full["attention/qk_norms"] == 67_584 + 16_896 + 8_704
    # SDPA: q, k, v (1 kv head), out in bf16 and the fp32 log-sum-exp; no mask on the full layer
    assert full["attention/core"] == 2 * (2 * 64 * 128 + 2 * 64 * 32) + 64 * 4 * 4
    # the sliding layer: k and v repeated to the 4 heads by the mask, which SDPA keeps in bf16 (b x s x s)
    assert sliding["attention/core"] == 2 * 4 * 64 * 64 + 64 * 4 * 4 + 2 * 32 * 32 * 2


def test_softcap_keeps_tanh_output():
    from planner.memory.activations import model_level_terms
    from planner.memory.dtypes import mode_of
    from planner.memory.shapes import dims_of

    spec = spec_from_config(TINY, model_id="gemma4", source="test")
    config = _config("bf16-mixed", None)
    level = model_level_terms(spec, config, dims_of(spec, config), mode_of(config), CPU_KERNELS)
    assert level["loss/softcap"] == 64 * 256 * 2  # tanh's bf16 output, T x V
    # rotary tables of both head dims, fp32: 2 x s x (16 + 32) x 4, and the int64 ids
    assert level["embeddings"] == 64 * 8 + 2 * 32 * (16 + 32) * 4


# the MoE variant (Gemma 4 26B-A4B's layout): a sliding then a full-attention layer, each with the dense
# MLP beside 8 experts of which 2 per token
TINY_MOE = TINY | dict(num_hidden_layers=2, enable_moe_block=True, num_experts=8, top_k_experts=2,
                       moe_intermediate_size=48)


@pytest.mark.parametrize(("precision", "lora"), [
    ("bf16-mixed", None), ("fp32", None), ("bf16-mixed", "all-linear"), ("fp32", "all-linear"),
])
def test_gemma4_moe_layers_match_what_autograd_saves(precision, lora):
    """The router on the residual (its weightless norm, scale, proj, per-expert scales), the experts after
    pre_feedforward_layernorm_2 (grouped_mm in the weights' dtype), the dense MLP beside them and the two
    post-branch norms, byte for byte (rope and layer_scalar as in the dense test). all-linear: peft has no
    gemma4 conversion, so it wraps the router's proj and the dense MLP and leaves the expert stacks alone."""
    from planner.memory.activations import layer_terms
    from planner.memory.parameters import lora_params

    spec = spec_from_config(TINY_MOE, model_id="gemma4-moe", source="test")
    check_plannable(spec)
    config = _config(precision, lora)
    measured, trainable = _saved_per_layer(TINY_MOE, precision, lora, attention="sdpa")
    predicted = [sum(terms.values()) for terms in layer_terms(spec, config, CPU_KERNELS)]
    rope = [2 * 32 * d * 4 for d in (16, 32)]
    assert predicted == [m - r - 4 for m, r in zip(measured, rope)]
    if lora:
        assert lora_params(spec, config) == trainable


def test_gemma4_router_by_hand():
    # T = 64, H = 64, E = 8, k = 2, bf16-mixed, full: the norm's row statistics 2 x 64 x 4 (its fp32 input is
    # the fp32 residual pre_feedforward_layernorm keeps), the normed tensor for scale's gradient 64*64*4,
    # proj's bf16 input 64*64*2, softmax 64*8*4, topk indices 64*2*8, the renormalisation's values and sum
    # 64*2*4 + 64*4, the division's result and the gathered per-expert scales 64*2*4 each
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY_MOE, model_id="gemma4-moe", source="test")
    block = layer_terms(spec, _config("bf16-mixed", None), CPU_KERNELS)[0]
    assert block["moe/router"] == 512 + 16_384 + 8_192 + 2_048 + 1_024 + 512 + 256 + 1_024 == 29_952
    # pre_feedforward_layernorm_2: 2 row statistics + its fp32 normalised tensor; the two post-branch norms:
    # fp32 input, 2 row statistics, fp32 normalised tensor each
    assert block["moe/norms"] == 512 + 16_384 + 2 * (16_384 + 512 + 16_384)


def test_gemma4_plans_by_id():
    dense = resolve_model("nvidia/Gemma-4-31B-IT-NVFP4")
    check_plannable(dense)
    assert [(n, first, view.head_dim, view.num_kv_heads) for n, first, view in dense.block_kinds] == [
        (50, 0, 256, 16), (10, 5, 512, 4)]
    moe = resolve_model("google/gemma-4-26B-A4B")
    check_plannable(moe)
    assert moe.routing is not None and moe.routing.parallel_experts and moe.num_experts == 128


def test_full_layers_apart_from_sliding_ones_of_the_same_weights():
    # one head dim and kv heads for both kinds and no k = v: the same weights, yet the full-attention layer
    # gets no window mask
    raw = TINY | dict(global_head_dim=16, attention_k_eq_v=False)
    spec = spec_from_config(raw, model_id="gemma4", source="test")
    assert [(n, first, view.sliding_attention) for n, first, view in spec.block_kinds] == [(2, 0, True), (1, 2, False)]
    from planner.memory.activations import layer_terms

    sliding, _, full = layer_terms(spec, _config("bf16-mixed", None), CPU_KERNELS)
    assert sliding["attention/core"] - full["attention/core"] == 2 * 2 * 64 * 16 * 2 + 2 * 32 * 32 * 2
