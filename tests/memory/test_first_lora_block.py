"""The first LoRA block before its first adapter: autograd keeps an operand only for an operand that
needs a gradient, so what runs on the frozen embedding's output before the first adapter keeps
nothing (no attention core, no weight casts, no dropout masks). Real CPU runs of a tiny llama with
adapters on the MLP only and on o_proj only, against the model (they read +4.8% and +2.5% when
every block's attention was counted)."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 512}


def _config(targets: tuple[str, ...]) -> TrainConfig:
    return TrainConfig(micro_batch=2, seq_len=128, precision="bf16-mixed", method="lora", lora_r=16,
                       lora_targets=targets)


def test_the_first_block_keeps_no_attention_before_its_first_adapter():
    """By hand: with adapters on the MLP only, the first block's attention core (SDPA: q, k, v, out
    and the fp32 log-sum-exp) and its q/k/v/o weight casts are not kept; a later block keeps them."""
    from planner.memory.activations import block_terms
    from planner.memory.shapes import block_context

    spec = spec_from_config(LLAMA, model_id="tiny", source="test")
    kernels = get_gpu("cpu").kernels
    config = _config(("gate_proj", "up_proj", "down_proj"))
    first = block_terms(block_context(spec, config, kernels, first=True))
    later = block_terms(block_context(spec, config, kernels, first=False))
    assert "attention/core" not in first and later["attention/core"] > 0
    # later: q, k, v, o (256x256, 128x256, 128x256, 256x256) + gate/up/down (512x256 x3) in bf16;
    # first: gate/up (their input, the normed embedding, needs no gradient) not kept, down kept
    qkvo = 2 * (256 * 256 + 128 * 256 + 128 * 256 + 256 * 256)
    mlp = 2 * 512 * 256
    assert later["autocast/weight_casts"] == qkvo + 3 * mlp
    assert first["autocast/weight_casts"] == mlp


@pytest.mark.slow
@pytest.mark.parametrize("targets", [("gate_proj", "up_proj", "down_proj"), ("o_proj",)])
def test_real_runs_agree(targets):
    pytest.importorskip("torch")
    from workers import run_in_process

    config = _config(targets)
    measured, _ = run_in_process(model_config=LLAMA, config=config)
    spec = spec_from_config(LLAMA, model_id="tiny", source="test")
    predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
    assert predicted == pytest.approx(measured.peak_allocated_bytes, rel=0.005)
