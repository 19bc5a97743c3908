"""The 2025-2026 model families (issue 23, phase A): active parameters of MoE models by hand,
release variants (-Instruct/-it/-Chat) resolving to their base architecture, ``planner models
--search`` by words and versions, and the refusal to plan what the memory model does not model.

Exact total counts against transformers' meta-device build are in tests/catalog/test_param_counts.py.
"""

from __future__ import annotations

import pytest

from planner.catalog import check_plannable, list_catalog, resolve_model
from planner.errors import UnknownModelError, UnsupportedError


def test_qwen3_30b_a3b_total_and_active_by_hand():
    spec = resolve_model("Qwen/Qwen3-30B-A3B")
    # H=2048, 48 layers, 32 q heads / 4 kv heads of 128, 128 experts of 768 (top-8), vocab 151936, untied
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048  # q, k, v, o = 18_874_368
    norms = 2 * 2048 + 2 * 128  # input/post-attention RMSNorms, q_norm/k_norm over head_dim
    router = 128 * 2048
    expert = 3 * 2048 * 768  # gate_up (2 x 768) + down = 4_718_592
    outside = 2 * 151936 * 2048 + 2048  # embedding, lm_head, final norm
    assert spec.params_total == 48 * (attention + norms + router + 128 * expert) + outside == 30_532_122_624
    assert spec.params_active == 48 * (attention + norms + router + 8 * expert) + outside == 3_353_032_704  # "A3B"
    assert (spec.num_experts, spec.experts_per_token, spec.is_moe) == (128, 8, True)


def test_deepseek_v3_dense_first_layers_and_shared_expert_by_hand():
    spec = resolve_model("deepseek-ai/DeepSeek-V3")
    # MLA: q_a 7168->1536, q_b 1536->128*192, kv_a 7168->512+64, kv_b 512->128*(128+128), o 128*128->7168
    mla = 7168 * 1536 + 1536 * 24576 + 7168 * 576 + 512 * 32768 + 16384 * 7168
    norms = 2 * 7168 + 1536 + 512
    dense = mla + 3 * 7168 * 18432 + norms
    moe_total = mla + 256 * 7168 + 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + norms
    moe_active = mla + 256 * 7168 + 8 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + norms
    outside = 2 * 129280 * 7168 + 7168
    assert spec.params_total == 3 * dense + 58 * moe_total + outside == 671_026_404_352
    assert spec.params_active == 3 * dense + 58 * moe_active + outside
    assert [(g.label, g.count, g.first) for g in spec.other_blocks] == [("moe", 58, 3)]


