"""The mixture-of-experts block: what its router and its routed experts keep for backward, term by
term, as transformers 5.24 runs them (``transformers/integrations/moe.py``, the
``@use_experts_implementation`` classes of ``models/mixtral/modeling_mixtral.py``,
``models/qwen3_moe/modeling_qwen3_moe.py``).

**Which kernel.** Every expert class decorated ``@use_experts_implementation`` (MixtralExperts
modeling_mixtral.py:56, Qwen3MoeExperts modeling_qwen3_moe.py:210, and the OLMoE, Qwen2-MoE,
DeepSeek-V3, Qwen3-Next, Qwen3.5-MoE, GPT-OSS, Nemotron-H ones) runs ``config._experts_implementation``,
which is ``grouped_mm`` unless asked otherwise (modeling_utils.py:1894
``get_correct_experts_implementation``: ``"grouped_mm" if requested_experts is None``), the
per-expert Python loop only with ``experts_implementation="eager"``. ``grouped_mm_experts_forward``
(integrations/moe.py:424-535) works on the S = T·k routed slots at once (T tokens, k experts per
token), sorted by expert; on the CPU with torch >= 2.11 and on CUDA sm80+ it calls
``torch.nn.functional.grouped_mm`` (moe.py:302-352, :379), else a custom op whose autograd saves the
same input and weight (moe.py:230-233).

**Dtype.** ``grouped_mm`` is not autocast-enabled: the input is cast to the weights' dtype
(moe.py:374-379 ``input.to(weight.dtype)``), so the experts compute in the stored weights' dtype:
fp32 under HF mixed precision (fp32 weights), and no 16-bit copies of the expert stacks are made.

**Routing.** With grouped kernels every slot is computed once whichever expert it goes to, so the
saved bytes depend on T·k alone: the balanced-routing assumption changes nothing here.

**transformers 4's loop** (``TrainConfig.experts_loop``; ``catalog.modern.per_expert_layout`` makes the
experts nn.Linear modules w1/w3/w2): MixtralSparseMoeBlock.forward (4.48.1 models/mixtral/modeling_mixtral.py
l.112-150) runs each expert on its own tokens, ``idx, top_x = torch.where(expert_mask[expert_idx])``,
``hidden_states[None, top_x]``, ``expert_layer(current_state) * routing_weights[top_x, idx, None]``,
``final_hidden_states.index_add_(0, top_x, ...)``: ``loop_expert_bytes``. The experts' saved tensors
summed over the experts again depend on T·k alone (each slot is in one expert's share); the backward
holds one expert's share at a time.

Measured (saved_tensors_hooks / the autograd graph's ``_saved_*``, tiny Mixtral, bf16-mixed, T=64,
k=2, H=64, I=96, E=4): router 8,192 + 1,024 + 1,024 + 512 + 256 B and experts 128 x (4 x (2 x 64 +
4 x 96) + 28) + 16 = 265,744 B, as ``router_bytes`` and ``expert_bytes`` give.

Pure module: no torch, no I/O.
"""

from __future__ import annotations

from planner.memory.dtypes import FP32, HALF, INT64
from planner.memory.shapes import BlockContext
from planner.modelspec import LinearKind, LinearSpec, ModelSpec

#: int32 ``offsets`` of grouped_mm, one per expert, saved by its backward (moe.py:450, GroupedMmBackward0 ``offs``)
OFFSET_BYTES = 4

