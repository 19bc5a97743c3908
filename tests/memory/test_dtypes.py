"""The dtype modes (planner/memory/dtypes.py) where LoRA's adapters compute, and the ZeRO terms the
2-rank CPU rows of bench/accuracy.py measured (llama-8k: hidden 256, intermediate 688, 2 layers,
4 heads of 64, 2 kv heads, vocabulary 8000, untied head), derived by hand."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.config import Method, Precision, TrainConfig
from planner.memory import model_state_breakdown
from planner.memory.dtypes import FP32, HALF, dtype_mode

LLAMA_8K = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
#: LoRA r16 on all seven linears of a layer: q 16x(256+256), k and v 16x(256+128), o 16x512,
#: gate and up 16x(256+688), down 16x(688+256) = 73,984 a layer
ADAPTERS = 2 * 73_984


def test_a_model_cast_to_16_bits_computes_with_16_bit_adapters():
    # DeepSpeed's bf16 mode and FSDP2's param_dtype cast the adapters with the rest: no fp32 copy
    # of an adapter's input, lora_A's output in bf16
    mode = dtype_mode(Method.LORA, Precision.BF16_MIXED, True)
    assert (mode.adapter_input, mode.adapter, mode.adapter_weight) == (0, HALF, HALF)
    # without a library's cast peft's adapters stay fp32 (they compute in bf16 under autocast only)
    autocast = dtype_mode(Method.LORA, Precision.BF16_MIXED, False)
    assert (autocast.adapter_input, autocast.adapter, autocast.adapter_weight) == (HALF, HALF, FP32)
    pure = dtype_mode(Method.LORA, Precision.BF16, False)
    assert (pure.adapter_input, pure.adapter, pure.adapter_weight) == (FP32, FP32, FP32)


@pytest.mark.parametrize("zero, adapters", [
    (2, ADAPTERS * HALF),  # whole on each rank, bf16: 295,936 B
    # ZeRO-3 partitions each adapter over 10 x 256 = 2,560 elements (half a rank) and keeps the
    # k/v lora_B (128 x 16 = 2,048) whole: (147,968 - 4 x 2,048) / 2 + 4 x 2,048 = 78,080 elements
    (3, 78_080 * HALF),
])
def test_deepspeed_keeps_lora_adapters_in_16_bits(zero, adapters):
    model = spec_from_config(LLAMA_8K, model_id="llama-8k", source="test")
    config = TrainConfig(method="lora", precision="bf16-mixed", zero=zero, gpus=2, seq_len=128)
    states, _ = model_state_breakdown(model, config)
    assert states["lora/weights"] == adapters
    assert states["master_weights"] == ADAPTERS // 2 * FP32  # the fp32 copy of what trains, partitioned


def test_zero3_on_two_ranks_keeps_what_runs_backward_gathered():
    model = spec_from_config(LLAMA_8K, model_id="llama-8k", source="test")
    layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688  # q, o; k, v; gate, up, down
    full, _ = model_state_breakdown(model, TrainConfig(precision="bf16-mixed", zero=3, gpus=2, seq_len=128))
    # every parameter over 2,560 elements gathered in bf16 from forward to its backward: the
    # embedding and lm_head (8000 x 256 each) and both layers' linears
    assert full["zero3/gathered_params_kept"] == (2 * 8000 * 256 + 2 * layer) * HALF == 11_091_968
    lora, _ = model_state_breakdown(model, TrainConfig(method="lora", precision="bf16-mixed", zero=3, gpus=2,
                                                        seq_len=128))
    # LoRA: the frozen embedding and layer 0's frozen q/k/v run no backward and are released; the
    # adapters over 2,560 elements (18 of 4,096 and 6 of 11,008) are gathered with the rest
    kept = 8000 * 256 + 2 * layer - (256 * 256 + 2 * 256 * 128) + 18 * 4096 + 6 * 11008
    assert lora["zero3/gathered_params_kept"] == kept * HALF == 7_013_376
    # on one rank nothing is gathered (the partition is the parameter)
    one, _ = model_state_breakdown(model, TrainConfig(precision="bf16-mixed", zero=3, gpus=1, seq_len=128))
    assert one.get("zero3/gathered_params", 0) == 0 and "zero3/gathered_params_kept" not in one
