"""config.json -> ``ModelSpec``: one builder per supported ``model_type``.

Each builder mirrors the module tree transformers (v5) builds for training: decoders as
``AutoModelForCausalLM``, bert/roberta as ``AutoModelForMaskedLM``. Every parameter-holding
module is listed so that ``ModelSpec.params_total`` equals ``sum(p.numel() for p in
model.parameters())`` exactly (tests/catalog/test_param_counts.py checks it on the meta device for every
catalog model), and ``layer_linears`` names each linear layer by its leaf module name, which is
what peft's ``target_modules`` matches.

Missing keys take transformers' own defaults, read from
``transformers/models/<type>/configuration_<type>.py`` (v5.23); each default is written next to
the key. The dimensions that define a model (hidden size, layers, heads, vocabulary and, where
transformers does not derive it, the MLP width) have no sensible default and are required:
falling back to a 7B-sized default for a 0.5B model would be a silent hole.

Pure module: no torch, no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from planner.catalog import modern
from planner.catalog.blocks import (
    FUSED_QKV_NAMES,
    ConfigReader,
    K,
    common_fields,
    fused_qkv_block,
    lin,
    qkvo,
    short,
    swiglu,
    two_layer_mlp,
    untied_head,
)
from planner.catalog.t5 import t5_fields
from planner.errors import ModelConfigError, UnsupportedError
from planner.modelspec import ModelSpec

# ---- llama family: llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2 -----------------------------

#: transformers v5 defaults per model type for the keys the llama-family builder reads
#: (configuration_<type>.py): tie_word_embeddings, max_position_embeddings, head_dim, and
#: num_key_value_heads when the key is absent (llama: = num_attention_heads).
_LLAMA_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie": False, "max_pos": 2048},
    "mistral": {"tie": False, "max_pos": 131072, "sliding_window": 4096, "kv": 8},
    "mixtral": {"tie": False, "max_pos": 131072, "kv": 8},
    "qwen2": {"tie": False, "max_pos": 32768, "kv": 32},
    "qwen3": {"tie": False, "max_pos": 32768, "head_dim": 128, "kv": 32},
    "gemma": {"tie": True, "max_pos": 8192, "head_dim": 256, "kv": 16},
    "gemma2": {"tie": True, "max_pos": 8192, "head_dim": 256, "sliding_window": 4096, "kv": 4},
}


def _llama_family(c: ConfigReader, model_type: str) -> dict[str, Any]:
    d = _LLAMA_FAMILY_DEFAULTS[model_type]
    hidden = c.size("hidden_size")
    layers = c.size("num_hidden_layers")
    heads = c.size("num_attention_heads")
    vocab = c.size("vocab_size")
    inter = c.size("intermediate_size")
    # llama reads config.head_dim when set (modeling_llama.py: getattr(config, "head_dim", ...)),
    # gemma/gemma2/qwen3 default it to a fixed number rather than hidden/heads.
    kv, head_dim = c.heads(
        hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=d.get("kv"),
        head_dim_key=True, head_dim_default=d.get("head_dim"),
    )

    attention_bias = c.flag("attention_bias", False)  # llama/qwen3/gemma: default False
    if model_type == "qwen2":
        # modeling_qwen2.py: q/k/v always carry a bias, o_proj never (attention_bias is not read).
        qkv_bias, o_bias = True, False
    elif model_type == "mistral" or model_type == "mixtral":
        qkv_bias = o_bias = False  # modeling_mistral.py / modeling_mixtral.py: bias=False
    else:
        qkv_bias = o_bias = attention_bias
    linears = qkvo(hidden, heads, kv, head_dim, qkv_bias=qkv_bias, o_bias=o_bias)

    experts = top_k = 0
    if model_type == "mixtral":
        experts = c.size("num_local_experts", default=8)
        top_k = c.size("num_experts_per_tok", default=2)
        if top_k > experts:
            raise c.error(f"num_experts_per_tok {top_k} is larger than num_local_experts {experts}")
        # transformers v5 keeps the experts as two 3D parameters of mlp.experts (MixtralExperts:
        # gate_up_proj [E, 2I, H], down_proj [E, H, I]) and the router as mlp.gate.weight [E, H]
        # (MixtralTopKRouter): not nn.Linear modules, so peft reaches them via target_parameters
        # (all-linear too: peft converts it for Mixtral, the fused gate_up at twice the rank).
        linears += [lin("gate", hidden, experts, False, K.ROUTER, module=False),
                    *modern.experts(hidden, inter, experts, top_k, peft_fused=True)]
    else:
        mlp_bias = c.flag("mlp_bias", False) if model_type == "llama" else False
        linears += swiglu(hidden, inter, bias=mlp_bias)

    # RMSNorm: weight only. gemma2 has four per layer (input, post_attention, pre_feedforward,
    # post_feedforward: modeling_gemma2.py Gemma2DecoderLayer); qwen3 adds q_norm/k_norm over head_dim.
    norms = (4 if model_type == "gemma2" else 2) * hidden
    if model_type == "qwen3":
        norms += 2 * head_dim

    if model_type == "gemma":
        act = c.text("hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
        # configuration_gemma.py rewrites the legacy "gelu" to the tanh approximation it meant.
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    elif model_type == "gemma2":
        act = c.text("hidden_activation", default="gelu_pytorch_tanh")
    else:
        act = c.text("hidden_act", default="silu")

    tied = c.flag("tie_word_embeddings", d["tie"])
    sliding: int | None = None
    if model_type in ("qwen2", "qwen3"):
        # Qwen only uses its window when use_sliding_window is true (default False).
        if c.flag("use_sliding_window", False):
            sliding = c.size("sliding_window")
    elif model_type in ("mistral", "mixtral", "gemma2"):
        # null = full attention; absent = the config class default
        sliding = c.optional_size("sliding_window") if "sliding_window" in c.raw else d.get("sliding_window")
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("max_position_embeddings", default=d["max_pos"]),
        layer_linears=tuple(linears), layer_norm_params=norms,
        embedding_params=vocab * hidden, final_norm_params=hidden,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=act, gated_mlp=True, norm="rmsnorm", norm_weight_fp32=model_type in ("gemma", "gemma2"),
        position="rope", attn_dropout=c.prob("attention_dropout"), hidden_dropout=0.0,
        num_experts=experts, experts_per_token=top_k, sliding_window=sliding,
        routing=modern.mixtral_routing(c) if model_type == "mixtral" else None,
        peft_converts_moe="mixtral" if model_type == "mixtral" else "",
        norm_placement="sandwich" if model_type == "gemma2" else "pre", qk_norm="head" if model_type == "qwen3" else "",
    )


# ---- phi (phi-1/1.5/2) and phi3 (phi-3, phi-4) ------------------------------------------------------


def _phi(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, inter = c.size("num_attention_heads"), c.size("vocab_size"), c.size("intermediate_size")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads")
    # modeling_phi.py PhiAttention: q/k/v and `dense` all carry a bias; fc1/fc2 too; one
    # input_layernorm (LayerNorm, weight+bias) per parallel block; optional q/k LayerNorms.
    linears = qkvo(hidden, heads, kv, head_dim, qkv_bias=True, o_bias=True, o_name="dense")
    linears += two_layer_mlp(("fc1", "fc2"), hidden, inter, bias=True)
    norms = 2 * hidden + (2 * 2 * head_dim if c.flag("qk_layernorm", False) else 0)
    tied = c.flag("tie_word_embeddings", False)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("max_position_embeddings", default=2048),
        layer_linears=tuple(linears), layer_norm_params=norms,
        embedding_params=vocab * hidden, final_norm_params=2 * hidden,
        # PhiForCausalLM: lm_head = nn.Linear(hidden, vocab, bias=True)
        head_params=untied_head(vocab, hidden, tied=tied, bias=True), tied_embeddings=tied,
        hidden_act=c.text("hidden_act", default="gelu_new"), gated_mlp=False, norm="layernorm",
        parallel_block=True, position="rope",
        attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("resid_pdrop"),
        embedding_dropout=c.prob("embd_pdrop"),
    )


def _phi3(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, inter = c.size("num_attention_heads"), c.size("vocab_size"), c.size("intermediate_size")
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads")
    # modeling_phi3.py: fused qkv_proj (heads + 2 kv) * head_dim and gate_up_proj 2 * I, no biases.
    linears = (
        lin("qkv_proj", hidden, (heads + 2 * kv) * head_dim, False, K.ATTN_IN),
        lin("o_proj", heads * head_dim, hidden, False, K.ATTN_OUT),
        lin("gate_up_proj", hidden, 2 * inter, False, K.MLP_IN),
        lin("down_proj", inter, hidden, False, K.MLP_OUT),
    )
    tied = c.flag("tie_word_embeddings", False)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("max_position_embeddings", default=4096),
        layer_linears=linears, layer_norm_params=2 * hidden,
        embedding_params=vocab * hidden, final_norm_params=hidden,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=c.text("hidden_act", default="silu"), gated_mlp=True, norm="rmsnorm", position="rope",
        attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("resid_pdrop"),
        embedding_dropout=c.prob("embd_pdrop"), sliding_window=c.optional_size("sliding_window"),
    )


# ---- starcoder2 --------------------------------------------------------------------------------------


def _starcoder2(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, inter = c.size("num_attention_heads"), c.size("vocab_size"), c.size("intermediate_size")
    # configuration_starcoder2.py: num_key_value_heads defaults to 2
    kv, head_dim = c.heads(hidden=hidden, heads=heads, kv_key="num_key_value_heads", kv_default=2)
    bias = c.flag("use_bias", True)  # configuration_starcoder2.py: use_bias=True
    linears = qkvo(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
    linears += two_layer_mlp(("c_fc", "c_proj"), hidden, inter, bias=bias)
    tied = c.flag("tie_word_embeddings", True)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("max_position_embeddings", default=4096),
        # two nn.LayerNorm (weight+bias) per layer and a final one (modeling_starcoder2.py)
        layer_linears=tuple(linears), layer_norm_params=4 * hidden,
        embedding_params=vocab * hidden, final_norm_params=2 * hidden,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=c.text("hidden_act", default="gelu_pytorch_tanh"), gated_mlp=False, norm="layernorm",
        position="rope", attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("residual_dropout"),
        embedding_dropout=c.prob("embedding_dropout"), sliding_window=c.optional_size("sliding_window"),
    )


# ---- gpt2, gpt_neox, opt, bloom, falcon -------------------------------------------------------------


def _gpt2(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("n_embd", "hidden_size"), c.size("n_layer", "num_hidden_layers")
    heads, vocab = c.size("n_head", "num_attention_heads"), c.size("vocab_size")
    if c.flag("add_cross_attention", False):
        raise UnsupportedError(
            f"{c.source}: gpt2 with add_cross_attention is an encoder-decoder part; not supported"
        )
    inter = c.size("n_inner", default=4 * hidden)  # modeling_gpt2.py: n_inner or 4 * hidden
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    positions = c.size("n_positions", "max_position_embeddings", default=1024)
    # HF Conv1D stores weights as [in, out]; the math sees (in_features, out_features) as for Linear.
    names = ("c_attn", "c_proj", "c_fc", "c_proj")
    linears = fused_qkv_block(names, hidden, 3 * hidden, inter, attn_bias=True, mlp_bias=True)
    tied = c.flag("tie_word_embeddings", True)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=heads, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=positions, layer_linears=linears, layer_norm_params=4 * hidden,
        embedding_params=vocab * hidden, other_embedding_params=positions * hidden,  # wpe
        final_norm_params=2 * hidden, head_params=untied_head(vocab, hidden, tied=tied),
        tied_embeddings=tied,
        hidden_act=c.text("activation_function", default="gelu_new"), gated_mlp=False, norm="layernorm",
        position="learned", attn_dropout=c.prob("attn_pdrop", default=0.1),
        hidden_dropout=c.prob("resid_pdrop", default=0.1), embedding_dropout=c.prob("embd_pdrop", default=0.1),
        eager_softmax="input_then_cast",
    )


def _gpt_neox(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, inter = c.size("num_attention_heads"), c.size("vocab_size"), c.size("intermediate_size")
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    bias = c.flag("attention_bias", True)
    # modeling_gpt_neox.py: fused query_key_value and dense (bias=attention_bias), MLP always biased.
    linears = fused_qkv_block(FUSED_QKV_NAMES, hidden, 3 * hidden, inter, attn_bias=bias, mlp_bias=True)
    tied = c.flag("tie_word_embeddings", False)  # separate embed_out/lm_head by default
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=heads, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("max_position_embeddings", default=2048),
        layer_linears=linears, layer_norm_params=4 * hidden,
        embedding_params=vocab * hidden, final_norm_params=2 * hidden,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=c.text("hidden_act", default="gelu"), gated_mlp=False, norm="layernorm",
        parallel_block=c.flag("use_parallel_residual", True), position="rope",
        # GPTNeoXModel.emb_dropout uses hidden_dropout too
        attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("hidden_dropout"),
        embedding_dropout=c.prob("hidden_dropout"),
    )


def _opt(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, ffn = c.size("num_attention_heads"), c.size("vocab_size"), c.size("ffn_dim")
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    proj = c.size("word_embed_proj_dim", default=hidden)
    bias = c.flag("enable_bias", True)
    affine = c.flag("layer_norm_elementwise_affine", True)
    max_pos = c.size("max_position_embeddings", default=2048)
    linears = qkvo(hidden, heads, heads, head_dim, qkv_bias=bias, o_bias=bias, o_name="out_proj")
    linears += two_layer_mlp(("fc1", "fc2"), hidden, ffn, bias=bias)
    norm = 2 * hidden if affine else 0
    # OPTLearnedPositionalEmbedding keeps 2 extra rows (offset 2, modeling_opt.py); opt-350m style
    # models embed in word_embed_proj_dim and add bias-free project_in/project_out.
    other = (max_pos + 2) * hidden + (2 * proj * hidden if proj != hidden else 0)
    # The final LayerNorm exists only for pre-norm checkpoints without the legacy
    # _remove_final_layer_norm flag (modeling_opt.py OPTDecoder.__init__).
    has_final = c.flag("do_layer_norm_before", True) and not c.flag("_remove_final_layer_norm", False)
    final = norm if has_final else 0
    tied = c.flag("tie_word_embeddings", True)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=heads, head_dim=head_dim, intermediate_size=ffn,
        max_seq_len=max_pos, layer_linears=tuple(linears), layer_norm_params=2 * norm,
        embedding_params=vocab * proj, other_embedding_params=other, final_norm_params=final,
        head_params=untied_head(vocab, proj, tied=tied), tied_embeddings=tied,
        hidden_act=c.text("activation_function", default="relu"), gated_mlp=False, norm="layernorm",
        position="learned", attn_dropout=c.prob("attention_dropout"),
        # OPTDecoder drops out the embeddings with the same probability
        hidden_dropout=c.prob("dropout", default=0.1), embedding_dropout=c.prob("dropout", default=0.1),
    )


#: BLOOM's config has no position limit (ALiBi has no position table); it was trained on
#: 2048-token sequences (BigScience, "BLOOM", arXiv:2211.05100, section 3.5), so that is the
#: length we plan for unless the config names a ``seq_length``.
BLOOM_DEFAULT_SEQ_LEN = 2048


def _bloom(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size", "n_embed"), c.size("n_layer", "num_hidden_layers")
    heads, vocab = c.size("n_head", "num_attention_heads"), c.size("vocab_size")
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    inter = 4 * hidden  # modeling_bloom.py BloomMLP: fixed 4 * hidden (n_inner is not read)
    linears = fused_qkv_block(FUSED_QKV_NAMES, hidden, 3 * hidden, inter, attn_bias=True, mlp_bias=True)
    tied = c.flag("tie_word_embeddings", True)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=heads, head_dim=head_dim, intermediate_size=inter,
        max_seq_len=c.size("seq_length", default=BLOOM_DEFAULT_SEQ_LEN),
        layer_linears=linears, layer_norm_params=4 * hidden,
        embedding_params=vocab * hidden, other_embedding_params=2 * hidden,  # word_embeddings_layernorm
        embedding_norm=True,
        final_norm_params=2 * hidden, head_params=untied_head(vocab, hidden, tied=tied),
        tied_embeddings=tied,
        # bloom_gelu_forward (modeling_bloom.py) is the tanh approximation of GELU
        hidden_act="gelu_pytorch_tanh", gated_mlp=False, norm="layernorm", position="alibi",
        attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("hidden_dropout"),
    )


def _falcon(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden = c.size("hidden_size", "n_embed")
    layers, heads = c.size("num_hidden_layers", "n_layer"), c.size("num_attention_heads", "n_head")
    vocab = c.size("vocab_size")
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    new_arch = c.flag("new_decoder_architecture", False)
    multi_query = c.flag("multi_query", True)
    parallel = c.flag("parallel_attn", True)
    bias = c.flag("bias", False)
    # modeling_falcon.py FalconAttention: the fused query_key_value has (heads + 2 kv) heads with
    # the new architecture, heads + 2 (one shared k/v head) with multi_query, else 3 * heads.
    if new_arch:
        kv = c.size("num_kv_heads", default=heads)
    elif multi_query:
        kv = 1
    else:
        kv = heads
    if heads % kv:
        raise c.error(f"num_attention_heads {heads} is not a multiple of num_kv_heads {kv}")
    inter = c.size("ffn_hidden_size", default=4 * hidden)
    qkv_out = (heads + 2 * kv) * head_dim
    linears = fused_qkv_block(FUSED_QKV_NAMES, hidden, qkv_out, inter, attn_bias=bias, mlp_bias=bias)
    # FalconDecoderLayer: two LayerNorms unless parallel_attn with one (num_ln_in_parallel_attn
    # defaults to 2 for the new architecture, else 1).
    num_ln = c.size("num_ln_in_parallel_attn", default=2 if new_arch else 1) if parallel else 2
    norms = (2 if num_ln == 2 else 1) * 2 * hidden
    tied = c.flag("tie_word_embeddings", True)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        # configuration_falcon.py: max_position_embeddings defaults to 2048 (falcon-7b/40b's
        # training length); the rotary cache is built for it.
        max_seq_len=c.size("max_position_embeddings", default=2048),
        layer_linears=linears, layer_norm_params=norms,
        embedding_params=vocab * hidden, final_norm_params=2 * hidden,
        head_params=untied_head(vocab, hidden, tied=tied), tied_embeddings=tied,
        hidden_act=c.text("activation", default="gelu"), gated_mlp=False, norm="layernorm",
        parallel_block=parallel or new_arch, position="alibi" if c.flag("alibi", False) else "rope",
        eager_softmax="residual",
        attn_dropout=c.prob("attention_dropout"), hidden_dropout=c.prob("hidden_dropout"),
    )


# ---- encoders: bert, roberta --------------------------------------------------------------------------


def _bert_like(c: ConfigReader, model_type: str) -> dict[str, Any]:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    heads, vocab, inter = c.size("num_attention_heads"), c.size("vocab_size"), c.size("intermediate_size")
    _, head_dim = c.heads(hidden=hidden, heads=heads, kv_key=None)
    max_pos = c.size("max_position_embeddings", default=512)
    types = c.size("type_vocab_size", default=2)
    # modeling_bert.py BertLayer: query/key/value, attention.output.dense, intermediate.dense,
    # output.dense, all biased; two LayerNorms (weight+bias).
    linears = (
        lin("query", hidden, hidden, True, K.ATTN_IN),
        lin("key", hidden, hidden, True, K.ATTN_IN),
        lin("value", hidden, hidden, True, K.ATTN_IN),
        lin("dense", hidden, hidden, True, K.ATTN_OUT),
        lin("dense", hidden, inter, True, K.MLP_IN),
        lin("dense", inter, hidden, True, K.MLP_OUT),
    )
    if model_type == "roberta":
        # Positions start at padding_idx + 1 (modeling_roberta.py create_position_ids_*), so
        # max_position_embeddings (514 for roberta) carries pad_token_id + 1 unusable rows.
        pad = c.raw.get("pad_token_id", 1)
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise c.error(f"pad_token_id must be a whole number >= 0, got {short(pad)}")
        max_seq = max_pos - (pad + 1)
        if max_seq < 1:
            raise c.error(
                f"max_position_embeddings {max_pos} leaves no positions after the padding offset {pad + 1}"
            )
    else:
        max_seq = max_pos
    tied = c.flag("tie_word_embeddings", True)
    # ForMaskedLM builds the encoder with add_pooling_layer=False: no pooler. Its head is a
    # transform dense (h*h + h) + LayerNorm (2h) and a vocab bias. _tied_weights_keys ties
    # decoder.weight to the word embedding and decoder.bias to that bias, but only when
    # tie_word_embeddings is on: untied, the decoder keeps its own weight and bias.
    transform = hidden * hidden + hidden + 2 * hidden
    head = transform + vocab + untied_head(vocab, hidden, tied=tied, bias=not tied)
    return dict(
        common_fields(model_type=model_type, hidden=hidden, layers=layers, heads=heads, vocab=vocab),
        is_encoder=True, num_kv_heads=heads, head_dim=head_dim, intermediate_size=inter, max_seq_len=max_seq,
        layer_linears=linears, layer_norm_params=4 * hidden,
        embedding_params=vocab * hidden,
        # positions, token types, embeddings LayerNorm
        other_embedding_params=max_pos * hidden + types * hidden + 2 * hidden,
        head_params=head, tied_embeddings=tied,
        hidden_act=c.text("hidden_act", default="gelu"), gated_mlp=False, norm="layernorm",
        position="learned",
        attn_dropout=c.prob("attention_probs_dropout_prob", default=0.1),
        # BertEmbeddings drops out the summed embeddings with the same probability
        hidden_dropout=c.prob("hidden_dropout_prob", default=0.1),
        embedding_dropout=c.prob("hidden_dropout_prob", default=0.1), embedding_norm=True,
        eager_softmax="input",
    )


# ---- encoder-decoder: t5 (planner/catalog/t5.py) --------------------------------------------------------


# ---- dispatch -------------------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[ConfigReader, str], dict[str, Any]]] = {
    **{t: _llama_family for t in _LLAMA_FAMILY_DEFAULTS},
    "phi": _phi,
    "phi3": _phi3,
    "starcoder2": _starcoder2,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "bloom": _bloom,
    "falcon": _falcon,
    "bert": _bert_like,
    "roberta": _bert_like,
    "t5": t5_fields,
    "granite": modern.granite,
    "olmo2": modern.olmo2,
    "gemma3_text": modern.gemma3_text,
    "qwen3_moe": modern.qwen3_moe,
    "qwen2_moe": modern.qwen2_moe,
    "gpt_oss": modern.gpt_oss,
    "deepseek_v3": modern.deepseek_v3,
    "llama4_text": modern.llama4_text,
    "qwen3_next": modern.qwen_hybrid,
    "qwen3_5_text": modern.qwen_hybrid,
    "qwen3_5_moe_text": modern.qwen_hybrid,
    "nemotron_h": modern.nemotron_h,
    "gemma4_text": modern.gemma4_text,
}

#: multimodal wrappers (image-text-to-text) -> the model_type of their ``text_config``: the
#: planner plans the language model, trained text-only (``ModelSpec.wrapper_type``)
WRAPPERS = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}

#: model types transformers 5.24 has no class for: the checkpoint ships its own modeling code
#: (``auto_map`` in its config.json, loaded with trust_remote_code=True), which the planner does
#: not run; the fix for each
REMOTE_CODE = {
    "kimi_k2": "Kimi-K2 is DeepSeek-V3's architecture (its config names DeepseekV3ForCausalLM): plan it "
               "from a copy of its config.json with \"model_type\": \"deepseek_v3\"",
    "nemotron-nas": "its blocks are searched per layer (block_configs: some without attention or MLP) "
                    "and no built-in transformers class builds them; plan a model of a built-in architecture",
}

#: model types that are recognised but have no builder yet, with the reason
_UNSUPPORTED = {
    "mt5": "encoder-decoder",
    "bart": "encoder-decoder",
    "whisper": "encoder-decoder",
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted({*_BUILDERS, *(w for w, t in WRAPPERS.items() if t in _BUILDERS)}))

#: model types trained as masked LMs (AutoModelForMaskedLM); every other type is a causal decoder
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta"})


def _wrapper_spec(config: Mapping[str, Any], model_type: str, *, model_id: str, source: str) -> ModelSpec:
    """The language model of a multimodal wrapper: its ``text_config`` built as a causal LM (what
    ``AutoModelForCausalLM.from_config(config.get_text_config())`` builds), the wrapper's
    ``tie_word_embeddings`` applying when the text config has none."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelConfigError(f"{source}: model_type {model_type} is a multimodal wrapper: its config needs a "
                               "text_config object (the language model's config)")
    text = {**text, "model_type": WRAPPERS[model_type]}
    if text.get("tie_word_embeddings") is None and config.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    fields = _BUILDERS[text["model_type"]](ConfigReader(text, f"{source} (text_config)"), text["model_type"])
    return ModelSpec(id=model_id, config=public_config(config), source=source, wrapper_type=model_type, **fields)


