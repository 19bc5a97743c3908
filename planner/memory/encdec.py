"""Activations of encoder-decoder models (T5): the encoder stack, then the decoder stack.

Source and target lengths: ``config.seq_len`` is the source (encoder) length and the target
(decoder) length equals it. That is what the measurement worker feeds (``labels = input_ids``,
shifted right into the decoder's input by ``T5ForConditionalGeneration._shift_right``) and it
keeps the interface one knob; every decoder tensor below is sized by the same tokens ``e = b*s``.

What autograd keeps, read from transformers 5.23 ``models/t5/modeling_t5.py`` (line numbers of
that file) and counted with ``saved_tensors_hooks`` on a tiny T5 (fp32 and bf16 autocast, CPU):

* an encoder block is a pre-norm block like the decoder-only ones (``activations.block_terms``):
  ``T5LayerNorm`` (l.59-72: fp32 input, rsqrt, the normalised tensor when the weight trains),
  q/k/v/o without biases, the attention core, a dropout on each sub-layer's output (l.140, 399);
* T5's MLP (l.83-123) has a dropout INSIDE it, between the activation and ``wo``: relu keeps its
  output, dropout its mask, ``wo`` the dropped tensor (three intermediate-sized tensors instead of
  one); gated-gelu keeps gelu_new's tensors, both factors of the product, the mask and ``wo``'s
  input;
* the first block of each stack computes the relative position bias (l.335-348, compute_bias
  l.264-279): the embedding backward keeps the int64 bucket ids ``[q, k]``; the bias itself is
  added to the scores, which keeps nothing, and is reused by every later block (l.739-742);
* a decoder block adds cross-attention (``T5LayerCrossAttention``, l.403-425): a third norm, q
  from the decoder, k and v from the encoder's output, which stays alive until the decoder's
  backward is done (fp32: one tensor shared by every block; under autocast each k and v keeps
  its own 16-bit cast); its core is that of self-attention over (target x source) scores;
* with SDPA the decoder's causal self-attention folds the bias into a float mask through
  ``torch.where(causal_mask, position_bias, min)`` (integrations/sdpa_attention.py l.74-81),
  which keeps the bool ``[1, 1, t, t]`` condition in every decoder block;
* around the stacks: both stacks' token ids (the encoder's input_ids, the decoder's shifted
  labels), both embedding dropouts, both final norms and final dropouts (l.744-745), the output
  head's input and the loss (``CrossEntropyLoss`` on the logits, l.1051-1054).

The logits and loss transients are those of ``activations`` (the loss' log_softmax is fp32 under
autocast; the fp32 model's logits are fp32).
"""

from __future__ import annotations

from planner.config import Attention, Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memory.activations import (
    ACTIVATION_SAVED,
    ACTIVATION_SAVED_DEFAULT,
    _norm_bytes,
    block_terms,
    breakdown_key,
    model_level_terms,
)
from planner.memory.attention import attention_terms
from planner.memory.dtypes import HALF, INT64, mode_of
from planner.memory.shapes import BlockContext, block_context, dims_of
from planner.modelspec import LinearKind, ModelSpec

#: Where each encoder-decoder term comes from (the breakdown's keys without ``activations/``),
#: beside ``activations.TERM_SOURCES``.
ENCDEC_TERM_SOURCES = {
    "position/buckets": "relative position bucket ids kept by the bias embedding's backward (compute_bias, l.264-279)",
    "attention/causal_mask": "torch.where's bool condition when SDPA folds the bias into a causal mask "
                             "(sdpa_attention.py create_position_bias_mask)",
    "attention/position_bias": "the float bias mask the fused CUDA kernel keeps (unmeasured: no GPU here)",
    "cross_attention/inputs": "q's input, and k/v's 16-bit casts of the encoder output under autocast (F.linear)",
    "cross_attention/core": "the attention core over (target x source) scores (as attention/core)",
    "cross_attention/norm": "T5LayerCrossAttention.layer_norm",
    "encoder_output": "the encoder's output, read by every cross-attention k and v (fp32: saved once)",
    "mlp/dropout": "T5DenseActDense's dropout between the activation and wo: mask and wo's input (l.83-94)",
}


def decoder_view(model: ModelSpec) -> ModelSpec:
    """The model seen from its decoder stack (``ModelSpec.decoder_view``)."""
    return model.decoder_view


def _mlp_terms(ctx: BlockContext) -> dict[str, int]:
    """T5's MLP keeps, between its input projections and ``wo``: the activation's tensors (relu:
    its output; gated: gelu_new's and both factors of the product), dropout's mask and the
    dropped tensor ``wo`` reads (when it needs its input)."""
    model, mode, e, i = ctx.model, ctx.mode, ctx.dims.tokens, ctx.dims.i
    inter = e * i * mode.compute
    wo = ctx.of_kind(LinearKind.MLP_OUT)
    wo_needs_input = ctx.full or any(ctx.targeted(lin) for lin in wo)
    act = ACTIVATION_SAVED.get(model.hidden_act, ACTIVATION_SAVED_DEFAULT)
    saved = act + 2 if model.gated_mlp else max(act, 1)  # relu: its output (threshold_backward)
    dropout = model.hidden_dropout > 0
    out = {"mlp/intermediate": saved * inter}
    if dropout:
        out["mlp/dropout"] = e * i * ctx.kernels.dropout_mask_bytes(mode.compute)
    if wo_needs_input and (dropout or model.gated_mlp):  # else wo reads the saved relu output
        out["mlp/dropout"] = out.get("mlp/dropout", 0) + inter
    return out


