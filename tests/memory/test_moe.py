"""The mixture-of-experts block's saved tensors (planner/memory/moe.py): by hand, and against what
autograd really keeps in a tiny Mixtral and Qwen3-MoE built from their configs (transformers'
grouped_mm experts on the CPU)."""

from __future__ import annotations

import pytest

from planner.catalog import check_plannable, resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import CPU_KERNELS
from planner.memory.activations import step_activations

TINY = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
}


def _terms(arch: str, **changes) -> dict[str, int]:
    spec = spec_from_config(TINY[arch], model_id=arch, source="test")
    config = TrainConfig(**(dict(micro_batch=2, seq_len=32, optimizer="adamw") | changes))
    blocks = step_activations(spec, config, CPU_KERNELS).blocks
    assert blocks is not None
    return blocks[0]


def test_mixtral_block_by_hand_bf16_mixed():
    # T = 2 x 32 = 64 tokens, H = 64, I = 96, E = 4 experts, k = 2: S = 128 routed slots.
    # Router (MixtralTopKRouter.forward): autocast's bf16 cast of the normed input T*H*2 = 8,192;
    # softmax(logits.float()) T*E*4 = 1,024; topk's int64 indices T*k*8 = 1,024; the in-place
    # renormalisation keeps the fp32 top-k values T*k*4 = 512 and their sum T*4 = 256: 11,008.
    # Experts (grouped_mm_experts_forward) in the fp32 weights' dtype, w = 4, per slot: three int64
    # index tensors 24, the fp32 routing weight 4, the up input H*w = 256, its output 2I*w = 768,
    # act(gate) I*w = 384, the down input I*w = 384, the down output H*w = 256: 2,076; S x 2,076 =
    # 265,728, plus grouped_mm's int32 offsets E*4 = 16: 265,744.
    terms = _terms("mixtral", precision="bf16-mixed")
    assert terms["moe/router"] == 8_192 + 1_024 + 1_024 + 512 + 256 == 11_008
    assert terms["moe/experts"] == 128 * (24 + 4 + 256 + 768 + 384 + 384 + 256) + 16 == 265_744
    # the autocast copies are the attention's four and the router's, not the expert stacks':
    # 2 x (64*64 + 64*32 + 64*32 + 64*64 + 4*64) = 25,088
    assert terms["autocast/weight_casts"] == 2 * (4096 + 2048 + 2048 + 4096 + 256) == 25_088
    assert "mlp/intermediate" not in terms


def test_qwen3_moe_block_by_hand_pure_bf16():
    # Pure bf16: weights bf16, w = 2. Router: the normed bf16 input T*H*2 = 8,192 (F.linear saves
    # it as it is: nothing else in the block does), softmax(dtype=float) T*E*4 = 64*8*4 = 2,048,
    # topk indices 1,024, norm_topk_prob's division 512 + 256: 12,032. Experts, per slot: indices
    # 24, the routing weight cast back to the logits' bf16 2, (2H + 4I)*w = (128 + 384)*2 = 1,024:
    # 1,050; S x 1,050 = 134,400, plus offsets 8*4 = 32.
    terms = _terms("qwen3_moe", precision="bf16")
    assert terms["moe/router"] == 8_192 + 2_048 + 1_024 + 512 + 256 == 12_032
    assert terms["moe/experts"] == 128 * (24 + 2 + 1_024) + 32 == 134_432


