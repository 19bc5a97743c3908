"""transformers 4's per-expert MoE loop (``TrainConfig.experts_loop``; planner/memory/moe.py loop_expert_bytes,
planner/catalog/modern.py per_expert_layout): by hand, and against what autograd keeps in a tiny Mixtral whose
MoE blocks are a hand-built module that runs transformers 4.48.1's MixtralSparseMoeBlock.forward
(models/mixtral/modeling_mixtral.py l.85-150: nn.Linear experts w1/w3/w2 in an nn.ModuleList, a Python loop
over them). transformers 5.24's ``experts_implementation="eager"`` is not that loop: it slices the 3D stacks
(``F.linear(x, self.gate_up_proj[i])``: no nn.Linear for peft or bitsandbytes, a fused gate_up) and keeps the
routing weights fp32, so the test builds transformers 4's block itself."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.catalog.modern import per_expert_layout
from planner.config import TrainConfig
from planner.errors import UnsupportedError
from planner.gpus import CPU_KERNELS
from planner.memory.activations import step_activations
from test_moe import saved_in_second_mlp  # noqa: E402

# T = 2 x 32 = 64 tokens, H = 64, I = 96, E = 4, k = 2: S = 128 routed slots
TINY = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _spec():
    return per_expert_layout(spec_from_config(TINY, model_id="mixtral", source="test"))


def _later_block(precision: str, **changes) -> dict[str, int]:
    config = TrainConfig(micro_batch=2, seq_len=32, optimizer="adamw", precision=precision, experts_loop=True,
                         **changes)
    return step_activations(_spec(), config, CPU_KERNELS).blocks[1]


def test_the_layout_is_transformers_4s_modules_with_the_same_parameters():
    fused = spec_from_config(TINY, model_id="mixtral", source="test")
    loop = _spec()
    assert loop.params_total == fused.params_total
    experts = {lin.name: (lin.in_features, lin.out_features, lin.count, lin.active, lin.module)
               for lin in loop.layer_linears if lin.count > 1}
    assert experts == {"w1": (64, 96, 4, 2, True), "w3": (64, 96, 4, 2, True), "w2": (96, 64, 4, 2, True)}
    assert next(lin for lin in loop.layer_linears if lin.name == "gate").module  # nn.Linear(hidden, E)
    assert per_expert_layout(loop) is loop
    qwen = spec_from_config(dict(TINY, model_type="qwen3_moe", moe_intermediate_size=96, head_dim=16, num_experts=4),
                            model_id="qwen3", source="test")
    with pytest.raises(UnsupportedError, match="drop --experts-loop"):
        per_expert_layout(qwen)


def test_qlora_quantizes_the_experts_and_all_linear_adapts_them():
    # bitsandbytes replaces every nn.Linear but lm_head: q 64x64, k 64x32, v 64x32, o 64x64 (12,288), the
    # router 4x64 (256) and the experts 4 x 3 x 96 x 64 (73,728) = 86,272 (transformers 5: 12,288 alone)
    from planner.memory.parameters import lora_params, quantized_linear_params
    assert quantized_linear_params(_spec()) == 2 * (12_288 + 256 + 73_728) == 2 * 86_272  # two blocks
    # all-linear at r = 16 wraps w1, w3, w2 as modules (rank r, no conversion): q,k,v,o 7,168, the gate
    # 16*(64+4) = 1,088, w1 and w3 4*16*(64+96) each = 20,480, w2 4*16*(96+64) = 10,240
    config = TrainConfig(micro_batch=2, seq_len=32, method="lora", lora_r=16, experts_loop=True)
    assert lora_params(_spec(), config) == 2 * (7_168 + 1_088 + 20_480 + 10_240) == 2 * 38_976  # two blocks


def test_loop_by_hand_bf16_mixed_full():
    # Router as transformers 5's (11,008: the bf16 cast of the input, softmax, top-k, renormalisation).
    # The loop, per slot: top_x and idx 16; w1's and w3's outputs and act's, bf16 under autocast, 3 x 96 x 2 =
    # 576; w2's output 64 x 2 = 128 and the routing weight in the fp32 stream's dtype 4; index_add_'s source,
    # their fp32 product, 64 x 4 = 256; w1's and w3's inputs, one bf16 cast each, 2 x 64 x 2 = 256; w2's input
    # 96 x 2 = 192: 1,428 x 128 = 182,784.
    # Autocast keeps a bf16 copy of every expert's weights: 2 x 4 x 3 x 96 x 64 = 147,456 beside the
    # attention's and the router's 25,088.
    terms = _later_block("bf16-mixed")
    assert terms["moe/router"] == 11_008
    assert terms["moe/expert_loop"] == 128 * (16 + 576 + 128 + 4 + 256 + 256 + 192) == 182_784
    assert terms["autocast/weight_casts"] == 25_088 + 147_456
    assert "moe/experts" not in terms


def test_loop_by_hand_frozen_experts():
    # LoRA on the attention, bf16-mixed: the experts are frozen nn.Linear modules and save no input;
    # per slot top_x and idx 16, 3I x 2 = 576, w2's output 128, the fp32 routing weight 4 and index_add_'s
    # source, the weighted output promoted to fp32, 64 x 4 = 256: 980 x 128 = 125,440 (grouped_mm's 183,824 in
    # fp32 stacks)
    terms = _later_block("bf16-mixed", method="lora", lora_r=4, lora_targets=ATTENTION)
    assert terms["moe/expert_loop"] == 128 * (16 + 576 + 128 + 4 + 256) == 125_440


def _v4_block(config):
    """A module that runs as transformers 4.48.1's MixtralSparseMoeBlock (modeling_mixtral.py l.85-150) with
    MixtralBlockSparseTop2MLP experts (l.67-82), written from their source (jitter 0, returned without the
    router logits, which the v4 decoder layer drops in training)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
            self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.w2(self.act_fn(self.w1(x)) * self.w3(x))

    class SparseMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
            self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
            self.experts = nn.ModuleList([Expert() for _ in range(self.num_experts)])

        def forward(self, hidden_states):
            batch, seq, hidden = hidden_states.shape
            hidden_states = hidden_states.view(-1, hidden)
            weights = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
            weights, chosen = torch.topk(weights, self.top_k, dim=-1)
            weights /= weights.sum(dim=-1, keepdim=True)
            weights = weights.to(hidden_states.dtype)
            final = torch.zeros((batch * seq, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
            mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
            for index in range(self.num_experts):
                idx, top_x = torch.where(mask[index])
                state = hidden_states[None, top_x].reshape(-1, hidden)
                out = self.experts[index](state) * weights[top_x, idx, None]
                final.index_add_(0, top_x, out.to(hidden_states.dtype))
            return final.reshape(batch, seq, hidden)

    return SparseMoeBlock()


def _saved_in_v4_moe_block(precision: str, targets: tuple[str, ...] | None) -> int:
    """Bytes autograd saves inside the second layer's transformers-4 MoE block (distinct storages, parameters
    left out), b=2, s=32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY)
    model_type = raw.pop("model_type")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf_config = AutoConfig.for_model(model_type, **raw)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    for layer in model.get_decoder().layers:
        layer.mlp = _v4_block(hf_config).to(dtype)
    if targets:
        from peft import LoraConfig, get_peft_model
        # peft 0.21 converts a Mixtral config's w1/w2/w3 targets to transformers 5's stacks
        # (utils/transformers_weight_conversion.py _convert_peft_config_moe, by config.model_type); the peft of
        # transformers 4's runs (0.13) wrapped the modules themselves: the model type hidden from the conversion
        model.config.model_type = "mixtral-v4"
        model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
    return saved_in_second_mlp(model, precision)


@pytest.mark.parametrize(("precision", "targets"), [
    ("bf16-mixed", None), ("fp32", None), ("bf16-mixed", ATTENTION), ("bf16", ATTENTION + ("w1", "w2", "w3")),
    ("fp32", ATTENTION + ("w2",)),
])
def test_loop_terms_match_what_autograd_saves(precision, targets):
    """The real thing on the CPU: what autograd saves inside transformers 4's MoE block against moe/router +
    moe/expert_loop, the adapters' lora_B inputs (lora/activations' expert share: T·k·r per adapted expert
    linear, in the adapters' dtype) and, under autocast, the router's and experts' bf16 weight copies."""
    changes = dict(method="lora", lora_r=4, lora_targets=targets) if targets else {}
    terms = _later_block(precision, **changes)
    spec = _spec()
    experts = [lin for lin in spec.layer_linears if lin.count > 1 or lin.name == "gate"]
    casts = 2 * sum(lin.count * lin.in_features * lin.out_features for lin in experts) \
        if precision == "bf16-mixed" else 0
    config = TrainConfig(micro_batch=2, seq_len=32, precision=precision, **changes)
    from planner.memory.dtypes import mode_of
    adapted = [lin for lin in spec.layer_linears if lin.count > 1 and targets and lin.name in targets]
    lora_b = sum(64 * lin.active * 4 * mode_of(config).adapter for lin in adapted)
    expected = terms["moe/router"] + terms["moe/expert_loop"] + lora_b + casts
    assert _saved_in_v4_moe_block(precision, targets) == expected
