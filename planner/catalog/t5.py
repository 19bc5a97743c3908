"""config.json -> ``ModelSpec`` fields of T5 (v1.0 and v1.1 / Flan-T5): an encoder-decoder.

Mirrors ``T5ForConditionalGeneration`` of transformers 5.23 (``models/t5/modeling_t5.py``, line
numbers of that file):

* one shared token embedding (``shared``, l.912) used by both stacks and by the output head:
  ``_tied_weights_keys`` ties ``lm_head.weight`` to ``shared.weight`` (l.902-906) and
  ``T5Config.__post_init__`` forces ``tie_word_embeddings = True`` (configuration_t5.py l.82-83).
  A v1.1 config's ``"tie_word_embeddings": false`` only turns off the ``d_model ** -0.5`` scaling
  of the decoder output before the head (``scale_decoder_outputs``, l.1044-1045): in transformers
  v5 the head is tied either way, so it adds no parameters;
* encoder blocks (``T5Block``, l.437): self-attention q/k/v (d_model -> heads * d_kv) and o
  (heads * d_kv -> d_model), no biases (l.206-209), then the MLP: ``wi``/``wo`` (v1.0, relu) or
  ``wi_0``/``wi_1``/``wo`` (``feed_forward_proj = "gated-gelu"``, v1.1; l.75-123); one
  ``T5LayerNorm`` (weight only, RMS style, l.50-72) before each sub-layer;
* decoder blocks add cross-attention (``EncDecAttention``, l.403) with its own norm;
* the first block of each stack holds ``relative_attention_bias``, an embedding
  ``[relative_attention_num_buckets, heads]`` (l.211-212, 648); every other block reuses the
  position bias the first one computed (l.739-742);
* a final ``T5LayerNorm`` per stack (l.650).

``d_kv * num_heads`` need not equal ``d_model`` (t5-11b: 128 heads of 128 with d_model 1024).
Pure module: no torch, no I/O.
"""

from __future__ import annotations

from typing import Any

from planner.catalog.blocks import ConfigReader, common_fields, lin
from planner.modelspec import LinearKind as K
from planner.modelspec import LinearSpec

#: Sequence length T5 was pre-trained on (Raffel et al. 2020, "Exploring the Limits of Transfer
#: Learning", sec. 3.1.2: 512 tokens); relative positions set no hard limit, so a config without
#: ``n_positions`` is planned for this length.
T5_DEFAULT_SEQ_LEN = 512


def _mlp(c: ConfigReader, d_model: int, d_ff: int) -> tuple[list[LinearSpec], str, bool]:
    """(MLP linears, activation, gated): ``feed_forward_proj`` is ``ACT`` or ``gated-ACT``;
    ``gated-gelu`` means ``gelu_new`` (configuration_t5.py l.69-75)."""
    proj = c.text("feed_forward_proj", default="relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise c.error(f"feed_forward_proj must be 'ACT' or 'gated-ACT' (e.g. relu, gated-gelu), got {proj!r}")
    gated, act = len(parts) == 2, parts[-1]
    if proj == "gated-gelu":
        act = "gelu_new"
    if gated:
        linears = [lin("wi_0", d_model, d_ff, False, K.MLP_IN), lin("wi_1", d_model, d_ff, False, K.MLP_IN)]
    else:
        linears = [lin("wi", d_model, d_ff, False, K.MLP_IN)]
    return linears + [lin("wo", d_ff, d_model, False, K.MLP_OUT)], act, gated


def _attention(d_model: int, inner: int, *, cross: bool) -> list[LinearSpec]:
    k_in, k_out = (K.CROSS_ATTN_IN, K.CROSS_ATTN_OUT) if cross else (K.ATTN_IN, K.ATTN_OUT)
    return [
        lin("q", d_model, inner, False, k_in),
        lin("k", d_model, inner, False, k_in),
        lin("v", d_model, inner, False, k_in),
        lin("o", inner, d_model, False, k_out),
    ]


def t5_fields(c: ConfigReader, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a T5 config. The sizes that define the model are required
    (T5Config's defaults describe t5-small, a silent hole for any other model); the rest take
    T5Config's defaults (configuration_t5.py l.44-62)."""
    d_model, layers = c.size("d_model"), c.size("num_layers")
    heads, vocab, d_ff, d_kv = c.size("num_heads"), c.size("vocab_size"), c.size("d_ff"), c.size("d_kv")
    decoder_layers = c.size("num_decoder_layers", default=layers)  # "default = symmetry" (l.65-67)
    buckets = c.size("relative_attention_num_buckets", default=32)
    inner = heads * d_kv
    mlp, act, gated = _mlp(c, d_model, d_ff)
    dropout = c.prob("dropout_rate", default=0.1)
    return dict(
        common_fields(model_type=model_type, hidden=d_model, layers=layers, heads=heads, vocab=vocab),
        is_encoder=False, num_kv_heads=heads, head_dim=d_kv, intermediate_size=d_ff,
        max_seq_len=c.size("n_positions", default=T5_DEFAULT_SEQ_LEN),
        layer_linears=tuple(_attention(d_model, inner, cross=False) + mlp),
        layer_norm_params=2 * d_model,
        decoder_layers=decoder_layers,
        decoder_linears=tuple(_attention(d_model, inner, cross=False) + _attention(d_model, inner, cross=True) + mlp),
        decoder_norm_params=3 * d_model,
        embedding_params=vocab * d_model,
        other_embedding_params=2 * buckets * heads,  # relative_attention_bias of each stack's block 0
        relative_attention_buckets=buckets,
        final_norm_params=2 * d_model,  # encoder.final_layer_norm, decoder.final_layer_norm
        head_params=0, tied_embeddings=True,
        hidden_act=act, gated_mlp=gated, norm="rmsnorm", position="relative",
        # eager_attention_forward (l.144-173): softmax in the scores' dtype, dropout, then probs @ v
        eager_softmax="input",
        attn_dropout=dropout, hidden_dropout=dropout, embedding_dropout=dropout,
    )


__all__ = ["T5_DEFAULT_SEQ_LEN", "t5_fields"]
