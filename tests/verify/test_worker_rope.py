"""``--rope-scaling`` in the measuring worker (workers/train.py): the model a measure or verify run trains is
built with the scaling on its config (transformers 5.24 ``rope_parameters``, merged by
``planner.emit.settings.scale_rope``, the function emit's train.py carries), from a config, from a local
checkpoint and through QLoRA's 4-bit reload, as emit's train.py builds it.

Hand-derived: the tiny llama's head_dim is 64 / 4 = 16, so its rotary embedding has 8 inverse frequencies
theta^(-2i/16), i = 0..7, with theta 10000 (LlamaConfig's default): 1, 10^-0.5 = 0.3162, ..., 10^-3.5.
Linear scaling (position interpolation, Chen et al. 2023) divides every one by the factor: x2 halves them,
and the model's positions grow from 128 to 256."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from planner.config import TrainConfig  # noqa: E402
from workers import train  # noqa: E402

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
UNSCALED = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)])  # theta^(-2i/head_dim)


def _inv_freq(model):
    return model.get_decoder().rotary_emb.inv_freq.float().cpu()


def test_without_scaling_the_frequencies_are_the_model_s():
    model = train._build_model(model_config=TINY, config=TrainConfig(seq_len=32), checkpoint_dir=None)
    assert torch.allclose(_inv_freq(model), UNSCALED)
    assert model.config.max_position_embeddings == 128


def test_linear_x2_halves_every_frequency_of_a_model_built_from_its_config():
    model = train._build_model(model_config=TINY, config=TrainConfig(seq_len=256, rope_scaling="2"), checkpoint_dir=None)
    assert torch.allclose(_inv_freq(model), UNSCALED / 2)
    assert model.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    assert model.config.max_position_embeddings == 256  # 128 x 2


def test_a_local_checkpoint_is_loaded_scaled(tmp_path):
    plain = train._build_model(model_config=TINY, config=TrainConfig(seq_len=32), checkpoint_dir=None)
    plain.save_pretrained(tmp_path)
    model = train._build_model(model_config=TINY, config=TrainConfig(seq_len=256, rope_scaling="linear:2"),
                               checkpoint_dir=str(tmp_path))
    assert torch.allclose(_inv_freq(model), UNSCALED / 2)
    # yarn keeps the pretraining length apart and rescales the frequencies its own way (not linear's halving)
    yarn = train._build_model(model_config=TINY, config=TrainConfig(seq_len=512, rope_scaling="yarn:4"),
                              checkpoint_dir=str(tmp_path))
    assert yarn.config.rope_parameters["original_max_position_embeddings"] == 128
    assert yarn.config.max_position_embeddings == 512


def test_qlora_s_4bit_reload_is_scaled_once(tmp_path):
    pytest.importorskip("bitsandbytes")
    config = TrainConfig(seq_len=256, method="qlora", precision="bf16-mixed", rope_scaling="2")
    model = train._build_qlora_base(model_config=TINY, config=config, checkpoint_dir=None, tmp=str(tmp_path))
    assert torch.allclose(_inv_freq(model), UNSCALED / 2)  # not / 4: the saved config is reloaded as it is
    assert model.config.max_position_embeddings == 256


# ---- Gemma 3: rope parameters per layer type ---------------------------------------------------------------------
#: a tiny Gemma 3 (head_dim 16), one sliding-window layer and one full-attention layer; Gemma3TextConfig's default
#: thetas (configuration_gemma3.py default_theta): 1,000,000 for full attention, 10,000 for the sliding window
GEMMA3 = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=128, sliding_window=32,
              layer_types=["sliding_attention", "full_attention"])
FULL = torch.tensor([1_000_000.0 ** (-2 * i / 16) for i in range(8)])  # 10^(-0.75 i): 1, 0.1778, 0.0316, ...
SLIDING = torch.tensor([10_000.0 ** (-2 * i / 16) for i in range(8)])  # 10^(-0.5 i): 1, 0.3162, 0.1, ...


def _gemma3_inv_freq(model, layer_type):
    return getattr(model.get_decoder().rotary_emb, f"{layer_type}_inv_freq").float().cpu()


def test_gemma3_scales_its_full_attention_layers_and_not_its_sliding_window():
    # transformers' Gemma3TextConfig applies a rope_scaling to full_attention alone (configuration_gemma3.py l.142-143)
    plain = train._build_model(model_config=GEMMA3, config=TrainConfig(seq_len=32), checkpoint_dir=None)
    assert torch.allclose(_gemma3_inv_freq(plain, "full_attention"), FULL)
    model = train._build_model(model_config=GEMMA3, config=TrainConfig(seq_len=256, rope_scaling="2"), checkpoint_dir=None)
    assert torch.allclose(_gemma3_inv_freq(model, "full_attention"), FULL / 2)  # linear x2 halves them
    assert torch.allclose(_gemma3_inv_freq(model, "sliding_attention"), SLIDING)  # unchanged
    assert model.config.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                                               "factor": 2.0}}
    assert model.config.max_position_embeddings == 256  # 128 x 2


def test_gemma3_yarn_keeps_its_pretraining_length_in_the_full_attention_parameters():
    model = train._build_model(model_config=GEMMA3, config=TrainConfig(seq_len=512, rope_scaling="yarn:4"),
                               checkpoint_dir=None)
    full = model.config.rope_parameters["full_attention"]
    assert full["rope_type"] == "yarn" and full["original_max_position_embeddings"] == 128
    assert model.config.max_position_embeddings == 512
    assert torch.allclose(_gemma3_inv_freq(model, "sliding_attention"), SLIDING)
    assert not torch.allclose(_gemma3_inv_freq(model, "full_attention"), FULL)  # yarn rescaled them its own way


def test_a_multimodal_config_is_scaled_in_its_text_config():
    from types import SimpleNamespace

    from planner.emit.settings import scale_rope

    text = SimpleNamespace(max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    wrapper = SimpleNamespace(text_config=text, get_text_config=lambda: text)  # PreTrainedConfig.get_text_config
    scale_rope(wrapper, {"rope_type": "linear", "factor": 2.0})
    assert text.rope_parameters == {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    assert text.max_position_embeddings == 256
