"""The eval pass during training (planner.memory.evaluation): its moments, its terms, and the
peak of a run that evaluates as the larger of the step and the eval pass."""

from __future__ import annotations

import pytest

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.errors import InvalidConfigError, UnsupportedError
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.evaluation import CASTS, KV_CACHE, LOGITS, STEP, eval_parts
from planner.memory.step import batch_line, batch_terms
from planner.memory.timeline import step_timeline

LLAMA = spec_from_config({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000,
                          "max_position_embeddings": 4096}, model_id="tiny-llama", source="test")
BERT = spec_from_config({"model_type": "bert", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 256, "vocab_size": 2000, "max_position_embeddings": 512},
                        model_id="tiny-bert", source="test")
CPU = get_gpu("cpu")
BASE = {"micro_batch": 2, "seq_len": 64, "precision": "bf16-mixed"}


def _estimate(**changes):
    return estimate_memory(model=LLAMA, config=TrainConfig(**(BASE | changes)), gpu=CPU)


def test_a_run_that_does_not_evaluate_is_planned_as_before():
    config = TrainConfig(**BASE)
    assert eval_parts(LLAMA, config, CPU.kernels) == ({}, {})
    timeline = step_timeline(model=LLAMA, config=config, kernels=CPU.kernels)
    curve = timeline.curve()
    resident = curve[timeline.start]
    # the eval moments are marked with nothing on top of the resident states: never the peak
    assert curve[timeline.marks["eval"]] == curve[timeline.marks["eval_generate"]] == resident
    assert timeline.peak_phase not in ("eval", "eval_generate")
    assert "eval_batch" not in config.to_dict()


def test_a_large_eval_batch_makes_the_eval_forward_the_peak():
    small, large = _estimate(eval_batch=1), _estimate(eval_batch=64)
    assert small.peak_phase != "eval" and large.peak_phase == "eval"
    assert small.peak_allocated_bytes == _estimate().peak_allocated_bytes
    assert any("the run's peak is the eval pass" in line for line in large.assumptions)
    assert any("the run's peak is the training step" in line for line in small.assumptions)
    # at the eval moment no gradient is alive (zero_grad set them to None before the eval pass)
    assert "gradients" not in large.breakdown and large.breakdown["optimizer_states"] > 0


def test_the_eval_forward_holds_the_logits_their_upcast_and_the_log_probabilities():
    config = TrainConfig(**BASE, eval_batch=4, eval_seq_len=32)
    forward, generate = eval_parts(LLAMA, config, CPU.kernels)
    tokens = 4 * 32
    assert forward[LOGITS] == tokens * 2000 * (2 + 4 + 4)  # bf16 logits, fp32 upcast, fp32 log_softmax
    assert forward[CASTS] > 0 and generate == {}
    # pure bf16 has no autocast, so no cached casts
    assert CASTS not in eval_parts(LLAMA, config.replace(precision="bf16"), CPU.kernels)[0]


def test_lora_caches_the_casts_of_its_adapters_only():
    from planner.memory.parameters import trainable_params

    config = TrainConfig(**BASE, method="lora", eval_batch=4)
    full = eval_parts(LLAMA, TrainConfig(**BASE, eval_batch=4), CPU.kernels)[0][CASTS]
    casts = eval_parts(LLAMA, config, CPU.kernels)[0][CASTS]
    # a frozen weight's cast is freed after its linear (nothing requires its gradient)
    assert casts == 2 * trainable_params(LLAMA, config) < full


def test_generation_holds_a_kv_cache_that_grows_by_each_generated_token():
    config = TrainConfig(**BASE, eval_batch=4, eval_seq_len=32, generate_tokens=300)
    longer = config.replace(generate_tokens=400)
    cache, cache_longer = (eval_parts(LLAMA, c, CPU.kernels)[1][KV_CACHE] for c in (config, longer))
    # 2 layers x 4 rows x 2 kv heads x 32 dims: fp32 keys (rope in the residual's dtype under
    # autocast) and bf16 values
    per_token = 2 * 4 * 2 * 32 * (4 + 2)
    assert cache == (32 + 300 - 1) * per_token and cache_longer - cache == 100 * per_token


def test_a_long_prompt_with_few_new_tokens_peaks_in_the_prefill():
    config = TrainConfig(**BASE, eval_batch=4, eval_seq_len=1024, generate_tokens=2)
    generate = eval_parts(LLAMA, config, CPU.kernels)[1]
    # the prompt's cache and the last layer's MLP: 2 hidden states in fp32, 3 intermediates in bf16
    assert generate[KV_CACHE] == 1024 * 2 * 4 * 2 * 32 * (4 + 2)
    assert generate[STEP] == 4 * 1024 * (2 * 128 * 4 + 3 * 256 * 2)


def test_the_eval_moments_are_flat_in_the_training_micro_batch():
    config = TrainConfig(**BASE, eval_batch=8, generate_tokens=16)
    one, slope = batch_line(LLAMA, config, CPU.kernels)
    terms = batch_terms(LLAMA, config, CPU.kernels)
    assert slope[-2:] == (0, 0)
    assert one[-2] == sum(terms.eval_generate.values()) and one[-1] == sum(terms.eval_forward.values())


def test_the_eval_settings_are_checked():
    with pytest.raises(InvalidConfigError, match="--eval-batch"):
        TrainConfig(generate_tokens=8)
    with pytest.raises(InvalidConfigError, match="--eval-batch"):
        TrainConfig(eval_seq_len=128)
    with pytest.raises(InvalidConfigError, match="--generate-tokens"):
        TrainConfig(eval_batch=2, generate_tokens=-1)
    with pytest.raises(InvalidConfigError, match="--eval-batch"):
        TrainConfig(eval_batch=0)
    config = TrainConfig(eval_batch=2, eval_seq_len=128, generate_tokens=8)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "eval b2x128+gen8" in config.label()


def test_an_encoder_evaluates_but_does_not_generate():
    config = TrainConfig(**BASE, eval_batch=4)
    assert estimate_memory(model=BERT, config=config, gpu=CPU).peak_allocated_bytes > 0
    with pytest.raises(UnsupportedError, match="does not generate"):
        estimate_memory(model=BERT, config=config.replace(generate_tokens=4), gpu=CPU)
