"""The analytical memory model, term by term, against numbers derived by hand.

Two models: a hand-built tiny Llama (hidden 64, intermediate 172, 2 layers, 4 heads, vocab 1000)
whose saved-for-backward bytes were measured with ``torch.autograd.graph.saved_tensors_hooks`` on
transformers 5.23 (see ``test_tiny_llama_activations_match_measurement`` and the slow re-measure),
and Llama-2-7b-hf from the catalog (6,738,415,616 parameters) for the seeds' bytes-per-parameter
rules and the ZeRO paper's partitioning formulas.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from planner.catalog import resolve_model, spec_from_config
from planner.config import Optimizer, TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import get_gpu
from planner.memory import (
    activation_breakdown,
    estimate_memory,
    lora_params,
    model_state_breakdown,
    model_states_bytes,
    trainable_params,
)
from planner.modelspec import LinearKind, LinearSpec, ModelSpec
from planner.optim import optimizer_state_bytes

# ---- fixtures ---------------------------------------------------------------------------------


def _lin(name: str, i: int, o: int, kind: LinearKind) -> LinearSpec:
    return LinearSpec(name=name, in_features=i, out_features=o, bias=False, kind=kind)


H, I, L, A, V = 64, 172, 2, 4, 1000  # noqa: E741 - hidden, intermediate, layers, heads, vocab: the paper's letters
TINY = ModelSpec(
    id="tiny-llama", model_type="llama", is_encoder=False,
    hidden_size=H, num_layers=L, num_heads=A, num_kv_heads=A, head_dim=H // A,
    intermediate_size=I, vocab_size=V, max_seq_len=256,
    layer_linears=(
        _lin("q_proj", H, H, LinearKind.ATTN_IN), _lin("k_proj", H, H, LinearKind.ATTN_IN),
        _lin("v_proj", H, H, LinearKind.ATTN_IN), _lin("o_proj", H, H, LinearKind.ATTN_OUT),
        _lin("gate_proj", H, I, LinearKind.MLP_IN), _lin("up_proj", H, I, LinearKind.MLP_IN),
        _lin("down_proj", I, H, LinearKind.MLP_OUT),
    ),
    layer_norm_params=2 * H,  # input_layernorm + post_attention_layernorm weights
    embedding_params=V * H, final_norm_params=H, head_params=V * H, tied_embeddings=False,
    hidden_act="silu", gated_mlp=True, norm="rmsnorm",
)
#: tiny parameter count by hand: per layer 4*64*64 = 16,384 (attention) + 3*64*172 = 33,024 (MLP)
#: + 128 (norms) = 49,536; x2 layers = 99,072; + 64,000 embedding + 64 final norm + 64,000 lm_head
TINY_PARAMS = 227_136
#: tiny parameter tensors: 2 layers x (7 linears + 2 norms) + embedding + final norm + lm_head
TINY_TENSORS = 21

LLAMA7B = "meta-llama/Llama-2-7b-hf"
PSI = 6_738_415_616  # Llama-2-7b parameters
#: 32 layers x 9 tensors (7 linears + 2 norms) + embedding + final norm + lm_head
LLAMA7B_TENSORS = 32 * 9 + 3  # = 291


@pytest.fixture(scope="module")
def llama7b() -> ModelSpec:
    return resolve_model(LLAMA7B)


@pytest.fixture(scope="module")
def cpu():
    return get_gpu("cpu")


def tiny_config(**kw) -> TrainConfig:
    return TrainConfig(micro_batch=kw.pop("micro_batch", 2), seq_len=kw.pop("seq_len", 64), **kw)


def acts(model: ModelSpec, config: TrainConfig) -> int:
    return sum(activation_breakdown(model, config).values())


# ---- the specs themselves -----------------------------------------------------------------------


def test_tiny_spec_is_what_the_catalog_builds_from_a_llama_config():
    config = dict(model_type="llama", hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=A,
                  num_key_value_heads=A, vocab_size=V, max_position_embeddings=256, rms_norm_eps=1e-6,
                  hidden_act="silu", tie_word_embeddings=False)
    built = spec_from_config(config, model_id="tiny-llama", source="test")
    assert built.params_total == TINY.params_total == TINY_PARAMS
    assert built.layer_linears == TINY.layer_linears
    assert (built.layer_norm_params, built.final_norm_params, built.head_params) == (128, 64, 64_000)


def test_llama7b_param_count(llama7b):
    assert llama7b.params_total == PSI


# ---- model states: the seeds' bytes-per-parameter rules ------------------------------------------


def test_full_bf16_mixed_adamw_is_16_bytes_per_param_plus_step_tensors(llama7b):
    states, host = model_state_breakdown(llama7b, TrainConfig(precision="bf16-mixed", optimizer="adamw"))
    # fp32 weights 4 B + fp32 grads 4 B + exp_avg and exp_avg_sq 2 x 4 B, plus torch AdamW's
    # 4-byte fp32 `step` tensor per parameter tensor (torch/optim/adamw.py _init_group)
    assert states["weights"] == 4 * PSI == 26_953_662_464
    assert states["gradients"] == 4 * PSI
    assert states["optimizer_states"] == 8 * PSI + 4 * LLAMA7B_TENSORS == 53_907_324_928 + 1_164
    assert host == 0
    # 16 x 6,738,415,616 = 107,814,649,856 (+1,164 of step tensors)
    assert model_states_bytes(llama7b, TrainConfig()) == 107_814_649_856 + 1_164


def test_pure_bf16_adamw_is_8_bytes_per_param(llama7b):
    states, _ = model_state_breakdown(llama7b, TrainConfig(precision="bf16", optimizer="adamw"))
    # bf16 weights 2 + bf16 grads 2 + two bf16 moments 4 (torch.zeros_like(param)) = 8 B/param
    assert states["weights"] == 2 * PSI
    assert states["gradients"] == 2 * PSI
    assert states["optimizer_states"] == 4 * PSI + 4 * LLAMA7B_TENSORS
    assert model_states_bytes(llama7b, TrainConfig(precision="bf16")) == 8 * PSI + 1_164 == 53_907_326_092


def test_adamw8bit_states_llama7b(llama7b):
    states, _ = model_state_breakdown(llama7b, TrainConfig(optimizer="adamw_8bit"))
    # every Llama-2-7b tensor has >= 4096 elements (the smallest, a norm, has exactly 4096) and a
    # multiple of 256 elements, so: two uint8 states (2 B/param) + two fp32 absmax per 256-element
    # block = 2*PSI + 2*4*PSI/256. PSI/256 = 26,321,936 blocks.
    assert PSI % 256 == 0 and PSI // 256 == 26_321_936
    assert states["optimizer_states"] == 2 * PSI + 8 * 26_321_936 == 13_687_406_720


def test_adamw8bit_states_tiny_keeps_32bit_states_for_small_tensors():
    states, _ = model_state_breakdown(TINY, TrainConfig(optimizer="adamw_8bit"))
    # embedding / lm_head 64,000 el: 2*64,000 + 8*ceil(64,000/256)=8*250  -> 130,000 each
    # q/k/v/o 4,096 el (not < 4096: 8-bit): 2*4,096 + 8*16               ->   8,320 each
    # gate/up/down 11,008 el: 2*11,008 + 8*ceil(43)=8*43                 ->  22,360 each
    # norms 64 el (< 4096: two fp32 states): 2*64*4                      ->     512 each
    per_layer = 4 * 8_320 + 3 * 22_360 + 2 * 512  # = 101,384
    assert states["optimizer_states"] == 2 * 130_000 + 2 * per_layer + 512 == 463_280


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ([4095], 2 * 4095 * 4),  # below bnb min_8bit_size: two fp32 states
        ([4096], 2 * 4096 + 2 * 16 * 4),  # 16 blocks of 256, one fp32 absmax per block per state
        ([4097], 2 * 4097 + 2 * 17 * 4),  # a partial block still has its absmax
    ],
)
def test_optimizer_state_bytes_8bit_boundaries(sizes, expected):
    assert optimizer_state_bytes(sizes=sizes, optimizer=Optimizer.ADAMW_8BIT, param_bytes=4) == expected
    assert optimizer_state_bytes(sizes=sizes, optimizer=Optimizer.PAGED_ADAMW_8BIT, param_bytes=2) == expected


def test_optimizer_state_bytes_adamw_and_sgd_by_hand():
    # AdamW: 2 moments like the param + 4 B step per tensor: 2*(1000*2) + 4 + 2*(10*2) + 4
    assert optimizer_state_bytes(sizes=[1000, 10], optimizer=Optimizer.ADAMW, param_bytes=2) == 4_048
    # SGD momentum: one buffer like the param
    assert optimizer_state_bytes(sizes=[1000, 10], optimizer=Optimizer.SGD, param_bytes=4) == 4_040


def test_optimizer_state_bytes_accepts_the_string_names():
    # 'adamw' with bf16 params must give the AdamW figure (4,048), not bnb 8-bit's 2 x 1010 x 4 = 8,080
    assert optimizer_state_bytes(sizes=[1000, 10], optimizer="adamw", param_bytes=2) == 4_048


@pytest.mark.parametrize("precision, per_param", [("bf16-mixed", 4), ("bf16", 2), ("fp32", 4)])
def test_sgd_momentum_is_one_param_dtype(llama7b, precision, per_param):
    states, _ = model_state_breakdown(llama7b, TrainConfig(precision=precision, optimizer="sgd"))
    assert states["optimizer_states"] == per_param * PSI


def test_qlora_weights_llama7b(llama7b):
    config = TrainConfig(method="qlora", lora_r=16)
    states, _ = model_state_breakdown(llama7b, config)
    # quantised: every per-layer linear = 32 x (4*4096^2 + 3*4096*11008) = 32 x 202,375,168
    q = 32 * 202_375_168
    assert q == 6_476_005_376
    # NF4: q/2 B + one 8-bit absmax per 64 (q/64 B) + one fp32 per 256 absmax (q/64/256*4 B)
    # = 3,238,002,688 + 101,187,584 + 1,581,056
    assert states["weights/nf4"] == 3_340_771_328
    # embedding, norms, lm_head in fp32 (prepare_model_for_kbit_training):
    # (131,072,000 + 32*8,192 + 4,096 + 131,072,000) x 4 = 262,410,240 x 4
    assert PSI - q == 262_410_240
    assert states["weights/unquantized"] == 1_049_640_960
    # the adapters are fp32, trained with fp32 AdamW
    assert states["lora/weights"] == 4 * 39_976_960


def test_lora_params_llama7b_r16_all_linear(llama7b):
    config = TrainConfig(method="lora", lora_r=16, lora_targets=("all-linear",))
    # r*(in+out) per linear: q,k,v,o 16*(4096+4096) = 131,072 x4 = 524,288;
    # gate, up, down 16*(4096+11008) = 241,664 x3 = 724,992; per layer 1,249,280; x32 layers
    assert lora_params(llama7b, config) == 32 * (524_288 + 724_992) == 39_976_960
    assert trainable_params(llama7b, config) == 39_976_960
    assert trainable_params(llama7b, TrainConfig()) == PSI


def test_lora_params_tiny_named_targets():
    # r=8 on q_proj and v_proj: 2 x 8*(64+64) = 2,048 per layer x 2 layers
    assert lora_params(TINY, TrainConfig(method="lora", lora_r=8, lora_targets=("q_proj", "v_proj"))) == 4_096
    # all-linear: 4 x 8*128 + 3 x 8*(64+172) = 4,096 + 5,664 = 9,760 per layer x 2
    assert lora_params(TINY, TrainConfig(method="lora", lora_r=8)) == 19_520
    # comma-separated string form is the same as the tuple
    assert lora_params(TINY, TrainConfig(method="lora", lora_r=8, lora_targets="q_proj, v_proj")) == 4_096


def test_lora_states_tiny_adamw():
    config = TrainConfig(method="lora", lora_r=8, lora_targets=("q_proj", "v_proj"), precision="bf16-mixed")
    states, _ = model_state_breakdown(TINY, config)
    # 4,096 fp32 adapter params: weights 4*4,096, grads 4*4,096, moments 8*4,096 + 4 B step per
    # tensor: 2 layers x 2 linears x (A, B) = 8 tensors
    assert states["weights"] == 4 * TINY_PARAMS  # frozen base stays fp32 under autocast
    assert states["lora/weights"] == 16_384
    assert states["gradients"] == 16_384
    assert states["optimizer_states"] == 32_768 + 4 * 8


def test_full_tiny_states_by_hand():
    # 16 B/param + 4 B step per tensor: 16*227,136 + 4*21
    assert model_states_bytes(TINY, TrainConfig()) == 16 * TINY_PARAMS + 4 * TINY_TENSORS == 3_634_260


def test_invalid_lora_target_names_the_available_ones():
    with pytest.raises(InvalidConfigError) as err:
        lora_params(TINY, TrainConfig(method="lora", lora_targets=("q_proj", "c_attn")))
    message = str(err.value)
    assert "c_attn" in message
    assert "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in message
    assert "\n" not in message
    with pytest.raises(InvalidConfigError):
        estimate_memory(model=TINY, config=TrainConfig(method="qlora", lora_targets=("nope",)), gpu=get_gpu("a10g"))


# ---- ZeRO (Rajbhandari et al. 2020, §3.1 / Figure 1, K = 12 for mixed-precision Adam) -----------

N = 8
H7 = 4096
BUCKET = H7 * H7 * 2  # reduce bucket: hidden^2 16-bit elements (HF "auto") = 33,554,432 B
#: ZeRO-3's persistent parameters (numel <= stage3_param_persistence_threshold = 10 x hidden =
#: 40,960): llama's RMSNorm weights, 2 per block + the final one, 65 x 4096 = 266,240 elements,
#: whole on every rank (planner/sharding/zero.py zero3_param_split)
PERSISTENT = 65 * 4096
#: ZeRO-3 holds at most stage3_max_live_parameters (1e9, DeepSpeed's default) + the largest
#: partitioned parameter (the embedding or the head, 32000 x 4096) gathered, in 16 bits
#: (zero.py zero3_live_params): (1e9 + 131,072,000) x 2 B = 2,262,144,000 B
GATHERED = (10**9 + 32000 * 4096) * 2


@pytest.mark.parametrize(
    "stage, paper_bytes, extra",
    [
        (1, 2 * PSI + 2 * PSI + 12 * PSI // N, BUCKET),  # = 13.48e9 + 13.48e9 + 10.11e9
        (2, 2 * PSI + 14 * PSI // N, BUCKET),
        # the persistent params are whole on every rank: 2 B x 266,240 x (1 - 1/8) = 465,920 B more
        (3, 16 * PSI // N, BUCKET + GATHERED + 2 * PERSISTENT - 2 * PERSISTENT // N),
    ],
)
def test_zero_stages_follow_the_paper(llama7b, stage, paper_bytes, extra):
    config = TrainConfig(zero=stage, gpus=N, precision="bf16-mixed")
    states, host = model_state_breakdown(llama7b, config)
    assert host == 0
    # + 4: the AdamW `step` tensor of the one flat fp32 partition DeepSpeed hands the optimizer
    assert sum(states.values()) == paper_bytes + extra + 4
    # the 12 bytes of K split as the fp32 master (4) and the two moments (8), partitioned
    assert states["master_weights"] == 4 * PSI // N == 3_369_207_808
    assert states["optimizer_states"] == 8 * PSI // N + 4  # + the flat partition's `step` tensor


def test_zero2_offload_moves_master_and_moments_to_host(llama7b):
    config = TrainConfig(zero=2, gpus=N, offload="optimizer")
    states, host = model_state_breakdown(llama7b, config)
    assert "master_weights" not in states and "optimizer_states" not in states
    largest = 32000 * 4096  # the embedding, the largest parameter tensor
    # device: 16-bit params 2*PSI + partitioned 16-bit grads 2*PSI/N + bucket + the staging
    # buffer of one (the largest) parameter's 16-bit gradient (temp_grad_buffer_for_gpu_offload)
    assert states["zero/offload_grad_buffer"] == 2 * largest
    assert sum(states.values()) == 2 * PSI + 2 * PSI // N + BUCKET + 2 * largest
    # host: fp32 master 4*PSI/N + moments 8*PSI/N + the fp32 gradient partition CPU Adam reads
    # 4*PSI/N (DeepSpeed stage_1_and_2: single_partition_of_fp32_groups[i].grad on the CPU)
    # + 4: the `step` tensor of the one flat partition + the 16-bit copy of the partition
    # 2*PSI/N + the host gradient buffer of the largest parameter
    assert host == 16 * PSI // N + 4 + 2 * PSI // N + 2 * largest == 15_423_579_140
    memory = estimate_memory(model=llama7b, config=config.replace(micro_batch=1, seq_len=512), gpu=get_gpu("a10g"))
    assert memory.cpu_bytes == host


def test_zero3_param_offload_moves_the_param_partition_too(llama7b):
    states, host = model_state_breakdown(llama7b, TrainConfig(zero=3, gpus=N, offload="optimizer+params"))
    # the persistent params stay whole on the device (partition_parameters.py l.1829-1830)
    assert states["weights"] == 2 * PERSISTENT == 532_480
    # host: fp32 master 4*PSI/N + moments 8*PSI/N + fp32 gradient partition 4*PSI/N + the `step`
    # tensor 4, the 16-bit partition of the partitioned params 2*(PSI - PERSISTENT)/N and the
    # pinned 16-bit gradient partition 2*PSI/N, which ZeRO-3 builds on the host under optimizer
    # offload (deepspeed stage3.py l.333, l.791-795)
    assert "zero3/grad_partitions" not in states
    assert host == 16 * PSI // N + 2 * (PSI - PERSISTENT) // N + 2 * PSI // N + 4 == 16_845_972_484


def test_zero3_without_offload_keeps_the_gradient_partition_on_the_device(llama7b):
    states, host = model_state_breakdown(llama7b, TrainConfig(zero=3, gpus=N, precision="bf16-mixed"))
    assert host == 0
    assert states["zero3/grad_partitions"] == 2 * PSI // N


def test_zero_sgd_momentum_lives_on_the_fp32_master_partition(llama7b):
    states, _ = model_state_breakdown(llama7b, TrainConfig(zero=2, gpus=N, optimizer="sgd", precision="bf16-mixed"))
    # DeepSpeedZeroOptimizer hands the fp32 flat partition (single_partition_of_fp32_groups) to
    # the wrapped torch.optim.SGD, whose momentum_buffer = clone(grad) is fp32: 4*PSI/8
    assert states["optimizer_states"] == 4 * PSI // N == 3_369_207_808


def test_ddp_adds_gradient_buckets(llama7b):
    states, _ = model_state_breakdown(llama7b, TrainConfig(gpus=2))
    assert states["ddp/buckets"] == states["gradients"] == 4 * PSI


# ---- activations -------------------------------------------------------------------------------

#: bytes autograd saved (pack hook deduplicating by untyped_storage().data_ptr(), parameters
#: excluded) for LlamaForCausalLM(tiny config), input_ids = labels of shape (2, 64), sdpa,
#: transformers 5.23 / torch 2.13 CPU; re-measured by test_activation_measurement_is_reproducible
MEASURED = {
    "fp32 full": (dict(precision="fp32"), 1_987_076),
    "bf16-mixed full": (dict(precision="bf16-mixed"), 1_845_764),
    "bf16 full": (dict(precision="bf16"), 1_335_812),
    "fp32 lora r8": (dict(precision="fp32", method="lora", lora_r=8), 1_813_508),
    "bf16-mixed lora r8": (dict(precision="bf16-mixed", method="lora", lora_r=8), 1_704_068),
    "bf16 lora r8": (dict(precision="bf16", method="lora", lora_r=8), 1_676_292),
    "fp32 eager": (dict(precision="fp32", attention="eager"), 2_245_124),
    "bf16 eager": (dict(precision="bf16", attention="eager"), 1_724_932),
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_tiny_llama_activations_match_measurement(name):
    kw, measured = MEASURED[name]
    predicted = acts(TINY, tiny_config(**kw))
    assert abs(predicted - measured) <= 0.001 * measured, (name, predicted, measured)


def test_grad_ckpt_keeps_one_residual_per_layer():
    # fp32 and bf16-mixed keep an fp32 residual stream; pure bf16 a bf16 one:
    # L*b*s*h*bytes = 2*2*64*64*4 = 65,536 and 2*2*64*64*2 = 32,768
    for precision, expected in (("fp32", 65_536), ("bf16-mixed", 65_536), ("bf16", 32_768)):
        breakdown = activation_breakdown(TINY, tiny_config(precision=precision, grad_ckpt=True))
        assert breakdown["activations/checkpoints"] == expected
        assert not any(k.startswith(("activations/mlp", "activations/attention", "activations/norms")) for k in breakdown)


def test_grad_ckpt_llama7b(llama7b):
    breakdown = activation_breakdown(llama7b, TrainConfig(micro_batch=1, seq_len=2048, grad_ckpt=True))
    # 32 layers x 1 x 2048 x 4096 x 4 B (fp32 residual under autocast) = 1 GiB
    assert breakdown["activations/checkpoints"] == 1_073_741_824


def test_activations_are_affine_in_micro_batch():
    one, two, four = (acts(TINY, tiny_config(precision="fp32", micro_batch=b)) for b in (1, 2, 4))
    per_sequence = two - one
    assert four - two == 2 * per_sequence
    # the only batch-independent term is rope's cos and sin tables: 2 x s x head_dim x 4 B
    # = 2*64*16*4 = 8,192
    assert one - per_sequence == 8_192


def test_eager_attention_adds_the_score_matrices():
    sdpa = acts(TINY, tiny_config(precision="fp32", attention="sdpa"))
    eager = acts(TINY, tiny_config(precision="fp32", attention="eager"))
    # per layer, eager saves q, k, v (3 x b*s*h*4), the fp32 softmax (b*a*s^2*4) and o_proj's
    # contiguous input (b*s*h*4); sdpa saves q, k, v, out (4 x b*s*h*4) and the fp32 logsumexp
    # (b*a*s*4). Difference: 4*b*a*s^2 - 4*b*a*s = 4*2*4*4096 - 4*2*4*64 = 131,072 - 2,048
    assert eager - sdpa == L * (131_072 - 2_048) == 258_048
    # doubling s quadruples the score term
    sdpa2 = acts(TINY, tiny_config(precision="fp32", attention="sdpa", seq_len=128))
    eager2 = acts(TINY, tiny_config(precision="fp32", attention="eager", seq_len=128))
    assert eager2 - sdpa2 == L * (4 * 2 * 4 * 128**2 - 4 * 2 * 4 * 128)


def test_logits_terms_scale_with_vocab():
    wide = dataclasses.replace(TINY, vocab_size=2 * V, embedding_params=2 * V * H, head_params=2 * V * H)
    config = tiny_config(precision="fp32")
    narrow_b, wide_b = activation_breakdown(TINY, config), activation_breakdown(wide, config)
    # log_softmax output: b*s*vocab*4 B + int64 labels b*s*8 -> 128*1000*4 + 1,024
    assert narrow_b["activations/loss/log_softmax"] == 513_024
    assert wide_b["activations/loss/log_softmax"] - narrow_b["activations/loss/log_softmax"] == 128 * 1000 * 4
    assert {k: v for k, v in wide_b.items() if "loss" not in k} == {k: v for k, v in narrow_b.items() if "loss" not in k}
    # under autocast the lm_head's bf16 weight cast (vocab x h x 2 B) is saved too
    mixed = activation_breakdown(wide, tiny_config(precision="bf16-mixed"))["autocast/weight_casts"]
    mixed_narrow = activation_breakdown(TINY, tiny_config(precision="bf16-mixed"))["autocast/weight_casts"]
    assert mixed - mixed_narrow == 1000 * H * 2


# ---- the whole estimate ------------------------------------------------------------------------

CONFIGS = [
    dict(),
    dict(precision="fp32", micro_batch=8),
    dict(precision="bf16", optimizer="sgd", grad_accum=4),
    dict(method="lora", lora_r=8, grad_ckpt=True, micro_batch=3),
    dict(method="qlora", optimizer="paged_adamw_8bit", micro_batch=5, grad_accum=2),
    dict(zero=3, gpus=4, offload="optimizer+params", micro_batch=6, grad_ckpt=True),
    dict(optimizer="adafactor", attention="eager", micro_batch=7),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("device", ["cpu", "a10g", "t4"])
def test_breakdown_sums_to_peak_and_the_totals_are_ordered(kw, device):
    gpu = get_gpu(device)
    if not gpu.supports(kw.get("precision", "bf16-mixed")):
        kw = {**kw, "precision": kw.get("precision", "bf16-mixed").replace("bf16", "fp16")}
    config = TrainConfig(seq_len=64, **kw)
    m = estimate_memory(model=TINY, config=config, gpu=gpu)
    assert sum(m.breakdown.values()) == m.peak_allocated_bytes
    assert all(v > 0 for v in m.breakdown.values())
    assert m.process_total_bytes >= m.peak_reserved_bytes >= m.peak_allocated_bytes
    assert m.peak_phase in ("forward", "backward_start", "backward_end", "optimizer")
    if device == "cpu":
        assert m.peak_reserved_bytes == m.peak_allocated_bytes == m.process_total_bytes
    else:
        assert m.process_total_bytes - m.peak_reserved_bytes >= gpu.cuda_context_bytes


@pytest.mark.parametrize("b", [3, 8, 13])
def test_estimate_activations_equal_the_direct_breakdown_at_any_micro_batch(b, cpu):
    """estimate_memory extrapolates from micro-batches 1 and 2; it must equal the direct sum."""
    config = TrainConfig(precision="fp32", micro_batch=b, seq_len=64, attention="eager")
    m = estimate_memory(model=TINY, config=config, gpu=cpu)
    assert m.peak_phase in ("forward", "backward_start")
    direct = activation_breakdown(TINY, config)
    assert {k: v for k, v in m.breakdown.items() if k in direct} == direct


def test_cpu_peak_of_tiny_fp32_by_hand(cpu):
    """The four moments of tiny fp32 AdamW, micro-batch 2, seq 64, assembled by hand."""
    m = estimate_memory(model=TINY, config=tiny_config(precision="fp32"), gpu=cpu)
    weights_and_moments = 12 * TINY_PARAMS + 4 * TINY_TENSORS  # 2,725,632 + 84 = 2,725,716
    grads = 4 * TINY_PARAMS  # 908,544
    saved = 1_987_072  # the model's saved activations (measured: 1,987,076)
    logits_fwd = 128 * 1000 * 4  # fp32 logits at the loss: b*s*vocab*4 = 512,000
    logits_bwd = 2 * 128 * 1000 * 4  # nll's dense grad + log_softmax's grad input = 1,024,000
    step_tmp = 2 * 64_000 * 4  # CPU single-tensor AdamW: 2 fp32 temporaries of the largest tensor
    moments = {
        "forward": weights_and_moments + saved + logits_fwd,  # 5,224,788
        "backward_start": weights_and_moments + saved + logits_bwd,  # 5,736,788
        "backward_end": weights_and_moments + grads,  # 3,634,260
        "optimizer": weights_and_moments + grads + step_tmp,  # 4,146,260
    }
    assert m.peak_phase == "backward_start"
    assert m.peak_allocated_bytes == max(moments.values()) == 5_736_788
    assert m.breakdown["logits/transient"] == logits_bwd
    assert "gradients" not in m.breakdown  # no accumulation: no gradient exists yet
    # with accumulation the previous micro-steps' gradients are alive during the forward
    accum = estimate_memory(model=TINY, config=tiny_config(precision="fp32", grad_accum=4), gpu=cpu)
    assert accum.peak_allocated_bytes == 5_736_788 + grads
    assert accum.breakdown["gradients"] == grads


# ---- optional: the measurement itself -----------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import json, os
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def measure(dtype, autocast, lora, attn):
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256, attn_implementation=attn)
        m = LlamaForCausalLM(cfg).to(dtype)
        if lora:
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=8, target_modules="all-linear"))
        m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen = {}
        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen.setdefault(st.data_ptr(), st.nbytes())
            return t
        ids = torch.randint(0, 1000, (2, 64))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                m(input_ids=ids, labels=ids)
        return sum(seen.values())

    f32, b16 = torch.float32, torch.bfloat16
    print(json.dumps({
        "fp32 full": measure(f32, False, False, "sdpa"),
        "bf16-mixed full": measure(f32, True, False, "sdpa"),
        "bf16 full": measure(b16, False, False, "sdpa"),
        "fp32 lora r8": measure(f32, False, True, "sdpa"),
        "bf16-mixed lora r8": measure(f32, True, True, "sdpa"),
        "bf16 lora r8": measure(b16, False, True, "sdpa"),
        "fp32 eager": measure(f32, False, False, "eager"),
        "bf16 eager": measure(b16, False, False, "eager"),
    }))
    """
)


