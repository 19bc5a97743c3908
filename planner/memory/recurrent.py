"""Linear-attention and state-space token mixers: what a Gated DeltaNet layer (Qwen3-Next, Qwen3.5) and a Mamba2
layer (Nemotron-H, ``mamba2_terms`` below) keep for backward, term by term, on each of the two paths transformers
5.24 runs them on.

**Which path.** ``Qwen3NextGatedDeltaNet.forward`` (modeling_qwen3_next.py:660-770; Qwen3_5GatedDeltaNet the
same after its four projections) calls ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``, each
decorated ``@use_kernel_func_from_hub_with_fallback`` (:339, :370): with the ``causal-conv1d`` and
``flash-linear-attention`` kernels installed (CUDA; the published Qwen3-Next/Qwen3.5 fine-tuning recipes
install both) the CUDA conv and fla's ``chunk_gated_delta_rule`` run, else the torch reference code of the
modeling file. The planner takes the kernels on a GPU (``KernelProfile.name`` ``cuda``) and the torch code
on the CPU, where no kernel exists.

The terms (T = b·s tokens, P = b·s rounded up to the 64-token chunk, Hk/Hv key and value heads of dk/dv,
conv = 2·Hk·dk + Hv·dv channels):

* ``linear_attn/conv``: the depthwise causal conv1d's input (when its weight trains) and, on the torch path,
  its whole padded output b x conv x (s + K - 1), which the silu keeps through the ``[..., :seq_len]`` view;
  the CUDA kernel fuses the silu and keeps only its input (causal_conv1d_interface.py
  ``ctx.save_for_backward(x, weight, bias, ...)``);
* ``linear_attn/gates``: ``b.sigmoid()``'s output, ``softplus(a.float() + dt_bias)``'s fp32 input and (when
  ``A_log`` trains) output, ``-A_log.float().exp()``;
* ``linear_attn/delta_rule``: the chunked delta rule. Torch (torch_chunk_gated_delta_rule, :371-510, all in
  fp32: ``.to(torch.float32)`` of q, k, v, beta and the decay): the l2norms' inputs and rsqrt, the padded
  k, v and beta, the chunk's C x C decays and the two C x C products, k·beta, the two triangular solves'
  matrix and results, the decayed q and the exps, and per chunk the recurrent state (b·Hv x dk x dv); under
  CPU autocast every ``@`` casts its operands to 16 bits (matmul is on autocast's lower-precision list) and
  those casts are what it keeps. fla (fla/ops/gated_delta_rule/chunk.py ``ChunkGatedDeltaRuleFunction``):
  ``save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, ...)``: the l2-normed q and k (contiguous 16-bit
  copies: ``input_guard``), their fp32 rstd, a contiguous v, the fp32 chunk-local cumsum of g, and A, the
  inverted T x 64 WY matrix per value head in k's dtype (``solve_tril(..., output_dtype=k.dtype)``);
* ``linear_attn/norm``: Qwen3NextRMSNormGated (:59-75): the fp32 input and rsqrt, the normalised tensor for
  the weight's gradient, ``gate.to(float32)``, silu's output and the weighted tensor, fp32;
* ``attention/out_input``: out_proj's input, the norm's output (``attention.out_input``).

Pure module: no torch, no I/O.
"""

from __future__ import annotations

from planner.memory.attention import out_input
from planner.memory.dtypes import FP32, HALF
from planner.memory.shapes import BlockContext
from planner.modelspec import GatedDeltaNet, LinearKind, Mamba2

TERM_SOURCES = {
    "linear_attn/conv": "causal_conv1d_fn (modeling_qwen3_next.py:339-361; causal-conv1d's CausalConv1dFn on a GPU): "
                        "the conv's input, the padded output silu keeps",
    "linear_attn/gates": "beta = b.sigmoid(), g = -A_log.float().exp() * softplus(a.float() + dt_bias) "
                         "(Qwen3NextGatedDeltaNet.forward)",
    "linear_attn/delta_rule": "torch_chunk_gated_delta_rule (modeling_qwen3_next.py:371-510) on the CPU; fla "
                              "ChunkGatedDeltaRuleFunction's saved q, k, v, g, beta, A and rstd on a GPU",
    "linear_attn/norm": "Qwen3NextRMSNormGated.forward: fp32 input, rsqrt, normalised tensor, the gate's fp32 "
                        "copy, silu's output, the weighted tensor",
}


