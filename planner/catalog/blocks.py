"""The building blocks every architecture builder shares: typed, bounded reads of one config.json
(``ConfigReader``) and the linear layers of the common block shapes.

``planner.catalog.architectures`` (one builder per ``model_type``) and ``planner.catalog.t5`` build
on these; nothing here knows an architecture. Pure module: no torch, no I/O.
"""

from __future__ import annotations

from typing import Any, Mapping

from planner.errors import ModelConfigError
from planner.modelspec import LinearKind, LinearSpec

K = LinearKind

# ---- bounds: what real models hold, with ~10x headroom ----------------------------------------------
# A config.json value past these is a typo (an extra zero, a byte count for a token count), and
# sizing it costs time and memory that grow with it (10^7 layers took minutes; 10^400 overflowed a
# float). The largest values of released models, from their config.json files:
#   layers: 126 (meta-llama/Llama-3.1-405B), 118 (PaLM 540B, Chowdhery et al. 2022, table 1)
#   hidden: 20480 (Megatron-Turing NLG 530B, Smith et al. 2022), 16384 (Llama-3.1-405B)
#   MLP width: 73728 (PaLM 540B), 53248 (Llama-3.1-405B)
#   attention heads: 232 (tiiuae/falcon-180B); head_dim: 256 (google/gemma-2b)
#   vocabulary: 262144 (google/gemma-3), 250880 (bigscience/bloom)
#   positions: 10485760 (meta-llama/Llama-4-Scout, 10M context)
#   experts: 2048 (google/switch-c-2048), 256 (deepseek-ai/DeepSeek-V3)
# (shipped catalog and /work/shared/model-configs: at most 94 layers (Qwen3-235B-A22B), hidden
# 8192, MLP 36864, 128 heads, head_dim 512 (Gemma 4 global layers), vocabulary 262208, 10485760
# positions (Llama 4 Scout), 512 experts (Qwen3-Next, Qwen3.5-397B).)
_LAYERS_MAX = 2_048
_HIDDEN_MAX = 262_144
_MLP_MAX = 1_048_576
_HEADS_MAX = 4_096
_VOCAB_MAX = 4_194_304
_POSITIONS_MAX = 134_217_728
_EXPERTS_MAX = 32_768

#: key -> (largest value accepted, what that bound is)
SIZE_BOUNDS: dict[str, tuple[int, str]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"),
                    (_LAYERS_MAX, "layers (largest real model: 126)")),
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "word_embed_proj_dim", "d_model"),
                    (_HIDDEN_MAX, "hidden size (largest real model: 20480)")),
    # T5's d_ff reaches 65536 (t5-11b)
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff"),
                    (_MLP_MAX, "MLP width (largest real model: 73728)")),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads", "num_kv_heads", "head_dim",
                     "num_heads", "d_kv"),
                    (_HEADS_MAX, "attention heads / head size (largest real model: 232 heads, head_dim 256)")),
    **dict.fromkeys(("vocab_size", "type_vocab_size"), (_VOCAB_MAX, "vocabulary (largest real model: 262144)")),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "seq_length", "sliding_window"),
                    (_POSITIONS_MAX, "positions (longest real context: 10485760)")),
    **dict.fromkeys(("num_local_experts", "num_experts_per_tok", "num_experts", "n_routed_experts", "top_k_experts",
                     "n_shared_experts"), (_EXPERTS_MAX, "experts (most in a real model: 2048)")),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp",
                     "moe_shared_expert_intermediate_size"), (_MLP_MAX, "MLP width (largest real model: 73728)")),
    **dict.fromkeys(("num_global_key_value_heads", "global_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "mamba_num_heads", "mamba_head_dim"),
                    (_HEADS_MAX, "attention heads / head size (largest real model: 232 heads, head_dim 256)")),
    "first_k_dense_replace": (_LAYERS_MAX, "layers (largest real model: 126)"),
    "num_ln_in_parallel_attn": (16, "layer norms per falcon block (real models: 1 or 2)"),
}
#: any other size key: the largest bound above
_OTHER_SIZE_MAX = (_POSITIONS_MAX, "sizes")


