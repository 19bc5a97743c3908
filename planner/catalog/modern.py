"""Builders of the 2025-2026 decoder families: dense (granite, olmo2, gemma3), mixture-of-experts
(qwen3_moe, gpt_oss, deepseek_v3, llama4) and hybrid (qwen3_next, qwen3_5, qwen3_5_moe, gemma4,
nemotron_h) models.

Each builder lists every block's parameter-holding modules as transformers 5.24 builds them
(``transformers/models/<type>/modeling_<type>.py``, cited per builder), so that ``params_total``
equals the meta-device model's count (tests/catalog/test_param_counts.py). Blocks that differ from block 0
(DeepSeek's MoE blocks after its dense ones, full-attention blocks among linear-attention ones,
Gemma 4's global blocks) go to ``ModelSpec.other_blocks``; ``layer_linears`` is block 0, the block
the test compares. Expert weights are 3D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``), one ``LinearSpec`` with ``count`` experts and ``active`` top-k: peft reaches them
through ``target_parameters``, while ``target_modules="all-linear"`` wraps the attention, router,
shared-expert and dense-MLP ``nn.Linear`` modules listed with them.

What the memory model has no terms for would be listed in ``ModelSpec.unmodelled``; planning such a model
is refused (``planner.catalog.check_plannable``). Every builder here is modelled now.

Pure module: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from planner.catalog.blocks import ConfigReader, K, common_fields, lin, qkvo, swiglu, untied_head
from planner.modelspec import BlockGroup, GatedDeltaNet, LatentAttention, LinearSpec, Mamba2, ModelSpec, MoeRouting

Block = tuple[str, tuple[LinearSpec, ...], int]
"""(label, linears, other parameters) of one decoder block."""


def group_blocks(blocks: Sequence[Block]) -> tuple[tuple[LinearSpec, ...], int, tuple[BlockGroup, ...]]:
    """Block 0's linears and other parameters, and the groups of blocks unlike it."""
    first = blocks[0]
    groups: dict[Block, list[int]] = {}
    for index, block in enumerate(blocks):
        # the label too: blocks of equal weights can differ in what the memory model reads (Gemma 4's
        # full-attention layers beside sliding ones when both have one head dim)
        if block != first:
            groups.setdefault(block, []).append(index)
    others = tuple(BlockGroup(label=label, count=len(idx), linears=linears, other_params=other, first=idx[0],
                              indices=tuple(idx))
                   for (label, linears, other), idx in groups.items())
    return first[1], first[2], others


def decoder_fields(c: ConfigReader, *, model_type: str, hidden: int, heads: int, kv: int, head_dim: int,
                   inter: int, vocab: int, blocks: Sequence[Block], tied: bool, max_pos: int, act: str,
                   final_norm: int, **extra: Any) -> dict[str, Any]:
    """The ModelSpec fields every decoder-only builder here shares."""
    linears, other, groups = group_blocks(blocks)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=len(blocks), heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter, max_seq_len=max_pos,
        layer_linears=linears, layer_norm_params=other, other_blocks=groups,
        embedding_params=vocab * hidden, final_norm_params=final_norm,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=act, gated_mlp=True, norm="rmsnorm", position="rope",
        attn_dropout=c.prob("attention_dropout"), **extra,
    )


def experts(hidden: int, inter: int, count: int, top_k: int, *, up: str = "gate_up_proj", gated: bool = True,
            bias: bool = False, peft_fused: bool = False) -> list[LinearSpec]:
    """The routed experts as HF stacks them: ``gate_up_proj`` (fused gate and up: 2I outputs; just
    ``up_proj`` for a non-gated MLP) and ``down_proj``, ``count`` copies, ``top_k`` per token.
    ``peft_fused``: peft converts a LoRA config of this model type from transformers v4's
    per-expert modules (its ``_MOE_TARGET_MODULE_MAPPING``: Mixtral and the Qwen2-MoE pattern, which
    Qwen3-MoE, OLMoE, DeepSeek-V3 and Qwen3-Next follow), giving the fused gate_up twice the rank."""
    fused = lin(up, hidden, (2 if gated else 1) * inter, bias, K.MLP_IN, count=count, active=top_k, module=False)
    return [
        dataclasses.replace(fused, lora_rank=2) if peft_fused and gated else fused,
        lin("down_proj", inter, hidden, bias, K.MLP_OUT, count=count, active=top_k, module=False),
    ]


#: the model types whose transformers-4 expert layout ``per_expert_layout`` builds: Mixtral's
#: MixtralBlockSparseTop2MLP (transformers 4.48.1 models/mixtral/modeling_mixtral.py l.67-82: nn.Linear w1
#: [H -> I], w2 [I -> H], w3 [H -> I], no bias) in MixtralSparseMoeBlock's ``self.experts = nn.ModuleList(...)``
#: beside its router ``self.gate = nn.Linear(hidden, num_experts, bias=False)`` (l.105-107)
PER_EXPERT_TYPES = frozenset({"mixtral"})


def per_expert_layout(model: ModelSpec) -> ModelSpec:
    """``model`` with its MoE experts as transformers 4 built them (``TrainConfig.experts_loop``): each expert
    of the fused stacks (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the nn.Linear modules w1 and w3 (the
    gate and up halves) and w2, ``count`` experts and top-k ``active``, and the router ``gate`` an nn.Linear:
    modules, so bitsandbytes quantises them under QLoRA, ``all-linear`` reaches them by their own names (peft
    has no conversion to make: ``peft_converts_moe`` empty) and autocast casts their weights. The same
    parameters (tests/catalog/test_param_counts.py). Refused for a model type whose v4 layout is not built here."""
    from planner.errors import UnsupportedError

    if model.model_type not in PER_EXPERT_TYPES:
        raise UnsupportedError(f"--experts-loop (transformers 4's per-expert MoE modules) is modelled for "
                               f"{', '.join(sorted(PER_EXPERT_TYPES))} only, not {model.id} (model type {model.model_type}): "
                               "drop --experts-loop")
    if model.other_blocks:  # Mixtral's blocks are all alike; a v4 layout of mixed blocks is not built here
        raise UnsupportedError(f"--experts-loop is not modelled for {model.id}'s mixed blocks: drop --experts-loop")
    if not any(lin.count > 1 and not lin.module for lin in model.layer_linears):
        return model  # already the per-expert layout
    linears: list[LinearSpec] = []
    for one in model.layer_linears:
        if one.kind is K.ROUTER:
            linears.append(dataclasses.replace(one, module=True))
        elif one.count > 1 and one.kind is K.MLP_IN:
            half = one.out_features // 2  # gate_up_proj: the gate (w1) rows, then the up (w3) rows
            linears += [lin("w1", one.in_features, half, one.bias, K.MLP_IN, count=one.count, active=one.active),
                        lin("w3", one.in_features, half, one.bias, K.MLP_IN, count=one.count, active=one.active)]
        elif one.count > 1 and one.kind is K.MLP_OUT:
            linears.append(lin("w2", one.in_features, one.out_features, one.bias, K.MLP_OUT, count=one.count,
                               active=one.active))
        else:
            linears.append(one)
    return dataclasses.replace(model, layer_linears=tuple(linears), peft_converts_moe="")


