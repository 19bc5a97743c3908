"""Tiny model configs that several test packages build (random weights, nothing downloaded)."""

from __future__ import annotations

#: a 4-layer Llama 4 text model: dense layers 0 and 2, MoE layers 1 and 3 (4 experts, top-1, a shared
#: expert), chunked attention, q/k norms
LLAMA4_TINY = dict(model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, use_qk_norm=True, attn_temperature_tuning=True,
                   vocab_size=256, max_position_embeddings=128, attention_chunk_size=16)

#: a 2-layer Llama with grouped-query attention: the optimizer tests' real CPU runs
TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2000, max_position_embeddings=256)


def cpu_peak_error(config, model_config=TINY_LLAMA) -> tuple[float, int, int]:
    """One real run of ``config`` on the CPU (``workers.run_in_process``, random weights) against the
    planner's prediction: (signed error in %, predicted, measured allocated peak); the run must end ok."""
    from planner.catalog import spec_from_config
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from planner.results import RunOutcome
    from workers import run_in_process

    measurement, _ = run_in_process(model_config=model_config, config=config)
    assert measurement.outcome is RunOutcome.OK, measurement.error
    spec = spec_from_config(model_config, model_id="tiny-model", source="test")
    predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
    measured = measurement.peak_allocated_bytes
    return 100 * (predicted - measured) / measured, predicted, measured