def size_bound(key: str) -> tuple[int, str]:
    """(largest accepted value, what it bounds) of a config.json size key."""
    return SIZE_BOUNDS.get(key, _OTHER_SIZE_MAX)


class ConfigReader:
    """Typed, validated reads from one config.json; errors name the file and the key."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source
        self._refuse_negative_sizes()

    def _refuse_negative_sizes(self) -> None:
        """A negative value of any size key (``SIZE_BOUNDS``) is a broken file, whether or not this
        architecture reads the key: a ``sliding_window`` of -1 on a llama, or ``num_experts`` of -4 on
        a dense model, was dropped without a word, so the plan was made for another model than the
        user meant. (Each read still checks the keys it uses: >= 1, or >= 0 for a count.)"""
        for key in SIZE_BOUNDS:
            value = self.raw.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise self.error(f"{key} is {short(value)}: a size cannot be negative; fix it in the config.json")

    def error(self, problem: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {problem}")

    def _lookup(self, keys: tuple[str, ...]) -> tuple[str, Any]:
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                return key, self.raw[key]
        return keys[0], None

    def size(self, *keys: str, default: int | None = None) -> int:
        """A positive whole number; required when ``default`` is None."""
        key, value = self._lookup(keys)
        if value is None:
            if default is None:
                names = " or ".join(keys)
                raise self.error(f"missing {names}: the planner needs it to size the model")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(f"{key} must be a whole number >= 1, got {short(value)}")
        bound, what = size_bound(key)
        if value > bound:
            raise self.error(
                f"{key} {short(value)} is past the bound on {what}: at most {bound:,}; check the config.json for a typo"
            )
        return value

    def optional_size(self, key: str) -> int | None:
        """A positive whole number, or None when the key is absent or null."""
        return None if self.raw.get(key) is None else self.size(key)

    def count(self, key: str, default: int) -> int:
        """A whole number >= 0 (a count that may be zero: dense first layers, shared experts)."""
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(f"{key} must be a whole number >= 0, got {short(value)}")
        bound, what = size_bound(key)
        if value > bound:
            raise self.error(f"{key} {short(value)} is past the bound on {what}: at most {bound:,}")
        return value

    def layer_indices(self, key: str) -> set[int] | None:
        """A list of layer indices (``mlp_only_layers``, ``moe_layers``), or None when absent or null."""
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
            raise self.error(f"{key} must be a list of layer indices (whole numbers >= 0), got {short(value)}")
        return set(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {short(value)}")
        return value

    def prob(self, *keys: str, default: float = 0.0) -> float:
        """A dropout probability in [0, 1)."""
        key, value = self._lookup(keys)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise self.error(f"{key} must be a dropout probability in [0, 1), got {short(value)}")
        return float(value)

    def text(self, *keys: str, default: str) -> str:
        key, value = self._lookup(keys)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(f"{key} must be a string, got {short(value)}")
        return value

    def heads(self, *, hidden: int, heads: int, kv_key: str | None, kv_default: int | None = None,
              head_dim_key: bool = False, head_dim_default: int | None = None) -> tuple[int, int]:
        """(num_kv_heads, head_dim) after checking they divide evenly.

        ``kv_default``: the number of kv heads transformers assumes when the key is absent (some
        config classes default it to a fixed number, e.g. mistral 8); None means "= heads", which
        is also what an explicit null means. ``head_dim_key``: the architecture reads an explicit
        ``head_dim`` (llama family, gemma, qwen3); its default is ``head_dim_default`` or else
        hidden / heads.
        """
        if head_dim_default is None:
            if hidden % heads and not (head_dim_key and self.raw.get("head_dim") is not None):
                raise self.error(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim_default = hidden // heads
        head_dim = self.size("head_dim", default=head_dim_default) if head_dim_key else head_dim_default
        if kv_key is None:
            kv = heads
        elif kv_key not in self.raw:
            kv = kv_default or heads
        else:
            kv = self.size(kv_key, default=heads)
        if heads % kv:
            raise self.error(f"num_attention_heads {heads} is not a multiple of {kv_key} {kv}")
        return kv, head_dim


def short(value: Any, limit: int = 40) -> str:
    """``repr`` of a config value cut to ``limit`` characters (an int of 400 digits stays one short line)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 4000 else f"<{value.bit_length()}-bit integer>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- building blocks ----------------------------------------------------------------------------


