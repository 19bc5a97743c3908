"""The architecture facts the memory and throughput models need, read from a config.json.

A ``ModelSpec`` is built by ``planner.catalog.spec_from_config`` for each supported
``model_type``; it lists every parameter-holding module so that the parameter count is a plain
sum (checked against ``sum(p.numel())`` of the real transformers model on the meta device) and
LoRA can be sized from the same linear layers peft would wrap.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping


class LinearKind(enum.StrEnum):
    """Where a linear layer sits in a transformer block; drives the activation model."""

    ATTN_IN = "attn_in"  # q/k/v projections (separate or fused)
    ATTN_OUT = "attn_out"  # attention output projection
    MLP_IN = "mlp_in"  # up/gate/fc1 (fused gate_up included)
    MLP_OUT = "mlp_out"  # down/fc2
    ROUTER = "router"  # MoE gate
    SHARED_GATE = "shared_gate"  # a shared expert's one-output gate (Qwen2-MoE ``shared_expert_gate``)
    CROSS_ATTN_IN = "cross_attn_in"  # encoder-decoder: cross-attention q (decoder side), k/v (encoder output)
    CROSS_ATTN_OUT = "cross_attn_out"  # encoder-decoder: cross-attention output projection
    PER_LAYER = "per_layer"  # Gemma 4's per-layer input gate and projection (counted; not planned: unmodelled)


@dataclass(frozen=True, kw_only=True)
class LinearSpec:
    """One ``nn.Linear`` (or HF ``Conv1D``) inside every transformer layer."""

    name: str
    """Leaf module name as peft's ``target_modules`` matches it, e.g. ``q_proj``, ``c_attn``."""
    in_features: int
    out_features: int
    bias: bool
    kind: LinearKind
    count: int = 1
    """Copies per layer (the number of experts for MoE expert weights)."""
    active: int = 1
    """Copies each token passes through (top-k for experts, else ``count``)."""
    module: bool = True
    """An ``nn.Linear`` (or ``Conv1D``) module, which peft's ``target_modules`` (``all-linear``
    included) wraps; False for a bare weight used with ``F.linear``: transformers v5's expert
    stacks and most MoE routers, which LoRA reaches only through peft's ``target_parameters``."""
    lora_rank: int = 1
    """The multiple of ``lora_r`` peft gives this weight's adapter: 2 for a fused gate_up expert
    stack of the models peft converts from transformers v4's per-expert modules (peft 0.21
    utils/transformers_weight_conversion.py ``_convert_peft_config_moe``: ``rank_pattern[gate_up_proj]
    = r * 2``, w1 and w3 fused)."""

    @property
    def key(self) -> str:
        """What a set of LoRA targets holds for this weight (``BlockContext.targets``): its leaf name
        for a module, and apart from modules of the same leaf name (Qwen3-MoE's dense ``down_proj``
        beside its experts' ``down_proj`` stack) for a bare weight peft reaches by
        ``target_parameters``."""
        return self.name if self.module else f"{self.name} (parameter)"

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))

    @property
    def active_params(self) -> int:
        return self.active * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True, kw_only=True)