def public_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without private ``_`` keys (``_source``, ``_name_or_path``, ...)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def spec_from_config(config: Mapping[str, Any], *, model_id: str, source: str) -> ModelSpec:
    """Build the ``ModelSpec`` of a config.json mapping.

    Raises ``ModelConfigError`` (one line naming ``source``) for a config that is not a model
    description and ``UnsupportedError`` for a known architecture without a builder.
    """
    if not isinstance(config, Mapping):
        raise ModelConfigError(f"{source}: a config.json must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if not isinstance(model_type, str) or not model_type:
        raise ModelConfigError(f"{source}: missing model_type (one of {supported})")
    if model_type in REMOTE_CODE:
        where = f"catalog id {model_id}" if source == "catalog" else source
        raise ModelConfigError(
            f"{where}: model_type {model_type} needs the model's own code (trust_remote_code=True), which the "
            f"planner does not run; {REMOTE_CODE[model_type]}"
        )
    if model_type in WRAPPERS and WRAPPERS[model_type] in _BUILDERS:
        return _wrapper_spec(config, model_type, model_id=model_id, source=source)
    if model_type in _UNSUPPORTED:
        raise UnsupportedError(
            f"{source}: model_type {model_type} ({_UNSUPPORTED[model_type]}) is not supported yet; "
            f"supported: {supported}"
        )
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise ModelConfigError(f"{source}: unknown model_type {short(model_type)}; supported: {supported}")
    fields = builder(ConfigReader(config, source), model_type)
    if not fields.get("training_notes") and (note := _quantized_checkpoint_note(config)):
        fields["training_notes"] = (note,)  # (gpt-oss and DeepSeek-V3 say their own: catalog/modern.py)
    return ModelSpec(id=model_id, config=public_config(config), source=source, **fields)


def _quantized_checkpoint_note(config: Mapping[str, Any]) -> str | None:
    """What a plan says of a checkpoint that ships quantized weights (config.json ``quantization_config``:
    GPTQ, AWQ, bitsandbytes, FP8, compressed-tensors, ...): its counts are the 16-bit model's, which full
    fine-tuning and LoRA load de-quantized and QLoRA quantizes with bitsandbytes itself; peft over the
    checkpoint's own quantized kernels is not modelled, and the plan says so rather than planning it silently."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, Mapping):
        return None
    method = quantization.get("quant_method")
    method = method[:40] if isinstance(method, str) and method.strip() else "quantized"
    return (f"{method} checkpoint: planned as the 16-bit model it de-quantizes to (--method qlora: bitsandbytes' "
            f"NF4 of it); training on its {method} weights directly is not modelled")