def _top_k(c: ConfigReader, experts_key: str, k_key: str, *, experts_default: int | None = None,
           k_default: int | None = None) -> tuple[int, int]:
    count = c.size(experts_key, default=experts_default)
    top_k = c.size(k_key, default=k_default)
    if top_k > count:
        raise c.error(f"{k_key} {top_k} is larger than {experts_key} {count}")
    return count, top_k


def mixtral_routing(c: ConfigReader) -> MoeRouting:
    """MixtralTopKRouter (modeling_mixtral.py:96-111): softmax over the experts in fp32, top-k,
    always renormalised, the weights kept fp32; MixtralSparseMoeBlock's ``router_jitter_noise``
    (default 0.0, configuration_mixtral.py)."""
    return MoeRouting(renorm=True, scores_fp32=True, jitter=c.prob("router_jitter_noise"),
                      aux_loss=c.flag("output_router_logits", False))


def qwen3_moe_routing(c: ConfigReader) -> MoeRouting:
    """Qwen3MoeTopKRouter (modeling_qwen3_moe.py:250-268; Qwen2MoeTopKRouter, modeling_qwen2_moe.py:311-329,
    is the same): softmax(dtype=float) over the experts,
    top-k, renormalised only with ``norm_topk_prob`` (default False, configuration_qwen3_moe.py:101),
    the weights cast back to the logits' dtype."""
    return MoeRouting(renorm=c.flag("norm_topk_prob", False), scores_fp32=False,
                      aux_loss=c.flag("output_router_logits", False))


def _layer_types(c: ConfigReader, layers: int, default: list[str]) -> list[str]:
    types = c.raw.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
        raise c.error(f"layer_types must be a list of {layers} layer type names (one per layer)")
    return types


# ---- dense: granite, olmo2, gemma3 ----------------------------------------------------------------------


def granite(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_granite.py: the llama block (q/k/v/o with ``attention_bias``, SwiGLU with
    ``mlp_bias``, two RMSNorms). Its multipliers (embedding, residual, attention, logits scaling)
    multiply by Python scalars, which save nothing for backward; configuration_granite.py
    defaults: untied, 2048 positions, kv heads = heads."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads")
    inter, vocab, layers = c.size("intermediate_size"), c.size("vocab_size"), c.size("num_hidden_layers")
    bias = c.flag("attention_bias", False)
    linears = tuple(qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
                    + swiglu(hidden, inter, bias=c.flag("mlp_bias", False)))
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=inter, vocab=vocab,
        blocks=[("decoder", linears, 2 * hidden)] * layers, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=2048), act=c.text("hidden_act", default="silu"),
        final_norm=hidden,
    )


def olmo2(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_olmo2.py: no input norm; ``post_attention_layernorm`` and
    ``post_feedforward_layernorm`` normalise the sublayers' outputs, and ``q_norm``/``k_norm``
    are RMSNorms over the whole q (heads * head_dim) and k (kv * head_dim) projections.
    configuration_olmo2.py defaults: untied, 2048 positions, kv heads = heads, no biases."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads")
    inter, vocab, layers = c.size("intermediate_size"), c.size("vocab_size"), c.size("num_hidden_layers")
    bias = c.flag("attention_bias", False)
    linears = tuple(qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias) + swiglu(hidden, inter))
    norms = 2 * hidden + heads * head_dim + kv * head_dim
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=inter, vocab=vocab,
        blocks=[("decoder", linears, norms)] * layers, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=2048), act=c.text("hidden_act", default="silu"),
        final_norm=hidden, norm_placement="post", qk_norm="projection",
        norm_weight_fp32=True,  # Olmo2RMSNorm.forward: (self.weight * hidden_states).to(input_dtype), in fp32
    )