TERM_SOURCES = {
    "moe/router": "the router (MixtralTopKRouter / Qwen3MoeTopKRouter.forward): F.linear's input (a 16-bit cast under "
                  "autocast), the fp32 softmax over the experts, topk's int64 indices, the top-k renormalisation's "
                  "operands, router_jitter_noise's noise",
    "moe/experts": "grouped_mm_experts_forward (transformers/integrations/moe.py:424-535), per routed slot: the "
                   "gather, routing-weight and un-permute indices (int64), the up grouped_mm's input, its output "
                   "(kept whole by the gate's view), act(gate), the down grouped_mm's input, the down output and the "
                   "routing weight the weighting multiplies; in the weights' dtype (grouped_mm casts its input to it)",
    "moe/shared_input": "a shared expert's gate_proj/up_proj and shared_expert_gate inputs (Qwen2MoeSparseMoeBlock; "
                        "DeepseekV3MoE's shared_experts, no gate)",
    "moe/shared_intermediate": "the shared expert's SwiGLU tensors (Qwen2MoeMLP, as a dense MLP's)",
    "moe/shared_gate": "sigmoid(shared_expert_gate(x)) * shared_expert_output: sigmoid's output and the shared output",
    "moe/norms": "Gemma 4's MoE block: pre_feedforward_layernorm_2 before the experts, post_feedforward_layernorm_1/_2 "
                 "on the dense MLP's and the experts' outputs (Gemma4TextDecoderLayer.forward; moe.parallel_norm_bytes)",
    "moe/expert_loop": "transformers 4's per-expert loop (MixtralSparseMoeBlock.forward, 4.48.1 modeling_mixtral.py "
                       "l.112-150; experts_loop), per routed slot: top_x and idx (int64) the gathers keep, the experts' "
                       "nn.Linear inputs where they train or are adapted, w1's and w3's outputs, act(w1), w2's output and "
                       "the routing weight the weighting multiplies (moe.loop_expert_bytes)",
    "lora/expert_weights": "LoRA on expert stacks and the router (peft ParamWrapper): the merged weight W + BA the "
                           "kernel saves, the factors' casts (moe.adapted_weight_bytes)",
}


def is_expert_stack(lin: LinearSpec) -> bool:
    """A routed-experts weight stack (a 3D parameter, ``count`` experts), which runs in grouped_mm:
    no autocast copy of it, and no nn.Linear for peft's ``all-linear``."""
    return lin.count > 1 and not lin.module


def expert_stacks(model: ModelSpec) -> tuple[LinearSpec, ...]:
    return tuple(lin for lin in model.layer_linears if is_expert_stack(lin))


def routed_experts(model: ModelSpec) -> tuple[LinearSpec, ...]:
    """The routed experts' weights: the 3D stacks (transformers 5) or the per-expert nn.Linear modules
    (transformers 4's layout, ``looped``), ``count`` experts each."""
    return tuple(lin for lin in model.layer_linears if lin.count > 1 and lin.kind in _EXPERT_KINDS)


_EXPERT_KINDS = frozenset({LinearKind.MLP_IN, LinearKind.MLP_OUT})


def looped(model: ModelSpec) -> bool:
    """The experts are nn.Linear modules run one after another in Python (transformers 4's
    MixtralSparseMoeBlock; ``catalog.modern.per_expert_layout``), not stacks run by grouped_mm."""
    return model.routing is not None and any(lin.module for lin in routed_experts(model))


def shared_expert(model: ModelSpec) -> tuple[LinearSpec, ...]:
    """An MoE block's shared expert: its nn.Linear MLP projections and its gate (Qwen2-MoE
    ``shared_expert`` + ``shared_expert_gate``); empty for a block without one, or a dense block."""
    if not expert_stacks(model):
        return ()  # (transformers 4's per-expert modules: Mixtral, no shared expert)
    return tuple(lin for lin in model.layer_linears if lin.module and lin.kind in _SHARED_KINDS)


_SHARED_KINDS = frozenset({LinearKind.MLP_IN, LinearKind.MLP_OUT, LinearKind.SHARED_GATE})


def shared_intermediate(model: ModelSpec) -> int:
    """The shared expert's intermediate size (0 without one)."""
    return next((lin.in_features for lin in shared_expert(model) if lin.kind is LinearKind.MLP_OUT), 0)


def router_input_saved(ctx: BlockContext) -> bool:
    """The router's F.linear saves the block's normed input itself (its weight trains:
    ``router_bytes``), not an fp32 copy of it (DeepSeek-V3's, in a 16-bit model)."""
    routing = ctx.model.routing
    copies = routing is not None and routing.group_limited is not None and ctx.mode.compute != FP32
    return _trains(ctx, LinearKind.ROUTER) and not copies


def moe_layers(model: ModelSpec) -> int:
    """Blocks with a router (``ModelSpec.block_kinds``)."""
    return sum(count for count, _, view in model.block_kinds if is_moe_block(view))


def is_moe_block(model: ModelSpec) -> bool:
    """Block 0 routes its tokens through expert stacks whose router the memory model knows."""
    return model.routing is not None and bool(routed_experts(model))


