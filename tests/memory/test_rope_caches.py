"""transformers 4's per-layer rotary tables (``TrainConfig.rope_caches``, planner/memory/buffers.py): a cos and a
sin table of max_position_embeddings x head_dim per attention layer, in the load dtype, resident on every rank;
by hand on Mistral-7B-v0.1 (32 layers, 32,768 positions, head_dim 128)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.buffers import ROPE_CACHES_KEY, rope_cache_tensors
from planner.memory.states import model_state_breakdown

MISTRAL = resolve_model("mistralai/Mistral-7B-v0.1")
GPU = get_gpu("a100-80gb")
#: 2 tables x 32 layers x 32,768 positions x 128 = 268,435,456 elements
ELEMENTS = 2 * 32 * 32_768 * 128


@pytest.mark.parametrize(("method", "precision", "gpus", "sharding", "dtype_bytes"), [
    ("full", "fp16", 1, "none", 2),  # loaded in fp16 (fms-acceleration's 2024 runs)
    ("full", "bf16-mixed", 1, "none", 4),  # fp32 weights under autocast: the default dtype at init is fp32
    ("lora", "fp16", 1, "none", 2),
    ("qlora", "fp16-mixed", 1, "none", 2),  # QLoRA loads in its 16-bit compute dtype; the k-bit upcast leaves buffers
    ("full", "bf16", 2, "fsdp1", 2),  # FSDP1 flattens and shards parameters, never buffers: whole on each rank
    ("full", "bf16-mixed", 2, "zero3", 2),  # DeepSpeed's module.half() casts buffers too; ZeRO-3 leaves them whole
])
def test_the_tables_are_resident_whole_on_every_rank_in_the_load_dtype(method, precision, gpus, sharding, dtype_bytes):
    config = TrainConfig(method=method, precision=precision, gpus=gpus, sharding=sharding, rope_caches=True)
    states, _ = model_state_breakdown(MISTRAL, config)
    assert states[ROPE_CACHES_KEY] == ELEMENTS * dtype_bytes
    without, _ = model_state_breakdown(MISTRAL, config.replace(rope_caches=False))
    assert ROPE_CACHES_KEY not in without and {k: v for k, v in states.items() if k != ROPE_CACHES_KEY} == without


def test_learned_positions_keep_no_table():
    assert rope_cache_tensors(resolve_model("gpt2"), TrainConfig(rope_caches=True)) == (0, 0)
    assert rope_cache_tensors(MISTRAL, TrainConfig(rope_caches=True)) == (64, 32_768 * 128)


def test_the_peak_holds_the_tables_and_the_replay_places_each_table():
    config = TrainConfig(method="lora", precision="fp16", micro_batch=2, seq_len=1024, grad_ckpt=True)
    a = estimate_memory(model=MISTRAL, config=config, gpu=GPU)
    b = estimate_memory(model=MISTRAL, config=config.replace(rope_caches=True), gpu=GPU)
    assert b.peak_allocated_bytes - a.peak_allocated_bytes == ELEMENTS * 2 == 512 * 2**20
    assert b.breakdown[ROPE_CACHES_KEY] == 512 * 2**20
    # 64 tables of 8 MiB, each a request of its own: 64 x 8 MiB fills 25.6 20-MiB segments' worth, so the replay's
    # reserve grows by at least their 512 MiB and by less than one 20 MiB segment a table beyond it
    grown = b.peak_reserved_bytes - a.peak_reserved_bytes
    assert 512 * 2**20 <= grown < 512 * 2**20 + 64 * 20 * 2**20


def test_the_knob_round_trips_and_is_said():
    config = TrainConfig(method="lora", rope_caches=True)
    assert TrainConfig.from_dict(config.to_dict()) == config and config.to_dict()["rope_caches"] is True
    assert "rope_caches" not in TrainConfig(method="lora").to_dict()
    assert "rotary tables per layer" in config.label()
