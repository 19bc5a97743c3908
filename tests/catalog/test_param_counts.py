"""The ModelSpec formulas against the real transformers models, built on the meta device.

For every catalog model, every config.json in the shared folder of real configs
(``../shared/model-configs``, enumerated) and small variants that exercise each builder's options
and transformers' defaults for missing keys: ``params_total`` must equal ``sum(p.numel() for p in
model.parameters())`` of the model we train (AutoModelForCausalLM, AutoModelForMaskedLM for
bert/roberta, AutoModelForSeq2SeqLM for t5), and ``layer_linears`` must list exactly the linear
layers of block 0 with the same names, shapes and biases, which is what LoRA sizing relies on.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from planner.catalog import catalog_ids, load_config_file, resolve_model, spec_from_config
from planner.errors import ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_meta_model(config: dict, *, encoder: bool, seq2seq: bool = False):
    """The model the planner trains, on the meta device (no memory, no weights, no network).

    A multimodal wrapper (a config with ``text_config``: gemma3, gemma4, llama4, qwen3_5) is
    planned as its language model trained text-only: ``AutoModelForCausalLM`` over
    ``get_text_config()`` (for gemma3/gemma4/llama4 the wrapper config itself would build the
    whole ForConditionalGeneration, vision tower included; for qwen3_5 it builds the same LM)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    hf_config = AutoConfig.for_model(**config)
    if isinstance(config.get("text_config"), dict):
        hf_config = hf_config.get_text_config()
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForMaskedLM if encoder else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config), hf_config


def build_for(spec, config: dict | None = None):
    return build_meta_model(dict(spec.config if config is None else config), encoder=spec.is_encoder,
                            seq2seq=spec.is_encoder_decoder)


@functools.cache
def catalog_model(model_id: str):
    model, _ = build_for(resolve_model(model_id))
    return model


# ---- the shared folder of real configs: every one resolves and counts exactly ----------------------


def shared_configs_dir() -> Path | None:
    """``$PLANNER_SHARED_CONFIGS``, else ``shared/model-configs`` beside the checkout (the
    project's layout: /work/main and /work/shared), else /work/shared/model-configs."""
    candidates = [os.environ.get("PLANNER_SHARED_CONFIGS"),
                  Path(__file__).resolve().parents[3] / "shared" / "model-configs",
                  "/work/shared/model-configs"]
    for candidate in candidates:
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


SHARED = shared_configs_dir()
SHARED_CONFIGS = sorted(str(p.relative_to(SHARED)) for p in SHARED.glob("**/config.json")) if SHARED else []


def test_the_shared_folder_is_there_and_holds_configs():
    if SHARED is None:
        pytest.skip("no shared model-configs folder (set PLANNER_SHARED_CONFIGS to its path)")
    assert len(SHARED_CONFIGS) >= 40 and "_/t5-large/config.json" in SHARED_CONFIGS


#: shared configs whose model_type only the checkpoint's own code builds (trust_remote_code):
#: they resolve to one line saying so, by path and by id
REMOTE_CODE_CONFIGS = {"moonshotai/Kimi-K2-Instruct": "kimi_k2",
                       "nvidia/Llama-3_3-Nemotron-Super-49B-v1": "nemotron-nas"}