class MoeRouting:
    """How an MoE block routes its tokens, as far as the tensors autograd saves depend on it
    (``planner.memory.moe``). The experts themselves are the block's expert stacks
    (``LinearSpec.count`` experts, ``active`` top-k)."""

    renorm: bool
    """The top-k probabilities are divided by their sum (Mixtral always:
    ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``, modeling_mixtral.py
    MixtralTopKRouter.forward; Qwen3-MoE with ``norm_topk_prob``): the in-place division saves
    the top-k values and their sum, both fp32."""
    scores_fp32: bool
    """The routing weights the experts multiply by stay fp32 (Mixtral); False: cast back to the
    router logits' dtype (Qwen3-MoE: ``router_top_value.to(router_logits.dtype)``)."""
    jitter: float = 0.0
    """Mixtral's ``router_jitter_noise``: in training the block's input is multiplied in place by
    a uniform noise tensor (MixtralSparseMoeBlock.forward), which the multiplication saves."""
    aux_loss: bool = False
    """``output_router_logits``: the causal-LM head adds the load-balancing loss over every
    layer's router logits (``load_balancing_loss_func``)."""
    topk_first: bool = False
    """Top-k over the raw logits, then a softmax over the k values in the logits' dtype (gpt-oss:
    GptOssTopKRouter.forward, modeling_gpt_oss.py:119-123): no softmax over all experts is saved."""
    group_limited: tuple[int, int] | None = None
    """DeepSeek-V3's router (DeepseekV3TopkRouter.forward, modeling_deepseek_v3.py:133-158): sigmoid
    scores (not a softmax), plus ``e_score_correction_bias``, top-2 per group of experts summed, the
    best ``topk_group`` of ``n_group`` groups kept by a mask, top-k among them, the sigmoid scores
    gathered, renormalised with ``norm_topk_prob`` and scaled by ``routed_scaling_factor``: (n_group,
    topk_group); None for a softmax router."""
    parallel_experts: bool = False
    """Gemma 4's MoE block (modeling_gemma4.py Gemma4TextDecoderLayer.forward :1389-1402, Gemma4TextRouter
    :1294-1328): the experts run beside a dense MLP, not instead of it; the router reads the residual
    stream through its own weightless RMSNorm times a learned ``scale`` (its ``proj`` an nn.Linear), the
    renormalised top-k weights are multiplied by ``per_expert_scale[top_k_index]``, and the experts read
    ``pre_feedforward_layernorm_2`` of the residual; ``post_feedforward_layernorm_1``/``_2`` norm each
    branch's output before their sum."""
    dense_experts: bool = False
    """Llama 4's MoE block (modeling_llama4.py Llama4Router.forward :147-153, Llama4TextMoe.forward :166-175,
    Llama4TextExperts.forward :66-85): the router keeps the top-k logits in a T x E tensor of -inf, then
    ``sigmoid(scores.float())``; every token is repeated to every expert (``hidden_states.repeat(E, 1)``)
    and multiplied by its score (0 off its top-k), and the experts run as two ``torch.bmm`` over all E x T rows,
    autocast-enabled (16-bit copies of the stacks under autocast): the experts' saved tensors scale with E,
    not k."""
    expert_gate: str = "act"
    """How an expert gates its up projection: ``act`` ``act_fn(gate) * up`` of a concatenated
    gate_up (integrations/moe.py ``_default_apply_gate``); ``clamped_swiglu`` gpt-oss's
    ``GptOssExperts._apply_gate`` (modeling_gpt_oss.py:85-91) on interleaved gate/up columns:
    ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``glu = gate * sigmoid(gate * alpha)``,
    ``(up + 1) * glu``."""


#: MLA's up projections and the down projection whose (normed) output each reads, not the block's
#: normed input (modeling_deepseek_v3.py:375-397, :441, :445-447)
LATENT_DOWN = {"q_b_proj": "q_a_proj", "kv_b_proj": "kv_a_proj_with_mqa"}
LATENT_UP = frozenset(LATENT_DOWN)


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """DeepSeek-V2/V3's multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention,
    :349-483): q through a low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one
    ``q_proj`` when ``q_rank`` is None), k and v from one latent ``kv_a_proj_with_mqa`` (kv_rank +
    rope outputs) -> ``kv_a_layernorm`` over its first kv_rank -> ``kv_b_proj`` (heads x (nope + v));
    q and k have ``nope + rope`` dims a head (``ModelSpec.head_dim``), v and the output ``v``."""

    q_rank: int | None
    kv_rank: int
    nope: int
    rope: int
    v: int


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNet:
    """A Gated DeltaNet token mixer's shapes (Qwen3NextGatedDeltaNet, modeling_qwen3_next.py:583-770;
    Qwen3_5GatedDeltaNet): ``k_heads`` query/key heads of ``k_dim``, ``v_heads`` value heads of ``v_dim``
    (q and k repeated to the value heads), a depthwise causal conv of ``kernel`` taps over q/k/v, and the
    chunked delta rule over chunks of ``chunk`` tokens (torch_chunk_gated_delta_rule's and fla's 64)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    chunk: int = 64

    @property
    def key(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv(self) -> int:
        """Channels of the causal conv: q, k and v."""
        return 2 * self.key + self.value


@dataclass(frozen=True, kw_only=True)
class Mamba2:
    """A Mamba2 token mixer's shapes (NemotronHMamba2Mixer, modeling_nemotron_h.py:390-614): ``heads`` SSM heads
    of ``head_dim`` (the inner size ``heads * head_dim``), ``groups`` groups of B and C with ``state`` dims each,
    a depthwise causal conv of ``kernel`` taps over x, B and C, and the chunked scan over chunks of ``chunk``
    tokens (``chunk_size``)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int
    chunk: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.inner + 2 * self.groups * self.state

    @property
    def projection(self) -> int:
        """in_proj's outputs: the gate, the conv's channels and dt."""
        return self.inner + self.conv + self.heads