def test_frozen_experts_save_no_grouped_mm_inputs():
    # LoRA on the attention only (the experts frozen), bf16-mixed, a later block: the router keeps
    # no input (its weight is frozen) but its softmax, indices and renormalisation (2,816); the
    # experts keep, per slot, the indices 24, the routing weight 4, the up output 768, act(gate)
    # 384 and the down output 256 (the routing weights need a gradient): 1,436; and the offsets,
    # which grouped_mm saves with its weight for the input's gradient: 4*4 = 16.
    spec = spec_from_config(TINY["mixtral"] | {"num_hidden_layers": 2}, model_id="mixtral", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", precision="bf16-mixed", method="lora",
                         lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    later = step_activations(spec, config, CPU_KERNELS).blocks[1]
    assert later["moe/router"] == 1_024 + 1_024 + 512 + 256 == 2_816
    assert later["moe/experts"] == 128 * (24 + 4 + 768 + 384 + 256) + 16 == 183_824


def test_qwen3_30b_a3b_plans_now():
    check_plannable(resolve_model("Qwen/Qwen3-30B-A3B"))  # every layer sparse
    dense_first = {**TINY["qwen3_moe"], "num_hidden_layers": 2, "mlp_only_layers": [0]}
    check_plannable(spec_from_config(dense_first, model_id="x", source="test"))  # dense and MoE blocks: planned


def _saved_in_moe_block(arch: str, precision: str, lora: str) -> int:
    """(bytes autograd saves inside the last block's MoE module, distinct storages, parameters left
    out; the router's autocast weight copy) for a 2-layer tiny model, b=2, s=32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY[arch], num_hidden_layers=2)
    model_type = raw.pop("model_type")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw), dtype=dtype,
                                             attn_implementation="sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model
        targets = "all-linear" if lora == "all-linear" else ["q_proj", "k_proj", "v_proj", "o_proj"]
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    return saved_in_second_mlp(model, precision)


def saved_in_second_mlp(model, precision: str) -> int:
    """Bytes autograd saves inside the second decoder layer's ``mlp`` module of ``model`` (distinct storages,
    parameters left out) over one training step on random ids, b=2, s=32."""
    import torch

    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    block = model.get_decoder().layers[1].mlp
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        if inside[0]:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, 256, (2, 32))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize(("arch", "precision", "lora"), [
    ("mixtral", "bf16-mixed", ""), ("mixtral", "fp32", ""), ("qwen3_moe", "bf16", ""),
    ("qwen3_moe", "bf16-mixed", "attention"), ("mixtral", "bf16-mixed", "all-linear"), ("mixtral", "bf16", "all-linear"),
])
def test_moe_terms_match_what_autograd_saves(arch, precision, lora):
    """The real thing on the CPU: every tensor autograd saves inside the second block's MoE module
    (distinct storages, parameters left out) against moe/router + moe/experts and the router's
    autocast weight copy (E x H x 2 under autocast); with LoRA on the attention only, or all-linear
    (peft's ParamWrapper on the expert stacks and the router: lora/expert_weights)."""
    changes = dict(precision=precision)
    if lora:
        targets = ("all-linear",) if lora == "all-linear" else ("q_proj", "k_proj", "v_proj", "o_proj")
        changes |= dict(method="lora", lora_r=4, lora_targets=targets)
    spec = spec_from_config(TINY[arch] | {"num_hidden_layers": 2}, model_id=arch, source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", **changes)
    later = step_activations(spec, config, CPU_KERNELS).blocks[1]
    router_cast = spec.num_experts * spec.hidden_size * 2 if precision == "bf16-mixed" else 0
    expected = later["moe/router"] + later["moe/experts"] + later.get("lora/expert_weights", 0) + router_cast
    assert _saved_in_moe_block(arch, precision, lora) == expected


def test_lora_all_linear_reaches_the_expert_stacks_as_peft_converts_them():
    # peft 0.21 converts all-linear for Mixtral to target_parameters {gate_up_proj, down_proj,
    # gate.weight}, the fused gate_up at rank 2r (transformers_weight_conversion.py): per block, with
    # r = 16, H = 64, I = 96, E = 4: q 16*(64+64) + k 16*(64+32) + v 16*(64+32) + o 16*(64+64) =
    # 7,168; gate 16*(64+4) = 1,088; gate_up 2*16*4*(64+192) = 32,768; down 16*4*(96+64) = 10,240.
    from planner.memory.parameters import lora_params
    spec = spec_from_config(TINY["mixtral"], model_id="mixtral", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, method="lora", lora_r=16)
    assert lora_params(spec, config) == 7_168 + 1_088 + 32_768 + 10_240 == 51_264


def test_lora_on_expert_stacks_by_hand():
    # bf16-mixed, r = 4, all-linear, a later block: the router and both stacks train through
    # ParamWrapper. lora/expert_weights: the merged fp32 stacks grouped_mm saves, 4*192*64*4 +
    # 4*64*96*4 = 196,608 + 98,304, and the 16-bit casts of the router's A and B under autocast,
    # 2*4*(64+4) = 544: 295,456. The experts save as in full fine-tuning (265,744) and the router
    # its input's bf16 cast too (11,008).
    spec = spec_from_config(TINY["mixtral"] | {"num_hidden_layers": 2}, model_id="mixtral", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, method="lora", lora_r=4, precision="bf16-mixed")
    later = step_activations(spec, config, CPU_KERNELS).blocks[1]
    assert later["lora/expert_weights"] == 196_608 + 98_304 + 544 == 295_456
    assert (later["moe/router"], later["moe/experts"]) == (11_008, 265_744)


def test_router_aux_loss_keeps_each_layers_softmax():
    # output_router_logits: load_balancing_loss_func keeps softmax(router logits) of each MoE layer,
    # in the logits' dtype on the CPU (bf16 under autocast): 2 layers x 64 tokens x 4 experts x 2 =
    # 2,048 B (read off SoftmaxBackward0._saved_result of a tiny Mixtral's aux_loss graph: two
    # bf16 [64, 4] tensors); fp32: 4,096 B.
    from planner.memory.activations import model_level_terms
    from planner.memory.dtypes import mode_of
    from planner.memory.shapes import dims_of
    spec = spec_from_config(TINY["mixtral"] | {"num_hidden_layers": 2, "output_router_logits": True},
                            model_id="mixtral", source="test")
    for precision, expected in (("bf16-mixed", 2 * 64 * 4 * 2), ("fp32", 2 * 64 * 4 * 4)):
        config = TrainConfig(micro_batch=2, seq_len=32, precision=precision)
        terms = model_level_terms(spec, config, dims_of(spec, config), mode_of(config), CPU_KERNELS)
        assert terms["moe/aux_loss"] == expected


def test_qlora_quantizes_the_attention_only():
    # bitsandbytes (transformers' integrations/bitsandbytes.py) replaces nn.Linear modules: of a
    # tiny Mixtral block only q 64x64, k 64x32, v 64x32 and o 64x64 = 12,288 weights; the router and
    # the 3D expert stacks (4 x 192 x 64 + 4 x 64 x 96 = 73,728) stay unquantised, upcast to fp32
    # by prepare_model_for_kbit_training.
    from planner.memory.parameters import quantized_linear_params
    spec = spec_from_config(TINY["mixtral"], model_id="mixtral", source="test")
    assert quantized_linear_params(spec) == 4096 + 2048 + 2048 + 4096 == 12_288


# ---- models mixing dense and MoE blocks, shared experts (Qwen2-MoE) --------------------------------------

MIXED = {
    # Qwen1.5-MoE-style: a shared expert and its sigmoid gate beside the routed ones; block 0 dense
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
                      norm_topk_prob=True),
    # decoder_sparse_step 2 and mlp_only_layers [2]: blocks dense, MoE, dense, MoE
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[2], decoder_sparse_step=2,
                      norm_topk_prob=True),
}


