"""QLoRA's k-bit preparation (``TrainConfig.kbit_upcast``): peft's ``prepare_model_for_kbit_training``
upcasts every non-4-bit parameter to fp32 (the default, the HF/TRL path); fms-acceleration's
accelerated-peft-bnb, torchtune, LLaMA-Factory and axolotl keep them, and the residual stream, 16-bit."""

from __future__ import annotations

import pytest

from planner.config import Method, Precision, TrainConfig
from planner.emit import settings
from planner.emit.train_script import render_train_script
from planner.errors import InvalidConfigError
from planner.memory.dtypes import FP32, HALF, dtype_mode, mode_of
from planner.request import FIELDS


def test_the_default_is_peft_s_upcast_and_its_mode_is_unchanged():
    config = TrainConfig(method="qlora")
    assert config.kbit_upcast is True and FIELDS["kbit_upcast"].default is True
    assert mode_of(config) == dtype_mode(Method.QLORA, Precision.BF16_MIXED, False)
    assert (mode_of(config).residual, mode_of(config).compute, mode_of(config).weight) == (FP32, FP32, FP32)
    # a payload without the key is peft's upcast, and the default keeps every payload's bytes
    assert "kbit_upcast" not in config.to_dict() and config.to_dict()["version"] == 2
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("precision", "autocast", "adapter_input", "adapter"),
                         [("bf16-mixed", True, HALF, HALF), ("bf16", False, FP32, FP32), ("fp16-mixed", True, HALF, HALF)])
def test_without_the_upcast_the_stream_projections_and_stored_weights_are_16_bit(precision, autocast, adapter_input,
                                                                                  adapter):
    mode = mode_of(TrainConfig(method="qlora", precision=precision, kbit_upcast=False))
    assert (mode.autocast, mode.residual, mode.compute, mode.attn, mode.weight) == (autocast, HALF, HALF, HALF, HALF)
    # peft's fp32 adapters: under autocast lora_A saves the 16-bit cast of its input, else peft's fp32 copy
    assert (mode.adapter_input, mode.adapter) == (adapter_input, adapter)


def test_fp32_has_nothing_to_upcast():
    assert mode_of(TrainConfig(method="qlora", precision="fp32", kbit_upcast=False)) == \
        mode_of(TrainConfig(method="qlora", precision="fp32"))


def test_only_qlora_takes_it_in_one_line():
    for method in ("full", "lora"):
        with pytest.raises(InvalidConfigError, match="--no-kbit-upcast describes QLoRA's k-bit preparation.*"
                                                     "use --method qlora or drop it"):
            TrainConfig(method=method, kbit_upcast=False)
    with pytest.raises(InvalidConfigError, match="kbit_upcast must be true or false"):
        TrainConfig(method="qlora", kbit_upcast="no")


def test_the_payload_and_label_say_it_where_set():
    config = TrainConfig(method="qlora", kbit_upcast=False)
    payload = config.to_dict()
    assert payload["kbit_upcast"] is False and payload["version"] == 3  # a version-2 reader would drop it
    assert TrainConfig.from_dict(payload) == config
    assert config.label().endswith("no-kbit-upcast")


def test_the_request_field_derives_the_cli_option():
    f = FIELDS["kbit_upcast"]
    assert f.flag == "--kbit-upcast/--no-kbit-upcast" and f.qlora_only and f.recipe


def test_emit_calls_prepare_model_for_kbit_training_only_when_upcasting():
    def script(config):
        return render_train_script(model="m", plan_id="p", rank=1, label="l", seq_len=8, dtype="bfloat16", dtype_why="",
                                   attention="sdpa", masked_lm=False, dataset=None, **settings.script_recipe(config))

    upcast, kept = TrainConfig(method="qlora"), TrainConfig(method="qlora", kbit_upcast=False)
    assert "KBIT_UPCAST = True" in script(upcast) and "KBIT_UPCAST = False" in script(kept)
    assert 'if read_settings("bnb_config.json") and KBIT_UPCAST:' in script(kept)
    assert not any("k-bit" in line for line in settings.run_assumptions(upcast))
    assert any(line.startswith("no k-bit upcast") and "bfloat16" in line for line in settings.run_assumptions(kept))