@pytest.mark.parametrize(("variant", "base"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ("google/gemma-2-9b-it", "google/gemma-2-9b"),
    ("google/gemma-3-12b-it", "google/gemma-3-12b-pt"),
    ("mistralai/Mistral-7B-Instruct-v0.1", "mistralai/Mistral-7B-v0.1"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1"),
    ("meta-llama/Llama-3.3-70B", "meta-llama/Llama-3.3-70B-Instruct"),
])
def test_release_variants_resolve_to_their_base_architecture(variant, base, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    spec = resolve_model(variant)
    assert (spec.id, spec.alias_of) == (variant, base)
    assert spec.params_total == resolve_model(base).params_total
    from planner.cli.models_cmd import describe_model

    assert f"architecture of {base}" in describe_model(spec)


def test_a_variant_of_another_release_is_not_guessed(tmp_path, monkeypatch):
    # Mistral-7B v0.3 changed the vocabulary (32768): the catalog's v0.1 is not its architecture
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(UnknownModelError, match="closest catalog ids"):
        resolve_model("mistralai/Mistral-7B-Instruct-v0.3")


def test_search_by_words_and_versions():
    found = {s.id for s in list_catalog(search="llama 3")}
    assert {"meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.3-70B-Instruct",
            "meta-llama/Meta-Llama-3-8B"} <= found
    assert not any("Llama-2" in mid or "Llama-4" in mid for mid in found)
    assert {s.id for s in list_catalog(search="qwen3_moe")} == {"Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"}
    # a wrapper is found by its own model_type too
    assert "google/gemma-3-4b-it" in {s.id for s in list_catalog(search="gemma3")}


def test_unmodelled_features_refuse_to_plan_in_one_line():
    # the small Gemma 4 models' layout (configuration_gemma4.py defaults: per-layer input embeddings of 256 a layer;
    # the last layers reading earlier layers' keys and values): counted, not planned yet
    from planner.catalog import spec_from_config
    from planner.estimation import estimate_configuration
    from planner.gpus import get_gpu

    raw = dict(model_type="gemma4_text", hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
               num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
               num_kv_shared_layers=20, use_double_wide_mlp=True)
    spec = spec_from_config(raw, model_id="gemma-4-small", source="test")
    # the per-layer embedding table alone: 262,144 x 35 x 256
    assert spec.other_embedding_params == (262_144 + 1536) * 35 * 256 + 256
    for feature in ("per-layer input embeddings", "kv-shared layers"):
        assert any(feature in f for f in spec.summary()["not_modelled"])  # planner models --json says so too
    with pytest.raises(UnsupportedError, match="per-layer input embeddings") as err:
        estimate_configuration(spec=spec, gpu=get_gpu("h100-80gb"), method="lora")
    assert "\n" not in str(err.value) and "not model" in str(err.value)


@pytest.mark.parametrize("model_id", [
    "Qwen/Qwen3-0.6B", "allenai/OLMo-2-1124-7B", "huihui-ai/granite-3.2-8b-instruct-abliterated",
    "google/gemma-3-1b-it", "google/gemma-3-4b-it", "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Ministral-8B-Instruct-2410", "microsoft/Phi-4-mini-instruct", "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-4-26B-A4B", "nvidia/Gemma-4-31B-IT-NVFP4", "Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-35B-A3B",
    "Qwen/Qwen3-Next-80B-A3B-Thinking",
])
def test_dense_new_models_and_mixtral_plan(model_id):
    from planner.estimation import estimate_configuration
    from planner.gpus import get_gpu

    spec = resolve_model(model_id)
    check_plannable(spec)
    answer, memory = estimate_configuration(spec=spec, gpu=get_gpu("h100-80gb"), method="lora", micro_batch=1,
                                            seq_len=512)
    assert answer["model"]["params"] == spec.params_total and memory.process_total_bytes > 0


def test_multimodal_wrapper_is_its_language_model():
    spec = resolve_model("google/gemma-3-4b-it")
    # Gemma3TextConfig defaults fill the text_config: 8 heads, 4 kv heads of 256, vocab 262208, tied
    assert (spec.wrapper_type, spec.model_type, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (
        "gemma3", "gemma3_text", 8, 4, 262_208)
    assert spec.tied_embeddings and spec.head_params == 0
    assert spec.summary()["language_model_of"] == "gemma3" and spec.summary()["not_modelled"] == []


@pytest.mark.parametrize(("model_id", "key", "value", "problem"), [
    ("Qwen/Qwen3-30B-A3B", "mlp_only_layers", 3, "mlp_only_layers must be a list of layer indices"),
    ("deepseek-ai/DeepSeek-V3", "first_k_dense_replace", "3", "first_k_dense_replace must be a whole number >= 0"),
    ("deepseek-ai/DeepSeek-V3", "num_experts_per_tok", 300, "num_experts_per_tok 300 is larger than n_routed_experts"),
    ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "hybrid_override_pattern", "MXM", "hybrid_override_pattern must be"),
    # gpt-oss reads layer_types for which layers attend through the window (its attention cost)
    ("openai/gpt-oss-20b", "layer_types", ["full_attention"], "layer_types must be a list of 24 layer type names"),
])
def test_malformed_new_configs_are_one_line(model_id, key, value, problem):
    from planner.catalog import spec_from_config
    from planner.errors import ModelConfigError

    config = {**resolve_model(model_id).config, key: value}
    if problem is None:
        spec_from_config(config, model_id=model_id, source="test")
        return
    with pytest.raises(ModelConfigError, match=problem) as err:
        spec_from_config(config, model_id=model_id, source="test")
    assert "\n" not in str(err.value) and str(err.value).startswith("test: ")


def test_a_wrapper_without_text_config_says_what_is_missing():
    from planner.catalog import spec_from_config
    from planner.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="needs a text_config object"):
        spec_from_config({"model_type": "gemma3"}, model_id="x", source="test")


# ---- the norms of the new dense blocks (q/k norms, Gemma's four norms, OLMo 2's post-norms) -------

_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2000, max_position_embeddings=256)
TINY_QWEN3 = dict(_TINY, model_type="qwen3", head_dim=32)
TINY_OLMO2 = dict(_TINY, model_type="olmo2")
TINY_GEMMA3 = dict(_TINY, model_type="gemma3_text", head_dim=32, sliding_window=32)


