"""The measurement worker on the CPU: every technique through ``run_in_process`` with a tiny
llama, the isolated ``measure`` with its OOM, crash and timeout paths, and the DeepSpeed config.

Hand-derived sizes of the tiny llama (hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV
heads -> head_dim 16, vocab 1000, untied head):
  embedding 1000*64 = 64,000; lm_head 64,000; final norm 64
  per layer: q 64*64 = 4,096, k 64*32 = 2,048, v 2,048, o 4,096, gate/up/down 3 * 64*128 =
  24,576, two norms 128 -> 36,992; two layers 73,984
  total 64,000 + 73,984 + 64 + 64,000 = 202,048 parameters in 21 tensors.
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from planner.config import TrainConfig  # noqa: E402
from planner.errors import InvalidConfigError  # noqa: E402
from planner.results import RunOutcome  # noqa: E402
from workers import measure, measure_with_details, run_in_process  # noqa: E402
from workers.runner import run_job  # noqa: E402

TINY = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
)
N_PARAMS = 202_048
N_TENSORS = 21
# LoRA r16 on all 7 linears of a layer: r*(in+out) each
#   q 16*(64+64) = 2,048; k, v 16*(64+32) = 1,536 each; o 2,048; gate, up, down 16*(64+128) = 3,072 each
#   -> 16,384 per layer, 32,768 for two layers, in 28 tensors (A and B of 14 linears)
N_LORA_ALL = 32_768


def run(**overrides):
    kw = dict(micro_batch=2, seq_len=32) | overrides
    measurement, details = run_in_process(model_config=TINY, config=TrainConfig(**kw))
    assert measurement.outcome is RunOutcome.OK, measurement.error
    assert measurement.peak_allocated_bytes > 0 and measurement.step_s > 0
    return measurement, details


def test_full_fp32_adamw_counts_weights_and_adam_states_exactly():
    m, d = run(precision="fp32", optimizer="adamw")
    assert d["params_total"] == N_PARAMS
    br = d["peak_breakdown"]
    assert br["parameters"] == 4 * N_PARAMS  # 808,192 B
    # exp_avg + exp_avg_sq in fp32, plus AdamW's fp32 "step" scalar per tensor
    assert br["optimizer_states"] == 8 * N_PARAMS + 4 * N_TENSORS
    assert sum(v for k, v in br.items() if k != "offloaded") == m.peak_allocated_bytes
    assert m.peak_reserved_bytes is None and m.process_total_bytes is None  # CPU
    assert m.device == "cpu"
    assert {"torch", "transformers", "peft", "bitsandbytes", "python"} <= set(m.library_versions)
    # tokens/s = micro_batch * seq_len * grad_accum / step time
    assert m.tokens_per_s == pytest.approx(2 * 32 / m.step_s)


def test_the_same_run_measures_the_same_peak_twice():
    a, _ = run(precision="fp32")
    b, _ = run(precision="fp32")
    assert a.peak_allocated_bytes == b.peak_allocated_bytes


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_keeps_fp32_weights(precision):
    m, d = run(precision=precision)
    assert d["peak_breakdown"]["parameters"] == 4 * N_PARAMS
    assert d["param_dtypes"] == ["float32"]
    if precision == "fp16-mixed":
        assert d["grad_scaler_scale"] > 0  # the GradScaler stepped the optimizer


def test_pure_bf16_halves_weights_and_adam_states():
    m, d = run(precision="bf16")
    br = d["peak_breakdown"]
    assert d["param_dtypes"] == ["bfloat16"]
    assert br["parameters"] == 2 * N_PARAMS
    assert br["optimizer_states"] == 4 * N_PARAMS + 4 * N_TENSORS  # moments in bf16, step fp32


def test_lora_all_linear_trains_only_the_adapters():
    m, d = run(method="lora", precision="fp32")
    assert d["params_trainable"] == N_LORA_ALL
    br = d["peak_breakdown"]
    assert br["parameters"] == 4 * (N_PARAMS + N_LORA_ALL)
    assert br["optimizer_states"] == 8 * N_LORA_ALL + 4 * 28


def test_lora_named_targets():
    # q: 16*(64+64) = 2,048, v: 16*(64+32) = 1,536 -> 3,584 per layer, 7,168 for two
    m, d = run(method="lora", lora_targets=("q_proj", "v_proj"))
    assert d["params_trainable"] == 7_168


def test_qlora_loads_4bit_weights_and_trains_adapters():
    m, d = run(method="qlora", precision="bf16-mixed", lora_targets=("q_proj", "v_proj"))
    assert "uint8" in d["param_dtypes"]  # bitsandbytes' packed NF4 weights
    assert d["params_trainable"] == 7_168
    full, _ = run(method="lora", precision="bf16-mixed", lora_targets=("q_proj", "v_proj"))
    assert m.peak_allocated_bytes < full.peak_allocated_bytes


def test_gradient_checkpointing_lowers_the_peak():
    plain, _ = run(precision="fp32", seq_len=128, optimizer="sgd")
    ckpt, _ = run(precision="fp32", seq_len=128, optimizer="sgd", grad_ckpt=True)
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes


def test_gradient_accumulation_keeps_gradients_across_micro_steps():
    m, d = run(precision="fp32", grad_accum=2, grad_ckpt=True)
    # the second micro-step runs with the first one's gradients alive: all fp32 gradients
    assert d["peak_breakdown"]["gradients"] == 4 * N_PARAMS
    assert m.tokens_per_s == pytest.approx(2 * 32 * 2 / m.step_s)


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit"])
def test_each_optimizer(optimizer):
    m, d = run(precision="fp32", optimizer=optimizer)
    states = d["peak_breakdown"]["optimizer_states"]
    if optimizer == "sgd":
        assert states == 4 * N_PARAMS  # one fp32 momentum buffer
    elif optimizer == "adafactor":
        # factored second moment: rows + cols of every matrix, full vector for norms, fp32:
        #   embedding and head 2 * (1000+64) = 2,128; per layer q 128, k 96, v 96, o 128,
        #   gate/up/down 3 * 192 = 576 -> 1,024, two layers 2,048; norms 5 * 64 = 320
        # plus transformers' Adafactor keeps its "RMS" as a 4-byte tensor per parameter
        assert states == 4 * (2_128 + 2_048 + 320) + 4 * N_TENSORS
    else:
        # 1-byte moments (tensors under 4096 elements stay 32-bit: bnb min_8bit_size)
        assert 0 < states < 8 * N_PARAMS / 3


def test_eager_attention_keeps_more_activations_than_sdpa():
    sdpa, _ = run(precision="fp32", seq_len=128, attention="sdpa")
    eager, _ = run(precision="fp32", seq_len=128, attention="eager")
    assert eager.peak_allocated_bytes > sdpa.peak_allocated_bytes


def test_encoder_runs_as_masked_lm():
    bert = dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=1000, max_position_embeddings=128)
    m, d = run_in_process(model_config=bert, config=TrainConfig(micro_batch=2, seq_len=32, method="lora"))
    assert m.outcome is RunOutcome.OK, m.error


def test_memory_limit_in_process_is_oom_with_the_text():
    m, _ = run_in_process(model_config=TINY, config=TrainConfig(micro_batch=2, seq_len=32), memory_limit_bytes=1_000_000)
    assert m.outcome is RunOutcome.OOM
    assert "memory limit" in m.error and m.peak_allocated_bytes is None


def test_a_failing_run_is_error_not_an_exception():
    m, _ = run_in_process(model_config=dict(TINY, model_type="no-such-arch"), config=TrainConfig(seq_len=8))
    assert m.outcome is RunOutcome.ERROR and "no-such-arch" in m.error


def test_bad_arguments_are_planner_errors():
    with pytest.raises(InvalidConfigError, match="steps must be >= 2"):
        run_in_process(model_config=TINY, config=TrainConfig(), steps=1)
    with pytest.raises(InvalidConfigError, match="model_type"):
        measure(model_config={}, config=TrainConfig())
    with pytest.raises(InvalidConfigError, match="cpu or cuda"):
        measure(model_config=TINY, config=TrainConfig(), device="tpu")


# ---- isolation: a fresh process per measurement ---------------------------------------------
def test_measure_in_a_fresh_process_matches_the_in_process_peak():
    config = TrainConfig(micro_batch=2, seq_len=32, precision="fp32")
    child = measure(model_config=TINY, config=config, timeout_s=300)
    here, _ = run_in_process(model_config=TINY, config=config)
    assert child.outcome is RunOutcome.OK, child.error
    assert child.peak_allocated_bytes == here.peak_allocated_bytes


def test_measure_under_a_memory_limit_is_oom_and_the_caller_is_unharmed():
    m = measure(model_config=TINY, config=TrainConfig(micro_batch=2, seq_len=32), memory_limit_bytes=2_000_000)
    assert m.outcome is RunOutcome.OOM
    assert "OutOfMemoryError" in m.error and "2000000" in m.error


def _job():
    return {"model_config": TINY, "config": TrainConfig().to_dict(), "device": "cpu", "steps": 2}


@pytest.mark.parametrize("fault, signal_name", [("sigkill", "SIGKILL"), ("abort", "SIGABRT")])
def test_a_crashed_process_is_error_naming_the_signal(fault, signal_name):
    m, details = run_job(dict(_job(), fault=fault), timeout_s=60)
    assert m.outcome is RunOutcome.ERROR
    assert f"killed by {signal_name}" in m.error


def test_a_hanging_process_is_killed_at_the_timeout():
    import time

    t0 = time.monotonic()
    m, details = run_job(dict(_job(), fault="hang"), timeout_s=2)
    assert m.outcome is RunOutcome.ERROR and "timed out after 2 s" in m.error
    assert details["timed_out"] and time.monotonic() - t0 < 30


def test_importing_workers_does_not_import_torch():
    import subprocess

    code = "import sys, workers, workers.probes, workers.deepspeed_config, workers.runner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- DeepSpeed ZeRO (one gloo process on the CPU) --------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "zero, offload",
    [(1, "none"), (2, "none"), (3, "none"), (2, "optimizer")],
)
def test_zero_stages_run_through_deepspeed(zero, offload):
    config = TrainConfig(micro_batch=2, seq_len=32, zero=zero, offload=offload, precision="bf16-mixed")
    m, d = measure_with_details(model_config=TINY, config=config, timeout_s=600)
    assert m.outcome is RunOutcome.OK, m.error
    assert "deepspeed" in m.library_versions
    zero_section = d["deepspeed_config"]["zero_optimization"]
    assert zero_section["stage"] == zero
    # the buckets the memory model assumes (HF Trainer's "auto": hidden²), not DeepSpeed's 5e8
    assert zero_section["reduce_bucket_size"] == 64 * 64
    br = d["peak_breakdown"]
    if offload == "optimizer":
        # fp32 master weights (4 B) and Adam's two moments (8 B) live on the host
        # + the fp32 gradient partition, the 16-bit copy of the partition and one parameter's
        # gradient buffer, all host-side (stage_1_and_2.py)
        assert br["offloaded"] >= 12 * N_PARAMS + 4 * N_PARAMS + 2 * N_PARAMS
        assert br["optimizer_states"] == 0
    else:
        assert br["optimizer_states"] >= 12 * N_PARAMS


@pytest.mark.slow
def test_an_in_process_zero3_run_leaves_the_stock_linear():
    """DeepSpeed's ZeRO-3 swaps torch.nn.functional.linear for its memory-efficient version for the
    rest of the process; after it, an in-process bf16-mixed run saved 1.28 MB less than the same
    run before it (a small T5: 18,846,924 B against 20,124,876 B), so the test that ran after it
    failed. The worker gives the stock linear back, and the run after measures as the run before."""
    import torch

    stock = torch.nn.functional.linear
    plain = TrainConfig(micro_batch=2, seq_len=32, precision="bf16-mixed")
    before, _ = run_in_process(model_config=TINY, config=plain)
    zero3, _ = run_in_process(model_config=TINY, config=plain.replace(zero=3))
    assert zero3.outcome is RunOutcome.OK, zero3.error
    assert torch.nn.functional.linear is stock
    after, _ = run_in_process(model_config=TINY, config=plain)
    assert after.peak_allocated_bytes == before.peak_allocated_bytes


def test_the_rendezvous_environment_is_put_back_after_the_block(monkeypatch):
    import os

    from workers.runner import DISTRIBUTED_ENV, distributed_env_kept

    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    with distributed_env_kept():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    assert {n: os.environ.get(n) for n in DISTRIBUTED_ENV} == {
        "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None, "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": None}


@pytest.mark.slow
def test_an_in_process_zero_run_leaves_no_rendezvous_behind():
    """An in-process ZeRO run joins a process group of one rank, whose rendezvous
    (``join_process_group``) setdefaults RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
    ``workers.run_in_process`` puts the environment back as it found it. In a fresh interpreter:
    DeepSpeed keeps the group of this one's earlier ZeRO runs, and a joined group joins no more."""
    import json
    import os
    import subprocess

    from workers.runner import DISTRIBUTED_ENV

    pytest.importorskip("deepspeed")
    code = (
        "import json, os, sys\n"
        "import torch.distributed as dist\n"
        "from planner.config import TrainConfig\n"
        "from workers import run_in_process\n"
        f"m, _ = run_in_process(model_config={TINY!r}, config=TrainConfig(micro_batch=2, seq_len=32, zero=2))\n"
        f"print(json.dumps([str(m.outcome), m.error, dist.is_initialized(), {{n: os.environ.get(n) for n in {DISTRIBUTED_ENV!r}}}]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV} | {"LOCAL_WORLD_SIZE": "1",
                                                                               "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome, error, joined, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == "ok", error
    assert joined  # the run did join a group: the variables were set while it ran
    assert after == dict.fromkeys(DISTRIBUTED_ENV) | {"LOCAL_WORLD_SIZE": "1"}


@pytest.mark.slow
def test_a_measurement_does_not_inherit_a_rendezvous(monkeypatch):
    """A caller inside torchrun (or after an in-process DeepSpeed run) has RANK/MASTER_PORT set;
    the child is one rank of its own and must not try to bind that port or join that group."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        config = TrainConfig(micro_batch=2, seq_len=32, zero=1, precision="bf16-mixed")
        m, _ = measure_with_details(model_config=TINY, config=config, timeout_s=600)
    assert m.outcome is RunOutcome.OK, m.error


def test_trace_lists_what_is_live_at_the_peak():
    from workers.probes import OFFLOADED, TRACE_RESOLUTION

    m, d = run_in_process(model_config=TINY, config=TrainConfig(micro_batch=2, seq_len=32, precision="fp32"), trace=True)
    assert m.outcome is RunOutcome.OK, m.error
    groups = d["peak_storages"]
    listed = sum(n for n, _, category, _ in groups if category != OFFLOADED)
    assert m.peak_allocated_bytes - TRACE_RESOLUTION <= listed <= m.peak_allocated_bytes
    # the lm_head's weight and the loss' fp32 log-probabilities (2*32 tokens x 1000 vocab), by
    # the op and library line that made them
    made_by = [by for _, _, _, by in groups]
    assert any(by.startswith("_log_softmax.default (64, 1000) float32 @ functional.py") for by in made_by), made_by[:10]
    with pytest.raises(ValueError, match="CPU probe"):
        from workers.probes import make_probe

        make_probe(device="cuda", trace=True)