def expert_dims(model: ModelSpec) -> tuple[int, int, bool]:
    """(expert intermediate size I, top-k, gated) of block 0's experts (the fused gate_up stack of
    2I outputs, or transformers 4's w1 and w3 modules)."""
    experts = routed_experts(model)
    down = next(lin for lin in experts if lin.kind is LinearKind.MLP_OUT)
    ups = [lin for lin in experts if lin.kind is LinearKind.MLP_IN]
    return down.in_features, down.active, ups[0].out_features == 2 * down.in_features or len(ups) == 2


def dense_experts(model: ModelSpec) -> bool:
    """The experts run over every token (Llama 4: ``MoeRouting.dense_experts``)."""
    return model.routing is not None and model.routing.dense_experts


def slots(ctx: BlockContext) -> int:
    """S = T·k routed (token, expert) pairs; T·E rows where every expert sees every token (Llama 4)."""
    return ctx.dims.tokens * (ctx.model.num_experts if dense_experts(ctx.model) else ctx.model.experts_per_token)


def expert_bytes_per_element(ctx: BlockContext) -> int:
    """The experts' compute dtype: the stored weights' (grouped_mm casts its input to it); Llama 4's bmm runs in
    the projections' output dtype (autocast-enabled)."""
    if dense_experts(ctx.model):
        return HALF if ctx.mode.autocast else ctx.mode.compute
    if looped(ctx.model):
        return ctx.mode.compute  # nn.Linear modules: the projections' output dtype (autocast's, bnb's)
    return ctx.mode.weight


def adapted_weights(ctx: BlockContext) -> tuple[LinearSpec, ...]:
    """The block's bare weights LoRA adapts (expert stacks, the router's ``gate.weight``): peft's
    ParamWrapper, through ``target_parameters`` (all-linear reaches them where peft converts the
    model type's v4 names: ``LinearSpec.lora_rank``)."""
    if not ctx.targets:
        return ()
    return tuple(lin for lin in ctx.model.layer_linears if not lin.module and lin.key in ctx.targets)


def _trains(ctx: BlockContext, kind: LinearKind) -> bool:
    """The block's weights of ``kind`` (expert stacks: MLP_IN, MLP_OUT; the router) get a gradient:
    full fine-tuning, or a ParamWrapper adapter on them (W + BA needs one)."""
    return ctx.full or any(lin.kind is kind for lin in adapted_weights(ctx))


def _moe_input_needs_grad(ctx: BlockContext) -> bool:
    router = [lin for lin in ctx.model.layer_linears if lin.kind is LinearKind.ROUTER]
    return ctx.input_needs_grad(router[0]) if router else ctx.block_input_needs_grad


def _scores_need_grad(ctx: BlockContext) -> bool:
    """The routing weights need a gradient when the router trains or its input needs one."""
    return _trains(ctx, LinearKind.ROUTER) or _moe_input_needs_grad(ctx)


def router_bytes(ctx: BlockContext) -> int:
    """What the router keeps (MixtralTopKRouter.forward, modeling_mixtral.py:104-111;
    Qwen3MoeTopKRouter.forward, modeling_qwen3_moe.py:259-268):

    * ``F.linear(hidden_states, self.weight)`` saves its input when the router's weight trains:
      autocast's 16-bit cast of it, else the normed tensor itself (nothing else in the block saves
      that tensor: the experts gather from it and save only the indices); its weight cast is an
      autocast weight copy (``activations._weight_casts``);
    * ``softmax(router_logits.float())`` / ``softmax(..., dtype=torch.float)`` saves its fp32
      output, T x E;
    * ``torch.topk`` saves its int64 indices, T x k;
    * the renormalisation ``router_top_value /= router_top_value.sum(-1, keepdim=True)`` saves the
      fp32 top-k values and their sum (DivBackward0 ``self``, ``other``);
    * ``router_jitter_noise`` > 0 (Mixtral, training): ``hidden_states *= torch.empty_like(
      hidden_states).uniform_(...)`` saves the noise, in the normed tensor's dtype (the residual's);
    * top-k first (gpt-oss, GptOssTopKRouter.forward, modeling_gpt_oss.py:119-123: ``F.linear(x, W, b)``,
      ``torch.topk(router_logits)``, ``softmax(router_top_value, dtype=router_top_value.dtype)``): topk's
      int64 indices and the softmax's output, T x k in the logits' dtype, instead of the softmax over
      every expert (measured on a tiny gpt-oss: 1,024 + 256 B at T = 64, k = 2, bf16-mixed).
    """
    model, mode, t, h = ctx.model, ctx.mode, ctx.dims.tokens, ctx.dims.h
    routing, k, e = model.routing, model.experts_per_token, model.num_experts
    assert routing is not None
    total = 0
    if _trains(ctx, LinearKind.ROUTER):
        # DeepSeek-V3's F.linear reads ``hidden_states.type(torch.float32)``: an fp32 copy outside autocast
        total += t * h * (HALF if mode.autocast else FP32 if routing.group_limited else mode.compute)
    if _scores_need_grad(ctx) and routing.group_limited:
        total += _group_limited_bytes(ctx)
    elif _scores_need_grad(ctx) and routing.dense_experts:
        # Llama4Router.forward (modeling_llama4.py:147-153): topk's int64 indices (scatter_ keeps the same tensor)
        # and sigmoid's fp32 result over the T x E scores
        total += t * k * INT64 + t * e * FP32
    elif _scores_need_grad(ctx) and routing.topk_first:
        total += t * k * INT64 + t * k * _score_bytes(ctx)
    elif _scores_need_grad(ctx):
        total += t * e * FP32 + t * k * INT64
        if routing.renorm:
            total += t * k * FP32 + t * FP32
    if routing.jitter > 0 and _moe_input_needs_grad(ctx):
        total += t * h * mode.residual
    return total


