"""``step.batch_line`` is the two-call definition the search's memo used: ``batch_totals`` at
micro-batch 1, and at 2 less that, each at ``config.with_split(micro_batch=b, grad_accum=...)``."""

from __future__ import annotations

import dataclasses
import itertools
from operator import sub

import pytest

from planner.catalog import resolve_model
from planner.config import ALL_LINEAR, TrainConfig
from planner.errors import PlannerError
from planner.gpus import get_gpu
from planner.memory.parameters import trained
from planner.memory.step import batch_line, batch_line_pair, batch_totals

MODELS = ["meta-llama/Llama-2-7b-hf", "gpt2", "t5-large", "mistralai/Mixtral-8x7B-v0.1", "microsoft/phi-2",
          "Qwen/Qwen3-Next-80B-A3B-Thinking", "bert-base-uncased", "facebook/opt-1.3b",
          "microsoft/Phi-3-mini-4k-instruct", "google/gemma-2-9b"]

#: (method, precision, extra fields): every method and precision, ZeRO's 16-bit model among them
RECIPES = [
    ("full", "bf16-mixed", {}), ("full", "fp32", {}), ("full", "fp16", {}), ("full", "bf16-mixed", {"zero": 2}),
    ("lora", "bf16-mixed", {}), ("lora", "bf16", {}), ("lora", "fp32", {}), ("lora", "fp16-mixed", {"zero": 3, "gpus": 2}),
    ("qlora", "bf16-mixed", {}), ("qlora", "fp32", {}), ("qlora", "bf16", {}),
]
#: the recipe settings the per-micro-batch terms read
SETTINGS = [
    {}, {"loop": "manual"}, {"fused_ce": True}, {"packing": False}, {"use_cache": True},
    {"loop": "manual", "use_cache": True, "packing": False}, {"fused_ce": True, "loop": "manual"},
    {"attention": "eager", "packing": False}, {"attention": "flash"}, {"loss_upcast": False, "loop": "manual"},
]


def _configs(model):
    """Every recipe and setting, with and without checkpointing, at a micro-batch and accumulation
    other than the line's, LoRA at two ranks on every linear, on one linear and on the attention
    projections, with and without adapter dropout."""
    from planner.search import attention_targets

    for (method, precision, extra), settings, ckpt in itertools.product(RECIPES, SETTINGS, (False, True)):
        adapters = [{}]
        if method != "full":
            first = model.linear_names()[0]
            adapters = [{"lora_r": r, "lora_targets": targets, "lora_dropout": dropout}
                        for r, targets, dropout in itertools.product(
                            (8, 64), [(ALL_LINEAR,), (first,), attention_targets(model)], (0.0, 0.1))]
        for lora in adapters:
            try:
                yield TrainConfig(method=method, precision=precision, micro_batch=3, grad_accum=4, grad_ckpt=ckpt,
                                  seq_len=min(384, model.max_seq_len), **extra, **settings, **lora)
            except PlannerError:
                continue


def _models():
    models = [resolve_model(m) for m in MODELS]
    return models + [dataclasses.replace(models[0], num_layers=1, id="llama-one-block")]


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.id)
def test_batch_line_is_the_totals_at_one_and_the_increase_to_two(model):
    checked = 0
    for config in _configs(model):
        targets = trained(model, config).target_names
        for gpu in ("a10g", "cpu"):
            kernels = get_gpu(gpu).kernels
            one, two = (batch_totals(model, config.with_split(micro_batch=b, grad_accum=config.grad_accum), kernels,
                                     targets) for b in (1, 2))
            assert batch_line(model, config, kernels, targets) == (one, tuple(map(sub, two, one))), (config.label(), gpu)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.id)
def test_batch_line_pair_is_the_line_without_and_with_checkpointing(model):
    """``step.batch_line_pair`` shares a later block's terms between the two lines: each is still
    ``batch_line`` of its configuration."""
    checked = 0
    for config in _configs(model):
        if config.grad_ckpt:
            continue
        ckpt = config.with_split(micro_batch=config.micro_batch, grad_accum=config.grad_accum, grad_ckpt=True)
        targets = trained(model, config).target_names
        for gpu in ("a10g", "cpu"):
            kernels = get_gpu(gpu).kernels
            lines = batch_line(model, config, kernels, targets), batch_line(model, ckpt, kernels, targets)
            assert batch_line_pair(model, config, kernels, targets) == lines, (config.label(), gpu)
            checked += 1
    assert checked > 50
