"""The fused AdamW (planner/optim/adamw.py ``adamw_fused``): the searched AdamW, as HF's Trainer builds
it by default since torch 2.8 (``adamw_torch_fused``); ``adamw`` is the same optimizer on the path torch
picks unasked (foreach on CUDA, single-tensor on the CPU), planned when a run names it."""

from __future__ import annotations

import warnings

import pytest

from planner.config import TrainConfig
from planner.gpus import CPU_KERNELS, CUDA_KERNELS, get_gpu
from planner.optim import OPTIMIZERS, SEARCHED, Optimizer


def test_the_fused_adamw_is_the_searched_one_and_first():
    fused, plain = OPTIMIZERS["adamw_fused"], OPTIMIZERS["adamw"]
    assert fused.hf_optim == "adamw_torch_fused" and plain.hf_optim == "adamw_torch"
    assert SEARCHED[0] is Optimizer.ADAMW_FUSED and Optimizer.ADAMW not in SEARCHED
    # the same states: two moments like the parameter and a 4-byte step per tensor
    assert fused.memory.state_bytes([1000, 10], 4) == plain.memory.state_bytes([1000, 10], 4) == 8 * 1010 + 2 * 4


def test_step_temporaries_by_hand():
    counts = ((5000, 2), (100, 3))
    fused, plain = OPTIMIZERS["adamw_fused"].memory, OPTIMIZERS["adamw"].memory
    # the fused kernel updates in registers, on either device
    assert fused.step_transient(counts, 4, CUDA_KERNELS) == fused.step_transient(counts, 4, CPU_KERNELS) == 0
    # foreach (CUDA): torch._foreach_sqrt(exp_avg_sqs) copies every second moment: (2 x 5000 + 3 x 100) x 4 B
    assert plain.step_transient(counts, 4, CUDA_KERNELS) == 10_300 * 4 == 41_200
    # single tensor (CPU): two temporaries of the largest tensor
    assert plain.step_transient(counts, 2, CPU_KERNELS) == 2 * 5000 * 2 == 20_000


def test_update_traffic_by_hand():
    """Device bytes per trainable parameter of the update: the fused kernel's 7 passes (read param,
    grad, two moments; write three) against the foreach path's 20 (planner.kernels
    ADAMW_SINGLE_TENSOR_PASSES); fp32 weights under full bf16-mixed fine-tuning, w = 4."""
    from planner.throughput import _update_bytes_per_param

    a10g = get_gpu("a10g")
    fused = TrainConfig(method="full", precision="bf16-mixed", optimizer="adamw_fused")
    assert _update_bytes_per_param(fused, a10g) == 7 * 4 == 28
    assert _update_bytes_per_param(fused.replace(optimizer="adamw"), a10g) == 20 * 4 == 80


def test_deepspeed_builds_the_fused_kernel_and_offloads_to_its_cpu_adam():
    section = OPTIMIZERS["adamw_fused"].deepspeed_section
    on_device = section(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, offload=False)
    # DeepSpeed's torch_adam path passes the section's other keys to torch.optim.AdamW
    # (deepspeed runtime/engine.py get_optimizer_configuration pops only its own)
    assert on_device["params"]["torch_adam"] is True and on_device["params"]["fused"] is True
    offloaded = section(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, offload=True)
    assert "fused" not in offloaded["params"] and "torch_adam" not in offloaded["params"]  # DeepSpeedCPUAdam
    TrainConfig(optimizer="adamw_fused", zero=2, offload="optimizer")  # offloadable, as adamw


def test_emit_writes_what_the_trainer_builds_as_the_fused_adamw():
    import torch
    from transformers import Trainer, TrainingArguments

    from planner.emit.settings import training_arguments

    args = training_arguments(TrainConfig(method="lora", optimizer="adamw_fused"), on_cpu=True)
    assert args["optim"] == "adamw_torch_fused"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(**args))
    assert cls is torch.optim.AdamW and kwargs.get("fused") is True


def test_a_trainer_config_naming_the_fused_adamw_reads_as_it():
    from planner.check.reading import _optimizers

    names = _optimizers()
    assert names["adamw_torch_fused"] == "adamw_fused" and names["adamw_torch"] == "adamw"




@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(),
    dict(precision="fp32"),
    dict(precision="bf16"),
    dict(method="lora"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "full-bf16-mixed")
def test_the_fused_adamw_measured_on_the_cpu_within_the_accuracy_bound(changes):
    """A real run of torch's fused AdamW on the CPU (torch supports ``fused=True`` there): the
    prediction within the CPU bench's bound (4 %, tests/integration/test_model_vs_measurement.py)."""
    from support.models import cpu_peak_error

    config = TrainConfig(**(dict(micro_batch=2, seq_len=64, precision="bf16-mixed", optimizer="adamw_fused") | changes))
    error, predicted, measured = cpu_peak_error(config)
    assert abs(error) <= 4, (config.label(), predicted, measured, error)