def _block(arch: dict, **changes) -> dict[str, int]:
    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.gpus import CPU_KERNELS
    from planner.memory.activations import block_terms
    from planner.memory.shapes import block_context

    spec = spec_from_config(arch, model_id="tiny", source="test")
    config = TrainConfig(**(dict(micro_batch=2, seq_len=64, precision="bf16-mixed") | changes))
    return block_terms(block_context(spec, config, CPU_KERNELS, first=False))


def test_qk_and_output_norms_by_hand():
    e = 2 * 64  # tokens
    # qwen3 q_norm/k_norm over head_dim 32 (4 q heads, 2 kv heads): fp32 input, one fp32 rsqrt per
    # head, the normalised tensor cast back to q_proj's bf16 output (full fine-tuning)
    assert _block(TINY_QWEN3)["attention/qk_norms"] == e * 6 * 32 * 4 + e * 6 * 4 + e * 6 * 32 * 2 == 150_528
    # olmo2 normalises the whole projection (one rsqrt per token each) and multiplies in fp32;
    # its two norms sit on the sublayers' outputs only
    olmo = _block(TINY_OLMO2)
    assert olmo["attention/qk_norms"] == e * 6 * 32 * 4 + 2 * e * 4 + e * 6 * 32 * 4 == 197_632
    assert olmo["norms"] == 2 * (e * 128 * 4 + e * 4 + e * 128 * 4) == 263_168
    # gemma3: four fp32-weighted norms (input, post-attention, pre- and post-feedforward)
    assert _block(TINY_GEMMA3)["norms"] == 4 * (e * 128 * 4 + e * 4 + e * 128 * 4) == 526_336
    # LoRA on v_proj only in a later block: the norms' inputs need a gradient, their weights none;
    # the q/k norms' inputs too (they read the block's input through q_proj/k_proj)
    lora = _block(TINY_QWEN3, method="lora", lora_targets=("v_proj",))
    assert lora["attention/qk_norms"] == e * 6 * 32 * 4 + e * 6 * 4


@pytest.mark.slow
@pytest.mark.parametrize("arch, bound", [
    (TINY_QWEN3, 0.1),  # measured when written: +0.01% (-1.88% before the q/k norm term)
    (TINY_OLMO2, 0.1),  # +0.01% (-2.46% when modelled as a pre-norm block without q/k norms)
    # -0.75% (-7.57% before): the rest is the sliding layers' attention (an explicit mask and
    # k/v repeated to the q heads), not the norms
    (TINY_GEMMA3, 1.0),
])
def test_new_dense_blocks_against_a_cpu_run(arch, bound):
    pytest.importorskip("torch")
    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from planner.results import RunOutcome
    from workers import run_in_process

    config = TrainConfig(micro_batch=2, seq_len=64, precision="bf16-mixed")
    measurement, _ = run_in_process(model_config=arch, config=config)
    assert measurement.outcome is RunOutcome.OK, measurement.error
    spec = spec_from_config(arch, model_id=f"tiny-{arch['model_type']}", source="test")
    predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
    error = 100 * (predicted - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes
    assert abs(error) <= bound, error