def tiny_model(raw: dict, precision: str, lora: str | tuple[str, ...] | None, attention: str = "sdpa"):
    """(model in train mode, the storages of its parameters) of a tiny random-weight model built
    from the config ``raw`` (seed 0) in ``precision``, with LoRA r=4 on ``lora`` when given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(raw)
    model_type = raw.pop("model_type")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw), dtype=dtype,
                                             attn_implementation=attention)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, target_modules=lora if isinstance(lora, str) else list(lora)))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return model, params


def _saved_per_layer(raw: dict, precision: str, lora: str | tuple[str, ...] | None,
                     attention: str = "sdpa") -> tuple[list[int], int]:
    """(bytes autograd saves inside each decoder layer, distinct storages, parameters left out; the
    trainable parameters) of a tiny model built from ``raw``, b=2, s=32."""
    import torch

    model, params = tiny_model(raw, precision, lora, attention)
    seen: list[dict[int, int]] = []
    inside = [-1]

    def pack(t):
        if inside[0] >= 0:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[inside[0]].setdefault(ptr, t.untyped_storage().nbytes())
        return t

    for index, layer in enumerate(model.get_decoder().layers):
        seen.append({})
        layer.register_forward_pre_hook(lambda *_, i=index: inside.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, -1))
    ids = torch.randint(0, 256, (2, 32))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, labels=ids).loss.backward()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return [sum(layer.values()) for layer in seen], trainable


@pytest.mark.parametrize(("arch", "precision", "lora"), [
    ("qwen2_moe", "bf16-mixed", None), ("qwen2_moe", "fp32", None), ("qwen2_moe", "bf16-mixed", "all-linear"),
    ("qwen2_moe", "bf16", "all-linear"), ("qwen2_moe", "fp32", ("q_proj", "v_proj")),
    ("qwen3_moe", "bf16-mixed", None), ("qwen3_moe", "bf16-mixed", "all-linear"), ("qwen3_moe", "fp32", "all-linear"),
])
def test_mixed_blocks_match_what_autograd_saves(arch, precision, lora):
    """Every decoder layer of a model mixing dense and MoE blocks, each with its own terms
    (``activations.layer_terms``), against what autograd saves inside it, byte for byte but for the
    rotary cos/sin every layer's attention saves and the model counts once (``embeddings``:
    2 x s x head_dim x the residual's bytes); and the trainable parameters against peft's (qwen2_moe:
    no conversion, all-linear wraps the shared expert's modules; qwen3_moe: converted, so the dense
    blocks' gate/up/down_proj are not wrapped and the expert stacks are)."""
    from planner.memory.activations import layer_terms
    from planner.memory.parameters import lora_params

    raw = MIXED[arch]
    spec = spec_from_config(raw, model_id=arch, source="test")
    changes = dict(precision=precision)
    if lora:
        changes |= dict(method="lora", lora_r=4, lora_targets=(lora,) if isinstance(lora, str) else lora)
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", **changes)
    measured, trainable = _saved_per_layer(raw, precision, lora)
    rope = 2 * 32 * spec.head_dim * (2 if precision == "bf16" else 4)
    assert [sum(terms.values()) for terms in layer_terms(spec, config, CPU_KERNELS)] == [m - rope for m in measured]
    if lora:
        assert lora_params(spec, config) == trainable


def test_mixed_blocks_parameter_counts_and_kinds():
    # qwen2_moe, H = 64, 3 blocks (block 0 dense): attention q 64*64+64, k and v 64*32+32 each, o 64*64
    # = 12,416; dense SwiGLU 3*64*160 = 30,720; MoE: router 8*64 = 512, stacks 8*96*64 + 8*64*48 =
    # 73,728, shared SwiGLU 3*64*80 = 15,360, shared gate 64; two norms 128 a block
    spec = spec_from_config(MIXED["qwen2_moe"], model_id="qwen2_moe", source="test")
    dense, moe = 12_416 + 30_720 + 128, 12_416 + 512 + 73_728 + 15_360 + 64 + 128
    assert spec.params_total == 256 * 64 * 2 + 64 + dense + 2 * moe
    assert [(n, first) for n, first, _ in spec.block_kinds] == [(1, 0), (2, 1)]
    assert spec.block_at(0).num_experts == 0 and spec.block_at(0).intermediate_size == 160
    assert spec.block_at(2).intermediate_size == 48


# ---- gpt-oss: top-k before softmax, clamped SwiGLU experts with biases, attention sinks -----------------

GPT_OSS = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=8)