def parallel_router_bytes(ctx: BlockContext) -> int:
    """Gemma4TextRouter.forward (modeling_gemma4.py:1307-1328; ``MoeRouting.parallel_experts``) on the
    residual stream x:

    * ``self.norm(x)``, a weightless Gemma4RMSNorm (:196-214): ``x.float()`` (a new fp32 copy only when the
      residual is 16-bit; else the tensor pre_feedforward_layernorm keeps already), ``pow(mean, -0.5)``'s base
      and result, fp32 per token, when x needs a gradient;
    * ``* self.scale``: the normed tensor (the residual's dtype, ``type_as``) when ``scale`` trains; the
      product times a Python number saves nothing;
    * ``proj`` (an nn.Linear): F.linear's input when its weight trains (autocast's 16-bit cast), or an
      adapter's: lora_A's cast, or the scaled tensor itself;
    * softmax(dtype=float32) over the experts, topk's int64 indices, the in-place renormalisation's fp32
      values and sum (as ``router_bytes``), and ``top_k_weights * self.per_expert_scale[top_k_index]``:
      the gathered scales (T x k in the parameter's dtype) and, when ``per_expert_scale`` trains, the
      division's fp32 result (the index op keeps topk's indices, saved already). Measured on a tiny Gemma 4
      (tests/memory/test_gemma4.py): the CloneBackward0 values, DivBackward0 result and IndexBackward0
      scales, T x k each."""
    model, mode, t, h = ctx.model, ctx.mode, ctx.dims.tokens, ctx.dims.h
    k, e = model.experts_per_token, model.num_experts
    router = next(lin for lin in model.layer_linears if lin.kind is LinearKind.ROUTER)
    needs_grad = ctx.input_needs_grad(router)
    total = 0
    if needs_grad:
        total += (t * h * FP32 if mode.residual != FP32 else 0) + 2 * t * FP32
    if ctx.full:
        total += t * h * mode.residual  # the normed tensor, for scale's gradient
        total += t * h * (HALF if mode.autocast else mode.residual)  # proj's input
    elif ctx.targeted(router):
        total += t * h * (mode.adapter_input if mode.adapter_input else
                          mode.residual if ctx.adapter_saves_shared_input else 0)
    if ctx.full or needs_grad or ctx.targeted(router):
        # the division's result only for per_expert_scale's gradient (full fine-tuning)
        total += t * e * FP32 + t * k * INT64 + t * k * FP32 + t * FP32 + t * k * mode.weight
        total += t * k * FP32 if ctx.full else 0
    return total


