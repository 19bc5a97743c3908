"""The attention core of one block: what SDPA, flash or the eager path saves for backward."""

from __future__ import annotations

from planner.config import Attention
from planner.gpus import KernelProfile
from planner.memory.dtypes import FP32, INT64, DtypeMode
from planner.memory.shapes import BlockContext
from planner.modelspec import ModelSpec


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
    e = dims.tokens
    q = e * dims.a * dims.d
    attention = effective_attention(model, ctx.config)
    # with a padding mask transformers repeats k/v to every head before SDPA
    # (integrations/sdpa_attention.py use_gqa_in_sdpa: GQA only when attention_mask is None)
    kvn = q if padding_mask(ctx.config) and attention is Attention.SDPA else e * dims.kv * dims.d
    if attention is Attention.SDPA and ctx.kernels.sdpa_dropout_math_fp32 and model.attn_dropout > 0:
        # SDPA's flash kernel refuses dropout here, so training falls back to the math path,
        # which upcasts 16-bit inputs to fp32 and saves q·scale, kᵀ·scale and v (fp32, all
        # heads), the fp32 softmax, the dropout mask and the dropped probabilities; its
        # (b, a, s, d) output needs a contiguous copy before o_proj. Measured on gpt2 and bert
        # (bench/accuracy.py, CPU probe).
        scores = dims.b * dims.a * dims.s * dims.s
        return {"attention/core": 4 * 3 * q + 4 * 3 * scores, "attention/out_input": out_input(ctx, q * mode.attn)}
    if attention in (Attention.SDPA, Attention.FLASH):
        return _fused_kernel_terms(ctx, q, kvn)
    # eager: q and k for the scores, the fp32 softmax and its cast back for probs @ v, v repeated
    # to all heads (repeat_kv), and the transposed output copied before o_proj
    # (eager_attention_forward).
    scores = dims.b * dims.a * dims.s * dims.s
    return {
        "attention/core": mode.attn * 3 * q,
        "attention/probs": scores * eager_probs_bytes_per_score(model, mode, ctx.kernels) + sink_bytes(ctx),
        "attention/out_input": out_input(ctx, q * mode.attn),
    }


def effective_attention(model: ModelSpec, config) -> Attention:
    """The attention path that runs: SDPA asked of a model without one (gpt-oss, ``ModelSpec.sdpa``)
    is planned as the eager path, the one its published recipe loads (``attn_implementation="eager"``,
    OpenAI's cookbook ``articles/gpt-oss/fine-tune-transfomers.ipynb``)."""
    if config.attention is Attention.SDPA and not model.sdpa:
        return Attention.EAGER
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


def padding_mask(config) -> bool:
    """Batches padded to the longest carry an attention mask into the model (not with flash-attn,
    which unpads). The model assumes the worst batch is padded; a micro-batch of one never is,
    where this over-counts the mask's terms."""
    return not config.packing and config.attention is not Attention.FLASH


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


__all__ = ["attention_terms", "eager_probs_bytes_per_score", "effective_attention", "out_input", "padding_mask",
           "sink_bytes"]