@pytest.mark.slow
def test_activation_measurement_is_reproducible():
    """Re-measure the saved bytes with the real transformers/peft on the CPU (~15 s)."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert measured == {name: value for name, (_, value) in MEASURED.items()}


# ---- terms found by the CPU accuracy benchmark (bench/accuracy.py) ----------------------------
GPT2_TINY = dataclasses.replace(
    TINY, id="tiny-gpt2", model_type="gpt2", hidden_act="gelu_new", gated_mlp=False, norm="layernorm",
    layer_linears=(
        _lin("c_attn", H, 3 * H, LinearKind.ATTN_IN), _lin("c_proj", H, H, LinearKind.ATTN_OUT),
        _lin("c_fc", H, I, LinearKind.MLP_IN), _lin("mlp.c_proj", I, H, LinearKind.MLP_OUT),
    ),
    attn_dropout=0.1, position="learned",
)


def test_cpu_sdpa_with_dropout_takes_the_math_path():
    config = tiny_config(precision="bf16-mixed")  # b=2, s=64
    e, q, scores = 2 * 64, 2 * 64 * H, 2 * A * 64 * 64
    gpu = activation_breakdown(GPT2_TINY, config)["activations/attention/core"]
    cpu = activation_breakdown(GPT2_TINY, config, is_cpu=True)["activations/attention/core"]
    # GPU (flash/efficient take dropout): q, k and v are views of c_attn's bf16 output, which
    # stays saved whole (3q), + out + the fp32 log-sum-exp, per layer
    assert gpu == L * (2 * 3 * q + 2 * q + e * A * 4)
    # CPU math path: fp32 q, kᵀ, v + fp32 softmax, mask, dropped probabilities, per layer, and
    # the bf16 contiguous output c_proj reads
    assert cpu == L * (4 * 3 * q + 4 * 3 * scores)
    assert activation_breakdown(GPT2_TINY, config, is_cpu=True)["activations/attention/out_input"] == L * e * H * 2
    # ... which a frozen c_proj without an adapter does not keep
    c_attn_only = tiny_config(precision="bf16-mixed", method="lora", lora_targets=("c_attn",))
    assert "activations/attention/out_input" not in activation_breakdown(GPT2_TINY, c_attn_only, is_cpu=True)
    # no dropout: the CPU flash kernel runs and nothing changes
    no_dropout = dataclasses.replace(GPT2_TINY, attn_dropout=0.0)
    assert activation_breakdown(no_dropout, config, is_cpu=True) == activation_breakdown(no_dropout, config)


def test_a_fused_qkv_projection_keeps_its_output_and_with_rope_a_copy_of_the_attention_output():
    """phi3's qkv_proj: v is a view of the fused output (kept whole); rope makes new q and k; the
    kernel's output is then (b, a, s, d)-contiguous and o_proj reads a transposed copy. Measured
    with the CPU probe on a tiny phi3 (within 0.1% for fp32, bf16-mixed, bf16, LoRA, QLoRA)."""
    phi3 = dataclasses.replace(
        TINY, id="tiny-phi3", model_type="phi3",
        layer_linears=(_lin("qkv_proj", H, 3 * H, LinearKind.ATTN_IN), _lin("o_proj", H, H, LinearKind.ATTN_OUT))
        + TINY.layer_linears[4:],
    )
    assert phi3.fused_qkv and not TINY.fused_qkv
    e, q = 2 * 64, 2 * 64 * H
    bf16 = activation_breakdown(phi3, tiny_config(precision="bf16-mixed"))
    # roped q, k copies + out (bf16) + the fused bf16 output (3q) + lse, per layer
    assert bf16["activations/attention/core"] == L * (2 * (2 * q + q) + 2 * 3 * q + e * A * 4)
    assert bf16["activations/attention/out_input"] == L * 2 * q
    # QLoRA under autocast: bnb's fp32 outputs are cast, so q, k and v are bf16 copies and the
    # fp32 fused buffer is not kept
    qlora = activation_breakdown(phi3, tiny_config(method="qlora", precision="bf16-mixed"))
    assert qlora["activations/attention/core"] == L * (2 * (3 * q + q) + e * A * 4)


def test_python_gelu_saves_four_more_intermediates_than_a_fused_one():
    config = tiny_config(precision="fp32")
    inter = 2 * 64 * I * 4  # one fp32 (b, s, intermediate) tensor
    # NewGELUActivation: x, tanh(.), 0.5x, 1 + tanh(.) and its output (fc2's input), per layer
    assert activation_breakdown(GPT2_TINY, config)["activations/mlp/intermediate"] == L * 5 * inter
    fused = dataclasses.replace(GPT2_TINY, hidden_act="gelu")
    assert activation_breakdown(fused, config)["activations/mlp/intermediate"] == L * 2 * inter
    # relu saves only its result, which fc2 saves anyway
    relu = dataclasses.replace(GPT2_TINY, hidden_act="relu")
    assert activation_breakdown(relu, config)["activations/mlp/intermediate"] == L * 1 * inter
    # an activation the table does not know is an assumption the estimate states
    odd = dataclasses.replace(GPT2_TINY, hidden_act="my_custom_act")
    assert any("'my_custom_act'" in a for a in estimate_memory(model=odd, config=config, gpu=get_gpu("cpu")).assumptions)
    # transformers' erf-based Python GELU: x/sqrt(2), 0.5·x and 1 + erf(.)
    erf = dataclasses.replace(GPT2_TINY, hidden_act="gelu_python")
    assert activation_breakdown(erf, config)["activations/mlp/intermediate"] == L * 4 * inter


def test_adafactor_step_holds_two_fp32_copies_of_the_largest_parameter(cpu):
    config = tiny_config(optimizer="adafactor", precision="fp32", micro_batch=1, seq_len=8)
    memory = estimate_memory(model=TINY, config=config, gpu=cpu)
    assert memory.peak_phase == "optimizer"
    assert memory.breakdown["optimizer_step/transient"] == 2 * (V * H) * 4  # embedding = lm_head size
    # pure bf16 parameters add the fp32 copies of the parameter and of its gradient
    bf16 = estimate_memory(model=TINY, config=config.replace(precision="bf16"), gpu=cpu)
    assert bf16.breakdown["optimizer_step/transient"] == 4 * (V * H) * 4


def test_zero_optimizer_steps_from_the_fp32_gradient_partition(cpu):
    config = tiny_config(zero=1, precision="bf16-mixed", micro_batch=1, seq_len=8)
    memory = estimate_memory(model=TINY, config=config, gpu=cpu)
    assert memory.peak_phase == "optimizer"
    p = TINY_PARAMS
    # the 16-bit gradients are freed; DeepSpeed steps one flat fp32 partition with its fp32
    # gradient (stage_1_and_2.py step); torch AdamW's temporaries of that one tensor: two on the
    # CPU (exp_avg_sq.sqrt() / c)
    assert memory.breakdown["gradients"] == 4 * p
    assert memory.breakdown["optimizer_step/transient"] == 2 * 4 * p
    assert memory.breakdown["weights"] == 2 * p
    assert memory.breakdown["master_weights"] == 4 * p
    assert memory.breakdown["optimizer_states"] == 8 * p + 4


def test_zero_flattens_the_gradients_before_the_step(cpu):
    """SGD adds no step temporaries, so the moment the step begins is the peak: the 16-bit
    gradients, their flat copy and its fp32 conversion (measured on gpt2)."""
    p = TINY_PARAMS
    memory = estimate_memory(model=TINY, config=tiny_config(zero=1, optimizer="sgd", micro_batch=1, seq_len=8), gpu=cpu)
    assert memory.peak_phase == "optimizer_start"
    assert memory.breakdown["gradients"] == 2 * p  # ZeRO-1 keeps every 16-bit gradient
    assert memory.breakdown["zero/gradient_flatten"] == 2 * p + 4 * p
    zero2 = estimate_memory(model=TINY, config=tiny_config(zero=2, gpus=2, optimizer="sgd", micro_batch=1, seq_len=8), gpu=cpu)
    # ZeRO-2 on two ranks: this rank's half of the gradients, flattened and converted
    assert zero2.breakdown["gradients"] == 2 * p // 2
    assert zero2.breakdown["zero/gradient_flatten"] == 2 * (p // 2) + 4 * (p // 2)


def test_a_trained_tied_embedding_has_two_partial_gradients_at_the_end_of_backward(cpu):
    tied = dataclasses.replace(TINY, tied_embeddings=True, head_params=0)
    config = tiny_config(precision="fp32", optimizer="sgd", micro_batch=1, seq_len=8)
    memory = estimate_memory(model=tied, config=config, gpu=cpu)
    assert memory.peak_phase == "backward_end"
    # the head's matmul gradient and the embedding backward's, summed into a third tensor
    assert memory.breakdown["gradients/tied_embedding_partials"] == 2 * V * H * 4
    assert "gradients/tied_embedding_partials" not in estimate_memory(model=TINY, config=config, gpu=cpu).breakdown
    lora = estimate_memory(model=tied, config=config.replace(method="lora"), gpu=cpu)
    assert "gradients/tied_embedding_partials" not in lora.breakdown  # a frozen embedding gets none


def test_checkpoint_recompute_does_not_overlap_the_loss_backward(cpu):
    config = tiny_config(grad_ckpt=True, seq_len=256, micro_batch=4)
    memory = estimate_memory(model=TINY, config=config, gpu=cpu)
    assert memory.peak_phase == "backward_start"
    assert "activations/recompute" not in memory.breakdown


def test_a_frozen_unadapted_down_projection_saves_no_input():
    inter = 2 * 64 * I * 4  # one fp32 (b, s, intermediate) tensor
    attention_only = tiny_config(method="lora", precision="fp32", lora_r=8, lora_targets=("q_proj", "v_proj"))
    # gate's output (silu's input), silu's output and up's output (both saved by the product);
    # down_proj is frozen and has no adapter, so nothing keeps the product
    assert activation_breakdown(TINY, attention_only)["activations/mlp/intermediate"] == L * 3 * inter
    with_down = attention_only.replace(lora_targets=("q_proj", "v_proj", "down_proj"))
    assert activation_breakdown(TINY, with_down)["activations/mlp/intermediate"] == L * 4 * inter


def test_dropout_keeps_only_masks_bool_on_cuda_and_in_the_dropped_dtype_on_the_cpu():
    model = dataclasses.replace(GPT2_TINY, attn_dropout=0.0, hidden_dropout=0.1, embedding_dropout=0.1)
    config = tiny_config(precision="bf16-mixed")
    eh = 2 * 64 * H
    gpu = activation_breakdown(model, config)["activations/dropout"]
    cpu = activation_breakdown(model, config, is_cpu=True)["activations/dropout"]
    # two masks per block (attention and MLP outputs) + one on the embeddings: one byte each on
    # CUDA (native_dropout's bool mask); on the CPU the dropped tensor's dtype: the bf16
    # projection outputs and the fp32 embeddings (measured on gpt2 and bert)
    assert gpu == L * 2 * eh + eh
    assert cpu == L * 2 * eh * 2 + eh * 4


def test_embedding_norm_and_the_masked_lm_transform_save_their_inputs():
    bert = resolve_model("bert-base-uncased")
    assert bert.embedding_norm and bert.is_encoder
    config = TrainConfig(micro_batch=2, seq_len=128, precision="fp32")
    plain = dataclasses.replace(bert, embedding_norm=False, is_encoder=False)
    eh = 2 * 128 * 768
    with_terms, without = activation_breakdown(bert, config), activation_breakdown(plain, config)
    # the embeddings' LayerNorm input (fp32) and the transform dense's output gelu keeps (fp32)
    assert with_terms["activations/embeddings"] - without["activations/embeddings"] == eh * 4
    assert with_terms["activations/lm_head/transform"] == eh * 4


def test_gemma_norms_save_the_fp32_normalised_tensor():
    gemma = dataclasses.replace(TINY, norm_weight_fp32=True)
    config = tiny_config(precision="bf16")
    eh = 2 * 64 * H
    # two norms per block and the final one keep x·rsqrt in fp32 (4 B) instead of bf16 (2 B)
    more = acts(gemma, config) - acts(TINY, config)
    assert more == (2 * L + 1) * eh * 2
    assert resolve_model("google/gemma-7b").norm_weight_fp32


@pytest.mark.parametrize(
    "softmax, dropout, is_cpu, per_score",
    [
        # llama's softmax(dtype=float32).to(q.dtype): fp32 probabilities + the bf16 cast probs @ v reads
        ("fp32", 0.0, False, 4 + 2),
        # with dropout the cast feeds dropout instead: mask (bool on CUDA) + dropped bf16
        ("fp32", 0.1, False, 4 + 1 + 2),
        # BERT on the CPU: softmax stays bf16 under CPU autocast; mask and dropped in bf16 (measured)
        ("input", 0.1, True, 2 + 2 + 2),
        # BERT on CUDA: autocast's fp32 softmax, a bool mask, then probs @ v keeps a bf16 cast
        ("input", 0.1, False, 4 + 1 + 2),
    ],
)
def test_eager_attention_probabilities_by_architecture(softmax, dropout, is_cpu, per_score):
    model = dataclasses.replace(TINY, eager_softmax=softmax, attn_dropout=dropout)
    config = tiny_config(precision="bf16-mixed", attention="eager")
    scores = 2 * A * 64 * 64
    assert activation_breakdown(model, config, is_cpu=is_cpu)["activations/attention/probs"] == L * scores * per_score


# ---- stored payloads: versioned, decoded tolerantly ------------------------------------------------

#: A candidate exactly as the planner wrote it before payloads carried a version (qlora on an
#: A10G, from ``Candidate.to_dict`` of that code).
OLD_CANDIDATE = json.loads(
    '{"rank": 1, "config": {"method": "qlora", "precision": "bf16-mixed", "optimizer": "adamw", "micro_batch": 4, '
    '"seq_len": 1024, "grad_accum": 1, "gpus": 1, "grad_ckpt": true, "attention": "sdpa", "lora_r": 16, '
    '"lora_targets": "all-linear", "zero": 0, "offload": "none"}, "memory": {"peak_allocated_bytes": 8920868608, '
    '"peak_reserved_bytes": 9396034918, "process_total_bytes": 9932905830, "cpu_bytes": 0, "breakdown": '
    '{"weights/nf4": 3340771328, "weights/unquantized": 1049640960, "lora/weights": 159907840, "optimizer_states": '
    '319817472, "autocast/weight_casts": 262144000, "activations/embeddings": 1081344, "activations/final_norm": '
    '67125248, "activations/checkpoints": 2147483648, "activations/loss/log_softmax": 524320768, "logits/transient": '
    '1048576000}, "peak_phase": "backward_start", "assumptions": ["allocator: +1 MiB rounding per large tensor and 5% '
    'of transient bytes reserved (uncalibrated on GPU)"]}, "throughput": {"step_s": 5.545680919113143, '
    '"tokens_per_s": 738.5928003688726, "flops_per_step": 115829899264000.0, "breakdown_s": {"compute": '
    '3.4677088729315555}, "assumptions": []}, "fits": true}'
)


def test_a_candidate_stored_before_payloads_had_versions_still_decodes():
    from planner.results import Candidate

    c = Candidate.from_dict(OLD_CANDIDATE)
    assert c.config == TrainConfig(method="qlora", micro_batch=4, seq_len=1024, grad_ckpt=True)
    assert c.config.alloc_conf is None  # a key version 1 did not have takes its default
    assert c.memory.peak_allocated_bytes == 8_920_868_608 and c.memory.fragmentation_bytes == 0
    assert c.throughput.tokens_per_s == pytest.approx(738.59, abs=0.01)
    again = c.to_dict()
    # written back at today's versions (the memory payload's 3rd carries the OOM risk and its interval)
    assert (again["config"]["version"], again["memory"]["version"], again["throughput"]["version"]) == (2, 3, 2)
    assert Candidate.from_dict(again) == c


def test_keys_a_newer_planner_writes_are_ignored():
    from planner.results import Candidate

    future = json.loads(json.dumps(OLD_CANDIDATE))
    future["memory"] |= {"version": 9, "timeline_svg": "<svg/>"}
    future["throughput"]["version"] = 9
    future["config"] |= {"version": 9, "rope_scaling_factor": 4.0}
    with pytest.warns(UserWarning, match="rope_scaling_factor"):
        c = Candidate.from_dict(future)
    assert c.memory.peak_phase == "backward_start"
    with pytest.raises(InvalidConfigError, match="rope_scaling_factor"):
        TrainConfig.from_dict(future["config"], strict=True)
