"""``planner emit --for axolotl`` with ``--rope-scaling``: axolotl sets each ``model_config`` key on the model's
config (src/axolotl/loaders/utils.py l.201-203, ``setattr``), and transformers 5's ``rope_scaling`` setter
replaces ``rope_parameters`` whole (5.24 configuration_utils.py l.724-733). The emitted dict must therefore carry
the model's own rope_theta (and partial_rotary_factor): without it the rotary embedding is built from
rope_theta None and the model does not build (a TypeError in the inverse frequencies).

Each test loads the emitted file as axolotl does: the model's config from its folder, then every model_config key
set on it, then the rotary embedding built from that config. Hand-derived: the tiny llama's head_dim is
64 / 4 = 16, so its 8 inverse frequencies are theta^(-2i/16); linear x2 halves each."""

from __future__ import annotations

import json

import pytest
import yaml
from support.cli import TINY

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.emit.trainers import trainer_files
from planner.errors import UnsupportedError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = TrainConfig(method="qlora", precision="bf16-mixed", seq_len=256, attention="sdpa", rope_scaling="2")


def _emitted(tmp_path, config_json: dict, config: TrainConfig = CONFIG) -> dict:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json))
    spec = resolve_model(str(folder / "config.json"))
    files, _ = trainer_files("axolotl", config=config, spec=spec, model=str(folder), dataset=None, on_cpu=False)
    return yaml.safe_load(files["axolotl.yaml"])


def _as_axolotl_loads_it(folder, model_config: dict):
    import warnings

    config = transformers.AutoConfig.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the rope_scaling setter's deprecation
        for key, value in model_config.items():  # loaders/utils.py load_model_config
            setattr(config, key, value)
    return config


def _inv_freq(theta: float, dims: int = 16) -> torch.Tensor:
    return torch.tensor([theta ** (-2 * i / dims) for i in range(dims // 2)])


def test_the_model_s_rope_theta_is_written_and_the_frequencies_are_halved(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    data = _emitted(tmp_path, {**TINY, "rope_theta": 500000.0})
    assert data["model_config"] == {"rope_scaling": {"rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0},
                                    "max_position_embeddings": 256}  # 128 x 2, as train.py's scale_rope sets it
    config = _as_axolotl_loads_it(tmp_path / "model", data["model_config"])
    assert torch.allclose(LlamaRotaryEmbedding(config).inv_freq.float(), _inv_freq(500000.0) / 2)


def test_without_rope_theta_in_the_config_the_model_type_s_default_is_written(tmp_path):
    # Llama-2's config.json has no rope_theta: LlamaConfig's default, 10000
    data = _emitted(tmp_path, TINY)
    assert data["model_config"]["rope_scaling"]["rope_theta"] == 10000.0
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _as_axolotl_loads_it(tmp_path / "model", data["model_config"])
    assert torch.allclose(LlamaRotaryEmbedding(config).inv_freq.float(), _inv_freq(10000.0) / 2)


def test_llama3_scaling_carries_its_band_edges(tmp_path):
    data = _emitted(tmp_path, {**TINY, "rope_theta": 500000.0}, CONFIG.replace(rope_scaling="llama3:2"))
    rope = data["model_config"]["rope_scaling"]
    assert rope == {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    LlamaRotaryEmbedding(_as_axolotl_loads_it(tmp_path / "model", data["model_config"]))  # builds


def test_a_partial_rotary_model_keeps_its_rotating_share():
    from planner.emit.settings import model_rope_parameters

    # pythia's config.json: rotary_pct 0.25, rotary_emb_base 10000 (GPTNeoXConfig's v4 names)
    assert model_rope_parameters(resolve_model("EleutherAI/pythia-1b").config) == {"rope_theta": 10000.0,
                                                                                  "partial_rotary_factor": 0.25}
    assert model_rope_parameters({"model_type": "mixtral"}) == {"rope_theta": 1_000_000.0}  # MixtralConfig's default


def test_per_layer_type_rope_parameters_are_refused_in_one_line():
    spec = resolve_model("google/gemma-3-1b-it")
    with pytest.raises(UnsupportedError, match=r"^--for axolotl: gemma3_text has rope parameters per layer type") as err:
        trainer_files("axolotl", config=CONFIG.replace(method="lora", precision="bf16"), spec=spec, model=spec.id,
                      dataset=None, on_cpu=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("scaling", ["yarn:4", "llama3:4", "linear:2", "dynamic:2"])
def test_axolotl_builds_the_rotary_embedding_train_py_builds(tmp_path, scaling):
    """train.py's model config (``scale_rope`` on the config.json's) and axolotl's (every model_config key set on it,
    in the file's order and in the reverse one) give the same rope parameters, max_position_embeddings, inverse
    frequencies and attention scaling. yarn and llama3 keep the pretraining length, 128, in
    original_max_position_embeddings and train at 128 x factor: yarn's attention scaling is 0.1 ln(4) + 1 = 1.1386
    (modeling_rope_utils.py get_mscale, from the explicit factor); dynamic NTK keeps max_position_embeddings at 128,
    the length it rescales beyond (so the file writes none)."""
    import math

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from planner.emit.settings import rope_parameters, scale_rope

    config = CONFIG.replace(rope_scaling=scaling, seq_len=128)
    data = _emitted(tmp_path, {**TINY, "rope_theta": 500000.0}, config)
    trained = scale_rope(transformers.AutoConfig.from_pretrained(tmp_path / "model"), rope_parameters(config))
    expected = LlamaRotaryEmbedding(trained)
    kind, factor = config.rope_scaling.split(":")
    assert trained.max_position_embeddings == (128 if kind == "dynamic" else 128 * int(factor))
    for keys in (data["model_config"], dict(reversed(data["model_config"].items()))):
        loaded = _as_axolotl_loads_it(tmp_path / "model", keys)
        built = LlamaRotaryEmbedding(loaded)
        assert loaded.max_position_embeddings == trained.max_position_embeddings
        assert loaded.rope_parameters == trained.rope_parameters
        assert torch.equal(built.inv_freq, expected.inv_freq)
        assert built.attention_scaling == expected.attention_scaling
    if kind == "yarn":
        assert math.isclose(expected.attention_scaling, 0.1 * math.log(4) + 1)