def gemma3_text(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_gemma3.py Gemma3DecoderLayer: gemma2's block (four RMSNorms, GeGLU) plus
    ``q_norm``/``k_norm`` over head_dim; sliding and full attention differ only in the mask (same
    weights). configuration_gemma3.py Gemma3TextConfig defaults fill what the multimodal configs
    leave out (google/gemma-3-4b-it's text_config has no heads or vocabulary): vocab 262208, hidden
    2304, MLP 9216, 26 layers, 8 heads, 4 kv heads, head_dim 256, 131072 positions, window 4096,
    tied embeddings."""
    hidden = c.size("hidden_size", default=2304)
    heads = c.size("num_attention_heads", default=8)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=4,
                           head_dim_key=True, head_dim_default=256)
    inter = c.size("intermediate_size", default=9216)
    vocab, layers = c.size("vocab_size", default=262_208), c.size("num_hidden_layers", default=26)
    bias = c.flag("attention_bias", False)
    linears = tuple(qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias) + swiglu(hidden, inter))
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=inter, vocab=vocab,
        blocks=[("decoder", linears, 4 * hidden + 2 * head_dim)] * layers, tied=c.flag("tie_word_embeddings", True),
        max_pos=c.size("max_position_embeddings", default=131_072),
        act=c.text("hidden_activation", default="gelu_pytorch_tanh"), final_norm=hidden,
        norm_weight_fp32=True, sliding_window=c.size("sliding_window", default=4096), norm_placement="sandwich",
        qk_norm="head",
    )


# ---- mixture of experts: qwen3_moe, gpt_oss, deepseek_v3, llama4 ----------------------------------------


def qwen3_moe(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_qwen3_moe.py: qwen3 attention (q/k norms over head_dim; head_dim from the config
    or hidden / heads), Qwen3MoeSparseMoeBlock (router ``gate.weight [E, H]``, Qwen3MoeExperts
    stacks) on layers where ``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers``,
    else a dense SwiGLU of ``intermediate_size`` (Qwen3MoeDecoderLayer.__init__); each kind of block
    has its own terms (``ModelSpec.block_kinds``). configuration_qwen3_moe.py defaults: 128
    experts, top-8, expert MLP 768, step 1, untied, 32768 positions, kv heads 4."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=4,
                           head_dim_key=True)
    vocab, layers = c.size("vocab_size"), c.size("num_hidden_layers")
    inter = c.size("intermediate_size", default=6144)
    moe_inter = c.size("moe_intermediate_size", default=768)
    count, top_k = _top_k(c, "num_experts", "num_experts_per_tok", experts_default=128, k_default=8)
    step = c.size("decoder_sparse_step", default=1)
    dense_only = c.layer_indices("mlp_only_layers") or set()
    bias = c.flag("attention_bias", False)
    attn = qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
    moe = tuple(attn + [lin("gate", hidden, count, False, K.ROUTER, module=False)]
                + experts(hidden, moe_inter, count, top_k, peft_fused=True))
    dense = tuple(attn + swiglu(hidden, inter))
    norms = 2 * hidden + 2 * head_dim
    blocks = [("moe", moe, norms) if i not in dense_only and (i + 1) % step == 0 else ("dense", dense, norms)
              for i in range(layers)]
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=moe_inter,
        vocab=vocab, blocks=blocks, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=32768), act=c.text("hidden_act", default="silu"),
        final_norm=hidden, num_experts=count, experts_per_token=top_k, qk_norm="head", routing=qwen3_moe_routing(c),
        peft_converts_moe="qwen2_moe",
    )


def qwen2_moe(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_qwen2_moe.py (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2 attention (q/k/v biases with
    ``qkv_bias``, default True; o_proj none: Qwen2MoeAttention.__init__ :222-225), and on layers where
    ``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers`` (Qwen2MoeDecoderLayer
    :358-363) Qwen2MoeSparseMoeBlock (:332-351): router ``gate.weight [E, H]`` (Qwen2MoeTopKRouter),
    Qwen2MoeExperts stacks, a ``shared_expert`` SwiGLU of ``shared_expert_intermediate_size`` and its
    one-output ``shared_expert_gate``; else a dense SwiGLU of ``intermediate_size``.
    configuration_qwen2_moe.py defaults (Qwen1.5-MoE-A2.7B's sizes): 60 experts, top-4, expert MLP
    1408, shared 5632, dense 5632, untied, 32768 positions, 16 kv heads (:83). peft has no conversion
    for qwen2_moe itself (transformers' ``_MODEL_TO_CONVERSION_PATTERN`` has no such key), so
    ``all-linear`` wraps the nn.Linear modules only: the attention, the shared expert and its gate."""
    hidden, heads = c.size("hidden_size", default=2048), c.size("num_attention_heads", default=16)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=16)
    vocab, layers = c.size("vocab_size", default=151_936), c.size("num_hidden_layers", default=24)
    inter = c.size("intermediate_size", default=5632)
    moe_inter = c.size("moe_intermediate_size", default=1408)
    shared = c.size("shared_expert_intermediate_size", default=5632)
    count, top_k = _top_k(c, "num_experts", "num_experts_per_tok", experts_default=60, k_default=4)
    step = c.size("decoder_sparse_step", default=1)
    dense_only = c.layer_indices("mlp_only_layers") or set()
    attn = qkvo(hidden, heads, kv, head_dim, qkv_bias=c.flag("qkv_bias", True), o_bias=False)
    moe = tuple(attn + [lin("gate", hidden, count, False, K.ROUTER, module=False)]
                + experts(hidden, moe_inter, count, top_k) + swiglu(hidden, shared)
                + [lin("shared_expert_gate", hidden, 1, False, K.SHARED_GATE)])
    dense = tuple(attn + swiglu(hidden, inter))
    blocks = [("moe", moe, 2 * hidden) if i not in dense_only and (i + 1) % step == 0 else ("dense", dense, 2 * hidden)
              for i in range(layers)]
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=moe_inter,
        vocab=vocab, blocks=blocks, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=32768), act=c.text("hidden_act", default="silu"),
        final_norm=hidden, num_experts=count, experts_per_token=top_k, routing=qwen3_moe_routing(c),
    )


def gpt_oss(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_gpt_oss.py: q/k/v/o with biases (``attention_bias`` default True), a learned
    ``sinks`` logit per head, GptOssTopKRouter (``router.weight [E, H]`` + ``router.bias [E]``),
    GptOssExperts stacks stored input-first (``gate_up_proj [E, H, 2I]`` + ``gate_up_proj_bias``,
    ``down_proj [E, I, H]`` + bias); sliding and full layers share weights.
    configuration_gpt_oss.py defaults: 128 experts, top-4, head_dim 64, 64/8 heads, window 128.
    The released checkpoints hold the experts in MXFP4; fine-tuning de-quantizes them to bf16
    (transformers' Mxfp4Config(dequantize=True), the published recipe): these are the bf16 counts."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads", default=64)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=8,
                           head_dim_key=True, head_dim_default=64)
    vocab, layers = c.size("vocab_size"), c.size("num_hidden_layers")
    inter = c.size("intermediate_size", default=2880)
    count, top_k = _top_k(c, "num_local_experts", "num_experts_per_tok", experts_default=128, k_default=4)
    bias = c.flag("attention_bias", True)
    linears = tuple(qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
                    + [lin("router", hidden, count, True, K.ROUTER, module=False)]
                    + experts(hidden, inter, count, top_k, bias=True))
    # configuration_gpt_oss.py l.84-87: sliding and full attention alternate, sliding first, unless the
    # config lists ``layer_types``; only a sliding layer passes the window to its kernel (modeling_gpt_oss.py l.284)
    types = _layer_types(c, layers, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])
    fields = decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=inter,
        vocab=vocab, blocks=[(f"moe {kind}", linears, 2 * hidden + heads) for kind in types],
        tied=c.flag("tie_word_embeddings", False), max_pos=c.size("max_position_embeddings", default=131_072),
        act=c.text("hidden_act", default="silu"), final_norm=hidden, num_experts=count, experts_per_token=top_k,
        sliding_window=c.size("sliding_window", default=128), routing=gpt_oss_routing(c),
        sdpa=False, attention_sinks=True,  # GptOssPreTrainedModel._supports_sdpa = False; GptOssAttention.sinks
        training_notes=(MXFP4_NOTE,),
        # eager_attention_forward (modeling_gpt_oss.py:216-226): softmax in the scores' dtype, which the
        # fp32 sinks (and the additive mask) promote to the parameters' (attention.sink_bytes)
        eager_softmax="residual",
        norm_weight_fp32=True,  # GptOssRMSNorm.forward (:63): (self.weight * hidden_states).to(input_dtype), in fp32
        sliding_attention=types[0] == "sliding_attention",
    )
    return dict(fields, other_blocks=tuple(dataclasses.replace(g, sliding=types[g.first] == "sliding_attention")
                                           for g in fields["other_blocks"]))