def gated_deltanet_terms(ctx: BlockContext) -> dict[str, int]:
    """A Gated DeltaNet block's mixer terms (the module docstring), replacing q/k norms and the attention core;
    the projections' inputs are ``activations._inputs``' (kind ``ATTN_IN``)."""
    model, mode, dims = ctx.model, ctx.mode, ctx.dims
    gdn = model.gated_deltanet
    assert gdn is not None
    t, b, s = dims.tokens, dims.b, dims.s
    # the projections' outputs (QLoRA's fp32 even under autocast) and the conv's (autocast's 16-bit); q, k, v
    # leave the conv in the projections' dtype (``out.to(hidden_states.dtype)``), and so does the mixer's output
    c, conv_bytes = mode.compute, HALF if mode.autocast else mode.compute
    terms = {"attention/out_input": out_input(ctx, t * gdn.value * c)}
    projections = [lin for lin in ctx.of_kind(LinearKind.ATTN_IN)]
    inner = ctx.full or ctx.block_input_needs_grad or any(ctx.targeted(lin) for lin in projections)
    if not inner:
        return terms
    cpu = ctx.kernels.name == "cpu"
    hv = gdn.v_heads
    conv = t * gdn.conv * conv_bytes  # its input (convolution_backward keeps input and weight whatever trains)
    if cpu:
        conv += b * gdn.conv * (s + gdn.kernel - 1) * conv_bytes  # the padded conv output silu keeps
        conv += gdn.conv * gdn.kernel * HALF if mode.autocast else 0  # the conv weight's autocast copy
    gates = t * hv * c + t * hv * FP32 + (t * hv * FP32 if ctx.full else 0) + hv * FP32 * (2 if ctx.full else 1)
    rule = _torch_rule_bytes(ctx, gdn) if cpu else _fla_rule_bytes(ctx, gdn)
    value = t * gdn.value
    norm = value * FP32 + t * hv * FP32 + (value * c if ctx.full else 0) + 2 * value * FP32 \
        + value * max(mode.weight, c)
    return terms | {"linear_attn/conv": conv, "linear_attn/gates": gates, "linear_attn/delta_rule": rule,
                    "linear_attn/norm": norm}


