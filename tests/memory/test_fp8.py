"""fp8 (torchao's float8 linears under accelerate's ``mixed_precision: fp8``, planner/config.py
``Precision.FP8``): its dtype mode, the saved tensors it changes against bf16-mixed, the backward's
cast temporaries, the combinations it is planned with and the GPUs that run it. Numbers by hand on
bench/accuracy.py's llama-8k (hidden 256, intermediate 688, 2 layers, 4 heads of 64, 2 kv heads,
vocabulary 8000, untied head): every block linear has both dims a multiple of 16, so accelerate
converts all of them but the model's first (layer 0's q_proj) and last (lm_head)."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.config import Method, Precision, TrainConfig
from planner.errors import InvalidConfigError, UnsupportedError
from planner.gpus import check_precision, fp8_gpus, get_gpu, list_gpus
from planner.memory import activation_breakdown
from planner.memory.activations import block_backward_terms
from planner.memory.dtypes import FP32, HALF, dtype_mode

LLAMA_8K = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
#: the block linears' weights of one layer: q 256x256, k and v 256x128, o 256x256, gate and up 256x688,
#: down 688x256
LAYER_WEIGHTS = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 688  # 724,992
HEAD = 8000 * 256


def model(**changes):
    return spec_from_config({**LLAMA_8K, **changes}, model_id="llama-8k", source="test")


def test_fp8_is_bf16_mixed_with_fp32_weights_and_its_own_mode():
    p = Precision.FP8
    assert (p.is_mixed, p.needs_bf16, p.weight_bytes, p.compute_bytes, p.compute_dtype) == (True, True, FP32, HALF,
                                                                                             "bfloat16")
    fp8, bf16 = dtype_mode(Method.FULL, p, False), dtype_mode(Method.FULL, Precision.BF16_MIXED, False)
    assert fp8.fp8 and not bf16.fp8
    # everything else typed alike: the autocast stream, fp32 weights
    assert (fp8.autocast, fp8.compute, fp8.residual, fp8.weight) == (bf16.autocast, bf16.compute, bf16.residual, bf16.weight)


def test_converted_linears_save_no_16_bit_weight_cast():
    spec = model()
    bf16 = activation_breakdown(spec, TrainConfig(precision="bf16-mixed", micro_batch=2, seq_len=64))
    fp8 = activation_breakdown(spec, TrainConfig(precision="fp8", micro_batch=2, seq_len=64))
    # bf16-mixed: autocast's 2-byte copy of every block weight and of the head
    assert bf16["autocast/weight_casts"] == 2 * (2 * LAYER_WEIGHTS) + 2 * HEAD == 6_995_968
    # fp8: Float8Linear saves the fp32 parameter itself (a view): only the unconverted lm_head's cast stays,
    # and the unconverted first linear's (layer 0's q_proj, 256 x 256) is counted apart
    assert fp8["autocast/weight_casts"] == 2 * HEAD == 4_096_000
    assert fp8["autocast/fp8_first_linear"] == 2 * 256 * 256 == 131_072
    # the inputs each linear saves are the same bf16 casts (float8_linear.py:45 saves input_hp)
    same = {k: v for k, v in bf16.items() if not k.startswith("autocast")}
    assert {k: fp8[k] for k in same} == same


def test_a_linear_whose_dims_do_not_divide_by_16_keeps_its_cast():
    # intermediate 690: gate, up (256 x 690) and down (690 x 256) stay nn.Linear (accelerate utils/ao.py:65)
    spec = model(intermediate_size=690)
    fp8 = activation_breakdown(spec, TrainConfig(precision="fp8", micro_batch=2, seq_len=64))
    assert fp8["autocast/weight_casts"] == 2 * (2 * 3 * 256 * 690) + 2 * HEAD


def test_gpt2_conv1d_blocks_are_not_converted():
    spec = spec_from_config(dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=256),
                            model_id="gpt2-tiny", source="test")
    bf16 = activation_breakdown(spec, TrainConfig(precision="bf16-mixed", micro_batch=2, seq_len=64))
    fp8 = activation_breakdown(spec, TrainConfig(precision="fp8", micro_batch=2, seq_len=64))
    assert fp8 == bf16


def test_the_backward_holds_the_fp8_casts_of_the_largest_linear():
    spec, kernels = model(), get_gpu("h100-80gb").kernels
    tokens = 2 * 64
    casts = block_backward_terms(spec, TrainConfig(precision="fp8", micro_batch=2, seq_len=64), kernels)["fp8/casts"]
    # per token: 2 x out + 9 x max(in, out) (two grad_output casts and the fp32 scratch with the fp8 copy of
    # the cast in progress): gate/up 2 x 688 + 9 x 688 = 7,568 is the largest (down 2 x 256 + 9 x 688 = 6,704);
    # plus the largest fp8 weight, 256 x 688 = 176,128 B
    assert casts == tokens * 7_568 + 176_128 == 1_144_832
    assert "fp8/casts" not in block_backward_terms(spec, TrainConfig(precision="bf16-mixed", micro_batch=2, seq_len=64),
                                                   kernels)


@pytest.mark.parametrize("changes, fix", [
    (dict(method="lora"), "--method full"),
    (dict(method="qlora"), "--method full"),
    (dict(zero=2, gpus=2), "use DDP"),
    (dict(sharding="fsdp2", gpus=2), "use DDP"),
])
def test_fp8_is_planned_for_full_fine_tuning_on_whole_replicas(changes, fix):
    with pytest.raises(UnsupportedError, match=fix):
        TrainConfig(precision="fp8", **changes)
    TrainConfig(precision="fp8", gpus=4)  # DDP


def test_only_gpus_with_fp8_tensor_cores_run_it():
    assert fp8_gpus() == tuple(g.name for g in list_gpus() if g.fp8)
    assert {"h100-80gb", "h200", "b200", "gb200", "l4", "l40s", "rtx4090", "rtx5090", "rtx6000-ada",
            "rtx-pro-6000"} <= set(fp8_gpus())
    for name in fp8_gpus():
        gpu = get_gpu(name)
        assert gpu.compute_capability >= (8, 9) and gpu.fp8_tflops == 2 * gpu.bf16_tflops
        assert gpu.sources["fp8_tflops"] and gpu.to_dict()["fp8_tflops"] == gpu.fp8_tflops
        check_precision(gpu, "fp8")
    assert get_gpu("h100-80gb").fp8_tflops == pytest.approx(1978.8)


@pytest.mark.parametrize("gpu, why", [
    ("a100-80gb", "NVIDIA A100-SXM4-80GB has no FP8 tensor cores (compute capability 8.0; FP8 needs 8.9+)"),
    ("t4", "NVIDIA T4 has no FP8 tensor cores (compute capability 7.5; FP8 needs 8.9+)"),
    ("cpu", "the cpu profile has no FP8 tensor cores"),
])
def test_fp8_is_refused_in_one_line_naming_the_gpus_that_have_it(gpu, why):
    with pytest.raises(InvalidConfigError) as exc:
        check_precision(get_gpu(gpu), "fp8")
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"--precision fp8: {why}")
    assert line.endswith("use bf16-mixed, or a GPU with FP8: " + ", ".join(fp8_gpus()))