#: what fine-tuning does with gpt-oss's MXFP4 experts: OpenAI's cookbook "Fine-tuning with gpt-oss and Hugging
#: Face Transformers" (openai/openai-cookbook articles/gpt-oss/fine-tune-transfomers.ipynb) loads the model with
#: ``Mxfp4Config(dequantize=True)``, ``dtype=torch.bfloat16``, ``attn_implementation="eager"``
#: (transformers integrations/mxfp4.py de-quantizes the blocks and scales into bf16 stacks at load)
MXFP4_NOTE = ("gpt-oss: the MXFP4 experts de-quantized to bf16 at load (Mxfp4Config(dequantize=True), OpenAI's "
              "fine-tuning cookbook): the counts and weights are the bf16 model's")


def gpt_oss_routing(c: ConfigReader) -> MoeRouting:
    """GptOssTopKRouter (modeling_gpt_oss.py:108-123): ``F.linear`` with a bias, top-k over the logits,
    then a softmax over the k values in their dtype (no renormalisation: the softmax is over the k);
    GptOssExperts._apply_gate's clamped SwiGLU (:85-91, ``swiglu_limit`` 7.0, ``alpha`` 1.702)."""
    return MoeRouting(renorm=False, scores_fp32=False, topk_first=True, expert_gate="clamped_swiglu",
                      aux_loss=c.flag("output_router_logits", False))


def deepseek_v3(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_deepseek_v3.py DeepseekV3Attention (MLA): ``q_a_proj`` -> ``q_a_layernorm`` ->
    ``q_b_proj`` (or one ``q_proj`` when q_lora_rank is null), ``kv_a_proj_with_mqa`` (kv_lora_rank
    + rope dims) -> ``kv_a_layernorm`` -> ``kv_b_proj`` (heads * (nope + v)), ``o_proj``; the first
    ``first_k_dense_replace`` layers have a dense SwiGLU, the rest DeepseekV3MoE: router
    ``gate.weight [E, H]`` (its e_score_correction_bias is a buffer), expert stacks and
    ``shared_experts`` (a SwiGLU of n_shared_experts * moe_intermediate_size).
    configuration_deepseek_v3.py defaults are DeepSeek-V3's own sizes."""
    hidden, heads = c.size("hidden_size", default=7168), c.size("num_attention_heads", default=128)
    vocab, layers = c.size("vocab_size", default=129_280), c.size("num_hidden_layers", default=61)
    inter, moe_inter = c.size("intermediate_size", default=18432), c.size("moe_intermediate_size", default=2048)
    count, top_k = _top_k(c, "n_routed_experts", "num_experts_per_tok", experts_default=256, k_default=8)
    shared = c.count("n_shared_experts", 1)
    q_rank = c.optional_size("q_lora_rank") if "q_lora_rank" in c.raw else 1536
    kv_rank = c.size("kv_lora_rank", default=512)
    nope, rope = c.size("qk_nope_head_dim", default=128), c.size("qk_rope_head_dim", default=64)
    v_dim = c.size("v_head_dim", default=128)
    dense_first = c.count("first_k_dense_replace", 3)
    bias = c.flag("attention_bias", False)
    qk = nope + rope
    if q_rank is None:
        q = [lin("q_proj", hidden, heads * qk, False, K.ATTN_IN)]
    else:
        q = [lin("q_a_proj", hidden, q_rank, bias, K.ATTN_IN), lin("q_b_proj", q_rank, heads * qk, False, K.ATTN_IN)]
    attn = q + [
        lin("kv_a_proj_with_mqa", hidden, kv_rank + rope, bias, K.ATTN_IN),
        lin("kv_b_proj", kv_rank, heads * (nope + v_dim), False, K.ATTN_IN),
        lin("o_proj", heads * v_dim, hidden, bias, K.ATTN_OUT),
    ]
    norms = 2 * hidden + (q_rank or 0) + kv_rank
    dense = tuple(attn + swiglu(hidden, inter))
    moe = tuple(attn + [lin("gate", hidden, count, False, K.ROUTER, module=False)]
                + experts(hidden, moe_inter, count, top_k, peft_fused=True)
                + (swiglu(hidden, moe_inter * shared) if shared else []))
    blocks = [("dense", dense, norms) if i < dense_first else ("moe", moe, norms) for i in range(layers)]
    return decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=heads, head_dim=qk, inter=moe_inter, vocab=vocab,
        blocks=blocks, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=4096), act=c.text("hidden_act", default="silu"),
        final_norm=hidden, num_experts=count, experts_per_token=top_k,
        peft_converts_moe="qwen2_moe",  # transformers' conversion_mapping.py: deepseek_v3 -> qwen2_moe
        latent_attention=LatentAttention(q_rank=q_rank, kv_rank=kv_rank, nope=nope, rope=rope, v=v_dim),
        training_notes=(FP8_NOTE,) if c.raw.get("quantization_config") else (),
        routing=deepseek_routing(c, count),
    )


#: DeepSeek-V3/R1 are published in FP8 (config.json ``quantization_config``: e4m3, 128 x 128 blocks); the planner
#: counts 16-bit weights, a de-quantized copy's (transformers' FineGrainedFP8Config(dequantize=True) loads one)
FP8_NOTE = ("DeepSeek-V3: the FP8 checkpoint is planned as a 16-bit (de-quantized) copy; training its FP8 weights "
            "directly is not modelled")