def parallel_norm_bytes(ctx: BlockContext) -> int:
    """The three norms Gemma 4's MoE block adds (Gemma4TextDecoderLayer.forward :1389-1402), Gemma4RMSNorms
    with a weight (``x.float()``, two fp32 row statistics, the fp32 normalised tensor when the weight
    trains: ``normed_output * self.weight.float()``):

    * ``pre_feedforward_layernorm_2`` on the residual: its fp32 input is the residual itself unless that is
      16-bit (then a copy);
    * ``post_feedforward_layernorm_1`` on the dense MLP's output and ``post_feedforward_layernorm_2`` on the
      experts': an fp32 input each (a copy of a 16-bit output, or the fp32 output itself, which nothing else
      keeps)."""
    mode, t, h = ctx.mode, ctx.dims.tokens, ctx.dims.h
    normed = t * h * FP32 if ctx.full else 0
    total = 0
    if _moe_input_needs_grad(ctx):
        total += (t * h * FP32 if mode.residual != FP32 else 0) + 2 * t * FP32
    total += normed
    outputs_grad = ctx.full or _moe_input_needs_grad(ctx) or bool(ctx.targeted_kinds)
    if outputs_grad:
        total += 2 * (t * h * FP32 + 2 * t * FP32)
    return total + 2 * normed


def _group_limited_bytes(ctx: BlockContext) -> int:
    """DeepseekV3TopkRouter.forward (modeling_deepseek_v3.py:133-158), when the scores need a gradient:
    ``router_logits.sigmoid()`` saves its output, T x E in the logits' dtype; the per-group
    ``.topk(2)`` saves its int64 indices, T x n_group x 2; the ``topk_group`` of the groups, T x
    topk_group int64; ``masked_fill`` its bool mask, T x E; the top-k, T x k int64 (``gather`` reads
    the same indices); ``norm_topk_prob``'s in-place division the gathered weights and their sum, T x
    k and T in the logits' dtype (``routed_scaling_factor``'s multiplication by a number saves nothing).
    Measured on a tiny DeepSeek-V3 (tests/memory/test_mla.py)."""
    routing, t, e, k = ctx.model.routing, ctx.dims.tokens, ctx.model.num_experts, ctx.model.experts_per_token
    assert routing is not None and routing.group_limited is not None
    groups, kept = routing.group_limited
    w = _score_bytes(ctx)
    total = t * e * w + t * groups * 2 * INT64 + t * kept * INT64 + t * e + t * k * INT64
    return total + (t * k * w + t * w if routing.renorm else 0)


def _score_bytes(ctx: BlockContext) -> int:
    """The routing weights' dtype: fp32, or the router logits' (16-bit under autocast, else the
    weights' dtype: F.linear's output; DeepSeek-V3's router weight stays fp32 whatever the model's
    dtype: ``_keep_in_fp32_modules_strict``, modeling_deepseek_v3.py:551)."""
    routing = ctx.model.routing
    if routing is not None and routing.scores_fp32:
        return FP32
    if ctx.mode.autocast:
        return HALF
    return FP32 if routing is not None and routing.group_limited else ctx.mode.compute


