"""--compile (torch.compile's fused kernels) through the command line: estimate, suggest, check and emit."""

from __future__ import annotations

import json

import yaml


def _estimate(cli, *flags: str) -> dict:
    r = cli("estimate", "-m", "gpt2", "-g", "a10g", "--seq-len", "512", "--json", *flags)
    assert r.code == 0, r
    return json.loads(r.out)


def test_estimate_prices_a_compiled_step_and_says_what_it_rests_on(cli):
    eager, compiled = _estimate(cli), _estimate(cli, "--compile")
    assert "compile" not in eager["config"] and compiled["config"]["compile"] is True
    assert compiled["throughput"]["tokens_per_s"] > eager["throughput"]["tokens_per_s"]
    assert compiled["throughput"]["breakdown_s"]["elementwise"] < eager["throughput"]["breakdown_s"]["elementwise"]
    said = [a for a in compiled["throughput"]["assumptions"] if "torch.compile" in a]
    assert said and "eager's saved tensors" in said[0] and "upper bound" in said[0]
    assert compiled["memory"]["peak_allocated_bytes"] == eager["memory"]["peak_allocated_bytes"]


def test_suggest_gives_every_plan_the_compile_it_was_asked_for(cli):
    r = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--seq-len", "512", "--compile", "--json")
    assert r.code == 0, r
    plans = json.loads(r.out)["plans"]
    assert plans and all(p["config"]["compile"] is True for p in plans)


def test_check_reads_a_compiled_trainer_config_and_emit_writes_it_back(cli, tmp_path):
    # torchtune's recipe key: top-level compile (training.compile_model / compile_loss)
    r = cli("suggest", "-m", "Qwen/Qwen2.5-0.5B", "-g", "a10g", "-b", "8", "--seq-len", "512", "--method", "lora",
            "--precision", "bf16", "--compile", "--json")
    assert r.code == 0, r
    plan_id = json.loads(r.out)["plan_id"]
    emitted = cli("emit", plan_id, tmp_path / "tt", "--for", "torchtune")
    assert emitted.code == 0, emitted
    (config_file,) = (tmp_path / "tt").glob("*.yaml")
    assert yaml.safe_load(config_file.read_text())["compile"] is True
    checked = cli("check", config_file, "--gpu", "a10g", "--model", "Qwen/Qwen2.5-0.5B", "--json")
    assert checked.code in (0, 3), checked
    read = json.loads(checked.out)
    assert read["read"]["compile"] == {"file": str(config_file), "key": "compile", "value": True, "given": True}
    assert read["estimate"]["config"]["compile"] is True
    assert any("torch.compile" in a for a in read["estimate"]["throughput"]["assumptions"])