@pytest.mark.parametrize(("precision", "lora"), [
    ("bf16-mixed", None), ("fp32", None), ("bf16", None), ("bf16-mixed", "all-linear"),
    ("bf16", ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_gpt_oss_layers_match_what_autograd_saves(precision, lora):
    """Both layers (sliding, then full attention) of a tiny gpt-oss, eager attention (its only path in
    transformers without kernels: GptOssPreTrainedModel._supports_sdpa = False), byte for byte but for
    its rotary cos/sin (2 x s x head_dim/2: GptOssRotaryEmbedding returns freqs, not cat(freqs,
    freqs)); and peft's trainable parameters: no conversion for gpt_oss, so all-linear is the
    attention's four projections only."""
    from planner.memory.parameters import lora_params

    spec = spec_from_config(GPT_OSS, model_id="gpt-oss", source="test")
    changes = dict(precision=precision, attention="eager")
    if lora:
        changes |= dict(method="lora", lora_r=4, lora_targets=(lora,) if isinstance(lora, str) else lora)
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", **changes)
    measured, trainable = _saved_per_layer(GPT_OSS, precision, lora, attention="eager")
    rope = 2 * 32 * (spec.head_dim // 2) * (2 if precision == "bf16" else 4)
    blocks = step_activations(spec, config, CPU_KERNELS).blocks
    assert [sum(blocks[0].values()), sum(blocks[1].values())] == [m - rope for m in measured]
    if lora:
        assert lora_params(spec, config) == trainable


def test_gpt_oss_block_by_hand_bf16_mixed():
    # T = 64 tokens, H = 64, I = 48, E = 8, k = 2: S = 128 slots, experts in fp32 (w = 4).
    # Router (GptOssTopKRouter): the input's bf16 cast T*H*2 = 8,192, topk's indices T*k*8 = 1,024 and
    # the softmax over the k logits T*k*2 = 256: 9,472 (the weight's bf16 cast E*H*2 is an autocast copy).
    # Experts per slot: four int64 indices (the gather, the weights' perm, inv_perm, the bias gathers'
    # expert ids) 32, the bf16 routing weight 2, the up input and the down output 2*H*4 = 512, the gate_up
    # output 2I*4 = 384, the clamped gate, sigmoid, glu and up + 1 4*I*4 = 768, the down input I*4 = 192:
    # 1,890; S x 1,890 + offsets E*4 = 241,952.
    spec = spec_from_config(GPT_OSS, model_id="gpt-oss", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", precision="bf16-mixed")
    block = step_activations(spec, config, CPU_KERNELS).blocks[1]
    assert block["moe/router"] == 8_192 + 1_024 + 256 == 9_472
    assert block["moe/experts"] == 128 * (32 + 2 + 512 + 384 + 768 + 192) + 32 == 241_952
    # eager attention with sinks: the fp32 softmax over s + 1 columns and its bf16 cast of the s x s
    # part, b*a*s*(s+1)*4 + b*a*s*s*2 = 33,792 + 16,384, and the max's int64 indices b*a*s*8 = 2,048
    assert block["attention/probs"] == 33_792 + 16_384 + 2_048 == 52_224
    # SDPA asked of gpt-oss: planned as the eager path it runs
    sdpa = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", precision="bf16-mixed", attention="sdpa")
    assert step_activations(spec, sdpa, CPU_KERNELS).blocks[1] == block


def test_gpt_oss_all_linear_is_the_attention_only():
    # peft converts no gpt_oss config (transformers' _MODEL_TO_CONVERSION_PATTERN has no gpt_oss), so
    # all-linear wraps q/k/v/o: r*(in + out) each, r = 16, H = 64, 4 heads x 16, 2 kv heads x 16:
    # 16*(64+64) + 2*16*(64+32) + 16*(64+64) = 7,168 per block, the expert stacks untouched
    from planner.memory.parameters import lora_params
    spec = spec_from_config(GPT_OSS, model_id="gpt-oss", source="test")
    config = TrainConfig(micro_batch=2, seq_len=32, method="lora", lora_r=16)
    assert lora_params(spec, config) == 2 * 7_168
    check_plannable(resolve_model("openai/gpt-oss-20b"))