def expert_bytes(ctx: BlockContext, *, act_saved: int, keeps_output: bool) -> int:
    """What ``grouped_mm_experts_forward`` keeps (integrations/moe.py), per routed slot, w bytes
    an element (``expert_bytes_per_element``):

    * ``hidden_states[perm // num_top_k]`` (:441): IndexBackward0 saves the int64 indices when the
      input needs a gradient; ``sample_weights[perm]`` (:442) saves ``perm`` when the routing
      weights do; ``weighted_out[inv_perm]`` (:528) saves ``inv_perm``: 8 B each;
    * the up ``grouped_mm`` (:489, :379) saves its input, H·w, when the stacks train (and the
      ``offsets``, E int32, whenever it saves anything);
    * its output, 2I·w: the gate's activation saves ``gate``, a view of it (``_default_apply_gate``
      :566 ``gate_up_out.chunk(2)``), and the product saves ``up``, another view, so all of it
      stays; a non-gated expert's activation saves its input, I·w;
    * ``act(gate) * up`` saves act's output, I·w (more for activations that save more than their
      input: ``ACTIVATION_SAVED``);
    * the down ``grouped_mm`` (:510) saves its input, the product, I·w, when the stacks train;
    * ``proj_out * sample_weights_g.unsqueeze(-1)`` (:523) saves the down output, H·w, when the
      routing weights need a gradient, and the routing weight (fp32 or the logits' dtype) when the
      output does.

    Full fine-tuning: S·(w·(2H + 4I) + 24 + score bytes) + 4E. With frozen experts (LoRA) grouped_mm
    saves only its (parameter) weight and the offsets: S·(w·(H + 3I) + 24 + score bytes) + 4E.

    ``act_saved``: the intermediate-sized tensors the activation saves (``activations.ACTIVATION_SAVED``);
    ``keeps_output``: its backward reads its own output (``activations.ACTIVATION_SAVES_OUTPUT``)."""
    model, s, h = ctx.model, slots(ctx), ctx.dims.h
    inter, _, gated = expert_dims(model)
    w = expert_bytes_per_element(ctx)
    needs_grad = _moe_input_needs_grad(ctx)
    scores = _scores_need_grad(ctx)
    up_trains, down_trains = _trains(ctx, LinearKind.MLP_IN), _trains(ctx, LinearKind.MLP_OUT)
    if not (up_trains or down_trains or needs_grad or scores):
        return 0
    if dense_experts(model):
        return _dense_expert_bytes(ctx, act_saved=act_saved, needs_grad=needs_grad, scores=scores)
    per_slot = 0
    if needs_grad:
        per_slot += INT64  # the gather's indices
    if scores:
        per_slot += INT64 + h * w  # sample_weights[perm]'s indices, the down output for the weights' gradient
    per_slot += INT64 + _score_bytes(ctx)  # weighted_out[inv_perm]'s indices, the routing weight
    if gated and model.routing is not None and model.routing.expert_gate == "clamped_swiglu":
        # gpt-oss (modeling_gpt_oss.py:85-91): the two clamps keep their inputs, strided views of the
        # whole gate_up output (2I); the clamped gate and sigmoid(gate * alpha) (the product's operands,
        # the sigmoid's result), glu and up + 1 (the last product's operands): 4I more
        per_slot += 2 * inter * w + 4 * inter * w
    elif gated:
        per_slot += 2 * inter * w + max(act_saved - 1, 0) * inter * w + inter * w
    else:
        per_slot += act_saved * inter * w + (inter * w if keeps_output and not down_trains else 0)
    per_slot += (h * w if up_trains else 0) + (inter * w if down_trains else 0)  # the grouped_mm inputs
    if ctx.full and any(lin.bias for lin in expert_stacks(model)):
        # the per-slot bias gathers ``gate_up_proj_bias[expert_ids_g]`` and ``down_proj_bias[...]``
        # (moe.py:467, :492) save the one int64 index tensor they share, when the biases train
        per_slot += INT64
    # the offsets, whenever grouped_mm saves anything (its weight, for the input's gradient, too)
    offsets = model.num_experts * OFFSET_BYTES if up_trains or down_trains or needs_grad else 0
    return s * per_slot + offsets


def _dense_expert_bytes(ctx: BlockContext, *, act_saved: int, needs_grad: bool, scores: bool) -> int:
    """Llama4TextMoe.forward and Llama4TextExperts.forward (modeling_llama4.py:66-85, :166-175), per row of the
    T·E rows (``slots``) every expert computes, in the projections' output dtype c (16-bit under autocast,
    whose bmm casts): ``routed_in * scores`` keeps the repeated input (the residual's dtype) when the scores need
    a gradient and the transposed scores' copy when the input does; the up bmm its input (autocast's cast, or the
    product) when the stacks train; its 2I output, which silu's gate view and the product's up view keep whole;
    act's output (more for activations that save more); the down bmm its input when the stacks train. The bmm's
    16-bit copies of the stacks are autocast weight copies (``activations._weight_casts``)."""
    mode, h = ctx.mode, ctx.dims.h
    inter, _, _ = expert_dims(ctx.model)
    c = expert_bytes_per_element(ctx)
    per_row = (h * mode.residual if scores else 0) + (_score_bytes(ctx) if needs_grad else 0)
    per_row += 2 * inter * c + max(act_saved - 1, 0) * inter * c + inter * c
    per_row += (h * c if _trains(ctx, LinearKind.MLP_IN) else 0) + (inter * c if _trains(ctx, LinearKind.MLP_OUT) else 0)
    return slots(ctx) * per_row


