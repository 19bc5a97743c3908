"""Qwen3.5 / Qwen3-Next: Gated DeltaNet layers on the CPU's torch path (planner/memory/recurrent.py), the gated
full-attention layers and Qwen3-Next's MoE blocks, against what autograd really keeps in tiny models built
from their configs shrunk (tests/memory/test_moe.py's technique, test_mla's liveness count)."""

from __future__ import annotations

import pytest
from test_mla import _saved_per_layer

from planner.catalog import check_plannable, resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import CPU_KERNELS, CUDA_KERNELS

# a Gated DeltaNet layer (2 key heads of 16, 4 value heads of 8: q and k repeated) then a gated attention one
TINY = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"], vocab_size=256, max_position_embeddings=128)
TINY_NEXT = dict(TINY, model_type="qwen3_next", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)


def _config(precision: str, lora, seq_len: int) -> TrainConfig:
    changes = dict(precision=precision)
    if lora:
        changes |= dict(method="lora", lora_r=4, lora_targets=(lora,))
    return TrainConfig(micro_batch=2, seq_len=seq_len, optimizer="adamw", **changes)


def _measured(raw: dict, precision: str, lora, seq_len: int) -> list[int]:
    """test_mla's per-layer count at b = 2, s = ``seq_len`` (it draws (2, 32) ids: drawn here at our length)."""
    import torch

    draw = torch.randint
    torch.randint = lambda low, high, shape, **kw: draw(low, high, (2, seq_len), **kw)
    try:
        return _saved_per_layer(raw, precision, lora, attention="sdpa")[0]
    finally:
        torch.randint = draw


@pytest.mark.parametrize(("raw", "precision", "lora", "seq_len"), [
    (TINY, "bf16-mixed", None, 32), (TINY, "bf16-mixed", None, 100), (TINY, "fp32", None, 100),
    (TINY, "bf16", None, 32), (TINY, "bf16-mixed", "all-linear", 32), (TINY, "fp32", "all-linear", 32),
    (TINY_NEXT, "bf16-mixed", None, 32), (TINY_NEXT, "bf16-mixed", "all-linear", 32),
])
def test_qwen_hybrid_layers_match_what_autograd_saves(raw, precision, lora, seq_len):
    """Both layers byte for byte but for what the model leaves out or counts once: the fp32 ``1 + weight`` each
    Qwen3NextRMSNorm whose input needs a gradient keeps (hidden x 4 for the two block norms, head_dim x 4 for q_norm and k_norm) and the
    attention layer's rotary cos/sin (b x s x 4 rotary dims each: partial_rotary_factor 0.25, the residual's
    dtype). s = 100 pads to two 64-token chunks."""
    from planner.memory.activations import layer_terms

    spec = spec_from_config(raw, model_id="hybrid", source="test")
    check_plannable(spec)
    measured = _measured(raw, precision, lora, seq_len)
    predicted = [sum(terms.values()) for terms in layer_terms(spec, _config(precision, lora, seq_len), CPU_KERNELS)]
    residual = 2 if precision == "bf16" else 4
    norms = 2 * 64 * 4
    rope = 2 * 2 * seq_len * 4 * residual
    # the first LoRA block's input norm keeps no weight: its input needs no gradient
    expected = [measured[0] - (norms // 2 if lora else norms), measured[1] - norms - 2 * 16 * 4 - rope]
    if "num_experts" not in raw:
        assert predicted == expected
    else:
        # an MoE layer's count moves by 1 x 1,024 B from one process to another (test_mla's note: one int64
        # T x k tensor more or less held)
        assert all(abs(p - e) <= 1024 for p, e in zip(predicted, expected))


def test_fla_path_by_hand():
    # the GPU path, bf16-mixed, full, T = 64: fla keeps the l2-normed q and k (2 key heads x 16, bf16) with their
    # fp32 rstd, v (4 x 8, bf16), the fp32 cumsum of g (4 heads) and A (4 heads x 64, bf16):
    # 2 * (64*32*2 + 64*2*4) + 64*32*2 + 64*4*4 + 64*4*64*2 = 47,104
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="hybrid", source="test")
    gdn = layer_terms(spec, _config("bf16-mixed", None, 32), CUDA_KERNELS)[0]
    assert gdn["linear_attn/delta_rule"] == 47_104
    # CausalConv1dFn keeps its input only (96 channels, bf16); the torch path also its padded output
    assert gdn["linear_attn/conv"] == 64 * 96 * 2
    cpu = layer_terms(spec, _config("bf16-mixed", None, 32), CPU_KERNELS)[0]
    assert cpu["linear_attn/conv"] == 64 * 96 * 2 + 2 * 96 * 35 * 2 + 96 * 4 * 2


def test_qwen_hybrids_plan_by_id():
    for model_id in ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-35B-A3B", "Qwen/Qwen3-Next-80B-A3B-Thinking"):
        spec = resolve_model(model_id)
        check_plannable(spec)
        kinds = {view.mixer for _, _, view in spec.block_kinds}
        assert kinds == {"gated_deltanet", "attention"} and spec.gated_deltanet is not None


def test_linear_attention_flops_by_hand():
    # one Gated DeltaNet layer, 4 value heads, k 16, v 8, 64-token chunks, per token: 4*64*16 (two C x C
    # products) + 64*(8 + 16) (the solves) + 2*64*8 (intra-chunk x v_new) + 4*16*8 (state read and update)
    from planner.kernels import _attention_layers, _linear_attention_flops

    spec = spec_from_config(TINY, model_id="hybrid", source="test")
    assert _linear_attention_flops(spec, 64) == 4 * (4 * 64 * 16 + 64 * 24 + 2 * 64 * 8 + 4 * 16 * 8) * 64
    # the softmax attention: only the full-attention layer
    assert _attention_layers(spec, _config("bf16-mixed", None, 32)) == ((1, 4, 16, 32),)
