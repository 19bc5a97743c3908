"""Activations: the tensors autograd keeps for backward, block by block, as named terms.

What "saved for backward" means is taken from the code that runs: per transformer block we list
the tensors autograd keeps (``torch.autograd.graph.saved_tensors_hooks`` on transformers 5.x
shows exactly these), e.g. for a Llama block under bf16 autocast: the fp32 input and the fp32
normalised activations of both RMSNorms, one bf16 cast of the normed input per q/k/v/gate/up
projection (autocast casts per call), q/k/v/out and the fp32 log-sum-exp of SDPA, and the four
b·s·intermediate tensors of the SwiGLU MLP. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", eq. 1: 34·s·b·h + 5·a·s²·b bytes per layer in 16-bit
with dropout) is the same accounting for Megatron's GPT block; we follow the HF modules instead,
since those are what users fine-tune.

Autograd saves an operand only when the other operand needs a gradient (the codegen checks
``should_compute_output``): with LoRA, frozen weights save nothing for their own input. Each
term's source is in ``TERM_SOURCES``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from planner.config import Attention, Method, TrainConfig
from planner.gpus import CPU_KERNELS, CUDA_KERNELS, KernelProfile
from planner.memo import IdentityMemo
from planner.memory import moe, recurrent
from planner.memory.attention import attention_terms, effective_attention, out_input, padding_mask
from planner.memory.dtypes import FP32, HALF, INT64, DtypeMode, fp8_converts, mode_of
from planner.memory.parameters import lora_targets
from planner.memory.shapes import BlockContext, Dims, block_context, block_input_needs_grad, dims_of
from planner.modelspec import LATENT_UP, LinearKind, LinearSpec, ModelSpec

#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search's batch lines read these thousands of times
_ATTN_IN, _MLP_IN, _MLP_OUT = LinearKind.ATTN_IN, LinearKind.MLP_IN, LinearKind.MLP_OUT
_CROSS_ATTN_IN, _ROUTER, _SHARED_GATE = LinearKind.CROSS_ATTN_IN, LinearKind.ROUTER, LinearKind.SHARED_GATE
_FULL, _QLORA, _SDPA = Method.FULL, Method.QLORA, Attention.SDPA

#: Intermediate-sized tensors an MLP activation (transformers' ACT2FN) saves for its backward,
#: besides its output, counted with saved_tensors_hooks (transformers 5.23, torch 2.13). Fused
#: kernels save their input (derivatives.yaml: gelu_backward(grad, self)); the Python ones save
#: every operand of their tensor-tensor products, e.g. NewGELUActivation x, tanh(.), 0.5·x and
#: 1 + tanh(.) (also seen on gpt2 with the CPU probe).
ACTIVATION_SAVED = {
    "silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "mish": 1, "relu2": 1, "relu6": 1,
    "leaky_relu": 1, "laplace": 1, "gelu_10": 2, "quick_gelu": 2, "gelu_python": 3, "gelu_new": 4,
    "gelu_accurate": 4, "gelu_python_tanh": 4, "gelu_fast": 7, "relu": 0, "tanh": 0, "sigmoid": 0,
    "linear": 0,
}
#: Activations whose backward reads their own output: it stays saved even when nothing after
#: them needs it (a frozen fc2).
ACTIVATION_SAVES_OUTPUT = frozenset({"relu", "tanh", "sigmoid"})
#: What an activation missing from ACTIVATION_SAVED is assumed to save (a fused kernel's input);
#: estimate_memory states the assumption.
ACTIVATION_SAVED_DEFAULT = 1

#: Where each activation term comes from (the breakdown's keys without ``activations/``).
TERM_SOURCES = {
    "norms": "LlamaRMSNorm.forward (fp32 input + rsqrt; normalised tensor when the weight trains); "
             "native_layer_norm saves input, mean, rstd (derivatives.yaml)",
    "attention/qkv_input": "F.linear saves its input for the weight gradient; autocast casts per call",
    "attention/qk_norms": "q_norm/k_norm RMSNorms on the q and k projections (Qwen3Attention.forward, "
                          "Olmo2Attention.forward, Gemma3Attention.forward): fp32 input + rsqrt, normalised tensor",
    "attention/core": "SDPA/flash: q, k, v, out, fp32 logsumexp (integrations/sdpa_attention.py); eager: "
                      "eager_attention_forward",
    "attention/latent": "multi-head latent attention's q_a/kv_a RMSNorms and the q_b/kv_b projections' inputs "
                        "(DeepseekV3Attention.forward; attention.latent_attention_terms)",
    "attention/probs": "eager attention's softmax output, its cast, dropout mask (eager_attention_forward)",
    "attention/out_input": "o_proj's input when it is a contiguous copy of the kernel's output",
    "mlp/input": "gate/up/fc1 inputs (F.linear)",
    "mlp/intermediate": "ACT2FN saved tensors, act*up operands, down_proj's input (LlamaMLP)",
    "dropout": "dropout masks (aten Dropout.cpp)",
    "lora/activations": "lora_B saves lora_A's output (peft LoraLayer.forward)",
    "lora/dropout": "lora_dropout > 0: each adapter's nn.Dropout(x) keeps its mask (aten Dropout.cpp: bool on CUDA's fused "
                    "kernel, the input's dtype on the CPU) and lora_A keeps the dropped copy where it saves no cast of it "
                    "(peft/tuners/lora/layer.py Linear.forward: lora_B(lora_A(dropout(x))), one dropout per adapter)",
    "autocast/weight_casts": "16-bit weight copies F.linear saves under autocast",
    "autocast/fp8_first_linear": "fp8: the model's first linear, which accelerate leaves unconverted, keeps its "
                                 "16-bit weight cast (accelerate utils/ao.py filter_first_and_last_linear_layers)",
    "fp8/casts": "fp8: a float8 linear's backward casts (torchao float8_linear.py backward; activations.fp8_cast_terms)",
    "lora/weight_casts": "16-bit copies of the fp32 adapters under autocast",
    "checkpoints": "torch.utils.checkpoint (non-reentrant) keeps each block's input",
    "recompute": "one block's saved tensors rebuilt during backward under checkpointing",
    "recompute_locals": "the recomputed block's forward tensors nothing saves, alive where the recompute stops "
                        "(activations.recompute_end_terms)",
    "block_backward": "the backward of the last block (the first backward reaches): the gradient of its output and the "
                      "MLP's gradients at the activation product (block_backward_terms)",
    "embeddings": "int64 token ids (embedding backward), rotary cos/sin, embedding LayerNorm input",
    "lm_head/transform": "BertPredictionHeadTransform's gelu input",
    "final_norm": "the final norm's saved tensors",
    "lm_head/input": "lm_head's input (F.linear)",
    "loss/log_softmax": "cross_entropy = log_softmax + nll_loss: fp32 log-probabilities and int64 labels "
                        "(transformers/loss/loss_utils.py ForCausalLMLoss; transformers <= 4.45: of the shifted "
                        "positions, activations.shifted_loss)",
    "loss/softcap": "final_logit_softcapping: tanh(logits / cap) keeps its output (Gemma4ForCausalLM.forward)",
    "loss/fused_grad_input": "fused linear cross-entropy: the gradient of the head's input, computed in the forward "
                             "and saved for backward (Liger ops/fused_linear_cross_entropy.py: grad_input = "
                             "torch.zeros_like(_input), ctx.save_for_backward(grad_input, ...))",
    "moe/aux_loss": "output_router_logits: load_balancing_loss_func's fp32 softmax over every MoE layer's router logits",
    "attention/output_gate": "attn_output * sigmoid(gate) (Qwen3NextAttention.forward): sigmoid's output",
    **moe.TERM_SOURCES,
    **recurrent.TERM_SOURCES,
}


def _norm_bytes(ctx: BlockContext, input_needs_grad: bool) -> int:
    """One norm: RMSNorm's x.to(fp32) -> pow -> mean -> rsqrt -> x*rsqrt -> weight * (.).to(dtype)
    saves the fp32 input and rsqrt when the input needs a gradient, the normalised tensor (model
    dtype) when the weight does; LayerNorm its input and the fp32 mean and rstd."""
    e, h, model = ctx.dims.tokens, ctx.dims.h, ctx.model
    if model.norm == "rmsnorm":
        total = e * h * FP32 + e * FP32 * model.norm_row_stats if input_needs_grad else 0
        if ctx.full:
            total += e * h * (FP32 if model.norm_weight_fp32 else ctx.mode.residual)
        return total
    return e * h * ctx.mode.residual + 2 * e * FP32 if input_needs_grad or ctx.full else 0


def _norms(ctx: BlockContext) -> int:
    """The block's norms over the hidden size (``ModelSpec.norm_placement``): before the sublayers
    (reading the residual stream), after them (reading the sublayers' outputs), or both."""
    placement, total = ctx.model.norm_placement, 0
    if placement == "single":
        # NemotronHRMSNorm (modeling_nemotron_h.py:626-634): ``self.weight.to(torch.float32) * hidden_states`` keeps
        # the fp32 copy of a 16-bit weight for the input's gradient
        weight_copy = ctx.dims.h * FP32 if ctx.block_input_needs_grad and ctx.mode.weight != FP32 else 0
        return _norm_bytes(ctx, ctx.block_input_needs_grad) + weight_copy
    if placement != "post":
        total += _norm_bytes(ctx, ctx.block_input_needs_grad)
        if not ctx.model.parallel_block:
            total += _norm_bytes(ctx, ctx.block_input_needs_grad or ctx.attn_targeted)
    if placement != "pre":
        # the attention output needs a gradient when anything before it trains; the MLP output
        # when anything in the block does
        attn_grad = ctx.block_input_needs_grad or ctx.attn_targeted
        total += _output_norm_bytes(ctx, attn_grad) + _output_norm_bytes(ctx, attn_grad or bool(ctx.targeted_kinds))
    return total


def _output_norm_bytes(ctx: BlockContext, input_needs_grad: bool) -> int:
    """One RMSNorm on a sublayer's output (Gemma 2/3's post_attention_layernorm and
    post_feedforward_layernorm, OLMo 2's): as ``_norm_bytes``, but its input is the projection's
    output, so the normalised tensor it saves for the weight's gradient is cast back to the
    projections' dtype (``self.weight * hidden_states.to(input_dtype)``, modeling_olmo2.py
    Olmo2RMSNorm.forward; Gemma keeps it fp32: ``output * (1.0 + self.weight.float())``)."""
    e, h = ctx.dims.tokens, ctx.dims.h
    total = e * h * FP32 + e * FP32 * ctx.model.norm_row_stats if input_needs_grad else 0
    if ctx.full:
        total += e * h * (FP32 if ctx.model.norm_weight_fp32 else ctx.mode.compute)
    return total


def _qk_norms(ctx: BlockContext) -> int:
    """q_norm and k_norm (``ModelSpec.qk_norm``), RMSNorms on the q and k projections' outputs
    (modeling_qwen3.py Qwen3Attention.forward ``self.q_norm(self.q_proj(hidden_states).view(
    hidden_shape))``; modeling_olmo2.py ``self.q_norm(self.q_proj(hidden_states))``; modeling_gemma3.py
    Gemma3Attention.forward): each saves its fp32 input and one fp32 rsqrt per normalised row (a
    head's head_dim, or OLMo 2's whole projection; ``ModelSpec.norm_row_stats`` of them) when its
    input needs a gradient (the projection trains, is adapted, or reads a tensor that needs one), and
    the normalised tensor in the projection's dtype (Gemma: fp32) when its weight trains. Measured on a
    tiny qwen3 (bf16-mixed, full): 300,176 B over two blocks against 301,056 B here.

    Gemma 4's weightless ``v_norm`` (modeling_gemma4.py:1222-1223, Gemma4RMSNorm ``with_scale=False``)
    saves its fp32 input and row statistics likewise, and no normalised tensor; on a full-attention layer
    with ``attention_k_eq_v`` it reads k_proj's raw output, whose fp32 copy in an fp32 model is the tensor
    k_norm keeps already (``.float()`` returns it)."""
    model, e, dims = ctx.model, ctx.dims.tokens, ctx.dims
    total = 0
    for heads, proj in ((dims.a, "q_proj"), (dims.kv, "k_proj")):
        if not (ctx.block_input_needs_grad or proj in ctx.targets):
            continue
        rows = 1 if model.qk_norm == "projection" else heads
        total += e * heads * dims.d * FP32 + e * rows * FP32 * model.norm_row_stats
        if ctx.full and model.qk_norm != "l2":  # Llama 4's L2 norm has no weight
            total += e * heads * dims.d * (FP32 if model.norm_weight_fp32 else ctx.mode.compute)
    if model.v_norm:
        source = "v_proj" if any(lin.name == "v_proj" for lin in model.layer_linears) else "k_proj"
        if ctx.block_input_needs_grad or source in ctx.targets:
            shared = source == "k_proj" and ctx.mode.compute == FP32
            total += (0 if shared else e * dims.kv * dims.d * FP32) + e * dims.kv * FP32 * model.norm_row_stats
    return total


def _output_gate_terms(ctx: BlockContext) -> dict[str, int]:
    """Qwen3-Next's gated attention (Qwen3NextAttention.forward, modeling_qwen3_next.py:275-303): ``q_proj``
    gives q and a gate, ``attn_output * torch.sigmoid(gate)`` keeps sigmoid's output and the attention output
    (``reshape(...).contiguous()`` of the kernel's transposed output: its own storage), and o_proj reads the product, a new tensor (``out_input``), all in
    the projections' output dtype. In an fp32 model q_norm's ``.float()`` is the strided half of q_proj's
    output, which keeps the whole output (q and gate) saved: one more q-sized tensor."""
    dims, mode = ctx.dims, ctx.mode
    q = dims.tokens * dims.a * dims.d
    needs = ctx.block_input_needs_grad or bool(ctx.attn_targeted)
    # sigmoid's output (the gate is q_proj's: the projections' dtype) and the attention output the product
    # reads, the reshaped copy of the kernel's (b, a, s, d) output (measured: a storage apart from what SDPA
    # keeps), in the kernel's dtype; the product in the wider of the two
    gate = q * (mode.compute + mode.attn) if needs else 0
    if mode.compute == FP32 and not mode.autocast and (ctx.block_input_needs_grad or "q_proj" in ctx.targets):
        gate += q * FP32
    return {"attention/output_gate": gate, "attention/out_input": out_input(ctx, q * max(mode.compute, mode.attn))}


def _inputs(ctx: BlockContext, kind: LinearKind) -> int:
    """Input copies saved by the linears of a group reading the same (normed) tensor: under
    autocast one 16-bit copy per linear, else the shared tensor; with LoRA only the adapted ones."""
    e, h, mode = ctx.dims.tokens, ctx.dims.h, ctx.mode
    if ctx.full:
        # modules only: an MoE block's expert stacks save their gathered slots (moe.expert_bytes)
        return e * 2 * sum([lin.in_features for lin in ctx.of_kind(kind) if lin.module]) if mode.autocast \
            else e * h * mode.compute
    if kind not in ctx.targeted_kinds:
        return 0
    if mode.adapter_input:
        return e * mode.adapter_input * sum([lin.in_features for lin in ctx.adapted_of(kind)])
    # lora_A saves the shared normed tensor, or with dropout each its own dropped copy (lora/dropout);
    # MLA's q_b_proj and kv_b_proj read their latents instead (attention.latent_attention_terms)
    reads_x = any(lin.name not in LATENT_UP for lin in ctx.adapted_of(kind))
    return e * h * mode.residual if ctx.adapter_saves_shared_input and reads_x else 0


def _mlp_intermediate(ctx: BlockContext) -> int:
    """Gated: act(gate) saves what ACTIVATION_SAVED says, act*up saves act's output and up, down
    saves the product (LlamaMLP); plain: the activation's own tensors, fc2 saves its output. A
    frozen, unadapted down/fc2 computes no weight gradient, so it saves no input (LoRA on the
    attention projections only; measured on mistral), unless the activation keeps its output."""
    model, mode = ctx.model, ctx.mode
    inter = ctx.dims.tokens * ctx.dims.i * mode.compute
    act_saved = ACTIVATION_SAVED.get(model.hidden_act, ACTIVATION_SAVED_DEFAULT)
    # a targeted down saves the product unless, with dropout and no cast, lora_A saves its dropped copy
    down_needs_input = ctx.full or (_MLP_OUT in ctx.targeted_kinds
                                    and (ctx.adapter_saves_shared_input or bool(mode.adapter_input)))
    if model.gated_mlp:
        saved_tensors = act_saved + 2 + (1 if down_needs_input else 0)
    else:
        saved_tensors = act_saved + (1 if down_needs_input or model.hidden_act in ACTIVATION_SAVES_OUTPUT else 0)
    total = saved_tensors * inter
    if not ctx.full and mode.adapter_input:
        down = ctx.adapted_of(_MLP_OUT)
        total += ctx.dims.tokens * (mode.adapter_input - mode.compute) * sum([lin.in_features for lin in down])
    return total


def _shared_ctx(ctx: BlockContext) -> BlockContext:
    """The block's context at its shared expert's intermediate size (what ``_mlp_intermediate`` reads)."""
    return ctx._but(dims=dataclasses.replace(ctx.dims, i=moe.shared_intermediate(ctx.model)))


def _shared_expert_terms(ctx: BlockContext) -> dict[str, int]:
    """A shared expert beside the routed ones (Qwen2MoeSparseMoeBlock.forward, modeling_qwen2_moe.py:340-351:
    ``shared_expert(x)``, a SwiGLU Qwen2MoeMLP of ``shared_expert_intermediate_size`` on the block's normed
    input, then ``F.sigmoid(self.shared_expert_gate(x)) * shared_expert_output``):

    * ``moe/shared_input``: what gate_proj, up_proj and shared_expert_gate save of x: under autocast a
      16-bit cast each (full) or each adapter's cast; without autocast x itself, which the router's
      F.linear already saves when the router trains (``moe.router_bytes``), else lora_A keeps it;
    * ``moe/shared_intermediate``: the SwiGLU's tensors as a dense MLP's (``_mlp_intermediate``);
    * ``moe/shared_gate``: sigmoid's output (T, its backward reads it; the product keeps the same tensor),
      and the shared expert's output (T x H, the product's other operand) when the gate needs a gradient,
      both in the projections' output dtype."""
    model, mode, e, h = ctx.model, ctx.mode, ctx.dims.tokens, ctx.dims.h
    linears = moe.shared_expert(model)
    reading = [lin for lin in linears if lin.kind is not _MLP_OUT]
    adapted = [lin for lin in reading if ctx.targeted(lin)]
    out_bytes = HALF if mode.autocast else mode.compute
    if ctx.full and mode.autocast:
        inputs = e * 2 * sum([lin.in_features for lin in reading])
    elif ctx.full:
        # x itself, unless the router's F.linear keeps it already (not DeepSeek-V3's fp32 copy of it)
        inputs = 0 if moe.router_input_saved(ctx) else e * h * mode.residual
    elif not adapted:
        inputs = 0
    elif mode.adapter_input:
        inputs = e * mode.adapter_input * sum([lin.in_features for lin in adapted])
    else:
        router_keeps_x = moe.router_input_saved(ctx) and not mode.autocast
        inputs = e * h * mode.residual if ctx.adapter_saves_shared_input and not router_keeps_x else 0
    gate = next((lin for lin in linears if lin.kind is _SHARED_GATE), None)
    shared = {"moe/shared_input": inputs, "moe/shared_intermediate": _mlp_intermediate(_shared_ctx(ctx))}
    if gate is None:
        # DeepseekV3MoE.forward (modeling_deepseek_v3.py:221): ``hidden_states + self.shared_experts(residuals)``
        return shared
    x_grad = ctx.input_needs_grad(gate)
    gate_grad = ctx.full or ctx.targeted(gate) or x_grad
    shared_grad = ctx.full or any(ctx.targeted(lin) for lin in linears) or x_grad
    gate_terms = (e * out_bytes if gate_grad or shared_grad else 0) + (e * h * out_bytes if gate_grad else 0)
    return shared | {"moe/shared_gate": gate_terms}


def _lora_activations(ctx: BlockContext) -> int:
    """lora_B saves lora_A's output (tokens x r) in the adapters' compute dtype (``DtypeMode.adapter``)."""
    r = ctx.config.lora_r or 0
    a_bytes = ctx.mode.adapter
    return ctx.dims.tokens * r * a_bytes * sum([lin.active for lin in ctx.adapted])


def _dropped_bytes(ctx: BlockContext, lin: LinearSpec) -> int:
    """The dtype dropout runs in: peft's Linear casts its input to the adapter's dtype first
    (LoraLayer._cast_input_dtype in Linear.forward; fp32, or 16-bit in a model cast with its
    adapters: ``DtypeMode.adapter_weight``); bnb's Linear4bit LoRA casts only outside
    autocast (peft/tuners/lora/bnb.py: requires_conversion = not torch.is_autocast_enabled()), so
    under CUDA autocast QLoRA drops the input as it comes: the residual stream's dtype before q/k/v
    and gate/up (and an MoE router and a cross-attention's q/k/v, which read the normed stream or
    the encoder output), the attention output's before o_proj, the MLP product's before down. That
    query asks CUDA's autocast state only (KernelProfile.plain_autocast_query): on the CPU bnb
    casts too."""
    if ctx.config.method is not _QLORA or not ctx.mode.autocast or not ctx.kernels.plain_autocast_query:
        return ctx.mode.adapter_weight
    kind = lin.kind
    if kind in (_ATTN_IN, _MLP_IN, _ROUTER, _SHARED_GATE, _CROSS_ATTN_IN):
        return ctx.mode.residual
    return ctx.mode.compute if kind is _MLP_OUT else ctx.mode.attn  # (ATTN_OUT, CROSS_ATTN_OUT)


def _lora_dropout(ctx: BlockContext, kinds: frozenset[LinearKind] | None = None) -> int:
    """Bytes of ``lora_dropout_tensors``."""
    return sum(lora_dropout_tensors(ctx, kinds))


def lora_dropout_tensors(ctx: BlockContext, kinds: frozenset[LinearKind] | None = None) -> tuple[int, ...]:
    """Per adapted linear (its own nn.Dropout, also where q, k and v read one tensor), in forward
    order: the mask, kept when the input needs a gradient (autograd records dropout only then),
    and the dropped copy where lora_A saves it as it is; each a tensor of its own (bytes), as the
    allocator replay places them. Under autocast lora_A saves a 16-bit cast of the dropped copy
    instead of one of x (the same bytes, counted with the inputs) and pure 16-bit saves the fp32
    dropped copy instead of the fp32 cast (same): there only the mask is new."""
    out: list[int] = []
    for lin in ctx.adapted:
        if kinds is not None and lin.kind not in kinds:
            continue
        n = ctx.dims.tokens * lin.in_features
        dropped = _dropped_bytes(ctx, lin)
        for _ in range(lin.active):
            if ctx.input_needs_grad(lin):
                out.append(n * ctx.kernels.dropout_mask_bytes(dropped))
            if not ctx.mode.adapter_input:
                out.append(n * dropped)
    return tuple(size for size in out if size)


def block_tensors(ctx: BlockContext) -> dict[str, tuple[int, ...]]:
    """The tensors (bytes, in the order they are made) of the ``block_terms`` whose tensors are
    known apart from one hidden state's size, for the allocator replay (``planner.memory.timeline``):
    LoRA dropout's masks (1 byte an element) and copies, one pair per adapted linear."""
    if ctx.targets and ctx.lora_dropout:
        return {"lora/dropout": lora_dropout_tensors(ctx)}
    return {}


#: ``_weight_casts`` by what it reads: the model, autocast, fp8, method, LoRA rank, targets and whether
#: the block's input needs a gradient. None of it reads the tokens: a batch line's two evaluations, and
#: the search's lines of one method and adapters, share it (four calls to each of ~156 lines a search)
_WEIGHT_CASTS = IdentityMemo(kept=256)


def _weight_casts(ctx: BlockContext) -> dict[str, int]:
    """``_casts_kept`` of ``ctx``, remembered (the callers read it, never change it)."""
    mode, config, model = ctx.mode, ctx.config, ctx.model
    key = (mode.autocast, mode.fp8, config.method, config.lora_r, ctx.targets, ctx.block_input_needs_grad)
    hit = _WEIGHT_CASTS.get(model, key)
    return hit if hit is not None else _WEIGHT_CASTS.put(model, key, _casts_kept(ctx))


def _casts_kept(ctx: BlockContext) -> dict[str, int]:
    """Autocast: the 16-bit weight copies F.linear saves for backward (not for 4-bit weights),
    and the fp32 adapters' casts: B's copy always (lora_A's output needs a gradient), A's when the
    adapter's input does (measured on a tiny llama: 9 A and 14 B copies over two blocks, the first
    block's q/k/v A copies missing)."""
    out = {}
    if not ctx.mode.autocast:
        return out
    # not the expert stacks: grouped_mm is not autocast-enabled (moe.is_expert_stack); Llama 4's bmm is, and
    # QLoRA's 4-bit modules are not cast, but its bare expert stacks (unquantised) are
    dense, qlora = moe.dense_experts(ctx.model), ctx.config.method is _QLORA
    if not qlora or dense:
        # a frozen weight's cast is kept only when the linear's input needs a gradient (mm saves the
        # other operand of the one that does): in the first LoRA block, none of the linears before the
        # first adapter (measured on a small T5 with wi/wo adapters: the first encoder block's o and wi
        # casts are not kept)
        # fp8: a converted linear keeps no 16-bit cast of its weight (DtypeMode.fp8)
        fp8 = ctx.mode.fp8
        out["autocast/weight_casts"] = 2 * sum([
            lin.count * lin.in_features * lin.out_features for lin in ctx.model.layer_linears
            if (ctx.full or ctx.input_needs_grad(lin)) and (dense if moe.is_expert_stack(lin) else not qlora)
            and not (fp8 and fp8_converts(ctx.model, lin))
        ])
    if ctx.targets:
        r = ctx.config.lora_r or 0
        out["lora/weight_casts"] = 2 * r * sum([
            lin.count * (lin.out_features + (lin.in_features if ctx.input_needs_grad(lin) else 0))
            for lin in ctx.adapted
        ])
    return out


def block_terms(ctx: BlockContext) -> dict[str, int]:
    """Bytes one transformer block keeps for backward, by term (see ``TERM_SOURCES``)."""
    e, h, mixer = ctx.dims.tokens, ctx.dims.h, ctx.model.mixer
    out = {"norms": _norms(ctx)}
    if mixer != "none":  # a Nemotron-H MLP or MoE block has no token mixer
        out["attention/qkv_input"] = _inputs(ctx, _ATTN_IN)
    if mixer == "gated_deltanet":
        out.update(recurrent.gated_deltanet_terms(ctx))
    elif mixer == "mamba2":
        out.update(recurrent.mamba2_terms(ctx))
    elif mixer == "attention":
        if ctx.model.qk_norm:
            out["attention/qk_norms"] = _qk_norms(ctx)
        out.update(attention_terms(ctx))
        if not (ctx.block_input_needs_grad or _ATTN_IN in ctx.targeted_kinds):
            # q, k and v need no gradient (a first LoRA block adapting none of them): the attention
            # keeps nothing; o's adapter still keeps its input (attention/out_input)
            out.pop("attention/core", None)
            out.pop("attention/probs", None)
        if ctx.model.attn_output_gate:
            out.update(_output_gate_terms(ctx))
    if moe.is_moe_block(ctx.model):
        out.update(moe.moe_block_terms(
            ctx, act_saved=ACTIVATION_SAVED.get(ctx.model.hidden_act, ACTIVATION_SAVED_DEFAULT),
            keeps_output=ctx.model.hidden_act in ACTIVATION_SAVES_OUTPUT))
        if ctx.model.routing is not None and ctx.model.routing.parallel_experts:
            # Gemma 4: a dense MLP beside the experts (its own normed input), as a dense block's
            dense = _shared_ctx(ctx)
            out["mlp/input"] = _inputs(dense, _MLP_IN)
            out["mlp/intermediate"] = _mlp_intermediate(dense)
        elif moe.shared_expert(ctx.model):
            out.update(_shared_expert_terms(ctx))
    elif ctx.model.has_mlp:
        out["mlp/input"] = _inputs(ctx, _MLP_IN)
        out["mlp/intermediate"] = _mlp_intermediate(ctx)
    if ctx.model.hidden_dropout > 0:
        # dropout on the attention and MLP outputs keeps only its mask (the residual add that
        # reads the output saves nothing), in the projections' output dtype
        # (each only when its sublayer's output needs a gradient: not in a first LoRA block before its
        # first adapter)
        outputs = (ctx.block_input_needs_grad or ctx.attn_targeted) + (ctx.block_input_needs_grad or bool(ctx.targeted_kinds))
        out["dropout"] = outputs * e * h * ctx.kernels.dropout_mask_bytes(ctx.mode.compute)
    if ctx.targets:
        out["lora/activations"] = _lora_activations(ctx)
        if ctx.lora_dropout:
            out["lora/dropout"] = _lora_dropout(ctx)
    out.update(_weight_casts(ctx))
    return out


def model_level_terms(model: ModelSpec, config: TrainConfig, dims: Dims, mode: DtypeMode,
                      kernels: KernelProfile) -> dict[str, int]:
    """Tensors saved outside the blocks: token ids, rotary tables, final norm, lm_head, loss."""
    e, h = dims.tokens, dims.h
    full = config.method is _FULL
    out = {"embeddings": e * INT64}  # int64 token ids kept by the embedding backward
    if model.position == "rope":
        # cos and sin (1, s, head_dim) in the residual dtype, shared by all blocks
        # (MLA ropes qk_rope_head_dim of each head: DeepseekV3RotaryEmbedding, its config's head_dim)
        rope = model.latent_attention.rope if model.latent_attention else dims.d
        # one table per head dim (Gemma 4: Gemma4TextRotaryEmbedding per layer type, each its layers' head dim)
        rope += sum({g.head_dim for g in model.other_blocks if g.head_dim and g.head_dim != model.head_dim})
        out["embeddings"] += 2 * dims.s * rope * mode.residual
    if model.embedding_norm:
        # the LayerNorm saves its input, the summed embeddings (in the residual dtype)
        out["embeddings"] += e * h * mode.residual
    if model.is_encoder:
        # the masked-LM head's transform: dense -> gelu -> LayerNorm before the decoder; gelu
        # saves the dense output (BertPredictionHeadTransform), the norm is counted as final_norm
        out["lm_head/transform"] = e * h * mode.compute
    if padding_mask(config) and not model.is_encoder:
        # transformers' 4D mask from the padding (masking_utils.create_causal_mask): (b, 1, s, s),
        # bool for SDPA, additive in the model's dtype for eager; made before the first block and
        # kept by every block's attention backward
        mask = 1 if effective_attention(model, config) is _SDPA else mode.residual
        out["embeddings"] += dims.b * dims.s * dims.s * mask
    if model.embedding_dropout > 0 and (full or config.grad_ckpt):
        # its mask, kept only when the embeddings' output needs a gradient: trained embeddings,
        # or peft's enable_input_require_grads under checkpointing
        out["dropout"] = e * h * kernels.dropout_mask_bytes(mode.residual)
    if model.norm == "rmsnorm":
        normalised = FP32 if model.norm_weight_fp32 else mode.residual
        out["final_norm"] = e * h * FP32 + e * FP32 * model.norm_row_stats + (e * h * normalised if full else 0)
    else:
        out["final_norm"] = e * h * mode.residual + 2 * e * FP32
    if config.fused_ce:
        # the head and the loss run without autograd inside the fused function: no lm_head input,
        # weight cast or log-probabilities are saved, only the precomputed input gradient, in the
        # dtype of the final norm's output (the residual stream's)
        out["loss/fused_grad_input"] = e * h * mode.residual
        return out
    if head_saves_input(config):
        out["lm_head/input"] = e * h * (HALF if mode.autocast else mode.residual)
    if mode.autocast and mode.weight == FP32:  # a 16-bit head (QLoRA without the upcast) casts nothing
        out["autocast/weight_casts"] = model.vocab_size * h * HALF
    if mode.fp8:
        out.update(fp8_first_linear(model))
    out["loss/log_softmax"] = log_softmax_bytes(dims, mode, upcast=config.loss_upcast, shift=config.loss_shift)
    if model.final_logit_softcap:
        # logits / cap -> tanh -> * cap (Gemma4ForCausalLM.forward): tanh keeps its output, the lm_head's dtype
        out["loss/softcap"] = e * dims.v * mode.logits
    router_logits = HALF if mode.autocast else mode.compute  # F.linear's output
    softmax_out = FP32 if mode.autocast and kernels.autocast_softmax_fp32 else router_logits
    if aux := moe.aux_loss_bytes(model, e, softmax_out):
        out["moe/aux_loss"] = aux
    return out


#: the model-level terms that belong to the output side (freed first in backward)
HEAD_TERMS = frozenset({"lm_head/transform", "final_norm", "lm_head/input", "loss/log_softmax", "loss/fused_grad_input",
                        "loss/softcap"})


def loss_chunk_tokens(dims: Dims, chunks: int = 1) -> int:
    """Tokens of the largest of ``chunks`` pieces a chunked cross-entropy splits the logits into
    along the sequence (torchtune's TransformerDecoder with ``num_output_chunks``: ``h.tensor_split
    (chunks, dim=1)``, the first pieces one token longer; CEWithChunkedOutputLoss's default is 8,
    torchtune/modules/loss/ce_chunked_output_loss.py). ``chunks`` 1: the whole logits at once, as
    transformers' ForCausalLMLoss computes them."""
    return dims.b * -(-dims.s // chunks)


def log_softmax_bytes(dims: Dims, mode: DtypeMode, *, upcast: bool = True, shift: bool = False) -> int:
    """What the loss saves for backward: cross_entropy = log_softmax + nll_loss, log_softmax keeping
    its output (the log-probabilities, fp32 after ForCausalLMLoss' upcast) and nll_loss the int64
    labels. ``upcast`` False: a loss on the logits as the head makes them (litgpt's
    chunked_cross_entropy calls F.cross_entropy on the bf16 pieces: litgpt/utils.py), whose
    log-probabilities are in the logits' dtype; chunked or not, every piece's are kept. ``shift``
    (transformers <= 4.45's loss, ``shifted_loss``): over the shifted positions only."""
    tokens = shifted_tokens(dims) if shift else dims.tokens
    return tokens * (dims.v * (FP32 if upcast else mode.logits) + INT64)


def shifted_tokens(dims: Dims) -> int:
    """The positions transformers <= 4.45's causal-LM loss reads: all but each sequence's last
    (``shift_logits = logits[..., :-1, :].contiguous()``, ``shift_labels = labels[..., 1:]``)."""
    return dims.b * (dims.s - 1)


class ShiftedLoss(NamedTuple):
    """The logits-sized tensors of transformers <= 4.45's causal-LM loss (``TrainConfig.loss_shift``),
    bytes each. The model's forward computes it (4.45.2 models/mistral/modeling_mistral.py
    l.1059-1074; llama l.1214-1229, qwen2 l.1187-1202; 4.40.0 mistral l.1171-1185, qwen2
    l.1182-1196): ``logits = self.lm_head(hidden_states).float()`` (the head's 16-bit output is a
    temporary, freed once upcast), ``shift_logits = logits[..., :-1, :].contiguous()`` (a second
    copy while ``logits``, returned in the outputs, is still referenced), then ``CrossEntropyLoss``:
    log_softmax keeps its output of the shifted positions, nll_loss the contiguous shifted labels.
    The shifted copy dies when the forward returns, the returned logits when the Trainer's
    compute_loss does (a hand-written loop keeps them: ``manual_loop_logits``). Backward:
    NllLossBackward's zero-filled gradient of the log-probabilities and LogSoftmaxBackward's
    gradient of the shifted copy exist with the saved log-probabilities (the loss' peak, as
    transformers 5's), both freed with them; the contiguous copy passes its gradient through, then
    SliceBackward makes a zero gradient of the whole logits and copies the shifted one into it
    (torch/csrc/autograd/FunctionsManual.cpp ``slice_backward``: ``at::zeros(input_sizes)``), and
    the upcast's backward casts that to the head's dtype (ToCopyBackward0) for the head's matmul.
    ``upcast`` False (a model that shifts without upcasting, GPT-2 and BLOOM): every tensor is in
    the head's dtype and there is no cast. The loss runs inside the model's forward, so the last
    hidden state the head read (the final norm's output, a local of the forward) is alive until it
    returns (transformers 5's ForCausalLMLoss runs there too, but its peak is the loss' backward,
    after the forward returned; this one's is the end of its forward). transformers 4.46-4.48
    (``loss_returns_head``): the model returns the head's 16-bit output and ``ForCausalLMLoss``
    upcasts it and makes the shifted copy (4.48.1 models/mistral/modeling_mistral.py l.848-852,
    loss/loss_utils.py l.36-47), so the head's output lives with the outputs and the upcast, a local
    of the loss function, dies as it returns, after the mark and before the shifted copy; the
    backward is 4.45's."""

    hidden: int
    """the final norm's output where nothing saved for backward is it (``shifted_loss``)"""
    head: int
    """the lm_head's output before its upcast (0 when the loss reads it as it is)"""
    logits: int
    """the returned logits, in the loss' dtype"""
    shifted: int
    """their contiguous copy of the shifted positions; each gradient of the loss' backward too"""
    saved: tuple[int, int]
    """what the loss keeps for backward, as made: nll_loss's int64 labels, log_softmax's output"""
    head_returned: bool = False
    """the head's output is what the model returns (``loss_returns_head``): alive until the outputs die
    (where the loss' dtype is the head's, ``.float()`` returns the head's output itself: 4.45's path)"""

    @property
    def forward(self) -> int:
        """Alive at the end of the loss' forward beside what it saves: the last hidden state, the
        logits and their copy (sequences of one token have no shifted position: there the head's
        output beside its upcast is the most, ``shifted_loss_events``)."""
        if self.head_returned:
            return self.hidden + self.head + self.logits + self.shifted
        return self.hidden + self.logits + (self.shifted if self.shifted else self.head)

    @property
    def backward(self) -> int:
        """Alive at the loss' backward beside what it saved: the two gradients of the shifted logits."""
        return 2 * self.shifted


def qlora_as_lora(mode: DtypeMode) -> bool:
    """Whether QLoRA's per-micro-batch terms are LoRA's in the same dtype mode ``mode``: they read
    QLoRA apart only for bitsandbytes' Linear4bit under autocast (``_dropped_bytes``, ``_casts_kept``,
    ``_down_saved``; the eval pass's casts, ``evaluation.weight_casts``) and for its cast of the adapter
    output to the base output's dtype before the up projection's sum (``_recompute_stops``), which
    changes nothing where the adapter computes in the projections' dtype; elsewhere only whether the
    method trains adapters. Of the bench request's 156 batch lines (every precision), 32 are QLoRA's
    in fp32 or DeepSpeed's 16-bit model, each its LoRA twin's (``planner.memory.step.line_reads``;
    tests/memory/test_line_reads.py)."""
    return not mode.autocast and mode.adapter == mode.compute


def head_saves_input(config: TrainConfig) -> bool:
    """The output head keeps its input for backward (``lm_head/input``): its weight trains, or the
    sharding's linears save their input whatever trains (``ShardingSpec.linear_saves_input``)."""
    return config.method is _FULL or config.sharding.spec.linear_saves_input


def shifted_loss(dims: Dims, mode: DtypeMode, config: TrainConfig) -> ShiftedLoss:
    """transformers <= 4.45's loss tensors (``ShiftedLoss``) at ``dims``, in ``config``'s loss dtype
    (``loss_upcast``). The last hidden state is counted where the head keeps no copy of its own of
    it: where it saves its input (``head_saves_input``) and that input is the hidden state itself,
    not autocast's 16-bit cast of an fp32 one, ``lm_head/input`` counts it."""
    dtype = FP32 if config.loss_upcast else mode.logits
    shifted = shifted_tokens(dims)
    same = head_saves_input(config) and (not mode.autocast or mode.residual == HALF)
    return ShiftedLoss(hidden=0 if same else dims.tokens * dims.h * mode.residual,
                       head=dims.tokens * dims.v * mode.logits if dtype != mode.logits else 0,
                       logits=dims.tokens * dims.v * dtype, shifted=shifted * dims.v * dtype,
                       saved=(shifted * INT64, shifted * dims.v * dtype),
                       head_returned=config.loss_returns_head and dtype != mode.logits)


#: the breakdown keys of the loss' events: its transients, and the log-probabilities it saves (the
#: head's saved term ``loss/log_softmax``)
_LOSS_TRANSIENT, _LOSS_SAVED = "logits/transient", "activations/loss/log_softmax"


def shifted_loss_events(dims: Dims, mode: DtypeMode, config: TrainConfig) -> tuple[tuple, tuple]:
    """The forward's and the backward's events of transformers <= 4.45's loss (``ShiftedLoss``) in
    their order, as the timeline replays them (``planner.memory.timeline``): (op, tensor, breakdown
    key, sizes), op ``alloc`` (the tensor's sizes as made), ``free`` or ``mark`` (the moment: the
    end of the loss' forward, the loss' backward). Sequences of one token have no shifted position,
    so nothing follows the upcast: the head's output is freed after the mark. Where the model
    returns the head's output (``ShiftedLoss.head_returned``) the loss function's locals die as it
    returns, the upcast then its copy, then the forward's last hidden state, and the head's output
    with the outputs."""
    loss = shifted_loss(dims, mode, config)
    free_head = ("free", "head", "", ())
    made = (("alloc", "hidden", _LOSS_TRANSIENT, (loss.hidden,)),
            ("alloc", "head", _LOSS_TRANSIENT, (loss.head,)), ("alloc", "logits", _LOSS_TRANSIENT, (loss.logits,)))
    copied = (("alloc", "shifted", _LOSS_TRANSIENT, (loss.shifted,)), ("alloc", "saved", _LOSS_SAVED, loss.saved),
              ("mark", "", "", ()))
    if loss.head_returned:
        forward = (*made, *copied, ("free", "logits", "", ()), ("free", "shifted", "", ()),
                   ("free", "hidden", "", ()), free_head)
    else:
        forward = (
            *made, *((free_head,) if loss.shifted else ()), *copied,
            *(() if loss.shifted else (free_head,)),
            ("free", "shifted", "", ()), ("free", "hidden", "", ()), ("free", "logits", "", ()),
        )
    backward = (
        ("alloc", "grad_saved", _LOSS_TRANSIENT, (loss.shifted,)),
        ("alloc", "grad_shifted", _LOSS_TRANSIENT, (loss.shifted,)),
        ("mark", "", "", ()),
        ("free", "grad_saved", "", ()), ("free", "saved", "", ()),
        ("alloc", "grad_logits", _LOSS_TRANSIENT, (loss.logits,)), ("free", "grad_shifted", "", ()),
        ("alloc", "grad_head", _LOSS_TRANSIENT, (loss.head,)), ("free", "grad_logits", "", ()),
        ("free", "grad_head", "", ()),
    )
    return forward, backward


def logits_forward_transient(dims: Dims, mode: DtypeMode, config: TrainConfig | None = None,
                             kernels: KernelProfile | None = None, *, chunks: int = 1, upcast: bool = True) -> int:
    """At the loss: the logits in the lm_head's output dtype + their fp32 upcast
    (``logits.float()`` in ForCausalLMLoss), before the upcast is released; with a fused
    cross-entropy its chunk loop's working set (``fused_ce_transient``). Over ``chunks`` pieces
    (``loss_chunk_tokens``) each piece is upcast on its own and its copy released once its
    log-probabilities are made (CEWithChunkedOutputLoss.compute_cross_entropy: ``F.cross_entropy(
    logits.float(), ...)`` per chunk; log_softmax saves its output, not the upcast input): one
    piece's upcast beside the whole 16-bit logits; ``upcast`` False (``log_softmax_bytes``): the
    logits alone."""
    if config is not None and config.fused_ce:
        return fused_ce_transient(dims, mode, kernels)
    if config is not None and config.loss_shift:
        return shifted_loss(dims, mode, config).forward
    ev = dims.tokens * dims.v
    return ev * mode.logits + (loss_chunk_tokens(dims, chunks) * dims.v * FP32 if upcast and mode.logits != FP32 else 0)


def logits_backward_transient(dims: Dims, mode: DtypeMode, config: TrainConfig | None = None, *,
                              chunks: int = 1, upcast: bool = True) -> int:
    """Backward of the loss: nll_loss's dense fp32 gradient and log_softmax's fp32 grad input
    exist together (the saved log-probabilities counted elsewhere); over ``chunks`` pieces each
    piece's backward runs on its own (each piece's loss is its own graph down to the lm_head's
    matmul on its slice of the hidden states), so two pieces' worth; ``upcast`` False: in the
    logits' dtype. A fused cross-entropy's backward scales its saved input gradient in place:
    nothing."""
    if config is not None and config.fused_ce:
        return 0
    if config is not None and config.loss_shift:
        return shifted_loss(dims, mode, config).backward
    return 2 * loss_chunk_tokens(dims, chunks) * dims.v * (FP32 if upcast else mode.logits)


def fused_ce_chunk_rows(dims: Dims) -> int:
    """Liger's chunk of tokens: ``inc_factor = cdiv(V, H)``, ``chunk_size =
    next_power_of_2(cdiv(BT, inc_factor))``, at most BT (ops/fused_linear_cross_entropy.py
    ``fused_linear_cross_entropy_forward``), so a chunk's logits are about BT x H."""
    inc = -(-dims.v // dims.h)
    rows = -(-dims.tokens // inc)
    return min(1 << (rows - 1).bit_length(), dims.tokens)


def fused_ce_transient(dims: Dims, mode: DtypeMode, kernels: KernelProfile | None = None) -> int:
    """The fused cross-entropy's working set at its peak, inside the chunk loop (Liger's
    ``fused_linear_cross_entropy_forward``; workers/fused_ce.py does the same in torch): the fp32
    ``loss_1d`` of BT, the shifted int64 labels, the weight cast to the matmul dtype under
    autocast (the head's weights are fp32 there), one chunk's logits (chunk x V, which the kernel
    overwrites with their gradient) and the chunk x H product ``grad_logits @ weight`` before it is
    copied into ``grad_input``, all in the matmul dtype; and the loss' input, the final norm's
    output (residual dtype), which the chunks read until the loop ends. Where a 16-bit matmul
    computes into an fp32 buffer (``KernelProfile.mm_fp32_buffer``: the CPU) the chunk's logits
    matmul holds that buffer beside its output, chunk x V x 4 B, more than the chunk x H product
    (measured without it: -0.7 % at 512 tokens to -1.8 % at 2048, growing as the chunk does)."""
    rows = fused_ce_chunk_rows(dims)
    matmul = HALF if mode.autocast else mode.weight
    weight_cast = dims.v * dims.h * HALF if mode.autocast and mode.weight != HALF else 0
    hidden = dims.tokens * dims.h * mode.residual
    if kernels is not None and kernels.mm_fp32_buffer and matmul != FP32:
        chunk = rows * dims.v * (matmul + FP32)  # at the logits' matmul
    else:
        chunk = rows * (dims.v + dims.h) * matmul  # at the gradient's
    return dims.tokens * (FP32 + INT64) + hidden + weight_cast + chunk


def kv_cache_block_bytes(model: ModelSpec, config: TrainConfig, dims: Dims, mode: DtypeMode) -> int:
    """One block's ``DynamicCache`` layer when the training forward builds one
    (``TrainConfig.builds_kv_cache``, decoder models): ``DynamicLayer.update`` keeps ``torch.cat([empty,
    key_states])`` and the same for values (transformers/cache_utils.py), new tensors of b x kv x
    s x d, each in its dtype (``kv_cache_token_bytes``)."""
    if not config.builds_kv_cache or model.is_encoder:
        return 0
    key, value = kv_cache_token_bytes(model, dims, mode)
    return dims.tokens * (key + value)


def kv_cache_token_bytes(model: ModelSpec, dims: Dims, mode: DtypeMode) -> tuple[int, int]:
    """One layer's cached key and value bytes per token. Keys are cached after the rotary
    embedding, which multiplies the projection's output by cos/sin in the residual stream's dtype
    (type promotion: fp32 under autocast); values in the projection's output dtype: transformers
    5.24 ``DynamicLayer.lazy_initialization`` makes the keys' and the values' empty tensors each in
    its own dtype, so ``torch.cat`` keeps it (measured: a bf16-mixed llama's cache, fp32 keys and
    bf16 values, 3,145,728 B in 8 tensors at 512 tokens; transformers 5.23 made both in the keys'
    dtype)."""
    kv = dims.kv * dims.d
    key = mode.residual if model.position == "rope" else mode.compute
    return kv * max(key, mode.compute), kv * mode.compute


def builds_logits(config: TrainConfig) -> bool:
    """The step materialises the full logits (tokens x vocab): not with a fused linear
    cross-entropy, whose head and loss run chunk by chunk (Liger's lce_forward returns no logits
    in training). The timeline's loss-path allocations read it (planner.memory.timeline)."""
    return not config.fused_ce


def manual_loop_logits(dims: Dims, mode: DtypeMode, config: TrainConfig) -> int:
    """The logits ``outputs.logits`` keeps in a hand-written loop (the lm_head's output; under
    transformers <= 4.45's loss its upcast, ``ShiftedLoss.logits``); none with a fused
    cross-entropy, whose forward returns no logits (Liger's lce_forward in training). transformers
    4.46-4.48 (``loss_returns_head``) return the head's output, as transformers 5 does."""
    if config.fused_ce:
        return 0
    if config.loss_shift and not config.loss_returns_head:
        return shifted_loss(dims, mode, config).logits
    return dims.tokens * dims.v * mode.logits


def breakdown_key(term: str) -> str:
    """The breakdown's name of an activation term (autocast and LoRA terms keep their own)."""
    return term if term.startswith(("autocast", "lora")) else f"activations/{term}"


def kernels_of(kernels: KernelProfile | None, is_cpu: bool) -> KernelProfile:
    """An explicit profile, or the CPU or CUDA one."""
    return kernels if kernels is not None else (CPU_KERNELS if is_cpu else CUDA_KERNELS)


def checkpoint_bytes(model: ModelSpec, dims: Dims, mode: DtypeMode) -> int:
    """One block's checkpointed input (the residual stream)."""
    return dims.tokens * dims.h * mode.residual


def decoder_activation_breakdown(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                                 targets: frozenset[str] | None = None) -> dict[str, int]:
    """Bytes a decoder-only (or encoder-only) model saves for backward over the whole forward
    pass, by breakdown key (``planner.memory.saved.activation_breakdown`` is the entry point
    for any model; ``targets``: the adapted linears' names when the caller has them)."""
    if model.other_blocks:
        return step_activations(model, config, kernels, targets).saved()
    dims, mode = dims_of(model, config), mode_of(config)
    level = model_level_terms(model, config, dims, mode, kernels)
    if config.grad_ckpt:
        return _saved_breakdown(model.num_layers, checkpoint_bytes(model, dims, mode), None, level)
    _, first, _, rest = _block_pair(block_context(model, config, kernels, first=False, targets=targets, dims=dims,
                                                  mode=mode))
    return _saved_breakdown(model.num_layers, 0, (first, rest), level)


def _block_pair(rest_ctx: BlockContext) -> tuple[BlockContext, dict[str, int], BlockContext, dict[str, int]]:
    """(first block's context, its terms, a later block's context, its terms), from the later
    block's context: the first block differs from the others only when its input needs no
    gradient, so its context and terms are made anew only then."""
    rest = block_terms(rest_ctx)
    if block_input_needs_grad(rest_ctx.config, first=True):
        return rest_ctx, rest, rest_ctx, rest
    first_ctx = rest_ctx.as_first(True)
    return first_ctx, block_terms(first_ctx), rest_ctx, rest


def _saved_breakdown(layers: int, checkpoint: int, blocks: tuple[dict[str, int], dict[str, int]] | None,
                     level: dict[str, int], others: tuple[tuple[int, dict[str, int]], ...] = (),
                     like_first: int | None = None) -> dict[str, int]:
    """The whole forward's saved bytes by breakdown key: every block's (``blocks``: the first
    block's terms and every later one's; None under checkpointing, where each of the ``layers``
    blocks keeps its input, ``checkpoint`` bytes) and the model-level terms ``level``. Summed by
    term, then keyed (``breakdown_key`` is one-to-one: the same sums, in the same order)."""
    if blocks is None:
        # Non-reentrant checkpointing keeps each block's input (the residual stream) and
        # recomputes one block at a time during backward (torch.utils.checkpoint).
        total = {"checkpoints": layers * checkpoint}
    else:
        total = dict(blocks[0])
        for n, terms in ((((like_first or layers) - 1), blocks[1]), *others):
            for k, v in terms.items():
                total[k] = total.get(k, 0) + v * n
    for k, v in level.items():
        total[k] = total.get(k, 0) + v
    return {breakdown_key(k): v for k, v in total.items() if v}


def decoder_recompute_bytes(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                            targets: frozenset[str] | None = None) -> int:
    """Under checkpointing, one (non-first) block's saved tensors rebuilt during backward, for a
    decoder-only (or encoder-only) model (``planner.memory.saved.recompute_bytes`` for any)."""
    if not config.grad_ckpt:
        return 0
    if model.other_blocks:
        return step_activations(model, config, kernels, targets).recompute
    return sum(block_terms(block_context(model, config, kernels, first=False, targets=targets)).values())


#: the MLP's output projection (down_proj / fc2 / dense_4h_to_h), the first linear backward reaches in a block
_DOWN = frozenset({LinearKind.MLP_OUT})


def _down_saved(ctx: BlockContext) -> dict[str, int]:
    """What the MLP's output projection saved, by the block's term it counts under
    (``block_terms``), released once its backward ran (autograd frees a
    node's saved tensors after it runs; torch.utils.checkpoint's unpack_hook drops its reference
    to a recomputed one as it hands it out: ``holder.handles[gid] = None``, torch 2.13
    utils/checkpoint.py:1206): its input (the activation product, or the adapter's cast of it),
    lora_B's input (lora_A's output), the 16-bit weight casts and the adapter dropout. Not the
    product when the activation keeps it as its own output (relu). By term, so that the timeline
    frees those very tensors of the last block where the backward releases them."""
    model, mode, e = ctx.model, ctx.mode, ctx.dims.tokens
    down = ctx.of_kind(_MLP_OUT)
    targeted = ctx.adapted_of(_MLP_OUT)
    keeps_output = not model.gated_mlp and model.hidden_act in ACTIVATION_SAVES_OUTPUT
    if not model.has_mlp:
        return {}  # a Nemotron-H block of a token mixer alone
    if moe.is_moe_block(model):
        # the down grouped_mm saves the product when the stacks train; no casts of the stacks
        casts = sum([lin.count * lin.in_features * lin.out_features * 2 for lin in down
                     if (not moe.is_expert_stack(lin) or moe.dense_experts(model))
                     and not (mode.fp8 and fp8_converts(model, lin))]) if mode.autocast and ctx.full else 0
        product = e * moe.shared_intermediate(model) * mode.compute if ctx.full else 0  # the shared down's input
        return {"moe/experts": moe.product_bytes(ctx), "autocast/weight_casts": casts,
                "moe/shared_intermediate": product}
    inter = ctx.dims.tokens * ctx.dims.i * mode.compute
    out = {}
    if (ctx.full or (targeted and (ctx.adapter_saves_shared_input or bool(mode.adapter_input)))) and not keeps_output:
        out["mlp/intermediate"] = inter  # _mlp_intermediate's "down saves the product"
        if not ctx.full and mode.adapter_input:
            out["mlp/intermediate"] += sum([e * lin.in_features * (mode.adapter_input - mode.compute) for lin in targeted])
    r = ctx.config.lora_r or 0
    out["lora/activations"] = sum([lin.active * e * r * mode.adapter for lin in targeted])
    if mode.autocast:
        if ctx.config.method is not _QLORA:
            out["autocast/weight_casts"] = sum([lin.count * lin.in_features * lin.out_features * 2 for lin in down
                                                if not (mode.fp8 and fp8_converts(model, lin))])
        out["lora/weight_casts"] = sum([lin.count * r * (lin.out_features + lin.in_features) * 2 for lin in targeted])
    if targeted and ctx.lora_dropout:
        out["lora/dropout"] = _lora_dropout(ctx, _DOWN)
    return out


def block_backward_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                         targets: frozenset[str] | None = None) -> dict[str, int]:
    """What the backward of the last block (the first block backward reaches) adds to the saved
    tensors that outlive the head's backward, by term; its peak is at the MLP's activation
    product (measured on the CPU, tests/memory/test_block_backward.py).

    * ``recompute`` (checkpointing): the block's saved tensors rebuilt while every checkpoint is
      still held (torch.utils.checkpoint, non-reentrant: the first unpack_hook runs
      ``frame.recompute_fn`` under enable_grad, utils/checkpoint.py:1175-1183; transformers'
      GradientCheckpointingLayer wraps each decoder layer, modeling_layers.py), less what the MLP's
      output projection saved (released by then, ``_down_saved``), less the block's own input
      when the first norm's saved input is that very tensor: LayerNorm saves its input, and
      RMSNorm's ``hidden_states.to(torch.float32)`` (modeling_llama.py LlamaRMSNorm.forward) is
      the same tensor when the residual stream is fp32 (autocast, QLoRA after
      prepare_model_for_kbit_training), so the checkpoint is counted once;
    * ``block_backward``: the gradient of the block's output (the residual stream's dtype), held
      until the attention half's gradient is added to it, and the MLP's gradients at the product
      ``act(gate) * up`` (LlamaMLP.forward): the product's gradient and both operands' (mul's
      backward: grad * other for each, derivatives.yaml ``mul.Tensor``), three intermediate-sized
      tensors in the projections' output dtype; with LoRA on the output projection the product's
      gradient is first the sum of the base layer's and the adapter's (autograd's input buffer
      adds them out of place), three again. A plain MLP (fc1 -> act -> fc2) holds two: the
      activation's output gradient and its input's. QLoRA's projections return fp32
      (bitsandbytes Linear4bit.forward ``out.to(inp_dtype)``, nn/modules.py; MatMul4Bit.backward
      returns ``grad_A`` in the input's dtype, autograd/_functions.py), so these are fp32. An MoE
      block runs its experts one after another (MixtralSparseMoeBlock), one expert's share of
      the routed tokens at a time. Without checkpointing the block's saved tensors are already
      alive; the released output-projection tensors come off this term instead.
    """
    if model.other_blocks:
        return step_activations(model, config, kernels, targets).block_backward
    ctx = block_context(model, config, kernels, first=model.num_layers == 1, targets=targets)
    saved = sum(block_terms(ctx).values()) if config.grad_ckpt else 0
    return _block_backward_at(ctx, saved, _down_saved(ctx))


def _mlp_split(ctx: BlockContext) -> tuple[int, int]:
    """(how many parts the MLP's backward runs in, the bytes of its intermediate elements): one
    part in the projections' dtype for a dense MLP; for an MoE block run by grouped_mm
    (``moe``) one part over all S = T·k slots in the expert weights' dtype; for one whose router
    the model does not know, or run by transformers 4's per-expert loop (``moe.looped``), one expert's
    share at a time."""
    if moe.looped(ctx.model):
        return ctx.model.num_experts, ctx.mode.compute
    if moe.is_moe_block(ctx.model):
        return 1, moe.expert_bytes_per_element(ctx)
    return max(ctx.model.num_experts, 1), ctx.mode.compute


def _block_backward_at(ctx: BlockContext, saved: int, down: dict[str, int]) -> dict[str, int]:
    """``block_backward_terms`` of the last block's context, given what the block saves
    (``block_terms``' sum; read under checkpointing only) and ``_down_saved`` of it."""
    model, dims, mode, e = ctx.model, ctx.dims, ctx.mode, ctx.dims.tokens
    experts, inter_bytes = _mlp_split(ctx)
    # a block without an MLP (Nemotron-H's mixer blocks): the output's gradient alone is counted
    # Llama 4's experts: every token through each; transformers 4's loop: the T·k routed slots, an expert's share at a time
    rows = moe.slots(ctx) if moe.dense_experts(model) or moe.looped(model) else e
    grads = (3 if model.gated_mlp else 2) * rows * dims.i * inter_bytes // experts if model.has_mlp else 0
    released = {term: nbytes // experts for term, nbytes in down.items() if nbytes // experts}
    g_out = e * dims.h * mode.residual
    casts = fp8_cast_terms(model, e) if mode.fp8 else {}
    if not ctx.config.grad_ckpt:
        # the saved tensors released come off their own terms (negative here, on top of the block's
        # saved ones in the moment's sum), so that the timeline frees those tensors and allocates
        # the gradients apart, each of its own size (the replay has no negative allocation)
        return {"block_backward": g_out + grads, **casts, **{term: -nbytes for term, nbytes in released.items()}}
    return {"recompute": saved - sum(released.values()) - _own_checkpoint(ctx), "block_backward": g_out + grads,
            **casts}


def fp8_first_linear(model: ModelSpec) -> dict[str, int]:
    """fp8: the model's first linear stays an ``nn.Linear`` under autocast (accelerate utils/ao.py:140-142
    leaves the first and last linears of ``named_modules`` unconverted; the first is the first block's
    first linear, the last the lm_head, counted with the head): its 16-bit weight cast is saved until
    the end of backward. Counted here only when the block terms took it as converted."""
    first = next((lin for lin in model.layer_linears if lin.module), None)
    if first is None or not fp8_converts(model, first):
        return {}
    return {"autocast/fp8_first_linear": first.count * first.in_features * first.out_features * HALF}


#: Bytes per element of one eager fp8 cast's fp32 scratch: ``tensor.to(torch.float32) * scale`` and its
#: clamp are alive together (torchao float8/float8_training_tensor.py:153, float8_utils.py:136
#: ``to_fp8_saturated``: ``x = x.clamp(...)`` while the caller still holds ``tensor_scaled``), 4 B each.
FP8_CAST_SCRATCH = 8


def fp8_cast_terms(model: ModelSpec, tokens: int) -> dict[str, int]:
    """What a converted linear's backward holds beside the usual gradients (``fp8/casts`` of the last
    block's backward), from torchao float8/float8_linear.py:94-204 with accelerate's defaults
    (tensorwise scales, ``pad_inner_dim=True``): the fp8 copies the backward makes and keeps to its end
    -- grad_output cast twice (T x out each, dim0 for grad_input and again for grad_weight: the
    tensorwise config casts the high-precision tensor anew), the weight (in x out) and the input (T x in),
    1 B each -- the zero-padded copies of the running GEMM's operands (``pad_tensor_for_matmul``:
    ``F.pad`` by zero copies), and the fp32 scratch of the cast in progress (``FP8_CAST_SCRATCH``). Per
    linear the worst of its steps is at most T x (2 out + 9 max(in, out)) + in x out; the term takes
    the largest token coefficient and the largest weight of the block's converted linears apart (an
    upper bound, affine in the tokens as the search's lines need). The scales cost nothing worth a term:
    dynamic scaling keeps one 0-dim fp32 scale per cast (float8_utils.py ``tensor_to_scale``; rowwise, one
    per row), and torchao has no amax history since delayed scaling was removed (float8_linear.py:323);
    Transformer Engine's amax history (accelerate's TE backend) is not modelled."""
    converted = [lin for lin in model.layer_linears if fp8_converts(model, lin)]
    if not converted:
        return {}
    per_token = max(2 * lin.out_features + (FP8_CAST_SCRATCH + 1) * max(lin.in_features, lin.out_features)
                    for lin in converted)
    weight = max(lin.in_features * lin.out_features for lin in converted)
    return {"fp8/casts": tokens * per_token + weight}


def _own_checkpoint(ctx: BlockContext) -> int:
    """The block's own checkpointed input when its first norm saves that very tensor: LayerNorm
    saves its input, and RMSNorm's fp32 cast is the same tensor when the residual stream is fp32
    (see ``block_backward_terms``): counted once."""
    first_norm_holds_input = ctx.model.norm != "rmsnorm" or ctx.mode.residual == FP32
    return checkpoint_bytes(ctx.model, ctx.dims, ctx.mode) if first_norm_holds_input else 0


def _read_as_is(ctx: BlockContext, kind: LinearKind, input_bytes: int) -> bool:
    """Whether a linear of ``kind`` saves the very tensor it reads (no autocast cast of it, no
    peft cast or dropped copy of it): then that tensor is a saved one, else a local of the forward."""
    if ctx.full:
        return not ctx.mode.autocast or input_bytes == HALF
    return ctx.adapter_saves_shared_input and kind in ctx.targeted_kinds


def _grads_before_down(ctx: BlockContext) -> int:
    """The gradients the last block's backward holds when its first saved tensor is unpacked:
    the block output's (the residual stream's dtype, kept for the residual branch), the MLP
    output's cast to the projections' dtype when it differs (the engine casts a gradient to its
    input's dtype, torch/csrc/autograd/engine.cpp validate_outputs), and with LoRA on the output
    projection the base output's share when peft's sum ran in another dtype (pure 16-bit: fp32
    adapter output + 16-bit base output, cast back by ``result.to(torch_result_dtype)``) and
    ``grad * scaling`` in lora_B's output dtype, the input of lora_B's MmBackward."""
    mode, e, h = ctx.mode, ctx.dims.tokens, ctx.dims.h
    total = mode.residual + (mode.compute if mode.compute != mode.residual else 0)
    if _MLP_OUT in ctx.targeted_kinds:
        lora_out = mode.adapter
        total += (mode.compute if max(mode.compute, lora_out) != mode.compute else 0) + lora_out
    return e * h * total


def _recompute_stops(ctx: BlockContext, down_saved: int) -> list[tuple[int, int]]:
    """(saved tensors not yet rebuilt, the forward's locals) at the two instants of the last
    block's recompute where it can peak (torch.utils.checkpoint's recompute runs the block's
    forward until its last saved tensor is packed: ``_StopRecomputationError``, utils/checkpoint.py).

    * inside the MLP's output projection, its last saved tensor being packed (lora_B's under LoRA):
      alive as locals besides the saved tensors are the MLP's input and the post-attention residual
      (LlamaDecoderLayer.forward ``residual``; LlamaMLP.forward's ``x``) unless a norm or linear
      saves them as they are, the product act(gate) * up unless saved as it is, and with LoRA the
      base projection's output (peft Linear.forward ``result``, made before the adapter) and
      peft's fp32 cast of a 16-bit product (LoraLayer._cast_input_dtype, tuners_utils.py:2235,
      ``x.to(dtype)``), which lora_A saves only outside autocast and without dropout;
    * gated MLPs with LoRA on the up projection (run after the gate's, LlamaMLP.forward), in
      peft's ``result + lora_B(lora_A(dropout(x))) * scaling`` (lora/layer.py:1102): the base
      output, the scaled adapter output (lora_B's dtype: 16-bit under autocast, else fp32), their
      sum in the promoted dtype, and on the CPU the base output promoted to it (TensorIterator.cpp
      compute_types: "Promotes inputs by creating temporaries of the correct dtype", CPU only); the
      up projection's output and everything the output projection saves are not made yet.

    ``down_saved``: ``_down_saved(ctx)``."""
    model, mode, e, h = ctx.model, ctx.mode, ctx.dims.tokens, ctx.dims.h
    if not model.has_mlp:
        # a block of a token mixer alone (Nemotron-H's Mamba2 and attention blocks): its recompute ends at the
        # output projection's saved input, the locals there not counted (Nemotron-H's released configs end in MoE)
        return [(0, 0)]
    experts, _ = _mlp_split(ctx)
    inter = (moe.slots(ctx) if moe.looped(model) else e) * ctx.dims.i // experts  # one expert's share of the slots
    outer = 0 if _read_as_is(ctx, _MLP_IN, mode.residual) else e * h * mode.residual
    if model.norm == "rmsnorm" and mode.residual != FP32 and not model.parallel_block:
        outer += e * h * mode.residual  # the residual; RMSNorm saved its fp32 copy
    keeps_output = not model.gated_mlp and model.hidden_act in ACTIVATION_SAVES_OUTPUT
    down = ctx.adapted_of(_MLP_OUT)
    local = outer + (0 if keeps_output or _read_as_is(ctx, _MLP_OUT, mode.compute) else inter * mode.compute)
    if down:
        if mode.compute != mode.adapter_weight and (mode.autocast or ctx.lora_dropout):
            local += inter * mode.adapter_weight
        local += sum([lin.active * e * lin.out_features * mode.compute for lin in down])
    stops = [(0, local)]
    up = ctx.adapted_of(_MLP_IN)
    if model.gated_mlp and up:
        lora_out = mode.adapter
        if ctx.config.method is _QLORA and not (mode.autocast and ctx.kernels.plain_autocast_query):
            # bnb's LoRA casts the adapter output to the base output's dtype before the sum
            # (peft/tuners/lora/bnb.py:549-552 ``output = output.to(expected_dtype)``): no promotion
            at_sum = mode.compute * 3 + max(lora_out - mode.compute, 0)
        else:
            summed = max(mode.compute, lora_out)
            promoted = summed if lora_out != mode.compute and ctx.kernels.promotes_inputs_by_copy else 0
            at_sum = mode.compute + lora_out + summed + promoted
        stops.append((inter * mode.compute + down_saved // experts, outer + inter * at_sum))
    return stops


def recompute_end_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                        targets: frozenset[str] | None = None) -> dict[str, int]:
    """What the last block adds to the saved tensors that outlive the head's backward before its
    backward frees anything (planner/memory/step.py ``first_block_recompute``), by term:

    * under checkpointing, at the larger of ``_recompute_stops``: ``recompute``, the block's saved
      tensors rebuilt so far (less the block's own input where the first norm saves it as it is,
      as in ``block_backward_terms``); ``recompute_locals``, the forward's tensors alive there
      that nothing saves; ``block_backward``, the gradients held (``_grads_before_down``);
    * without checkpointing, the start of that backward: the gradients it holds.

    Measured on bench/accuracy.py's llama-v2k (tests/memory/test_block_backward.py): bf16-mixed LoRA
    peaks inside down_proj's adapter (the fp32 cast of the product beside lora_A's bf16 cast),
    pure bf16 LoRA inside up_proj's adapter sum."""
    if model.other_blocks:
        return step_activations(model, config, kernels, targets).recompute_end
    ctx = block_context(model, config, kernels, first=model.num_layers == 1, targets=targets)
    if not config.grad_ckpt:
        return _recompute_end_at(ctx, 0, {})
    return _recompute_end_at(ctx, sum(block_terms(ctx).values()), _down_saved(ctx))


def _stop_excess(stop: tuple[int, int]) -> int:
    """What a stop of ``_recompute_stops`` adds: its locals less the saved tensors not yet rebuilt."""
    return stop[1] - stop[0]


def _recompute_end_at(ctx: BlockContext, saved: int, down: dict[str, int]) -> dict[str, int]:
    """``recompute_end_terms`` of the last block's context, given what the block saves
    (``block_terms``' sum) and ``_down_saved`` of it (both read under checkpointing only)."""
    grads = _grads_before_down(ctx)
    if not ctx.config.grad_ckpt:
        return {"block_backward": grads}
    missing, local = max(_recompute_stops(ctx, sum(down.values())), key=_stop_excess)
    return {"recompute": saved - missing - _own_checkpoint(ctx), "recompute_locals": local,
            "block_backward": grads}


class StepActivations(NamedTuple):
    """A decoder-only configuration's activation terms of one micro-step, from one context per
    block kind: what ``decoder_activation_breakdown``, ``decoder_recompute_bytes``, ``model_level_terms``,
    ``block_backward_terms`` and ``recompute_end_terms`` give, each of which would build the
    block's context and its terms anew (``planner.memory.step`` needs them all). (An immutable named
    tuple, made by keyword, as ``BlockContext``: the search makes four per batch line pair, 236 a
    search, and a frozen dataclass of these nine fields took 1.2 us to make, against 0.5.)"""

    layers: int
    """Blocks of the model."""
    blocks: tuple[dict[str, int], dict[str, int]] | None
    """The first block's saved terms and every later block's; None under checkpointing."""
    checkpoint: int
    """Under checkpointing, one block's checkpointed input (``checkpoint_bytes``); else 0."""
    level: dict[str, int]
    """``model_level_terms``, by term."""
    recompute: int
    """``decoder_recompute_bytes``."""
    block_backward: dict[str, int]
    """``block_backward_terms``, by term."""
    recompute_end: dict[str, int]
    """``recompute_end_terms``, by term."""
    others: tuple[tuple[int, dict[str, int]], ...] = ()
    """(how many, the saved terms of one) of each kind of block unlike block 0 (``ModelSpec.block_kinds``);
    ``blocks`` then holds block 0's kind's, and ``like_first`` how many blocks are of it."""
    like_first: int = 0
    """Blocks of block 0's kind (``layers`` when ``others`` is empty)."""

    def saved(self) -> dict[str, int]:
        """``decoder_activation_breakdown``: saved for backward over the whole forward, by breakdown key."""
        return _saved_breakdown(self.layers, self.checkpoint, self.blocks, self.level, self.others,
                                self.like_first or self.layers)

    def saved_bytes(self) -> int:
        """The sum of ``saved()``, without building it."""
        if self.blocks is None:
            blocks = self.layers * self.checkpoint
        else:
            blocks = sum(self.blocks[0].values()) + ((self.like_first or self.layers) - 1) * sum(self.blocks[1].values())
            blocks += sum(n * sum(terms.values()) for n, terms in self.others)
        return blocks + sum(self.level.values())


def step_activations(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                     targets: frozenset[str] | None = None, dims: Dims | None = None,
                     mode: DtypeMode | None = None) -> StepActivations:
    """The activation terms of a decoder-only model (``StepActivations``), each block's terms
    computed once: a later block's serve the whole forward, the recompute and the last block's
    backward (the last block is the first one when there is only one). ``dims`` and ``mode``:
    when the caller has them."""
    return block_step_activations(block_context(model, config, kernels, first=False, targets=targets, dims=dims,
                                                mode=mode))


def block_step_activations(ctx: BlockContext) -> StepActivations:
    """``step_activations`` from a later block's context ``ctx``, when the caller has one."""
    if ctx.model.other_blocks:
        return _mixed_step_activations(ctx)
    first, first_terms, rest, rest_terms = _block_pair(ctx)
    last = first if ctx.model.num_layers == 1 else rest
    return _step_at(ctx, first_terms, rest_terms, last, _down_saved(last))


def block_step_pair(ctx: BlockContext, ckpt: BlockContext) -> tuple[StepActivations, StepActivations]:
    """``block_step_activations`` of a later block's context ``ctx``, without checkpointing, and of
    ``ckpt``, the same block of ``ctx``'s configuration with checkpointing (``BlockContext.at``). A
    later block's input needs a gradient either way (``block_input_needs_grad``), so its terms and
    what its MLP's output projection saves (``_down_saved``) read nothing of checkpointing: both are
    worked out once (the search's memo asks for both of every slot's lines). A model whose blocks
    differ, or of one block (the last block is the first), takes them one at a time."""
    if ctx.model.other_blocks or ctx.model.num_layers == 1:
        return block_step_activations(ctx), block_step_activations(ckpt)
    _, first_terms, rest, rest_terms = _block_pair(ctx)
    down = _down_saved(rest)
    return _step_at(ctx, first_terms, rest_terms, rest, down), _step_at(ckpt, rest_terms, rest_terms, ckpt, down)


def _step_at(ctx: BlockContext, first_terms: dict[str, int], rest_terms: dict[str, int], last: BlockContext,
             down: dict[str, int]) -> StepActivations:
    """``block_step_activations`` of a later block's context ``ctx`` given the first block's terms and
    a later one's, the last block's context and ``_down_saved`` of it."""
    model, config, dims = ctx.model, ctx.config, ctx.dims
    ckpt = config.grad_ckpt
    last_saved = sum((first_terms if model.num_layers == 1 else rest_terms).values())
    return StepActivations(
        layers=model.num_layers,
        blocks=None if ckpt else (first_terms, rest_terms),
        checkpoint=checkpoint_bytes(model, dims, ctx.mode) if ckpt else 0,
        level=model_level_terms(model, config, dims, ctx.mode, ctx.kernels),
        recompute=sum(rest_terms.values()) if ckpt else 0,
        block_backward=_block_backward_at(last, last_saved, down),
        recompute_end=_recompute_end_at(last, last_saved, down),
    )


def kind_contexts(ctx: BlockContext) -> tuple[tuple[int, int, BlockContext], ...]:
    """(how many blocks, index of the first, a later block's context) of each kind of block of a
    model whose blocks differ (``ModelSpec.block_kinds``): each at its own MLP's intermediate size."""
    out = []
    for count, first, view in ctx.model.block_kinds:
        own = dims_of(view, ctx.config)  # its MLP's intermediate size, its head dim and kv heads (Gemma 4)
        dims = dataclasses.replace(ctx.dims, i=own.i, d=own.d, kv=own.kv)
        out.append((count, first, BlockContext(model=view, config=ctx.config, dims=dims, mode=ctx.mode,
                                               kernels=ctx.kernels, first=False, targets=ctx.targets)))
    return tuple(out)


def _last_block(model: ModelSpec, kinds: tuple[tuple[int, int, BlockContext], ...]) -> BlockContext:
    """The context of the model's last block (the first one backward reaches)."""
    view = model.block_at(model.num_layers - 1)
    return next(c for _, _, c in kinds if c.model is view)


def _mixed_step_activations(ctx: BlockContext) -> StepActivations:
    """``block_step_activations`` of a model whose blocks differ (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, Qwen2-MoE's): each kind's terms from its own context; under checkpointing
    the recompute of the largest kind's block; the last block's backward from its own kind."""
    model, config = ctx.model, ctx.config
    kinds = kind_contexts(ctx)
    _, first_terms, _, rest_terms = _block_pair(kinds[0][2])
    others = tuple((count, block_terms(c)) for count, _, c in kinds[1:])
    level = model_level_terms(model, config, ctx.dims, ctx.mode, ctx.kernels)
    ckpt = config.grad_ckpt
    last = _last_block(model, kinds)
    if model.num_layers == 1:
        last_terms = first_terms
        last = last.as_first(True)
    else:
        last_terms = block_terms(last)
    last_saved, down = sum(last_terms.values()), _down_saved(last)
    recompute = max([sum(rest_terms.values())] + [sum(terms.values()) for _, terms in others]) if ckpt else 0
    return StepActivations(
        layers=model.num_layers, blocks=None if ckpt else (first_terms, rest_terms),
        checkpoint=checkpoint_bytes(model, ctx.dims, ctx.mode) if ckpt else 0, level=level, recompute=recompute,
        block_backward=_block_backward_at(last, last_saved, down), recompute_end=_recompute_end_at(last, last_saved, down),
        others=() if ckpt else others, like_first=kinds[0][0],
    )


def layer_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, targets: frozenset[str] | None = None,
                dims: Dims | None = None) -> tuple[dict[str, int], ...]:
    """Each block's saved terms in the model's order (block 0 as the first block), for a model whose
    blocks differ (``ModelSpec.other_blocks``): what the step's timeline allocates block by block."""
    ctx = block_context(model, config, kernels, first=False, targets=targets, dims=dims)
    kinds = kind_contexts(ctx)
    terms = {id(c.model): block_terms(c) for _, _, c in kinds}
    first = _block_pair(kinds[0][2])[1]
    return (first,) + tuple(terms[id(model.block_at(i))] for i in range(1, model.num_layers))


def down_gradient_params(model: ModelSpec, config: TrainConfig, targets: frozenset[str] | None = None) -> int:
    """Trainable elements of one block's MLP output projection, whose gradient its backward
    makes first (full: the weight and bias; LoRA: A and B of each adapted one), of the last block."""
    down = [lin for lin in model.block_at(model.num_layers - 1).layer_linears if lin.kind is _MLP_OUT]
    if config.method is _FULL:
        return sum(lin.params for lin in down)
    r = config.lora_r or 0
    names = targets if targets is not None else frozenset(lin.key for lin in lora_targets(model, config))
    return sum(lin.count * r * (lin.in_features + lin.out_features) for lin in down if lin.key in names)


__all__ = [
    "ACTIVATION_SAVED",
    "ACTIVATION_SAVED_DEFAULT",
    "ACTIVATION_SAVES_OUTPUT",
    "HEAD_TERMS",
    "TERM_SOURCES",
    "StepActivations",
    "block_backward_terms",
    "block_tensors",
    "builds_logits",
    "block_step_activations",
    "block_step_pair",
    "block_terms",
    "breakdown_key",
    "checkpoint_bytes",
    "decoder_activation_breakdown",
    "decoder_recompute_bytes",
    "fp8_cast_terms",
    "fp8_first_linear",
    "down_gradient_params",
    "fused_ce_chunk_rows",
    "fused_ce_transient",
    "kernels_of",
    "kind_contexts",
    "kv_cache_block_bytes",
    "kv_cache_token_bytes",
    "layer_terms",
    "logits_backward_transient",
    "logits_forward_transient",
    "log_softmax_bytes",
    "loss_chunk_tokens",
    "lora_dropout_tensors",
    "manual_loop_logits",
    "model_level_terms",
    "recompute_end_terms",
    "ShiftedLoss",
    "head_saves_input",
    "qlora_as_lora",
    "shifted_loss",
    "shifted_loss_events",
    "shifted_tokens",
    "step_activations",
]
