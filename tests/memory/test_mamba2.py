"""Nemotron-H: Mamba2 layers on the CPU's torch path (planner/memory/recurrent.py mamba2_terms) beside its MoE,
attention and MLP blocks (one norm and one mixer a block), against what autograd really keeps in a tiny model built
from its config shrunk (tests/memory/test_mla.py's liveness count); the GPU kernel's saved tensors by hand; peft's
refusal of out_proj, in one line."""

from __future__ import annotations

import pytest
from test_gated_deltanet import _measured

from planner.catalog import check_plannable, resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import CPU_KERNELS, CUDA_KERNELS

# Mamba2 (4 heads of 16, 2 groups of 8 states, 16-token chunks), MoE (8 relu2 experts, top-2, shared expert),
# Mamba2, attention (4 heads, 2 kv heads of 16), MoE, MLP: every kind of block, the released pattern's order
TINY = dict(model_type="nemotron_h", hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8,
            conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, hybrid_override_pattern="MEM*E-", vocab_size=256, max_position_embeddings=128)
#: every nn.Linear but the Mamba2 out_proj, which peft refuses on nemotron_h
TARGETS = ("in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _config(precision: str, lora, seq_len: int) -> TrainConfig:
    changes = dict(precision=precision)
    if lora:
        changes |= dict(method="lora", lora_r=4, lora_targets=lora)
    return TrainConfig(micro_batch=2, seq_len=seq_len, optimizer="adamw", **changes)


@pytest.mark.parametrize(("precision", "lora", "seq_len"), [
    ("bf16-mixed", None, 32), ("fp32", None, 40), ("bf16", None, 40), ("bf16-mixed", TARGETS, 40),
    ("fp32", TARGETS, 40), ("bf16", TARGETS, 32), ("bf16-mixed", ("in_proj",), 32),
])
def test_nemotron_h_layers_match_what_autograd_saves(precision, lora, seq_len):
    """Every block byte for byte (s = 40 pads the scan to three 16-token chunks) but the MoE blocks, whose count
    moves by 1-3 x 1,024 B from one process to another (test_mla's note: an int64 T x k or S-sized tensor more or
    less held): within that."""
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="nemotron", source="test")
    check_plannable(spec)
    measured = _measured(TINY, precision, lora, seq_len)
    predicted = [sum(terms.values()) for terms in layer_terms(spec, _config(precision, lora, seq_len), CPU_KERNELS)]
    moe = [i for i, letter in enumerate(TINY["hybrid_override_pattern"]) if letter == "E"]
    assert [p for i, p in enumerate(predicted) if i not in moe] == [m for i, m in enumerate(measured) if i not in moe]
    assert all(abs(predicted[i] - measured[i]) <= 3 * 1024 for i in moe)


def test_mamba2_terms_by_hand():
    # bf16-mixed, full, b = 2, s = 32 (T = P = 64: two 16-token chunks), I = 64, conv = 96, 4 heads, 2 groups of 8
    from planner.memory.activations import layer_terms

    spec = spec_from_config(TINY, model_id="nemotron", source="test")
    cpu = layer_terms(spec, _config("bf16-mixed", None, 32), CPU_KERNELS)[0]
    # the conv's bf16 input 64*96*2, its padded output 2*96*35*2, the weight's copy 96*4*2
    assert cpu["mamba/conv"] == 12_288 + 13_440 + 768
    # softplus and clamp inputs 2 x 64*4*2, two fp32 dt copies 2 x 64*4*4, A and exp(A_log) 2 x 4*4
    assert cpu["mamba/gates"] == 1_024 + 2_048 + 32
    # the gate's fp32 copy, the scan output, silu's output, the product, the normalised tensor 5 x 64*64*4, rsqrt 64*2*4
    assert cpu["mamba/norm"] == 5 * 16_384 + 512
    # the GPU kernel: zxbcdt (64 x 164) and out_x (64 x 64) in bf16, rstd 64*2*4; out_proj's input is recomputed
    gpu = layer_terms(spec, _config("bf16-mixed", None, 32), CUDA_KERNELS)[0]
    assert gpu["mamba/scan"] == 64 * (164 + 64) * 2 and gpu["mamba/norm"] == 512 and gpu["attention/out_input"] == 0
    assert "mamba/conv" not in gpu


def test_nemotron_h_plans_by_id_and_refuses_what_peft_refuses():
    from planner.estimation import estimate_configuration
    from planner.gpus import get_gpu

    spec = resolve_model("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    check_plannable(spec)
    assert {view.mixer for _, _, view in spec.block_kinds} == {"mamba2", "none", "attention"}
    assert spec.routing is not None and spec.routing.group_limited == (1, 1)
    gpu = get_gpu("h100-80gb")
    for lora in ("all-linear", "out_proj,in_proj"):
        with pytest.raises(InvalidConfigError, match="fails on nemotron_h: peft refuses LoRA on the Mamba2 out_proj") as err:
            estimate_configuration(spec=spec, gpu=gpu, method="lora", lora_targets=lora, micro_batch=1, seq_len=512)
        assert "\n" not in str(err.value) and "use --lora-targets in_proj," in str(err.value)
    answer, memory = estimate_configuration(spec=spec, gpu=gpu, method="lora", lora_targets=",".join(TARGETS),
                                            micro_batch=1, seq_len=512)
    assert answer["model"]["params"] == spec.params_total and memory.process_total_bytes > 0
    from planner.search import attention_targets

    assert attention_targets(spec) == ("in_proj",) and "out_proj" not in spec.peft_linear_names
    # LoRA without targets: all-linear's default named, and the estimate says so
    answer, memory = estimate_configuration(spec=spec, gpu=gpu, method="lora", micro_batch=1, seq_len=512)
    assert set(answer["config"]["lora_targets"].split(",")) == set(TARGETS)
    assert any(note.startswith("LoRA on ") and "every linear but out_proj" in note for note in memory.assumptions)


def test_mamba2_flops_by_hand():
    # two Mamba2 layers, 4 heads of 16, 8 states, 16-token chunks, per token and head: 2*16*(8 + 16) + 4*16*8
    from planner.kernels import _mamba2_flops

    spec = spec_from_config(TINY, model_id="nemotron", source="test")
    assert _mamba2_flops(spec, 64) == 2 * 4 * (2 * 16 * 24 + 4 * 16 * 8) * 64


def test_a_config_saved_by_transformers_5_reads_its_layer_list():
    # NemotronHConfig turns hybrid_override_pattern into layers_block_type, which save_pretrained writes instead
    from transformers import AutoConfig

    raw = dict(TINY)
    saved = AutoConfig.for_model(raw.pop("model_type"), **raw).to_dict()
    assert "layers_block_type" in saved and "hybrid_override_pattern" not in saved
    spec = spec_from_config(saved, model_id="nemotron", source="test")
    assert spec.params_total == spec_from_config(TINY, model_id="nemotron", source="test").params_total
    assert [g.label for g in spec.other_blocks] == ["moe", "attention", "mlp"]
