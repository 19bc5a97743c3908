"""Tiny model configs that several test packages build (random weights, nothing downloaded)."""

from __future__ import annotations

#: a 4-layer Llama 4 text model: dense layers 0 and 2, MoE layers 1 and 3 (4 experts, top-1, a shared
#: expert), chunked attention, q/k norms
LLAMA4_TINY = dict(model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, use_qk_norm=True, attn_temperature_tuning=True,
                   vocab_size=256, max_position_embeddings=128, attention_chunk_size=16)
