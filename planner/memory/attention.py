"""The attention core of one block: what SDPA, flash or the eager path saves for backward."""

from __future__ import annotations

from planner.config import Attention
from planner.gpus import KernelProfile
from planner.memory.dtypes import FP32, INT64, DtypeMode
from planner.memory.shapes import BlockContext
from planner.modelspec import ModelSpec

#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search's batch lines read these thousands of times
_EAGER, _FLASH, _SDPA = Attention.EAGER, Attention.FLASH, Attention.SDPA


def out_input(ctx: BlockContext, copy_bytes: int) -> int:
    """What o_proj's input costs beyond the kernel's saved output: ``copy_bytes`` when the
    attention output reaches o_proj as a separate (transposed, contiguous) copy and o_proj or a
    sharing adapter keeps it, plus the adapters' own input casts."""
    total = 0
    if copy_bytes and (ctx.full or (ctx.o_targeted and ctx.adapter_saves_shared_input)):
        total += copy_bytes
    if not ctx.full and ctx.mode.adapter_input and ctx.o_targeted:
        total += sum([ctx.dims.tokens * lin.in_features * ctx.mode.adapter_input for lin in ctx.attn_out])
    return total


def attention_terms(ctx: BlockContext) -> dict[str, int]:
    """``attention/core`` (and ``attention/probs``, ``attention/out_input``) of one block."""
    dims, mode, model = ctx.dims, ctx.mode, ctx.model
    if model.latent_attention is not None:
        return latent_attention_terms(ctx)
    e = dims.tokens
    q = e * dims.a * dims.d
    attention = effective_attention(model, ctx.config)
    # with a padding mask transformers repeats k/v to every head before SDPA
    # (integrations/sdpa_attention.py use_gqa_in_sdpa: GQA only when attention_mask is None)
    window = window_mask(ctx)
    kvn = q if (padding_mask(ctx.config) or window) and attention is _SDPA else e * dims.kv * dims.d
    if attention is _SDPA and ctx.kernels.sdpa_dropout_math_fp32 and model.attn_dropout > 0:
        # SDPA's flash kernel refuses dropout here, so training falls back to the math path,
        # which upcasts 16-bit inputs to fp32 and saves q·scale, kᵀ·scale and v (fp32, all
        # heads), the fp32 softmax, the dropout mask and the dropped probabilities; its
        # (b, a, s, d) output needs a contiguous copy before o_proj. Measured on gpt2 and bert
        # (bench/accuracy.py, CPU probe).
        scores = dims.b * dims.a * dims.s * dims.s
        return {"attention/core": 4 * 3 * q + 4 * 3 * scores, "attention/out_input": out_input(ctx, q * mode.attn)}
    if attention in (_SDPA, _FLASH):
        terms = _fused_kernel_terms(ctx, q, kvn)
        if window:
            terms["attention/core"] += window
        return terms
    # eager: q and k for the scores, the fp32 softmax and its cast back for probs @ v, v repeated
    # to all heads (repeat_kv), and the transposed output copied before o_proj
    # (eager_attention_forward).
    scores = dims.b * dims.a * dims.s * dims.s
    return {
        "attention/core": mode.attn * 3 * q,
        "attention/probs": scores * eager_probs_bytes_per_score(model, mode, ctx.kernels) + sink_bytes(ctx),
        "attention/out_input": out_input(ctx, q * mode.attn),
    }