def deepseek_routing(c: ConfigReader, experts: int, *, groups: int = 8, kept: int = 4) -> MoeRouting:
    """DeepseekV3TopkRouter (modeling_deepseek_v3.py:120-158): sigmoid scores, group-limited top-k
    (``n_group`` default ``groups``, ``topk_group`` default ``kept``: 8 and 4 in
    configuration_deepseek_v3.py), ``norm_topk_prob`` (default True), the routing weights in the router
    logits' dtype (its weight is kept fp32: ``_keep_in_fp32_modules_strict = ["e_score_correction_bias",
    "gate.weight"]``, :551)."""
    groups, kept = c.size("n_group", default=groups), c.size("topk_group", default=kept)
    if experts % groups or kept > groups:
        raise c.error(f"n_routed_experts {experts} must split into n_group {groups} groups, "
                      f"of which topk_group {kept} are kept")
    return MoeRouting(renorm=c.flag("norm_topk_prob", True), scores_fp32=False, group_limited=(groups, kept),
                      aux_loss=c.flag("output_router_logits", False))


def llama4_text(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_llama4.py: llama attention whose rotary layers (``no_rope_layers``: by default every
    ``no_rope_layer_interval``-th layer, 4, has none; configuration_llama4.py) apply a weightless L2 norm to q and k
    after the rotary embedding (``use_qk_norm``; Llama4TextL2Norm :106-118) and whose NoPE layers scale q by a
    position's temperature (``attn_temperature_tuning``: a T-sized tensor, not counted); Llama4TextMoe on
    ``moe_layers`` (router: an ``nn.Linear`` subclass named ``router``; Llama4TextExperts stacks stored input-first
    ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, run over every token: ``MoeRouting.dense_experts``; a
    ``shared_expert`` SwiGLU of ``intermediate_size``), else a dense SwiGLU of ``intermediate_size_mlp``.
    configuration_llama4.py defaults: Llama 4 Scout's sizes, moe_layers every ``interleave_moe_layer_step``-th
    layer, untied. LoRA cannot adapt the router: all-linear wraps it (an nn.Linear) and peft's Linear adds its
    adapter's output to the router's (scores, logits) tuple, which fails."""
    hidden, heads = c.size("hidden_size", default=5120), c.size("num_attention_heads", default=40)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=8,
                           head_dim_key=True, head_dim_default=128)
    vocab, layers = c.size("vocab_size", default=202_048), c.size("num_hidden_layers", default=48)
    inter, inter_mlp = c.size("intermediate_size", default=8192), c.size("intermediate_size_mlp", default=16384)
    count, top_k = _top_k(c, "num_local_experts", "num_experts_per_tok", experts_default=16, k_default=1)
    step = c.size("interleave_moe_layer_step", default=1)
    moe_layers = c.layer_indices("moe_layers")
    moe_set = moe_layers if moe_layers is not None else set(range(step - 1, layers, step))
    rope = _llama4_rope_layers(c, layers)
    chunk = c.optional_size("attention_chunk_size") if "attention_chunk_size" in c.raw else 8192
    qk_norm = "l2" if c.flag("use_qk_norm", True) else ""
    bias = c.flag("attention_bias", False)
    attn = qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
    moe = tuple(attn + [lin("router", hidden, count, False, K.ROUTER)] + experts(hidden, inter, count, top_k)
                + swiglu(hidden, inter))
    dense = tuple(attn + swiglu(hidden, inter_mlp))
    blocks = [(("moe" if i in moe_set else "dense") + ("" if rope[i] else " nope"), moe if i in moe_set else dense,
               2 * hidden) for i in range(layers)]
    fields = decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, inter=inter, vocab=vocab,
        blocks=blocks, tied=c.flag("tie_word_embeddings", False),
        max_pos=c.size("max_position_embeddings", default=131_072), act=c.text("hidden_act", default="silu"),
        final_norm=hidden, num_experts=count, experts_per_token=top_k, qk_norm=qk_norm if rope[0] else "",
        # the rotary layers' chunked attention (``layer_types`` chunked_attention with ``attention_chunk_size``):
        # its mask is planned as a sliding window's of the chunk (masking_utils.py create_chunked_causal_mask)
        sliding_window=chunk, sliding_attention=chunk is not None and rope[0],
        # Llama4Router (modeling_llama4.py:141-153): top-k of the logits, sigmoid in fp32, the weights cast back
        routing=MoeRouting(renorm=False, scores_fp32=False, dense_experts=True),
        # eager_attention_forward (:248-271): softmax in the scores' dtype, no fp32 cast; the additive mask (the
        # model's dtype) promotes the scores to the residual's
        eager_softmax="residual",
        lora_refused=("router",),
        lora_refused_why="all-linear wraps Llama4Router, an nn.Linear subclass whose forward returns (scores, logits), "
                         "and peft's LoRA Linear cannot add its output to that tuple",
    )
    groups = tuple(dataclasses.replace(g, qk_norm="" if g.label.endswith("nope") else qk_norm,
                                       sliding=chunk is not None and not g.label.endswith("nope"))
                   for g in fields["other_blocks"])
    return dict(fields, other_blocks=groups)


def _llama4_rope_layers(c: ConfigReader, layers: int) -> list[bool]:
    """Which layers apply the rotary embedding (and the qk norm): ``no_rope_layers`` (1 rope, 0 NoPE) or, by
    default, all but every ``no_rope_layer_interval``-th (configuration_llama4.py Llama4TextConfig)."""
    given = c.raw.get("no_rope_layers")
    if given is None or given == []:
        interval = c.size("no_rope_layer_interval", default=4)
        return [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or any(v not in (0, 1) for v in given):
        raise c.error(f"no_rope_layers must be a list of {layers} zeros and ones (one per layer)")
    return [bool(v) for v in given]


# ---- hybrid: qwen3_next, qwen3_5, qwen3_5_moe, nemotron_h, gemma4 --------------------------------------


def _gated_deltanet(c: ConfigReader, hidden: int, *, split_proj: bool) -> tuple[list[LinearSpec], int, GatedDeltaNet]:
    """A Gated DeltaNet token mixer (Qwen3NextGatedDeltaNet, modeling_qwen3_next.py; Qwen3_5GatedDeltaNet,
    modeling_qwen3_5.py): q/k/v/z and b/a projections (fused ``in_proj_qkvz`` + ``in_proj_ba`` in
    Qwen3-Next, four ``in_proj_*`` in Qwen3.5), ``out_proj``; outside linears a depthwise
    ``conv1d`` over q/k/v (no bias), ``dt_bias`` and ``A_log`` per value head and a gated
    RMSNorm over the value head dim. Defaults: configuration_qwen3_next.py / _qwen3_5.py."""
    k_heads, v_heads = c.size("linear_num_key_heads", default=16), c.size("linear_num_value_heads", default=32)
    k_dim, v_dim = c.size("linear_key_head_dim", default=128), c.size("linear_value_head_dim", default=128)
    kernel = c.size("linear_conv_kernel_dim", default=4)
    key, value = k_heads * k_dim, v_heads * v_dim
    if split_proj:
        projections = [lin("in_proj_qkv", hidden, 2 * key + value, False, K.ATTN_IN),
                       lin("in_proj_z", hidden, value, False, K.ATTN_IN),
                       lin("in_proj_b", hidden, v_heads, False, K.ATTN_IN),
                       lin("in_proj_a", hidden, v_heads, False, K.ATTN_IN)]
    else:
        projections = [lin("in_proj_qkvz", hidden, 2 * key + 2 * value, False, K.ATTN_IN),
                       lin("in_proj_ba", hidden, 2 * v_heads, False, K.ATTN_IN)]
    other = (2 * key + value) * kernel + 2 * v_heads + v_dim
    if v_heads % k_heads:
        raise c.error(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
    shape = GatedDeltaNet(k_heads=k_heads, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim, kernel=kernel)
    return projections + [lin("out_proj", value, hidden, False, K.ATTN_OUT)], other, shape


def qwen_hybrid(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """qwen3_next (modeling_qwen3_next.py), qwen3_5_text (modeling_qwen3_5.py), qwen3_5_moe_text
    (modeling_qwen3_5_moe.py): ``layer_types`` (default: full attention every
    ``full_attention_interval`` = 4th layer, else linear attention) choose Gated DeltaNet or gated
    attention (``q_proj`` twice as wide: the output gate; q/k norms over head_dim); the MLP is a
    SparseMoeBlock (router ``gate``, expert stacks, ``shared_expert`` SwiGLU and its one-output
    ``shared_expert_gate``) in the MoE types (qwen3_next: unless in ``mlp_only_layers`` or off the
    ``decoder_sparse_step``), a dense SwiGLU in qwen3_5_text."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads", default=16)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=2,
                           head_dim_key=True, head_dim_default=256)
    vocab, layers = c.size("vocab_size"), c.size("num_hidden_layers")
    interval = c.size("full_attention_interval", default=4)
    types = _layer_types(c, layers, ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(layers)])
    bias = c.flag("attention_bias", False)
    full = [lin("q_proj", hidden, 2 * heads * head_dim, bias, K.ATTN_IN)] + qkvo(
        hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)[1:]
    linear, linear_other, gdn = _gated_deltanet(c, hidden, split_proj=model_type != "qwen3_next")
    moe_type = model_type != "qwen3_5_text"
    count = top_k = 0
    if moe_type:
        count, top_k = _top_k(c, "num_experts", "num_experts_per_tok", experts_default=512 if model_type == "qwen3_next"
                              else 256, k_default=10 if model_type == "qwen3_next" else 8)
        moe_inter = c.size("moe_intermediate_size", default=512)
        shared = c.size("shared_expert_intermediate_size", default=512)
        mlp_moe = ([lin("gate", hidden, count, False, K.ROUTER, module=False)]
                   + experts(hidden, moe_inter, count, top_k, peft_fused=model_type == "qwen3_next")
                   + swiglu(hidden, shared) + [lin("shared_expert_gate", hidden, 1, False, K.SHARED_GATE)])
    inter = c.size("intermediate_size", default=5632 if model_type == "qwen3_next" else 12288) \
        if not moe_type or model_type == "qwen3_next" else 0
    step = c.size("decoder_sparse_step", default=1) if model_type == "qwen3_next" else 1
    dense_only = (c.layer_indices("mlp_only_layers") or set()) if model_type == "qwen3_next" else set()
    blocks: list[Block] = []
    for i, kind in enumerate(types):
        mixer, other = (linear, linear_other) if kind == "linear_attention" else (full, 2 * head_dim)
        is_moe = moe_type and i not in dense_only and (i + 1) % step == 0
        mlp = mlp_moe if is_moe else swiglu(hidden, inter)
        blocks.append((f"{kind}{' moe' if is_moe else ''}", tuple(mixer + mlp), other + 2 * hidden))
    fields = decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim,
        inter=c.size("moe_intermediate_size", default=512) if moe_type else inter, vocab=vocab, blocks=blocks,
        tied=c.flag("tie_word_embeddings", False), max_pos=c.size("max_position_embeddings", default=32768),
        act=c.text("hidden_act", default="silu"), final_norm=hidden, num_experts=count, experts_per_token=top_k,
        # Qwen3NextRMSNorm.forward: ``output * (1.0 + self.weight.float())`` keeps the fp32 normalised tensor
        norm_weight_fp32=True, qk_norm="head", attn_output_gate=True, gated_deltanet=gdn,
        mixer="gated_deltanet" if types[0] == "linear_attention" else "attention",
        # Qwen3NextTopKRouter (modeling_qwen3_next.py:828-846, norm_topk_prob default True,
        # configuration_qwen3_next.py:117) and Qwen3_5MoeTopKRouter (modeling_qwen3_5_moe.py:898-909: always
        # renormalised): softmax in fp32, top-k, the weights cast back to the logits' dtype
        routing=MoeRouting(renorm=c.flag("norm_topk_prob", True) if model_type == "qwen3_next" else True,
                           scores_fp32=False, aux_loss=c.flag("output_router_logits", False)) if moe_type else None,
        peft_converts_moe="qwen2_moe" if model_type == "qwen3_next" else "",  # conversion_mapping.py
    )
    groups = tuple(dataclasses.replace(g, mixer="gated_deltanet" if g.label.startswith("linear_attention")
                                       else "attention") for g in fields["other_blocks"])
    return dict(fields, other_blocks=groups)


