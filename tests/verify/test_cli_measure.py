"""``planner measure`` end to end on the CPU: a real run per technique in a fresh process, the
prediction beside it, and the run stored.

The issue's list: full, LoRA and QLoRA, each optimizer, with and without checkpointing, and a
ZeRO-2 run with optimizer offload, on a model given as a config.json (a tiny llama).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

TINY = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 256,
}

RUNS = {
    "full fp32": ["--precision", "fp32"],
    "full bf16-mixed ckpt": ["--grad-ckpt"],
    "lora": ["--method", "lora", "--lora-r", "8"],
    "qlora ckpt": ["--method", "qlora", "--grad-ckpt"],
    "sgd": ["--optimizer", "sgd"],
    "adafactor": ["--optimizer", "adafactor"],
    "adamw_8bit": ["--optimizer", "adamw_8bit"],
    "paged_adamw_8bit": ["--method", "lora", "--optimizer", "paged_adamw_8bit"],
    "zero2 offload": ["--zero", "2", "--offload", "optimizer"],
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("options", list(RUNS.values()), ids=list(RUNS))
def test_measure_prints_measured_beside_predicted_and_stores_the_run(cli, tiny_config, options):
    args = ["measure", "--model", str(tiny_config), "--gpu", "cpu", "--micro-batch", "2", "--seq-len", "64", *options]
    r = cli(*args, "--json")
    assert r.code == 0, r
    data = json.loads(r.out)
    assert data["measurement"]["outcome"] == "ok"
    assert abs(data["error_pct"]["peak_allocated_bytes"]) < 4  # the model against the real run
    assert data["measurement"]["tokens_per_s"] > 0
    assert data["error_pct"]["tokens_per_s"] is not None
    stored = json.loads(cli("history", "--json", "--status", "measured").out)
    assert [row["id"] for row in stored] == [data["plan_id"]]

    human = cli(*args, "--no-save")
    assert human.code == 0, human
    assert "predicted vs measured" in human.out and "peak allocated" in human.out and "tokens/s" in human.out


@pytest.mark.slow
def test_a_run_past_gpu_mem_on_the_cpu_is_an_oom_outcome_with_exit_1(cli, tiny_config):
    r = cli("measure", "--model", str(tiny_config), "--gpu", "cpu", "--gpu-mem", "4MiB", "--micro-batch", "2",
            "--seq-len", "64", "--json")
    assert r.code == 1, r
    data = json.loads(r.out)
    assert data["measurement"]["outcome"] == "oom"
    assert "memory limit" in data["measurement"]["error"]
    stored = json.loads(cli("history", "--json", "--status", "measured").out)
    assert [row["id"] for row in stored] == [data["plan_id"]]  # an OOM is a result, kept


def test_measure_without_the_workers_extra_is_one_line_and_stores_nothing(cli, tiny_config, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    r = cli("measure", "--model", str(tiny_config), "--gpu", "cpu", "--micro-batch", "2", "--seq-len", "64")
    assert r.code == 2
    assert r.err.strip().splitlines() == [r.err.strip()]
    assert "needs torch" in r.err and "pip install 'oom-planner[workers]'" in r.err
    assert "no plans stored yet" in cli("history").out