@pytest.mark.parametrize("relpath", SHARED_CONFIGS)
def test_every_shared_config_resolves_and_counts_exactly(relpath):
    """Each config.json of the folder resolves (by path) and its parameter count equals the
    transformers model's; the ones the catalog ships are the same config under their id; block 0
    and one block of each other kind hold the spec's linears."""
    path = SHARED / relpath
    org, name = Path(relpath).parts[:2]
    model_id = name if org == "_" else f"{org}/{name}"
    if model_id in REMOTE_CODE_CONFIGS:
        for name_or_path in (str(path), model_id):
            with pytest.raises(ModelConfigError, match=f"model_type {REMOTE_CODE_CONFIGS[model_id]} needs the model's "
                                                       "own code \\(trust_remote_code=True\\)") as err:
                resolve_model(name_or_path)
            assert "\n" not in str(err.value)
        return
    spec = resolve_model(str(path))
    config = {k: v for k, v in load_config_file(path).items() if not k.startswith("_")}
    in_catalog = model_id in catalog_ids()
    # the catalog's copy of the same config: one meta build serves both tests (the 600B MoE
    # configs take a second or two each)
    model = catalog_model(model_id) if in_catalog and resolve_model(model_id).config == config \
        else build_for(spec, config)[0]
    assert spec.params_total == n_params(model)
    if spec.other_blocks or spec.unmodelled or spec.wrapper_type:  # the new families: their blocks too
        check_blocks(spec, model)
    assert in_catalog, f"{model_id} is in the shared folder but not in the catalog"
    assert resolve_model(model_id).params_total == spec.params_total


def check_blocks(spec, model) -> None:
    """Block 0 holds ``layer_linears`` and the first block of each ``other_blocks`` group its
    linears; each block's parameters add up."""
    layers = blocks_of(model, spec.num_layers)
    assert spec_linears(spec) == real_linears(layers[0])
    assert spec.params_per_layer == n_params(layers[0])
    for group in spec.other_blocks:
        block = layers[group.first]
        assert spec_linears(spec, group.linears) == real_linears(block), group.label
        assert group.params == n_params(block), group.label