def latent_attention_terms(ctx: BlockContext) -> dict[str, int]:
    """Multi-head latent attention (DeepseekV3Attention.forward, modeling_deepseek_v3.py:435-483), a
    block's tensors besides the hidden-size norms and the q_a/kv_a inputs (``_inputs``):

    * ``attention/latent``: ``q_a_layernorm`` and ``kv_a_layernorm`` (DeepseekV3RMSNorm :47-52) save
      their fp32 input and rsqrt when it needs a gradient, the normalised tensor in the projection's
      dtype when the weight trains; the fp32 input of ``kv_a_layernorm`` is a copy of its slice of
      ``kv_a_proj_with_mqa``'s output, except in fp32, where ``.to(float32)`` keeps the slice, a view
      of the whole kv_rank + rope output; ``q_b_proj`` and ``kv_b_proj`` save their own inputs (the
      norms' outputs; under autocast their 16-bit casts are counted with the q_a/kv_a ones);
    * ``attention/core``: the rope/nope split makes q and k new tensors of nope + rope dims a head
      (``torch.cat((q_pass, q_rot))`` :462, ``expand_kv`` :421-423 ``new_empty`` + ``copy_``), v a view
      of ``kv_b_proj``'s output (``torch.split`` :417) with its own v dims, and the output has v dims:
        - SDPA on the CPU: the flash kernel needs one head dim for q, k and v (aten sdp_utils_cpp.cpp
          check_head_dim_size_cpp), so the math path runs; it saves fp32 q, k, v copies and the fp32
          softmax, b x a x s x s (measured); its output reaches o_proj through a contiguous copy;
        - SDPA on CUDA: the flash backend needs one head dim too, the memory-efficient one does not
          (sdp_utils.cpp check_head_dim_size_mem_efficient), and saves q, k, v (the whole kv_b output
          it views), out and the fp32 log-sum-exp; out is laid out (b, s, a, v), so o_proj reads a view;
        - flash-attn (integrations/flash_attention.py:61-65, :96-97): v padded to the qk head dim
          (``F.pad``, a new tensor), so flash saves q, k, the padded v and a padded output, plus the
          log-sum-exp; the output cropped to v dims is copied by the reshape before o_proj;
        - eager (eager_attention_forward :237-259): q and k for the scores, v for probs @ v (matmul
          copies the strided kv_b view to a contiguous batch: its own b x a x s x v, measured), the
          probabilities as for MHA, and the transposed output copied before o_proj.
    Against MHA of the same heads: k and q are nope + rope wide, v is v wide, and the latent tensors
    are added; no cache is written in training."""
    dims, mode, model, e = ctx.dims, ctx.mode, ctx.model, ctx.dims.tokens
    mla = model.latent_attention
    assert mla is not None
    heads, qk = dims.a, dims.d
    q, kv_out, out = e * heads * qk, e * heads * (mla.nope + mla.v), e * heads * mla.v
    attention = effective_attention(model, ctx.config)
    lse = e * heads * FP32
    if attention is _SDPA and ctx.kernels.sdpa_dropout_math_fp32:
        # the CPU's sdp_utils_cpp decides both: dropout and unequal head dims send SDPA to the math path
        core = {"attention/core": FP32 * (2 * q + out) + FP32 * dims.b * heads * dims.s * dims.s,
                "attention/out_input": out_input(ctx, out * mode.attn)}
    elif attention is _SDPA:
        core = {"attention/core": mode.attn * (2 * q + kv_out + out) + lse, "attention/out_input": out_input(ctx, 0)}
    elif attention is _FLASH:
        core = {"attention/core": mode.attn * 4 * q + lse, "attention/out_input": out_input(ctx, out * mode.attn)}
    else:
        scores = dims.b * heads * dims.s * dims.s
        core = {"attention/core": mode.attn * (2 * q + out),
                "attention/probs": scores * eager_probs_bytes_per_score(model, mode, ctx.kernels),
                "attention/out_input": out_input(ctx, out * mode.attn)}
    return {"attention/latent": _latent_bytes(ctx, mla)} | core


def _latent_bytes(ctx: BlockContext, mla) -> int:
    """``attention/latent`` of ``latent_attention_terms``: the two low-rank norms and the inputs of the
    up projections (q_b_proj, kv_b_proj) that ``_inputs`` does not count."""
    mode, e = ctx.mode, ctx.dims.tokens
    total = 0
    by_name = {lin.name: lin for lin in ctx.model.layer_linears}
    for down, up, rank, extra in (("q_a_proj", "q_b_proj", mla.q_rank, 0), ("kv_a_proj_with_mqa", "kv_b_proj",
                                                                            mla.kv_rank, mla.rope)):
        if rank is None:
            continue
        if ctx.block_input_needs_grad or ctx.full or down in ctx.targets:
            # fp32 input (in fp32 the kv slice keeps the whole latent output) and rsqrt
            total += e * (rank + (extra if mode.compute == FP32 else 0)) * FP32 + e * FP32
        if ctx.full:
            total += e * rank * mode.compute  # the normalised tensor, for the weight's gradient
        lin = by_name[up]
        if ctx.full and not mode.autocast:
            total += e * rank * mode.compute  # the up projection's input, the norm's output
        elif not ctx.full and ctx.targeted(lin) and not mode.adapter_input and ctx.adapter_saves_shared_input:
            total += e * rank * mode.compute  # lora_A keeps the norm's output
    return total


def effective_attention(model: ModelSpec, config) -> Attention:
    """The attention path that runs: SDPA asked of a model without one (gpt-oss, ``ModelSpec.sdpa``)
    is planned as the eager path, the one its published recipe loads (``attn_implementation="eager"``,
    OpenAI's cookbook ``articles/gpt-oss/fine-tune-transfomers.ipynb``)."""
    if config.attention is _SDPA and not model.sdpa:
        return _EAGER
    return config.attention


def sink_bytes(ctx: BlockContext) -> int:
    """gpt-oss's eager attention with sinks (modeling_gpt_oss.py:216-226): the scores get one more
    column, ``torch.cat([attn_weights, sinks], dim=-1)``, whose dtype is promoted to the sinks'
    (the parameters', ``mode.residual``: fp32 under autocast) along with the rest, so softmax saves
    b x a x s x (s + 1) in that dtype (the s x s part, and the cast probs @ v reads, counted by
    ``eager_probs_bytes_per_score`` with ``ModelSpec.eager_softmax`` ``residual``), and
    ``combined_logits.max(dim=-1)`` keeps its int64 indices, b x a x s. The window of a sliding layer is an additive mask: eager saves the
    same tensors for sliding and full layers (and flash the same q, k, v, out and log-sum-exp)."""
    if not ctx.model.attention_sinks:
        return 0
    rows = ctx.dims.b * ctx.dims.a * ctx.dims.s
    return rows * ctx.mode.residual + rows * INT64