def lin(
    name: str, n_in: int, n_out: int, bias: bool, kind: LinearKind, count: int = 1, active: int | None = None,
    *, module: bool = True,
) -> LinearSpec:
    return LinearSpec(
        name=name, in_features=n_in, out_features=n_out, bias=bias, kind=kind,
        count=count, active=count if active is None else active, module=module,
    )


def qkvo(
    hidden: int, heads: int, kv: int, head_dim: int, *, qkv_bias: bool, o_bias: bool, o_name: str = "o_proj"
) -> list[LinearSpec]:
    """Separate q/k/v projections (grouped-query when kv < heads) and the output projection."""
    q_out, kv_out = heads * head_dim, kv * head_dim
    return [
        lin("q_proj", hidden, q_out, qkv_bias, K.ATTN_IN),
        lin("k_proj", hidden, kv_out, qkv_bias, K.ATTN_IN),
        lin("v_proj", hidden, kv_out, qkv_bias, K.ATTN_IN),
        lin(o_name, q_out, hidden, o_bias, K.ATTN_OUT),
    ]


def swiglu(hidden: int, inter: int, *, bias: bool = False) -> list[LinearSpec]:
    return [
        lin("gate_proj", hidden, inter, bias, K.MLP_IN),
        lin("up_proj", hidden, inter, bias, K.MLP_IN),
        lin("down_proj", inter, hidden, bias, K.MLP_OUT),
    ]


def two_layer_mlp(names: tuple[str, str], hidden: int, inter: int, *, bias: bool) -> list[LinearSpec]:
    return [lin(names[0], hidden, inter, bias, K.MLP_IN), lin(names[1], inter, hidden, bias, K.MLP_OUT)]


#: leaf names of the fused-qkv blocks (gpt_neox, bloom, falcon): qkv, attention out, MLP up, MLP down
FUSED_QKV_NAMES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


def fused_qkv_block(names: tuple[str, str, str, str], hidden: int, qkv_out: int, inter: int, *,
                     attn_bias: bool, mlp_bias: bool) -> tuple[LinearSpec, ...]:
    """One fused q/k/v projection, the attention output and a two-layer MLP."""
    qkv, out, up, down = names
    return (
        lin(qkv, hidden, qkv_out, attn_bias, K.ATTN_IN),
        lin(out, hidden, hidden, attn_bias, K.ATTN_OUT),
        *two_layer_mlp((up, down), hidden, inter, bias=mlp_bias),
    )


def untied_head(vocab: int, n_in: int, *, tied: bool, bias: bool = False) -> int:
    """Parameters the lm_head adds beyond the token embedding (weight only when untied)."""
    return (0 if tied else vocab * n_in) + (vocab if bias else 0)


def common_fields(*, model_type: str, hidden: int, layers: int, heads: int, vocab: int) -> dict[str, Any]:
    return {
        "model_type": model_type, "hidden_size": hidden, "num_layers": layers,
        "num_heads": heads, "vocab_size": vocab,
    }


__all__ = ["FUSED_QKV_NAMES", "K", "SIZE_BOUNDS", "ConfigReader", "common_fields", "fused_qkv_block", "lin", "qkvo", "short",
           "size_bound", "swiglu", "two_layer_mlp", "untied_head"]