def _self_block(ctx: BlockContext) -> dict[str, int]:
    """One block's self-attention and MLP terms (``block_terms`` with T5's MLP)."""
    out = block_terms(ctx)
    out.pop("mlp/intermediate", None)
    out.update(_mlp_terms(ctx))
    return out


def _cross_terms(ctx: BlockContext) -> dict[str, int]:
    """What a decoder block's cross-attention adds: its norm, q's input, k/v's casts of the
    encoder output under autocast, the core, o's input, the output dropout's mask."""
    e, h, mode = ctx.dims.tokens, ctx.dims.h, ctx.mode
    cross = ctx.of_kind(LinearKind.CROSS_ATTN_IN)
    hit = [lin for lin in cross if ctx.full or ctx.targeted(lin)]
    needs_grad = ctx.block_input_needs_grad or ctx.attn_targeted
    inputs = 0
    for lin in hit:
        if lin.name == "q" and not mode.autocast:
            inputs += e * h * mode.compute  # the normed tensor (in the residual dtype)
        elif mode.autocast:
            inputs += e * h * HALF  # one 16-bit cast per call
        elif mode.adapter_input:
            inputs += e * h * mode.adapter_input
    core = attention_terms(ctx)
    out = {
        "cross_attention/norm": _norm_bytes(ctx, needs_grad),
        "cross_attention/inputs": inputs,
        "cross_attention/core": sum(core.values()),
    }
    if ctx.model.hidden_dropout > 0:
        out["dropout"] = e * h * ctx.kernels.dropout_mask_bytes(mode.compute)
    return out


def _bias_masks(ctx: BlockContext, *, decoder: bool) -> dict[str, int]:
    """SDPA with T5's bias: on the CPU's math path the decoder's causal ``torch.where`` keeps its
    bool condition per block; a fused CUDA kernel keeps the float mask it reads (the decoder's
    where() output per block; the encoder's bias is one tensor shared by its blocks, counted in
    ``stack_extras``)."""
    if ctx.config.attention is not Attention.SDPA or not decoder:
        return {}
    s, a = ctx.dims.s, ctx.dims.a
    if ctx.kernels.sdpa_dropout_math_fp32 and ctx.model.attn_dropout > 0:
        return {"attention/causal_mask": s * s}
    return {"attention/causal_mask": s * s, "attention/position_bias": a * s * s * ctx.mode.weight}


def block_list(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
               targets: frozenset[str] | None = None) -> list[dict[str, int]]:
    """Every block's saved tensors by term, encoder blocks then decoder blocks (no checkpointing)."""
    dims = dims_of(model, config)
    dec = decoder_view(model)
    out = []
    for stack, n, decoder in ((model, model.num_layers, False), (dec, model.decoder_layers, True)):
        for k in range(n):
            if k >= 2:  # a block's terms depend on its index only through ``first``: the rest repeat block 1
                out.append(dict(out[-1]))
                continue
            ctx = block_context(stack, config, kernels, first=k == 0, targets=targets, dims=dims)
            terms = _self_block(ctx)
            if decoder:
                for key, v in _cross_terms(ctx).items():
                    terms[key] = terms.get(key, 0) + v
            terms.update(_bias_masks(ctx, decoder=decoder))
            if k == 0 and model.relative_attention_buckets:
                terms["position/buckets"] = dims.s * dims.s * INT64
            out.append({key: v for key, v in terms.items() if v})
    return out


def stack_extras(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                 targets: frozenset[str] | None = None) -> dict[str, dict[str, int]]:
    """Terms around the stacks, by where they live: ``encoder`` (embeddings, freed with the
    first encoder block), ``encoder_end`` (final norm, its dropout and the encoder output, alive
    until the decoder's backward is done), ``decoder_start`` (the decoder's ids and embedding
    dropout) and ``head`` (final norm, lm_head, loss: ``activations.model_level_terms``)."""
    dims, mode = dims_of(model, config), mode_of(config)
    level = model_level_terms(model, config, dims, mode, kernels)
    e, h = dims.tokens, dims.h
    embeddings = {k: v for k, v in level.items() if k in ("embeddings", "dropout")}
    head = {k: v for k, v in level.items() if k not in embeddings}
    ctx = block_context(decoder_view(model), config, kernels, first=False, targets=targets, dims=dims)
    end = {"final_norm": head["final_norm"]}
    if model.hidden_dropout > 0:
        end["dropout"] = e * h * kernels.dropout_mask_bytes(mode.residual)
        head["dropout"] = end["dropout"]
    kv = [lin for lin in ctx.of_kind(LinearKind.CROSS_ATTN_IN) if lin.name != "q"]
    if not mode.autocast and (ctx.full or any(ctx.targeted(lin) for lin in kv)):
        end["encoder_output"] = e * h * mode.residual
    if config.attention is Attention.SDPA and not (kernels.sdpa_dropout_math_fp32 and model.attn_dropout > 0):
        # the fused kernel keeps the encoder's shared bias and the cross-attention's zero bias
        end["attention/position_bias"] = dims.a * dims.s * dims.s * (mode.weight + mode.attn)
    return {"encoder": embeddings, "encoder_end": end, "decoder_start": dict(embeddings), "head": head}