def _torch_rule_bytes(ctx: BlockContext, gdn: GatedDeltaNet) -> int:
    """torch_chunk_gated_delta_rule's saved tensors (the module docstring), every value head: P padded tokens,
    N chunks of C a sequence."""
    dims, autocast = ctx.dims, ctx.mode.autocast
    t, b, hv, dk, dv, chunk = dims.tokens, dims.b, gdn.v_heads, gdn.k_dim, gdn.v_dim, gdn.chunk
    n = -(-dims.s // chunk)
    p = b * n * chunk
    state = b * hv * dk * dv
    total = 2 * (t * hv * dk * FP32 + t * hv * FP32)  # l2norm of q and k: fp32 input, rsqrt
    total += p * hv * (dv + 1 + dk) * FP32  # padded v, beta and k (v * beta, k * beta)
    total += chunk * chunk  # the strictly-upper bool mask masked_fill keeps
    total += 2 * p * hv * chunk * FP32  # exp(pairwise decay); the UT system solve_triangular reads
    total += p * hv * dk * FP32 + p * hv * FP32  # k_beta and exp(cum_decay) of decayed_k_beta
    total += p * hv * (dv + dk) * FP32  # the two solves' results: new values, k_cumdecay
    total += p * hv * dk * FP32 + p * hv * FP32  # the scaled q and exp(cum_decay) the q decay keeps
    # the loop (chunk i: v_new = new_values_i - k_cumdecay_i @ state_i; out_i = q_i @ state_i + intra_i @ v_new;
    # state_i+1 = state_i * chunk_decay_i + k_iᵀ @ v_new). The last chunk's state update feeds nothing (the
    # final state is dropped: output_final_state False), so autograd frees what it saved; the first state is
    # zeros and needs no gradient, so the first chunk's ``@ state`` keeps the state alone
    if autocast:
        # fp32 states kept by ``state * chunk_decay`` (not the last), two 16-bit casts of every state, the
        # k_cumdecay and q slices of the chunks after the first, the intra-chunk slices, v_new for
        # ``intra @ v_new`` in every chunk and ``kᵀ @ v_new`` but in the last, the key slices but the last's
        total += (n - 1) * state * FP32 + 2 * n * state * HALF + 2 * (n - 1) * b * hv * chunk * dk * HALF
        total += p * hv * chunk * HALF + (2 * n - 1) * b * hv * chunk * dv * HALF + (n - 1) * b * hv * chunk * dk * HALF
        total += 2 * 2 * p * hv * dk * HALF  # k_beta @ kᵀ and q @ kᵀ: 16-bit casts of their operands
        total += 2 * p * hv * chunk * HALF  # both C x C products, 16-bit, which the decay multiplies keep
    else:
        # k_beta·kᵀ and q·kᵀ (the decay multiplies keep them) and the decayed q·kᵀ (the loop's matmul keeps it)
        total += 3 * p * hv * chunk * FP32
        # every state (k_cumdecay_i @ state_i keeps it), v_new; the decayed keys (and their exp) and q when a
        # chunk after the first reads them
        total += n * state * FP32 + p * hv * dv * FP32
        total += 2 * p * hv * dk * FP32 if n > 1 else 0
    total += p * hv * FP32 + b * hv * n * FP32  # exp of the key decay, the chunk decay
    return total


def _fla_rule_bytes(ctx: BlockContext, gdn: GatedDeltaNet) -> int:
    """fla's ChunkGatedDeltaRuleFunction.save_for_backward (the module docstring): q and k l2-normed in their
    16-bit dtype (fla refuses fp32: ``chunk_gated_delta_rule`` asserts ``q.dtype != torch.float32``) with their
    fp32 rstd, v, the fp32 cumsum of g, and A (T x Hv x 64 in k's dtype); beta is sigmoid's output, kept
    already."""
    t, hk, hv, c = ctx.dims.tokens, gdn.k_heads, gdn.v_heads, HALF
    return 2 * (t * hk * gdn.k_dim * c + t * hk * FP32) + t * gdn.value * c + t * hv * FP32 + t * hv * gdn.chunk * c


def mamba2_terms(ctx: BlockContext) -> dict[str, int]:
    """A Mamba2 block's mixer terms (NemotronHMamba2Mixer.forward, modeling_nemotron_h.py:467-614), replacing the
    attention core; in_proj's input is ``activations._inputs``' (kind ``ATTN_IN``).

    **Which path.** In training without a cache the mixer first calls ``mamba2_split_conv1d_scan_combined``
    (:487-512, ``@use_kernel_func_from_hub_with_fallback("mamba_split_conv1d_scan_combined", "mamba_ssm")``): with
    mamba-ssm installed (CUDA; NVIDIA's Nemotron-H model cards install mamba-ssm and causal-conv1d) that is
    mamba_ssm/ops/triton/ssd_combined.py ``MambaSplitConv1dScanCombinedFn``, which runs the conv, the scan, the
    gated norm and out_proj's matmul in one autograd node and ``save_for_backward(zxbcdt, conv1d_weight, conv1d_bias,
    out_x, A, D, dt_bias, initial_states, seq_idx, rmsnorm_weight, rstd, outproj_weight, outproj_bias)``: in_proj's
    whole output, the scan's output before the norm (x's dtype), the norm's fp32 rstd per group, and under autocast
    out_proj's 16-bit weight copy (counted with the autocast weight casts); out_proj's input is recomputed in the
    backward. It reads ``self.out_proj.weight`` directly, so a LoRA adapter on out_proj takes no part on that path.
    Without mamba-ssm (the CPU) the fallback returns None and the torch code runs: ``causal_conv1d_fn`` (:163-184),
    ``mamba2_chunk_scan`` (:273-387) and NemotronHRMSNormGated, whose tensors are the terms below (T = b·s tokens,
    P = b·s rounded up to the chunk, I = heads x head_dim; w: the einsums' operand dtype, 16-bit under CPU autocast
    which casts every einsum's bmm operands, else fp32 since the scan upcasts x, B, C and dt):

    * ``mamba/conv``: as the Gated DeltaNet's (the conv's 16-bit input cast and weight copy under autocast, the padded
      output silu keeps); without autocast the conv reads a view of in_proj's output, which it keeps whole (gate
      and dt included);
    * ``mamba/gates``: softplus's input and clamp's (dt's dtype), the fp32 ``dt.float()`` the two products keep (two
      copies of a 16-bit dt when A_log trains, else one, or dt itself), A (and exp's result when A_log trains);
    * ``mamba/scan``: x's fp32 copy (or the conv output it views), the padded x ``D`` multiplies (when D trains),
      the two C x C segment-sum masks a segment sum, the exp of the intra-chunk decays L (P x heads x C), the
      operand copies of the five einsums (C and B for G, G itself, M and x for Y_diag, x and B·decay for the chunk
      states, the decay_chunk and states for the inter-chunk pass, C and the chunk states for Y_off), B in fp32,
      the three exps of the decays, and C·states the Y_off product keeps;
    * ``mamba/norm``: the gated RMSNorm's fp32 gate copy (16-bit projections), the scan output (P x I, fp32),
      silu's output, the product, the rsqrt per group and, when its weight trains, the normalised tensor;
    * ``attention/out_input``: out_proj's input (autocast's cast of the fp32 norm output, or ``.to(dtype)``'s).

    Measured per layer with saved_tensors_hooks (tests/memory/test_mamba2.py)."""
    model, mode, dims = ctx.model, ctx.mode, ctx.dims
    m = model.mamba2
    assert m is not None
    t, b, s = dims.tokens, dims.b, dims.s
    c = mode.compute  # in_proj's output dtype (QLoRA's fp32 even under autocast): x, B, C, dt and the gate
    cpu = ctx.kernels.name == "cpu"
    terms = {"attention/out_input": out_input(ctx, t * m.inner * c) if cpu else 0}
    inner = ctx.full or ctx.block_input_needs_grad or any(ctx.targeted(lin) for lin in ctx.of_kind(LinearKind.ATTN_IN))
    if not inner:
        return terms
    a_log = m.heads * FP32 * (2 if ctx.full else 1)  # A the dt product keeps; exp(A_log)'s result when it trains
    if not cpu:
        # MambaSplitConv1dScanCombinedFn: zxbcdt and out_x in the projections' dtype, rstd fp32 per group
        return terms | {"mamba/gates": a_log, "mamba/scan": t * (m.projection + m.inner) * c,
                        "mamba/norm": t * m.groups * FP32}
    if mode.autocast:
        conv = t * m.conv * HALF + b * m.conv * (s + m.kernel - 1) * HALF + m.conv * m.kernel * HALF
    else:
        conv = t * m.projection * c + b * m.conv * (s + m.kernel - 1) * c
    # softplus's and clamp's inputs; the fp32 dt ``x * dt`` keeps, and a second ``.float()`` copy ``A * dt`` keeps for
    # A's gradient (A_log trains) when dt is 16-bit (else both keep dt itself)
    dt = 2 * t * m.heads * c + t * m.heads * FP32 * (2 if c != FP32 and ctx.full else 1)
    # silu keeps the gate's fp32 copy, or the fp32 gate itself, a view of in_proj's output, which the autocast conv
    # keeps none of (a 16-bit cast instead: QLoRA's fp32 projections)
    gate_copy = t * m.inner * FP32 if c != FP32 else t * m.projection * FP32 if mode.autocast else 0
    padded = -(-s // m.chunk) * m.chunk * b
    norm = gate_copy + padded * m.inner * FP32 + 2 * t * m.inner * FP32 + t * m.groups * FP32
    norm += t * m.inner * FP32 if ctx.full else 0
    return terms | {"mamba/conv": conv, "mamba/gates": dt + a_log, "mamba/scan": _torch_scan_bytes(ctx, m),
                    "mamba/norm": norm}


def _torch_scan_bytes(ctx: BlockContext, m: Mamba2) -> int:
    """mamba2_chunk_scan's saved tensors on the torch path (``mamba2_terms``), n chunks of C, P padded tokens."""
    dims, autocast = ctx.dims, ctx.mode.autocast
    t, b, s, hm, n_state, chunk = dims.tokens, dims.b, dims.s, m.heads, m.state, m.chunk
    w = HALF if autocast else FP32
    n = -(-s // chunk)
    p = b * n * chunk
    # x.float()'s copy of a 16-bit x, or the fp32 conv output x views (QLoRA: the conv's ``.to(float32)`` copy)
    total = t * m.inner * FP32 if ctx.mode.compute != FP32 else t * m.conv * FP32
    total += p * m.inner * FP32 if ctx.full else 0  # D * pad(x), for D's gradient
    total += 2 * chunk * chunk + 2 * (n + 1) ** 2  # segment_sum's two ~mask, twice
    total += p * hm * chunk * FP32  # L = exp(segment_sum(A))
    total += 2 * p * hm * n_state * w + p * hm * chunk * w  # G = einsum(C, B): both operands; G the mask product keeps
    total += p * hm * chunk * w + p * m.inner * w  # Y_diag = einsum(M, x)
    total += p * hm * n_state * FP32 + p * hm * FP32  # B * decay_states: B (fp32, repeated to the heads), the exp
    total += p * m.inner * w + p * hm * n_state * w  # states = einsum(B_decay, x)
    chunk_states = b * hm * m.head_dim * n_state
    total += b * hm * (n + 1) ** 2 * FP32 + (b * hm * (n + 1) ** 2 * HALF if autocast else 0)  # decay_chunk
    total += (n + 1) * chunk_states * w  # new_states = einsum(decay_chunk, states)
    total += p * hm * FP32  # state_decay_out = exp(A_cumsum)
    total += p * hm * n_state * w + n * chunk_states * w  # C_times_states = einsum(C, states)
    total += p * m.inner * w  # Y_off = C_times_states * state_decay_out keeps C_times_states
    return total


__all__ = ["TERM_SOURCES", "gated_deltanet_terms", "mamba2_terms"]
