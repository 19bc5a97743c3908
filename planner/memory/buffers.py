"""Buffers a model keeps on the device beside its parameters: transformers 4's per-layer rotary tables
(``TrainConfig.rope_caches``).

Up to transformers 4.40 (Llama), 4.41 (Mistral), 4.44 (Qwen2) and 4.47 (Mixtral) every attention layer
built its own rotary embedding, which precomputes cos and sin for every position up to
``max_position_embeddings`` at init and registers them as non-persistent buffers (4.39.3
models/mistral/modeling_mistral.py l.93-116 ``MistralRotaryEmbedding._set_cos_sin_cache``: ``emb.cos().to(dtype)``
with ``dtype=torch.get_default_dtype()``, the dtype ``from_pretrained`` loads the model in; one per
``MistralAttention``, l.232; Llama's ``_cos_cached``/``_sin_cached`` in 4.39.3 models/llama/modeling_llama.py
l.95-113). Transformers 5 keeps one model-level ``inv_freq`` and computes cos and sin for the positions of each
forward, so the planner's own runs hold none. The tables move to the device with the model and stay there: no
sharding scheme partitions buffers (FSDP and ZeRO-3 flatten and split parameters only), so each rank holds all
of them.

Pure module: no torch, no I/O.
"""

from __future__ import annotations

from planner.config import Method, TrainConfig
from planner.memory.dtypes import DtypeMode
from planner.modelspec import ModelSpec

#: the breakdown key of the tables (a weights category: loaded with the model, ``timeline.category``)
ROPE_CACHES_KEY = "weights/rope_caches"
#: cos and sin: two tables a layer
ROPE_TABLES_PER_LAYER = 2
#: QLoRA loads the model in its 16-bit compute dtype (``planner.emit.settings``: ``torch_dtype``); peft's k-bit
#: preparation upcasts parameters, not buffers (peft utils/other.py ``prepare_model_for_kbit_training``: ``for
#: param in model.parameters()``), so the tables stay 16-bit. (An fp32 compute dtype would make them twice this:
#: not told apart, as QLoRA's batch-independent terms read no precision, ``search._static_key``.)
QLORA_TABLE_BYTES = 2


def rope_cache_tensors(model: ModelSpec, config: TrainConfig) -> tuple[int, int]:
    """(tables, elements each) of the rotary tables ``config`` keeps: ``ROPE_TABLES_PER_LAYER`` a layer of
    ``max_position_embeddings`` x ``head_dim``; (0, 0) without ``rope_caches`` or where the model's positions are
    not rotary (learned, ALiBi, relative: transformers builds no such table)."""
    if not config.rope_caches or model.position != "rope":
        return 0, 0
    return ROPE_TABLES_PER_LAYER * model.num_layers, model.max_seq_len * model.head_dim


def rope_cache_bytes(model: ModelSpec, config: TrainConfig, mode: DtypeMode) -> int:
    """Device bytes of the rotary tables, in the dtype the model is loaded in: the stored weights' (``mode.weight``:
    fp32 under fp32 and *-mixed, 16-bit for pure 16-bit training and where DeepSpeed casts the module, buffers
    too: deepspeed runtime/engine.py ``module.half()``), QLoRA's 16-bit compute dtype (``QLORA_TABLE_BYTES``)."""
    tables, elements = rope_cache_tensors(model, config)
    if not tables:
        return 0
    dtype_bytes = QLORA_TABLE_BYTES if config.method is Method.QLORA else mode.weight
    return tables * elements * dtype_bytes


__all__ = ["QLORA_TABLE_BYTES", "ROPE_CACHES_KEY", "ROPE_TABLES_PER_LAYER", "rope_cache_bytes", "rope_cache_tensors"]