def adapted_weight_bytes(ctx: BlockContext) -> int:
    """What peft's ParamWrapper adds for the adapted bare weights (peft 0.21 tuners/lora/layer.py):

    * an expert stack: ``_LoraFactorsProxy.forward`` (:2319-2323) folds the adapter into a new
      weight, ``torch.baddbmm(W, lhs, rhs, alpha=scaling)`` with autocast off, in W's dtype, which
      grouped_mm saves for its input's gradient: count x in x out x w; the factors are cast to W's
      dtype first (``get_delta_factors`` :2542 ``lhs.to(param.dtype)``), new tensors that baddbmm
      saves when W is 16-bit: rank x count x (in + out) x w;
    * the router's ``gate.weight`` (one "expert": ``Linear.get_delta_weight``): ``W + B @ A``,
      which F.linear saves outside autocast (E x H in the weights' dtype; under autocast its
      16-bit cast, an autocast weight copy); under autocast ``B @ A`` saves 16-bit casts of A and B.

    Measured on a tiny Mixtral (tests/memory/test_moe.py)."""
    mode, r = ctx.mode, ctx.config.lora_r or 0
    total = 0
    for lin in adapted_weights(ctx):
        weight = lin.count * lin.in_features * lin.out_features
        if is_expert_stack(lin):
            total += weight * mode.weight
            if mode.weight != FP32:
                total += r * lin.lora_rank * lin.count * (lin.in_features + lin.out_features) * mode.weight
        elif mode.autocast:
            total += HALF * r * lin.lora_rank * (lin.in_features + lin.out_features)
        else:
            total += weight * mode.weight
    return total


def product_bytes(ctx: BlockContext) -> int:
    """The down grouped_mm's input, act(gate) * up, over all slots: what the down projection saves
    when the down stack trains (released once its backward ran); else 0."""
    if looped(ctx.model):
        return _loop_product_bytes(ctx)
    if not _trains(ctx, LinearKind.MLP_OUT):
        return 0
    inter, _, _ = expert_dims(ctx.model)
    return slots(ctx) * inter * expert_bytes_per_element(ctx)


def moe_block_terms(ctx: BlockContext, *, act_saved: int, keeps_output: bool) -> dict[str, int]:
    """The MoE block's saved bytes by term (``TERM_SOURCES``); ``act_saved``, ``keeps_output``: as
    ``expert_bytes``."""
    parallel = ctx.model.routing is not None and ctx.model.routing.parallel_experts
    out = {"moe/router": parallel_router_bytes(ctx) if parallel else router_bytes(ctx)}
    if looped(ctx.model):
        out["moe/expert_loop"] = loop_expert_bytes(ctx, act_saved=act_saved)
    else:
        out["moe/experts"] = expert_bytes(ctx, act_saved=act_saved, keeps_output=keeps_output)
    if parallel:
        out["moe/norms"] = parallel_norm_bytes(ctx)
    if adapted := adapted_weight_bytes(ctx):
        out["lora/expert_weights"] = adapted
    return out