def checkpointed_block_list(model: ModelSpec, config: TrainConfig) -> list[dict[str, int]]:
    """Under checkpointing each block keeps its input (the residual stream); the position biases
    the first block of a stack computes are inputs of every later block's checkpoint, so they
    stay alive too: the encoder's and the decoder's relative bias ``[1, heads, s, s]`` (the bias
    embedding's dtype) and the cross-attention's zero bias (q's dtype), which requires a gradient
    under checkpointing (modeling_t5.py l.338-344)."""
    dims, mode = dims_of(model, config), mode_of(config)
    one = {"checkpoints": dims.tokens * dims.h * mode.residual}
    blocks = [dict(one) for _ in range(model.num_layers + model.decoder_layers)]
    bias = dims.a * dims.s * dims.s
    blocks[0]["checkpoints/position_bias"] = bias * mode.weight
    blocks[model.num_layers]["checkpoints/position_bias"] = bias * (mode.weight + mode.attn)
    return blocks


def recompute_bytes(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                    targets: frozenset[str] | None = None) -> int:
    """Under checkpointing, the recomputed block counted at ``step``'s ``backward_end``: backward's
    peak is the largest over blocks of (gradients made so far + the block being recomputed).
    With full fine-tuning the gradients dominate, so it is the end of backward, when the
    encoder's first block is recomputed last. With adapters the gradients are small and it is a
    decoder block's recomputation, beside the gradients only backward holds then: the encoder
    output's (accumulated over every cross-attention k and v) and the three shared position
    biases' (checkpointed_block_list). Measured on a small T5 (CPU allocator, bench rows): full
    +5%, LoRA -7% (the rest: backward's per-op temporaries inside the block, not modelled)."""
    if not config.grad_ckpt:
        return 0
    dims, mode = dims_of(model, config), mode_of(config)
    blocks = block_list(model, config, kernels, targets)
    if config.method is Method.FULL:
        return sum(blocks[0].values())
    bias_grads = dims.a * dims.s * dims.s * (2 * mode.weight + mode.attn)
    return max(sum(b.values()) for b in blocks) + dims.tokens * dims.h * mode.residual + bias_grads


def activation_breakdown(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                         targets: frozenset[str] | None = None) -> dict[str, int]:
    """Saved for backward over the whole forward pass, by term (``planner.memory.saved.activation_breakdown``
    for an encoder-decoder; keys without the ``activations/`` prefix)."""
    blocks = checkpointed_block_list(model, config) if config.grad_ckpt else block_list(model, config, kernels, targets)
    total: dict[str, int] = {}
    for part in [*blocks, *stack_extras(model, config, kernels, targets).values()]:
        for key, v in part.items():
            total[key] = total.get(key, 0) + v
    return {k: v for k, v in total.items() if v}




def _keyed(terms: dict[str, int]) -> dict[str, int]:
    return {breakdown_key(k): v for k, v in terms.items() if v}


def _merged(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for key, v in part.items():
            out[key] = out.get(key, 0) + v
    return out


def timeline_parts(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                   targets: frozenset[str] | None = None) -> tuple[dict[str, int], list[dict[str, int]], dict[str, int]]:
    """(embeddings, blocks in forward order, head) by breakdown key, for
    ``planner.memory.timeline``: the encoder's final norm, final dropout and output go with its
    last block (freed when backward reaches it, after the whole decoder), the decoder's ids and
    embedding dropout with its first block."""
    extras = stack_extras(model, config, kernels, targets)
    blocks = checkpointed_block_list(model, config) if config.grad_ckpt else block_list(model, config, kernels, targets)
    enc = model.num_layers
    blocks[enc - 1] = _merged(blocks[enc - 1], extras["encoder_end"])
    blocks[enc] = _merged(extras["decoder_start"], blocks[enc])
    return _keyed(extras["encoder"]), [_keyed(b) for b in blocks], _keyed(extras["head"])


__all__ = ["ENCDEC_TERM_SOURCES", "activation_breakdown", "block_list", "checkpointed_block_list",
           "decoder_view", "recompute_bytes", "stack_extras", "timeline_parts"]