def blocks_of(model, num_layers: int):
    """The (only) ModuleList that holds one entry per layer."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise AssertionError("no ModuleList of transformer blocks found")


def first_block(model, num_layers: int):
    """Block 0: the first module of the (only) ModuleList that holds one entry per layer."""
    return blocks_of(model, num_layers)[0]


#: expert stacks stored input-first, [E, in, out] (modeling_gpt_oss.py GptOssExperts
#: ``gate_up_proj [E, H, 2I]``; modeling_llama4.py Llama4TextExperts); the others are [E, out, in]
IN_FIRST_EXPERTS = {"GptOssExperts", "Llama4TextExperts"}


def real_linears(block) -> list[tuple[str, int, int, bool, int, bool]]:
    """(leaf name, in, out, bias, copies, an nn.Linear/Conv1D module) of every linear map in one block.

    nn.Linear and HF Conv1D (weight stored [in, out]) modules, plus the weight tensors transformers
    v5 keeps outside nn.Linear: expert stacks [E, out, in] (or [E, in, out]: ``IN_FIRST_EXPERTS``)
    with an optional ``<name>_bias`` [E, out], and routers' bare weight [E, H] with an optional
    ``bias`` [E] beside it (gpt-oss).
    """
    from transformers.pytorch_utils import Conv1D

    found = []
    covered: set[str] = set()
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            found.append((leaf, module.in_features, module.out_features, module.bias is not None, 1, True))
        elif isinstance(module, Conv1D):
            n_in, n_out = module.weight.shape
            found.append((leaf, n_in, n_out, module.bias is not None, 1, True))
        else:
            continue
        covered.update(f"{name}.{p}" for p, _ in module.named_parameters())
    params = dict(block.named_parameters())
    for name, param in params.items():
        if name in covered or name.endswith("_bias"):
            continue
        owner, _, leaf = name.rpartition(".")
        if isinstance(block.get_submodule(owner), torch.nn.Conv1d):  # Mamba2 / Gated DeltaNet conv: no linear
            continue
        if param.dim() == 3:  # expert stack [count, out, in]
            n_out, n_in = param.shape[1], param.shape[2]
            if type(block.get_submodule(owner)).__name__ in IN_FIRST_EXPERTS:
                n_in, n_out = n_out, n_in
            found.append((leaf, n_in, n_out, f"{name}_bias" in params, param.shape[0], False))
        elif param.dim() == 2:  # a bare weight used with F.linear (router): named by its module
            found.append((owner.rsplit(".", 1)[-1], param.shape[1], param.shape[0], f"{owner}.bias" in params, 1,
                          False))
    return sorted(found)


def spec_linears(spec, linears=None) -> list[tuple[str, int, int, bool, int, bool]]:
    return sorted((lin.name, lin.in_features, lin.out_features, lin.bias, lin.count, lin.module)
                  for lin in (spec.layer_linears if linears is None else linears))


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- every catalog model ------------------------------------------------------------------------


@pytest.mark.parametrize("model_id", catalog_ids())
def test_catalog_param_count_is_exact(model_id):
    spec = resolve_model(model_id)
    assert spec.params_total == n_params(catalog_model(model_id))


@pytest.mark.parametrize("model_id", catalog_ids())
def test_catalog_layer_linears_match_block_zero(model_id):
    spec = resolve_model(model_id)
    model = catalog_model(model_id)
    if spec.is_encoder_decoder:
        check_encoder_decoder_blocks(spec, model)
        return
    block = first_block(model, spec.num_layers)
    assert spec_linears(spec) == real_linears(block)
    # norms and any other per-block parameters too: the whole block adds up
    assert spec.params_per_layer == n_params(block)


def check_encoder_decoder_blocks(spec, model) -> None:
    """T5: the encoder's and the decoder's block 0 hold the spec's linears; a block's parameters
    are its linears and norms, plus the relative position bias in block 0 of each stack."""
    bias = spec.relative_attention_buckets * spec.num_heads
    for stack, linears, per_layer, layers in (
        (model.encoder, spec.layer_linears, spec.params_per_layer, spec.num_layers),
        (model.decoder, spec.decoder_linears, spec.decoder_params_per_layer, spec.decoder_layers),
    ):
        assert len(stack.block) == layers
        block = stack.block[0]
        spec_side = spec_linears(spec, linears)
        # relative_attention_bias is an nn.Embedding, not a linear map
        assert spec_side == [row for row in real_linears(block) if row[0] != "relative_attention_bias"]
        assert per_layer + bias == n_params(block)


def test_mixtral_total_and_active_by_hand():
    spec = resolve_model("mistralai/Mixtral-8x7B-v0.1")
    # H=4096, I=14336, L=32, V=32000, 8 experts, top-2, 8 kv heads of 128.
    attention = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096  # q, k, v, o = 41_943_040
    router = 8 * 4096  # 32_768
    expert = 3 * 4096 * 14336  # w1/w3 (fused gate_up) + w2 = 176_160_768
    norms = 2 * 4096
    per_layer_total = attention + router + 8 * expert + norms  # 1_451_270_144
    per_layer_active = attention + router + 2 * expert + norms  # 394_305_536
    outside = 32000 * 4096 * 2 + 4096  # embedding + untied lm_head + final norm = 262_148_096
    assert per_layer_total * 32 + outside == 46_702_792_704  # "46.7B"
    assert per_layer_active * 32 + outside == 12_879_925_248  # "12.9B active"
    assert spec.params_total == 46_702_792_704
    assert spec.params_active == 12_879_925_248
    assert (spec.num_experts, spec.experts_per_token) == (8, 2)


def test_dense_models_have_active_equal_total():
    for model_id in ("meta-llama/Llama-2-7b-hf", "gpt2", "bert-base-uncased"):
        spec = resolve_model(model_id)
        assert spec.params_active == spec.params_total and not spec.is_moe


def test_gpt2_count_by_hand():
    spec = resolve_model("gpt2")
    # per block: c_attn 768*2304+2304, attn c_proj 768*768+768, c_fc 768*3072+3072,
    # mlp c_proj 3072*768+768, ln_1 + ln_2 4*768 = 7_087_872
    block = (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    assert block == 7_087_872
    # wte 50257*768 + wpe 1024*768 + ln_f 2*768; lm_head tied to wte
    assert 50257 * 768 + 1024 * 768 + 12 * block + 2 * 768 == spec.params_total == 124_439_808


def test_bert_mlm_head_and_no_pooler_by_hand():
    spec = resolve_model("bert-base-uncased")
    embeddings = 30522 * 768 + 512 * 768 + 2 * 768 + 2 * 768  # words, positions, token types, LayerNorm
    layer = 4 * (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    mlm_head = (768 * 768 + 768) + 2 * 768 + 30522  # transform dense, LayerNorm, decoder bias (weight tied)
    assert embeddings + 12 * layer + mlm_head == spec.params_total == 109_514_298
    # BertModel's pooler (768*768+768) would make it 110_104_890: ForMaskedLM has none
    assert not any("pooler" in name for name, _ in catalog_model("bert-base-uncased").named_parameters())


# ---- small variants: every builder option and transformers' defaults for missing keys ------------

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
#: for types whose config class defaults num_key_value_heads to a fixed number (mistral/mixtral 8,
#: qwen2/qwen3 32, gemma 16): enough heads that the default divides them
WIDE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 32, "vocab_size": 100}

VARIANTS = {
    # only the required keys: everything else is transformers' default
    "llama-defaults": {"model_type": "llama", "intermediate_size": 96, **SMALL},
    "llama-biases-gqa-tied": {
        "model_type": "llama", "intermediate_size": 96, **SMALL, "num_key_value_heads": 2,
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "head_dim": 8,
    },
    "mistral-defaults": {"model_type": "mistral", "intermediate_size": 96, **WIDE},
    "mixtral-defaults": {"model_type": "mixtral", "intermediate_size": 96, **WIDE},
    "mixtral-4x1": {
        "model_type": "mixtral", "intermediate_size": 96, **SMALL, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 1,
    },
    "qwen2-defaults": {"model_type": "qwen2", "intermediate_size": 96, **WIDE},
    "qwen2-tied": {
        "model_type": "qwen2", "intermediate_size": 96, **SMALL, "tie_word_embeddings": True,
        "num_key_value_heads": 1,
    },
    "qwen3-defaults": {"model_type": "qwen3", "intermediate_size": 96, **WIDE},
    "qwen3-bias": {
        "model_type": "qwen3", "intermediate_size": 96, **SMALL, "num_key_value_heads": None,
        "attention_bias": True, "head_dim": 16,
    },
    "gemma-defaults": {"model_type": "gemma", "intermediate_size": 96, **WIDE},
    "gemma2-defaults": {"model_type": "gemma2", "intermediate_size": 96, **SMALL},
    "phi-defaults": {"model_type": "phi", "intermediate_size": 96, **SMALL},
    "phi-qk-layernorm-tied": {
        "model_type": "phi", "intermediate_size": 96, **SMALL, "qk_layernorm": True,
        "tie_word_embeddings": True,
    },
    "phi3-defaults": {"model_type": "phi3", "intermediate_size": 96, **SMALL, "pad_token_id": 0},
    "phi3-gqa": {
        "model_type": "phi3", "intermediate_size": 96, **SMALL, "pad_token_id": 0,
        "num_key_value_heads": 2,
    },
    "starcoder2-defaults": {"model_type": "starcoder2", "intermediate_size": 96, **SMALL},
    "starcoder2-nobias-untied": {
        "model_type": "starcoder2", "intermediate_size": 96, **SMALL, "use_bias": False,
        "tie_word_embeddings": False,
    },
    "gpt2-defaults": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100},
    "gpt2-n-inner-untied": {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_inner": 80,
        "n_positions": 32, "tie_word_embeddings": False,
    },
    "gpt_neox-defaults": {"model_type": "gpt_neox", "intermediate_size": 96, **SMALL},
    "gpt_neox-nobias-tied-serial": {
        "model_type": "gpt_neox", "intermediate_size": 96, **SMALL, "attention_bias": False,
        "tie_word_embeddings": True, "use_parallel_residual": False,
    },
    "opt-defaults": {"model_type": "opt", "ffn_dim": 96, **SMALL},
    # opt-350m style: embeddings in a smaller space with project_in/out, post-norm (no final LN)
    "opt-350m-style": {
        "model_type": "opt", "ffn_dim": 96, **SMALL, "word_embed_proj_dim": 32,
        "do_layer_norm_before": False,
    },
    "opt-no-affine-no-bias": {
        "model_type": "opt", "ffn_dim": 96, **SMALL, "enable_bias": False,
        "layer_norm_elementwise_affine": False,
    },
    "bloom-defaults": {
        "model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
    },
    "falcon-defaults": {"model_type": "falcon", **SMALL},
    "falcon-new-arch": {
        "model_type": "falcon", **SMALL, "new_decoder_architecture": True, "num_kv_heads": 2, "bias": True,
    },
    "falcon-new-arch-one-ln": {
        "model_type": "falcon", **SMALL, "new_decoder_architecture": True, "num_kv_heads": 2,
        "num_ln_in_parallel_attn": 1,
    },
    "falcon-mha-serial": {
        "model_type": "falcon", **SMALL, "multi_query": False, "parallel_attn": False,
        "ffn_hidden_size": 80, "alibi": True,
    },
    "bert-defaults": {"model_type": "bert", "intermediate_size": 96, **SMALL},
    "bert-untied": {
        "model_type": "bert", "intermediate_size": 96, **SMALL, "tie_word_embeddings": False,
        "type_vocab_size": 3,
    },
    "roberta-defaults": {"model_type": "roberta", "intermediate_size": 96, **SMALL},
    # T5 v1.0: only the required sizes; relu MLP, decoder as deep as the encoder
    "t5-required-only": {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "d_kv": 16,
                         "d_ff": 96, "vocab_size": 100},
    # T5 v1.1 / Flan-T5: gated-gelu, "untied" (in transformers v5 only the output scaling goes),
    # heads * d_kv != d_model, a shallower decoder, other bucket count
    "t5-v1_1-style": {"model_type": "t5", "d_model": 64, "num_layers": 3, "num_decoder_layers": 2,
                      "num_heads": 6, "d_kv": 8, "d_ff": 80, "vocab_size": 100, "feed_forward_proj": "gated-gelu",
                      "tie_word_embeddings": False, "relative_attention_num_buckets": 16},
    # ---- the 2025-2026 families (planner/catalog/modern.py) ----
    "granite-defaults": {"model_type": "granite", "intermediate_size": 96, **SMALL},
    "granite-biases-tied": {"model_type": "granite", "intermediate_size": 96, **SMALL, "attention_bias": True,
                            "mlp_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 2},
    "olmo2-defaults": {"model_type": "olmo2", "intermediate_size": 96, **SMALL},
    "olmo2-gqa-bias": {"model_type": "olmo2", "intermediate_size": 96, **SMALL, "num_key_value_heads": 2,
                       "attention_bias": True},
    "gemma3_text-defaults": {"model_type": "gemma3_text", **SMALL},
    "gemma3_text-sizes": {"model_type": "gemma3_text", "intermediate_size": 96, **SMALL, "num_key_value_heads": 1,
                          "head_dim": 32, "tie_word_embeddings": False, "sliding_window": 16},
    "gemma3-wrapper": {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "intermediate_size": 96,
                                                                **SMALL}},
    "qwen3_moe-defaults": {"model_type": "qwen3_moe", **WIDE, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32},
    # every other layer sparse, layer 1 forced dense: dense, dense, dense, moe
    "qwen3_moe-sparse-step": {"model_type": "qwen3_moe", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2,
                              "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                              "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [1],
                              "head_dim": 8, "attention_bias": True},
    "qwen2_moe-defaults": {"model_type": "qwen2_moe", **WIDE, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                           "intermediate_size": 96},
    # a shared expert on the MoE blocks; block 0 dense (mlp_only_layers), every other layer sparse
    "qwen2_moe-mixed": {"model_type": "qwen2_moe", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2,
                        "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40,
                        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0, 2],
                        "qkv_bias": False},
    "gpt_oss-small": {"model_type": "gpt_oss", **SMALL, "num_key_value_heads": 2, "head_dim": 16,
                      "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3-small": {"model_type": "deepseek_v3", **SMALL, "num_hidden_layers": 3, "intermediate_size": 96,
                          "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                          "topk_group": 1, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": 24,
                          "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
    "deepseek_v3-no-q-lora": {"model_type": "deepseek_v3", **SMALL, "num_hidden_layers": 2, "intermediate_size": 96,
                              "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": None,
                              "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
    "llama4_text-interleaved": {"model_type": "llama4_text", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96,
                                "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2},
    "qwen3_next-small": {"model_type": "qwen3_next", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2,
                         "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                         "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
                         "mlp_only_layers": [2]},
    "qwen3_5-wrapper": {"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 16}},
    "qwen3_5_moe-wrapper": {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": {
        "model_type": "qwen3_5_moe_text", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 16}},
    "nemotron_h-all-kinds": {"model_type": "nemotron_h", **SMALL, "num_hidden_layers": 5,
                             "hybrid_override_pattern": "M*E-M", "num_key_value_heads": 2, "head_dim": 16,
                             "intermediate_size": 96, "moe_intermediate_size": 32,
                             "moe_shared_expert_intermediate_size": 48, "n_routed_experts": 4,
                             "num_experts_per_tok": 2, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2,
                             "ssm_state_size": 8, "use_conv_bias": False},
    "gemma4_text-dense": {"model_type": "gemma4_text", **SMALL, "num_hidden_layers": 6, "intermediate_size": 96,
                          "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
                          "hidden_size_per_layer_input": 0},
    "gemma4_text-per-layer-kv-shared": {"model_type": "gemma4_text", **SMALL, "num_hidden_layers": 6,
                                         "intermediate_size": 96, "num_key_value_heads": 2, "head_dim": 16,
                                         "global_head_dim": 32, "hidden_size_per_layer_input": 8,
                                         "vocab_size_per_layer_input": 128, "num_kv_shared_layers": 2,
                                         "use_double_wide_mlp": True,
                                         "layer_types": ["sliding_attention", "full_attention"] * 3},
    "gemma4_text-moe-k-eq-v": {"model_type": "gemma4_text", **SMALL, "num_hidden_layers": 6, "intermediate_size": 96,
                               "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
                               "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                               "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 4,
                               "top_k_experts": 2, "moe_intermediate_size": 32},
}


#: dense types of planner/catalog/modern.py (checked by ``check_blocks`` with the others there)
MODERN_DENSE = {"granite", "olmo2"}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_counts_linears_and_defaults(name):
    config = VARIANTS[name]
    spec = spec_from_config(config, model_id=name, source="test")
    model, hf = build_for(spec, config)
    assert spec.params_total == n_params(model)
    if spec.is_encoder_decoder:
        check_encoder_decoder_blocks(spec, model)
        assert (spec.decoder_layers, spec.hidden_act, spec.gated_mlp) == (
            hf.num_decoder_layers, hf.dense_act_fn, hf.is_gated_act)
        assert model.lm_head.weight is model.shared.weight and spec.tied_embeddings and not spec.head_params
        return
    if spec.other_blocks or spec.unmodelled or spec.wrapper_type or config["model_type"] in MODERN_DENSE:
        check_blocks(spec, model)
        assert spec.tied_embeddings == hf.tie_word_embeddings
        assert spec.max_seq_len == hf.max_position_embeddings
        return
    block = first_block(model, spec.num_layers)
    assert spec_linears(spec) == real_linears(block)
    assert spec.params_per_layer == n_params(block)
    # defaults the planner fills in are the ones transformers applies
    assert spec.tied_embeddings == hf.tie_word_embeddings
    if config["model_type"] == "roberta":
        assert spec.max_seq_len == hf.max_position_embeddings - (hf.pad_token_id + 1)
    elif config["model_type"] != "bloom":
        assert spec.max_seq_len == hf.max_position_embeddings
    if config["model_type"] in ("mistral", "mixtral", "gemma2", "phi3", "starcoder2"):
        assert spec.sliding_window == hf.sliding_window