def test_suggest_gives_qlora_candidates_the_16_bit_mode_and_others_their_plans(cli):
    """``suggest --no-kbit-upcast`` (a recipe setting of QLoRA alone: ``request.recipe_for``) plans
    its QLoRA candidates without the upcast, below the upcast's peak for the same configuration,
    and its LoRA candidates as without the flag."""
    import json

    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory

    args = ("suggest", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "-b", "8", "--seq-len", "1024", "-k", "10",
            "--no-save", "--json")
    kept, upcast = cli(*args, "--no-kbit-upcast"), cli(*args)
    assert kept.code == 0 and upcast.code == 0, (kept, upcast)
    plans, before = json.loads(kept.out)["plans"], json.loads(upcast.out)["plans"]
    qlora = [p for p in plans if p["config"]["method"] == "qlora"]
    assert qlora and all(p["config"]["kbit_upcast"] is False for p in qlora)
    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    for plan in qlora:
        config = TrainConfig.from_dict(plan["config"])
        with_upcast = estimate_memory(model=model, config=config.replace(kbit_upcast=True), gpu=gpu)
        peak = plan["memory"]["peak_allocated_bytes"]
        # fp32 has nothing to upcast (test_fp32_has_nothing_to_upcast)
        assert peak == with_upcast.peak_allocated_bytes if config.precision == "fp32" else \
            peak < with_upcast.peak_allocated_bytes
    assert any(p["config"]["precision"] != "fp32" for p in qlora)
    # LoRA's candidates are planned as without the flag, and shown as without it: under fidelity an
    # exotic plan (ZeRO on one GPU) competes with the plain plans of its own tier, not with QLoRA's,
    # whose 16-bit stream makes them faster here (ranking._by_speed)
    lora = [p for p in plans if p["config"]["method"] == "lora"]
    assert lora and lora == [p for p in before if p["config"]["method"] == "lora"]
    assert all("kbit_upcast" not in p["config"] for p in lora)
    for plan in lora:
        alone = estimate_memory(model=model, config=TrainConfig.from_dict(plan["config"]), gpu=gpu)
        assert plan["memory"]["peak_allocated_bytes"] == alone.peak_allocated_bytes
        assert plan["memory"]["peak_reserved_bytes"] == alone.peak_reserved_bytes


def test_suggest_without_qlora_refuses_it_in_one_line(cli):
    r = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--method", "lora", "--no-kbit-upcast", "--no-save")
    assert r.code == 2, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "--no-kbit-upcast" in lines[0] and "--method qlora" in lines[0], r.err


@pytest.mark.parametrize("upcast, words", [(True, "upcast to fp32 by prepare_model_for_kbit_training"),
                                           (False, "kept in the 16-bit compute dtype")])
def test_the_estimate_notes_say_which_k_bit_preparation_was_planned(upcast, words):
    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory

    estimate = estimate_memory(model=resolve_model("meta-llama/Llama-2-7b-hf"), gpu=get_gpu("a10g"),
                               config=TrainConfig(method="qlora", seq_len=512, kbit_upcast=upcast))
    (note,) = [n for n in estimate.assumptions if n.startswith("NF4")]
    assert words in note


def test_linear4bit_quantises_the_weights_and_keeps_the_biases():
    """bitsandbytes' Linear4bit packs ``weight`` and keeps ``bias`` an ordinary parameter: Qwen2.5-0.5B's q, k, v
    biases are not 4-bit, and the step time dequantises the same weights the memory model packs."""
    from planner.catalog import resolve_model
    from planner.memory.parameters import quantized_linear_params
    from planner.throughput import _quantized_weights

    model = resolve_model("Qwen/Qwen2.5-0.5B")
    # a layer: q and o 896 x 896, k and v 896 x 128, gate, up and down 896 x 4864: 14,909,440 weights; 24 layers
    assert quantized_linear_params(model) == 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) == 357_826_560
    assert _quantized_weights(model) == quantized_linear_params(model)