def _fused_kernel_terms(ctx: BlockContext, q: int, kvn: int) -> dict[str, int]:
    """SDPA/flash save q, k, v, out and the fp32 log-sum-exp; transformers uses the native GQA
    path when there is no mask, so k/v keep kv heads (integrations/sdpa_attention.py)."""
    dims, mode, model = ctx.dims, ctx.mode, ctx.model
    lse = dims.tokens * dims.a * FP32
    if not model.fused_qkv:
        # o_proj reads the output in place: its (b, s, a, d) layout makes the reshape a view
        return {"attention/core": mode.attn * (2 * q + 2 * kvn) + lse, "attention/out_input": out_input(ctx, 0)}
    # q, k and v are views of one projection's output. Rope makes new q and k; a dtype change
    # (QLoRA's fp32 outputs under autocast) makes copies of all three; whatever stays a view keeps
    # the whole fused buffer saved. Rope on a strided slice of q returns a (b, a, s, d)-contiguous
    # q, so the kernel's output is laid out that way too and o_proj reads a transposed copy
    # (measured on phi3 and gpt2: qkv_proj's output and sdpa_attention.py's .contiguous(), which
    # copies for phi3 only).
    roped = model.position == "rope"
    cast = mode.compute != mode.attn
    copies = (q + kvn) if roped or cast else 0
    copies += kvn if cast else 0
    fused = 0 if cast else (q + 2 * kvn) * mode.compute
    return {"attention/core": mode.attn * (copies + q) + fused + lse,
            "attention/out_input": out_input(ctx, q * mode.attn if roped else 0)}


def window_mask(ctx: BlockContext) -> int:
    """A sliding-window layer's mask under SDPA (``ModelSpec.sliding_attention``), once the sequence is
    longer than the window: transformers hands SDPA a (b, 1, s, s) bool mask
    (masking_utils.py create_sliding_window_causal_mask), which makes it repeat k and v to every head
    (integrations/sdpa_attention.py ``use_gqa_in_sdpa``: GQA only without a mask), and SDPA converts the
    bool mask to q's dtype for its kernel in every layer (aten attention.cpp
    ``convert_boolean_attn_mask``), a tensor its backward keeps: b x s x s in the attention's dtype
    (measured on a tiny Gemma 4, tests/memory/test_gemma4.py). 0 otherwise."""
    model, config = ctx.model, ctx.config
    if not model.sliding_attention or model.sliding_window is None or config.seq_len <= model.sliding_window:
        return 0
    if effective_attention(model, config) is not _SDPA:
        return 0
    return ctx.dims.b * ctx.dims.s * ctx.dims.s * ctx.mode.attn


def padding_mask(config) -> bool:
    """Batches padded to the longest carry an attention mask into the model (not with flash-attn,
    which unpads). The model assumes the worst batch is padded; a micro-batch of one never is,
    where this over-counts the mask's terms."""
    return not config.packing and config.attention is not _FLASH


def eager_probs_bytes_per_score(model: ModelSpec, mode: DtypeMode, kernels: KernelProfile) -> int:
    """Bytes per attention score the eager path keeps: softmax's output (its backward reads it),
    a cast for probs @ v when the dtypes differ, and with attention dropout the mask and the
    dropped probabilities. Where autocast leaves softmax alone (the CPU), the probabilities stay
    16-bit (BERT's, measured with the CPU probe)."""
    if model.eager_softmax == "fp32":
        p = FP32
    elif model.eager_softmax == "residual":
        p = mode.residual
    else:
        p = FP32 if mode.autocast and kernels.autocast_softmax_fp32 else mode.attn
    dropout = model.attn_dropout > 0
    if model.eager_softmax in ("fp32", "input_then_cast"):
        # cast to q's / v's dtype, then dropout on that: the cast is kept by probs @ v only
        # when there is no dropout between them
        if dropout:
            return p + kernels.dropout_mask_bytes(mode.attn) + mode.attn
        return p + (mode.attn if p != mode.attn else 0)
    # dropout on softmax's output, then probs @ v casts (autocast) what it reads
    kept = p + (kernels.dropout_mask_bytes(p) if dropout else 0)
    if p != mode.attn:
        return kept + mode.attn
    return kept + (p if dropout else 0)


__all__ = ["attention_terms", "eager_probs_bytes_per_score", "effective_attention", "latent_attention_terms",
           "out_input", "padding_mask", "sink_bytes", "window_mask"]