def loop_expert_bytes(ctx: BlockContext, *, act_saved: int) -> int:
    """What transformers 4's per-expert loop keeps (MixtralSparseMoeBlock.forward, 4.48.1
    models/mixtral/modeling_mixtral.py l.112-150; the expert, MixtralBlockSparseTop2MLP.forward l.79-82:
    ``self.w2(self.act_fn(self.w1(x)) * self.w3(x))``), summed over the experts, per routed slot (each
    of the S = T·k slots is in one expert's ``top_x``), c bytes an element (the projections' output
    dtype: autocast's 16 bits, bitsandbytes Linear4bit's ``out.to(inp_dtype)``), r the routing weights'
    (``routing_weights.to(hidden_states.dtype)``, l.125: the normed stream's dtype):

    * ``hidden_states[None, top_x]`` (l.143): IndexBackward0 saves ``top_x`` (int64) when the input needs a
      gradient; ``index_add_(0, top_x, ...)`` (l.148) saves the same tensor when the expert's output does;
      ``routing_weights[top_x, idx, None]`` (l.144) saves ``idx`` too when the routing weights need one;
    * w1 and w3 save their input where they train (under autocast a 16-bit cast each, else the gathered
      tokens, H·r) or are adapted (lora_A: each adapter's cast, or the gathered tokens once); w2 its input,
      the product (I·c), likewise (``_loop_product_bytes``); a frozen nn.Linear or Linear4bit saves only its
      weight (bitsandbytes MatMul4Bit: ``ctx.tensors = (None, B)``);
    * act(w1 x) saves w1's output (more for activations that save more: ``act_saved``), ``* w3(x)`` saves
      act's output and w3's: 3I·c for SiLU;
    * ``* routing_weights[...]`` saves w2's output (H·c) when the routing weights need a gradient, and
      the routing weight (r) when the output does;
    * ``index_add_`` saves its source, the weighted output (H in the product's promoted dtype, the wider of
      c and r), for its gradient's ``expand_as(source)`` (torch tools/autograd/derivatives.yaml ``index_add``).

    Frozen experts (LoRA on the attention): S·(8 + 8 + c·(3I + H) + r + H·max(c, r)), measured on a tiny
    Mixtral (tests/memory/test_expert_loop.py). transformers 4.39.3 (modeling_mixtral.py l.870-877) indexed
    with ``top_x.tolist()`` and ``idx.tolist()``, each index a new int64 tensor: 16 B a slot more, not counted."""
    mode, h, s = ctx.mode, ctx.dims.h, slots(ctx)
    inter, _, _ = expert_dims(ctx.model)
    c, r = mode.compute, mode.residual
    experts = routed_experts(ctx.model)
    needs_grad, scores = _moe_input_needs_grad(ctx), _scores_need_grad(ctx)
    adapted = [lin for lin in experts if ctx.targeted(lin)]
    out_grad = needs_grad or ctx.full or bool(adapted)
    if not (out_grad or scores):
        return 0
    per_slot = (INT64 if out_grad else 0) + (INT64 if scores else 0)  # top_x, idx
    per_slot += (max(act_saved - 1, 0) + 3) * inter * c  # w1's and w3's outputs, act's
    per_slot += (h * c if scores else 0) + (r if out_grad else 0)  # the weighting's operands
    per_slot += h * max(c, r) if out_grad else 0  # index_add_'s source
    ups = [lin for lin in experts if lin.kind is LinearKind.MLP_IN]
    if ctx.full:
        per_slot += len(ups) * h * HALF if mode.autocast else h * r
    elif mode.adapter_input:
        per_slot += sum(h * mode.adapter_input for lin in adapted if lin.kind is LinearKind.MLP_IN)
    elif ctx.adapter_saves_shared_input and any(lin.kind is LinearKind.MLP_IN for lin in adapted):
        per_slot += h * r  # lora_A's input: the gathered tokens, once for w1 and w3
    return s * per_slot + _loop_product_bytes(ctx)


def _loop_product_bytes(ctx: BlockContext) -> int:
    """w2's input, act(w1 x) * w3(x), over all slots, where w2 trains or lora_A of its adapter saves it (each
    adapter's cast, or the product itself); released once w2's backward ran (``product_bytes``)."""
    inter, _, _ = expert_dims(ctx.model)
    down = [lin for lin in routed_experts(ctx.model) if lin.kind is LinearKind.MLP_OUT]
    if ctx.full:
        return slots(ctx) * inter * ctx.mode.compute
    if not any(ctx.targeted(lin) for lin in down):
        return 0
    if ctx.mode.adapter_input:
        return slots(ctx) * inter * ctx.mode.adapter_input
    return slots(ctx) * inter * ctx.mode.compute if ctx.adapter_saves_shared_input else 0


def aux_loss_bytes(model: ModelSpec, tokens: int, logits_bytes: int) -> int:
    """``output_router_logits``: ``load_balancing_loss_func`` (modeling_mixtral.py:475-540) takes, per
    MoE layer, ``softmax(layer_gate, dim=-1)`` of the router logits the forward recorded, whose
    backward keeps its output: layers x T x E in the softmax's output dtype ``logits_bytes`` (the
    logits' dtype, fp32 where autocast runs softmax in fp32: CUDA's); the ``.float().sum(0)`` and
    the histogram after it save nothing of that size."""
    if model.routing is None or not model.routing.aux_loss:
        return 0
    # only the MoE blocks record router logits (OutputRecorder of the router module)
    return moe_layers(model) * tokens * model.num_experts * logits_bytes


__all__ = ["TERM_SOURCES", "adapted_weight_bytes", "adapted_weights", "aux_loss_bytes", "dense_experts", "expert_bytes",
           "expert_dims",
           "expert_stacks", "is_expert_stack", "is_moe_block", "loop_expert_bytes", "looped", "moe_block_terms", "moe_layers", "parallel_norm_bytes",
           "parallel_router_bytes", "product_bytes", "routed_experts", "router_bytes", "router_input_saved", "shared_expert", "shared_intermediate", "slots"]