@dataclass(frozen=True, kw_only=True)
class BlockGroup:
    """Blocks of a decoder that differ from block 0 (``ModelSpec.layer_linears``): DeepSeek-V3's MoE
    blocks after its dense first ones, the full-attention blocks between Gated DeltaNet ones
    (Qwen3-Next, Qwen3.5), Nemotron-H's MoE and attention blocks between Mamba2 ones, Gemma 4's
    global-attention blocks, Llama 4's NoPE blocks. Counted in ``ModelSpec.params_total``; the memory model
    reads each kind's own view (``ModelSpec.block_kinds``)."""

    label: str
    """What these blocks are, e.g. ``full_attention``, ``moe``."""
    count: int
    linears: tuple[LinearSpec, ...]
    other_params: int
    """Norm weights and any other parameters of one such block outside its linears."""
    first: int
    """Index of the first such block."""
    indices: tuple[int, ...] = ()
    """Every such block's index."""
    head_dim: int = 0
    """These blocks' attention head dim when it differs from ``ModelSpec.head_dim`` (Gemma 4's
    full-attention layers: ``global_head_dim``, configuration_gemma4.py per_layer_config); 0: the model's."""
    kv_heads: int = 0
    """These blocks' key/value heads when they differ from ``ModelSpec.num_kv_heads`` (Gemma 4's
    ``num_global_key_value_heads``); 0: the model's."""
    sliding: bool = False
    """These blocks attend through a sliding window (``ModelSpec.sliding_attention``)."""
    mixer: str = "attention"
    """These blocks' token mixer (``ModelSpec.mixer``)."""
    qk_norm: str | None = None
    """These blocks' q/k norms when they differ from the model's (``ModelSpec.qk_norm``; Llama 4's NoPE layers
    have none); None: the model's."""

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.other_params


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture of one model, independent of how it is trained."""

    id: str
    """Catalog id, HF id or the path the config came from."""
    model_type: str
    """transformers' ``model_type`` (llama, qwen2, gpt2, bert, ...)."""
    is_encoder: bool
    """Bidirectional encoder (bert, roberta; trained as masked LM) instead of a causal decoder."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    """Longest sequence the model's positions allow (max_position_embeddings or n_positions)."""

    layer_linears: tuple[LinearSpec, ...]
    """Every linear layer of one transformer block (all blocks are alike)."""
    layer_norm_params: int
    """Norm weights and biases of one block."""
    layer_other_params: int = 0
    """Any other per-block parameters (e.g. falcon's none, bert's none) not in a linear or norm."""
    embedding_params: int
    """Token embedding matrix (vocab x hidden)."""
    other_embedding_params: int = 0
    """Learned positions, token types, embedding layer norms, OPT's project_in/out, ..."""
    final_norm_params: int = 0
    head_params: int = 0
    """Output head beyond the token embedding: untied lm_head (+bias), MLM transform, ..."""
    tied_embeddings: bool

    hidden_act: str
    gated_mlp: bool
    """SwiGLU/GeGLU: the MLP has a gate and an up projection multiplied together."""
    norm: str
    """``rmsnorm`` or ``layernorm``."""
    norm_weight_fp32: bool = False
    """The RMSNorm multiplies by its weight in fp32, so it saves the fp32 normalised tensor
    (Gemma: ``output * (1.0 + self.weight.float())``) instead of one in the model's dtype."""
    norm_placement: str = "pre"
    """Where a block's norms over the hidden size sit: ``pre`` one before each sublayer (llama), ``single`` one
    before the block's only sublayer (Nemotron-H: NemotronHBlock, modeling_nemotron_h.py:934-993),
    ``sandwich`` also one after each sublayer's output (Gemma 2/3: ``post_attention_layernorm``
    and ``post_feedforward_layernorm`` besides ``input_layernorm`` and ``pre_feedforward_layernorm``,
    modeling_gemma2.py Gemma2DecoderLayer.forward), ``post`` only after each sublayer's output
    (OLMo 2: modeling_olmo2.py Olmo2DecoderLayer.forward)."""
    qk_norm: str = ""
    """RMSNorms on the query and key projections: ``head`` over head_dim (Qwen3, Gemma 3:
    ``self.q_norm(self.q_proj(x).view(hidden_shape))``), ``projection`` over the whole projection
    (OLMo 2: ``self.q_norm(self.q_proj(x))``), ``l2`` a weightless norm over head_dim after the rotary
    embedding (Llama 4: Llama4TextL2Norm, modeling_llama4.py:106-118), ``""`` none."""
    parallel_block: bool = False
    """Attention and MLP read the same normed input (falcon, phi, gpt_neox with parallel residual)."""
    position: str = "rope"
    """``rope``, ``learned``, ``alibi`` (bloom), ``relative`` (T5's bucketed bias) or ``none``."""
    eager_softmax: str = "fp32"
    """How the eager attention computes its probabilities (transformers' modeling files):
    ``fp32`` softmax(dtype=float32) cast back to q's dtype (llama family, phi, opt, gpt_neox,
    bloom, starcoder2); ``input_then_cast`` softmax in the scores' dtype, cast to v's (gpt2);
    ``input`` softmax in the scores' dtype, cast by the matmul after dropout (bert, roberta);
    ``residual`` softmax(dtype=hidden_states.dtype) (falcon)."""
    attn_dropout: float = 0.0
    hidden_dropout: float = 0.0
    """Dropout probabilities active in train mode (each one > 0 saves a mask for backward)."""
    embedding_dropout: float = 0.0
    """Dropout on the embeddings' output (gpt2's embd_pdrop, BERT's and OPT's shared rate)."""
    embedding_norm: bool = False
    """A LayerNorm on the summed embeddings (BERT's embeddings.LayerNorm, bloom's
    word_embeddings_layernorm)."""
    num_experts: int = 0
    experts_per_token: int = 0
    routing: MoeRouting | None = None
    """How the MoE blocks route their tokens (None: the memory model has no routing terms for
    this architecture's router, which leaves it in ``unmodelled``)."""
    sliding_window: int | None = None
    peft_converts_moe: str = ""
    """The pattern (``mixtral`` or ``qwen2_moe``) by which peft converts a LoRA config of this model
    type from transformers v4's per-expert modules (peft 0.21 utils/transformers_weight_conversion.py
    ``_convert_peft_config_moe``, by the type's entry in transformers' conversion_mapping.py
    ``_MODEL_TO_CONVERSION_PATTERN``: qwen3_moe, olmoe, deepseek_v3, qwen3_next, ... follow
    ``qwen2_moe``'s, which ``qwen2_moe`` itself has none of), so ``all-linear`` also reaches the bare
    expert stacks and routers (``LinearSpec.module`` False) through ``target_parameters``; ""
    (gpt-oss, qwen2_moe): ``all-linear`` wraps the ``nn.Linear`` modules only."""
    lora_refused: tuple[str, ...] = ()
    """nn.Linear leaf names LoRA cannot adapt in this model type, ``all-linear`` included (it reaches them):
    peft refuses them (peft 0.21 tuners/tuners_utils.py:146-162 ``_check_lora_target_modules_mamba``: ``out_proj``
    and ``conv1d`` of the Mamba model types, nemotron_h among them), or wraps them and the forward fails (Llama 4's
    ``router``, an nn.Linear subclass returning a tuple). The planner refuses them in one line naming the targets
    that work (``peft_linear_names``) and why (``lora_refused_why``)."""
    lora_refused_why: str = ""
    sdpa: bool = True
    """transformers has an SDPA path for this architecture; False (gpt-oss:
    ``GptOssPreTrainedModel._supports_sdpa = False``, modeling_gpt_oss.py) means the eager path is what
    runs when SDPA is asked for (``activations`` plans it so)."""
    training_notes: tuple[str, ...] = ()
    """How the checkpoint is assumed to be loaded for training where it is stored otherwise (gpt-oss's
    MXFP4 experts), as ``planner estimate`` states it."""
    latent_attention: LatentAttention | None = None
    """Multi-head latent attention's shapes (DeepSeek-V3); None for q/k/v projections."""
    attention_sinks: bool = False
    """A learned sink logit per head joins each row's softmax (gpt-oss ``self.sinks``,
    modeling_gpt_oss.py eager_attention_forward)."""

    other_blocks: tuple[BlockGroup, ...] = ()
    """Blocks unlike block 0 (heterogeneous decoders); ``num_layers`` counts them too."""
    norm_row_stats: int = 1
    """fp32 per-row tensors each RMSNorm saves besides its input: 1, the rsqrt (LlamaRMSNorm
    ``hidden_states * torch.rsqrt(variance + eps)``); 2 for Gemma 4's ``hidden_states *
    torch.pow(mean_squared, -0.5)`` (modeling_gemma4.py:205-208): pow's backward keeps its base, the
    product its result."""
    sliding_attention: bool = False
    """Block 0's attention is a sliding window of ``sliding_window`` tokens whose mask transformers
    materialises for SDPA once the sequence is longer than the window (masking_utils.py
    create_sliding_window_causal_mask; Gemma 4's ``sliding_attention`` layers; each of ``other_blocks``
    says it for its own blocks). Set by the builders that know their layers' types (Gemma 4)."""
    mixer: str = "attention"
    """Block 0's token mixer: ``attention`` (q/k/v projections and an attention kernel), ``gated_deltanet``
    (``ModelSpec.gated_deltanet``'s linear attention), ``mamba2`` (``ModelSpec.mamba2``'s state-space layer) or
    ``none`` (a block of an MLP or MoE alone: Nemotron-H's); each of ``other_blocks`` says its own."""
    gated_deltanet: GatedDeltaNet | None = None
    """The Gated DeltaNet layers' shapes (Qwen3-Next, Qwen3.5); None without such layers."""
    mamba2: Mamba2 | None = None
    """The Mamba2 layers' shapes (Nemotron-H); None without such layers."""
    attn_output_gate: bool = False
    """The attention output is multiplied by ``sigmoid(gate)``, the gate being the second half of a
    q_proj twice as wide (Qwen3NextAttention.forward, modeling_qwen3_next.py:275-303)."""
    v_norm: bool = False
    """A weightless RMSNorm over each value head (Gemma 4's ``v_norm``, modeling_gemma4.py Gemma4TextAttention),
    which saves its fp32 input and row statistics when the values need a gradient."""
    final_logit_softcap: bool = False
    """The causal-LM head soft-caps its logits, ``tanh(logits / cap) * cap`` (Gemma4ForCausalLM.forward,
    modeling_gemma4.py ``final_logit_softcapping``): tanh keeps its output for backward."""
    unmodelled: tuple[str, ...] = ()
    """Architecture features the memory model has no terms for yet (none of the catalog's builders sets one
    today; the small Gemma 4 models' per-layer embeddings are refused by their builder instead): planning
    such a model is refused rather than answered as if it were dense."""
    wrapper_type: str = ""
    """The multimodal wrapper's ``model_type`` when the config has a ``text_config`` (gemma3,
    qwen3_5, llama4, ...): the spec is then its language model alone (what
    ``AutoModelForCausalLM`` builds from ``text_config``), trained text-only; the vision tower is
    neither counted nor loaded."""
    alias_of: str = ""
    """The catalog id whose config this id resolved to (``-Instruct``/``-it``/``-Chat`` variants
    share their base model's architecture)."""

    # ---- encoder-decoder models (T5): the fields above describe the encoder stack -------------
    decoder_layers: int = 0
    """Blocks of the decoder stack; 0 for a decoder-only or encoder-only model. When > 0,
    ``num_layers``, ``layer_linears``, ``layer_norm_params`` describe the ENCODER's blocks."""
    decoder_linears: tuple[LinearSpec, ...] = ()
    """Every linear layer of one decoder block: self-attention, cross-attention (kinds
    ``CROSS_ATTN_*``), MLP."""
    decoder_norm_params: int = 0
    """Norm weights of one decoder block."""
    relative_attention_buckets: int = 0
    """T5's relative position buckets: the first block of each stack holds a
    ``[buckets, heads]`` embedding (counted in ``other_embedding_params``)."""

    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The config.json as read (``_source`` and other private keys dropped)."""
    source: str = ""
    """Where the config came from: ``catalog``, a file path or the HF cache path."""

    # ---- parameter counts (cached: the search reads them thousands of times; the spec is frozen)
    @functools.cached_property
    def params_per_layer(self) -> int:
        """Parameters of block 0 (every block unless ``other_blocks`` says otherwise)."""
        return sum(lin.params for lin in self.layer_linears) + self.layer_norm_params + self.layer_other_params

    @functools.cached_property
    def blocks_like_first(self) -> int:
        """How many blocks are like block 0."""
        return self.num_layers - sum(g.count for g in self.other_blocks)

    @functools.cached_property
    def block_kinds(self) -> "tuple[tuple[int, int, ModelSpec], ...]":
        """(how many blocks, index of the first, a homogeneous spec of that block) for block 0's kind
        and each of ``other_blocks``: what the activation terms read per block (a dense block of an
        MoE model has no routing and its own MLP's intermediate size; an MoE block keeps the experts').
        One entry, this spec, for a model whose blocks are all alike."""
        if not self.other_blocks:
            return ((self.num_layers, 0, self),)
        first = (self.blocks_like_first, 0, self._block_view(self.layer_linears, self.layer_norm_params))
        return (first,) + tuple((g.count, g.first, self._block_view(g.linears, g.other_params, g))
                                for g in self.other_blocks)

    def _block_view(self, linears: tuple[LinearSpec, ...], other_params: int,
                    group: "BlockGroup | None" = None) -> "ModelSpec":
        stacks = [lin for lin in linears if lin.count > 1 and not lin.module]
        down = [lin for lin in linears if lin.kind is LinearKind.MLP_OUT]
        if stacks:
            inter = next((lin.in_features for lin in stacks if lin.kind is LinearKind.MLP_OUT), self.intermediate_size)
            moe = {}
        else:
            inter = down[0].in_features if down else self.intermediate_size
            moe = {"num_experts": 0, "experts_per_token": 0, "routing": None}
        return dataclasses.replace(self, layer_linears=linears, layer_norm_params=other_params, layer_other_params=0,
                                   other_blocks=(), intermediate_size=inter, **moe, **({} if group is None else {
                                       "head_dim": group.head_dim or self.head_dim,
                                       "num_kv_heads": group.kv_heads or self.num_kv_heads,
                                       "sliding_attention": group.sliding, "mixer": group.mixer,
                                       "qk_norm": self.qk_norm if group.qk_norm is None else group.qk_norm}))

    def block_at(self, index: int) -> "ModelSpec":
        """The homogeneous spec (``block_kinds``) of block ``index``."""
        for _, first, view in self.block_kinds[1:]:
            group = next(g for g in self.other_blocks if g.first == first)
            if index in group.indices:
                return view
        return self.block_kinds[0][2]

    @functools.cached_property
    def linears_by_kind(self) -> "Mapping[LinearKind, tuple[LinearSpec, ...]]":
        """One block's linears grouped by kind (the activation terms ask for them per block)."""
        return {kind: tuple(lin for lin in self.layer_linears if lin.kind is kind) for kind in LinearKind}

    @functools.cached_property
    def linear_params_per_layer(self) -> int:
        return sum(lin.params for lin in self.layer_linears)

    @functools.cached_property
    def decoder_params_per_layer(self) -> int:
        """Parameters of one decoder block of an encoder-decoder model (0 otherwise)."""
        return sum(lin.params for lin in self.decoder_linears) + self.decoder_norm_params

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder_layers > 0

    @functools.cached_property
    def stacks(self) -> tuple[tuple[int, tuple[LinearSpec, ...]], ...]:
        """(blocks, linears of one block) of each stack: the one stack of a decoder-only or
        encoder-only model, the encoder's and the decoder's of an encoder-decoder."""
        out = ((self.num_layers, self.layer_linears),)
        return out + ((self.decoder_layers, self.decoder_linears),) if self.decoder_layers else out

    @functools.cached_property
    def decoder_view(self) -> "ModelSpec":
        """An encoder-decoder seen from its decoder stack: a decoder block's linears and norms in
        the fields that describe a block (``num_layers``, ``layer_linears``, ``layer_norm_params``)."""
        return dataclasses.replace(self, num_layers=self.decoder_layers, layer_linears=self.decoder_linears,
                                   layer_norm_params=self.decoder_norm_params, decoder_layers=0, decoder_linears=(),
                                   decoder_norm_params=0)

    @functools.cached_property
    def all_blocks(self) -> tuple[tuple[int, tuple[LinearSpec, ...]], ...]:
        """(blocks, linears of one block) of every kind of block: ``stacks`` with the blocks like
        block 0 counted apart from ``other_blocks``."""
        first = ((self.blocks_like_first, self.layer_linears),)
        rest = tuple((g.count, g.linears) for g in self.other_blocks)
        dec = ((self.decoder_layers, self.decoder_linears),) if self.decoder_layers else ()
        return first + rest + dec

    @functools.cached_property
    def block_tensors(self) -> tuple[tuple[int, tuple[LinearSpec, ...], int], ...]:
        """(blocks, linears of one block, its norm and other small parameters) of every kind of block,
        in ``all_blocks``' order: what a block holds besides its linears, each kind its own."""
        norms = ([self.layer_norm_params + self.layer_other_params] + [g.other_params for g in self.other_blocks]
                 + [self.decoder_norm_params])
        return tuple((n, linears, norm) for (n, linears), norm in zip(self.all_blocks, norms))

    @functools.cached_property
    def block_linear_params(self) -> int:
        """Parameters of every block's linear layers, over all stacks."""
        return sum(n * sum(lin.params for lin in linears) for n, linears in self.all_blocks)

    @functools.cached_property
    def params_total(self) -> int:
        return (
            self.embedding_params
            + self.other_embedding_params
            + self.blocks_like_first * self.params_per_layer
            + sum(g.count * g.params for g in self.other_blocks)
            + self.decoder_layers * self.decoder_params_per_layer
            + self.final_norm_params
            + self.head_params
        )

    @functools.cached_property
    def params_active(self) -> int:
        """Parameters each token passes through (differs from the total for MoE)."""
        inactive = sum(n * sum(lin.params - lin.active_params for lin in linears) for n, linears in self.all_blocks)
        return self.params_total - inactive

    @functools.cached_property
    def fused_qkv(self) -> bool:
        """q, k and v come out of one projection (phi3's qkv_proj, gpt_neox's query_key_value)."""
        if self.attn_output_gate or self.mixer != "attention":
            return False  # q_proj's second half is the output gate; a linear-attention block has no q/k/v
        return any(lin.kind is LinearKind.ATTN_IN and lin.out_features > self.num_heads * self.head_dim
                   for lin in self.layer_linears)

    @functools.cached_property
    def has_mlp(self) -> bool:
        """Block 0 has an MLP (dense, or routed experts): not a Nemotron-H block of a token mixer alone."""
        return any(lin.kind in (LinearKind.MLP_IN, LinearKind.MLP_OUT) for lin in self.layer_linears)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def lm_head_params(self) -> int:
        """Parameters of the vocab projection matmul (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    def linear_names(self) -> tuple[str, ...]:
        return self._linear_names

    @functools.cached_property
    def module_names(self) -> frozenset[str]:
        """Leaf names of the blocks' nn.Linear modules (what peft's ``target_modules`` can match)."""
        return frozenset(lin.name for _, linears in self.all_blocks for lin in linears if lin.module)

    @functools.cached_property
    def peft_linear_names(self) -> tuple[str, ...]:
        """The nn.Linear leaf names peft wraps (``module_names`` but ``lora_refused``), in the blocks' order: what
        ``all-linear`` means for a model whose type peft refuses it on."""
        return tuple(n for n in self._linear_names if n in self.module_names and n not in self.lora_refused)

    @functools.cached_property
    def _linear_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(lin.name for _, linears in self.all_blocks for lin in linears))

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "architecture": self.model_type,
            "params": self.params_total,
            "active_params": self.params_active,
            "moe": self.is_moe,
            "experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "not_modelled": list(self.unmodelled),
            "language_model_of": self.wrapper_type or None,
            "layers": self.num_layers + self.decoder_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
        }