#: nemotron_h's hybrid_override_pattern letters (configuration_nemotron_h.py ``_pattern_to_list``): the block's
#: label and its token mixer (``ModelSpec.mixer``)
_NEMOTRON_BLOCKS = {"M": ("mamba", "mamba2"), "E": ("moe", "none"), "*": ("attention", "attention"),
                    "-": ("mlp", "none")}


def nemotron_h(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_nemotron_h.py NemotronHBlock (:934-993): one RMSNorm and one mixer per block, chosen by
    ``hybrid_override_pattern`` (M Mamba2, E MoE, * attention, - MLP). Mamba2 mixer (:390-614): ``in_proj``
    (hidden -> intermediate + conv_dim + heads, intermediate = mamba heads * head dim, conv_dim =
    intermediate + 2 * n_groups * state), depthwise ``conv1d`` (bias: use_conv_bias), ``dt_bias``/``A_log``/``D``
    per head, gated RMSNorm over intermediate, ``out_proj``. MoE (:715-797): non-gated relu2 experts
    (``up_proj [E, I, H]``, ``down_proj``), router ``gate.weight`` (NemotronHTopkRouter: DeepSeek-V3's sigmoid,
    group-limited top-k, the input and weight cast to fp32), ``shared_experts`` up/down MLP; attention q/k/v/o
    without biases. NemotronHRMSNorm (:617-636) multiplies by its weight in fp32. peft has no conversion for
    nemotron_h (transformers' ``_MODEL_TO_CONVERSION_PATTERN`` has no such key), so ``all-linear`` wraps the
    nn.Linear modules only, not the expert stacks or the router."""
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=8,
                           head_dim_key=True, head_dim_default=128)
    vocab = c.size("vocab_size")
    pattern = _nemotron_pattern(c)
    if c.raw.get("moe_latent_size") is not None:
        raise c.error("moe_latent_size (latent MoE projections) is not supported yet")
    shape = Mamba2(heads=c.size("mamba_num_heads", default=128), head_dim=c.size("mamba_head_dim", default=64),
                   groups=c.size("n_groups", default=8), state=c.size("ssm_state_size", default=128),
                   kernel=c.size("conv_kernel", default=4), chunk=c.size("chunk_size", default=128))
    if shape.heads % shape.groups:
        raise c.error(f"mamba_num_heads {shape.heads} is not a multiple of n_groups {shape.groups}")
    use_bias, conv_bias = c.flag("use_bias", False), c.flag("use_conv_bias", True)
    mamba = (lin("in_proj", hidden, shape.projection, use_bias, K.ATTN_IN),
             lin("out_proj", shape.inner, hidden, use_bias, K.ATTN_OUT))
    mamba_other = shape.conv * shape.kernel + (shape.conv if conv_bias else 0) + 3 * shape.heads + shape.inner
    attn = tuple(qkvo(hidden, heads, kv, head_dim, qkv_bias=False, o_bias=False))
    mlp_bias = c.flag("mlp_bias", False)
    inter = c.size("intermediate_size")
    mlp = (lin("up_proj", hidden, inter, mlp_bias, K.MLP_IN), lin("down_proj", inter, hidden, mlp_bias, K.MLP_OUT))
    count = top_k = 0
    moe: tuple[LinearSpec, ...] = ()
    routing = None
    if "E" in pattern:
        count, top_k = _top_k(c, "n_routed_experts", "num_experts_per_tok", experts_default=8, k_default=2)
        moe_inter = c.size("moe_intermediate_size", default=7688)
        shared = c.size("moe_shared_expert_intermediate_size", default=7688)
        moe = tuple([lin("gate", hidden, count, False, K.ROUTER, module=False)]
                    + experts(hidden, moe_inter, count, top_k, up="up_proj", gated=False)
                    + [lin("up_proj", hidden, shared, mlp_bias, K.MLP_IN),
                       lin("down_proj", shared, hidden, mlp_bias, K.MLP_OUT)])
        routing = _nemotron_routing(c, count)
    kinds = {"M": (mamba, mamba_other), "E": (moe, 0), "*": (attn, 0), "-": (mlp, 0)}
    blocks = [(_NEMOTRON_BLOCKS[ch][0], kinds[ch][0], kinds[ch][1] + hidden) for ch in pattern]
    if "num_hidden_layers" in c.raw and c.size("num_hidden_layers") != len(blocks):
        raise c.error(f"num_hidden_layers {c.raw['num_hidden_layers']} differs from the {len(blocks)} letters of "
                      "hybrid_override_pattern")
    mixers = {label: mixer for label, mixer in _NEMOTRON_BLOCKS.values()}
    fields = decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=kv, head_dim=head_dim,
        inter=c.size("moe_intermediate_size", default=7688) if count else inter, vocab=vocab, blocks=blocks,
        tied=c.flag("tie_word_embeddings", False), max_pos=c.size("max_position_embeddings", default=4096),
        act=c.text("mlp_hidden_act", default="relu2"), final_norm=hidden, num_experts=count,
        experts_per_token=top_k, routing=routing, mamba2=shape if "M" in pattern else None,
        mixer=mixers[_NEMOTRON_BLOCKS[pattern[0]][0]], norm_placement="single", lora_refused=("out_proj",),
        lora_refused_why="peft refuses LoRA on the Mamba2 out_proj (peft tuners_utils.py _check_lora_target_modules_mamba)",
        norm_weight_fp32=True,  # NemotronHRMSNorm: (self.weight.to(torch.float32) * hidden_states).to(input_dtype)
    )
    groups = tuple(dataclasses.replace(g, mixer=mixers[g.label]) for g in fields["other_blocks"])
    return dict(fields, gated_mlp=False, other_blocks=groups)


#: configuration_nemotron_h.py ``_pattern_to_list``: the layer type of each pattern letter
_NEMOTRON_TYPES = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}


def _nemotron_pattern(c: ConfigReader) -> str:
    """The blocks' letters: ``hybrid_override_pattern`` (the released configs), or the ``layers_block_type`` list a
    config saved by transformers 5 holds instead (NemotronHConfig.__post_init__ turns the pattern into it)."""
    types = c.raw.get("layers_block_type", c.raw.get("layer_types"))
    if c.raw.get("hybrid_override_pattern") is None and types is not None:
        if not isinstance(types, list) or not types or any(t not in _NEMOTRON_TYPES for t in types):
            raise c.error(f"layers_block_type must be a list of {', '.join(_NEMOTRON_TYPES)} (one per layer)")
        return "".join(_NEMOTRON_TYPES[t] for t in types)
    pattern = c.raw.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NEMOTRON_BLOCKS):
        raise c.error("hybrid_override_pattern must be a string of M, E, * and - (one letter per layer)")
    return pattern


def _nemotron_routing(c: ConfigReader, experts: int) -> MoeRouting:
    """NemotronHTopkRouter.forward (modeling_nemotron_h.py:772-797), DeepseekV3TopkRouter's with
    ``n_group`` and ``topk_group`` defaulting to 1 (configuration_nemotron_h.py); its weight kept fp32
    (``_keep_in_fp32_modules_strict``, :1012)."""
    return deepseek_routing(c, experts, groups=1, kept=1)


def gemma4_text(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """modeling_gemma4.py Gemma4TextDecoderLayer (:1331-1418): four block RMSNorms around the attention and
    the MLP (gemma 2/3's sandwich), Gemma4TextAttention (:1141-1252: ``q_norm``/``k_norm`` over the layer's
    head_dim, a weightless ``v_norm``; full-attention layers take ``global_head_dim`` and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` and no ``v_proj``, the values being the raw key
    projection: configuration_gemma4.py per_layer_config), a GeGLU MLP and with ``enable_moe_block`` a router
    (``proj`` linear, ``scale [H]``, ``per_expert_scale [E]``), expert stacks and three more norms.
    Gemma4RMSNorm (:196-214) multiplies by its weight in fp32 (``normed_output * self.weight.float()``) and
    normalises with ``torch.pow(mean_squared, -0.5)``: two fp32 row statistics saved. Gemma4ForCausalLM
    soft-caps the logits (``final_logit_softcapping``). Each kind of layer keeps its own head dim and kv heads
    (``BlockGroup.head_dim``). The MoE block's routing: ``MoeRouting.parallel_experts`` (softmax in fp32,
    top-k renormalised, fp32 weights: Gemma4TextRouter.forward); no peft conversion for gemma4 in
    transformers' conversion_mapping.py, so ``all-linear`` wraps the router's ``proj`` and the dense MLP, not the
    expert stacks. The small models' per-layer input embeddings (Gemma4TextModel :1563-1579: ``embed_tokens_per_layer``
    [vocab_size_per_layer_input, layers x hidden_size_per_layer_input], ``per_layer_model_projection``, its norm;
    in every layer ``per_layer_input_gate``, ``per_layer_projection`` and ``post_per_layer_input_norm``, :1345-1350)
    and kv-shared layers (the last ``num_kv_shared_layers``: q_proj, q_norm and o_proj alone, :1162-1185, their MLP
    twice as wide with ``use_double_wide_mlp``, :1053-1058) are counted, and not planned yet
    (``ModelSpec.unmodelled``)."""
    hidden, heads = c.size("hidden_size", default=2304), c.size("num_attention_heads", default=8)
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=4,
                           head_dim_key=True, head_dim_default=256)
    vocab, layers = c.size("vocab_size", default=262_144), c.size("num_hidden_layers", default=30)
    inter = c.size("intermediate_size", default=9216)
    types = _layer_types(c, layers, ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(layers)])
    types[-1] = "full_attention"  # configuration_gemma4.py forces the last layer to full attention
    k_eq_v = c.flag("attention_k_eq_v", False)
    global_dim = c.size("global_head_dim", default=512)
    global_kv = c.size("num_global_key_value_heads", default=kv) if k_eq_v else kv
    bias = c.flag("attention_bias", False)
    moe: list[LinearSpec] = []
    moe_other = count = top_k = 0
    if c.flag("enable_moe_block", False):
        count, top_k = _top_k(c, "num_experts", "top_k_experts")
        moe = [lin("proj", hidden, count, False, K.ROUTER)] + experts(hidden, c.size("moe_intermediate_size"), count, top_k)
        moe_other = hidden + count + 3 * hidden
    shapes = {"full_attention": (global_dim, global_kv), "sliding_attention": (head_dim, kv)}
    ple = c.size("hidden_size_per_layer_input", default=256) if c.raw.get("hidden_size_per_layer_input", 256) else 0
    shared = c.count("num_kv_shared_layers", 0)
    if shared > layers:
        raise c.error(f"num_kv_shared_layers {shared} is more than num_hidden_layers {layers}")
    double = c.flag("use_double_wide_mlp", False)
    per_layer = [lin("per_layer_input_gate", hidden, ple, False, K.PER_LAYER),
                 lin("per_layer_projection", ple, hidden, False, K.PER_LAYER)] if ple else []
    blocks: list[Block] = []
    for i, kind in enumerate(types):
        dim, n_kv = shapes.get(kind, shapes["sliding_attention"])
        attn = qkvo(hidden, heads, n_kv, dim, qkv_bias=bias, o_bias=bias)
        if k_eq_v and kind == "full_attention":
            attn = [a for a in attn if a.name != "v_proj"]
        reuse = i >= layers - shared  # reads an earlier layer's keys and values: no k/v projections or norms
        if reuse:
            attn = [a for a in attn if a.name in ("q_proj", "o_proj")]
        mlp = swiglu(hidden, inter * (2 if double and reuse else 1))
        other = 4 * hidden + (1 if reuse else 2) * dim + moe_other + (hidden if ple else 0)
        blocks.append((kind + (" kv-shared" if reuse else ""), tuple(attn + mlp + moe + per_layer), other))
    first_dim, first_kv = shapes.get(types[0], shapes["sliding_attention"])
    softcap = c.raw.get("final_logit_softcapping")
    fields = decoder_fields(
        c, model_type=model_type, hidden=hidden, heads=heads, kv=first_kv, head_dim=first_dim, inter=inter,
        vocab=vocab, blocks=blocks, tied=c.flag("tie_word_embeddings", True),
        max_pos=c.size("max_position_embeddings", default=131_072),
        act=c.text("hidden_activation", default="gelu_pytorch_tanh"), final_norm=hidden, norm_weight_fp32=True,
        sliding_window=c.size("sliding_window", default=512), num_experts=count, experts_per_token=top_k,
        norm_placement="sandwich", qk_norm="head", norm_row_stats=2, v_norm=True,
        final_logit_softcap=softcap is not None and softcap > 0, sliding_attention=types[0] == "sliding_attention",
        routing=MoeRouting(renorm=True, scores_fp32=True, parallel_experts=True) if count else None,
        other_embedding_params=(c.size("vocab_size_per_layer_input", default=262_144) + hidden) * layers * ple + ple,
        unmodelled=tuple(feature for feature, present in (
            ("per-layer input embeddings (hidden_size_per_layer_input)", ple),
            ("kv-shared layers (num_kv_shared_layers)", shared)) if present),
    )
    kinds = {g.first: types[g.first] for g in fields["other_blocks"]}
    groups = tuple(dataclasses.replace(g, head_dim=shapes.get(kinds[g.first], shapes["sliding_attention"])[0],
                                       kv_heads=shapes.get(kinds[g.first], shapes["sliding_attention"])[1],
                                       sliding=kinds[g.first] == "sliding_attention")
                   for g in fields["other_blocks"])
    return dict(fields, other_blocks=groups)
