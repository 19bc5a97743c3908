"""FSDP1's rate limiter as a bounded-lead host/device timeline (planner/sharding/fsdp1_host.py) and the share
of QLoRA's Linear4bit host time it exposes (planner/sharding/fsdp1.py ``linear4bit_exposed_seconds``)."""

from __future__ import annotations

from functools import partial

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.sharding.fsdp1 import (
    LINEAR4BIT_HOST_SECONDS,
    SPECS,
    UNSHARD_HOST_SECONDS,
    linear4bit_exposed_seconds,
)
from planner.sharding.fsdp1_host import Hooks, Timeline, exposed_seconds
from planner.throughput import fsdp1_decoder_layer

MISTRAL, LLAMA70 = "mistralai/Mistral-7B-v0.1", "meta-llama/Llama-2-70b-hf"
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
NO_HOOKS = Hooks(before_wait=0.0, after_wait=0.0, post_forward=0.0, post_backward=0.0)


def _layer_of(model, config, gpu):
    """What the throughput model hands FSDP1: its decoder layer on ``gpu`` by the base calls' host seconds."""
    return partial(fsdp1_decoder_layer, model, config, gpu)


def _fms(method: str = "qlora", **changes) -> TrainConfig:
    """fms-acceleration's 2-GPU runs: FSDP1 on A100s, LoRA r16 on q, k, v, o, 4096 tokens, transformers 4's
    reentrant checkpoint around each layer; QLoRA at fp16-mixed with 16-bit adapters (no k-bit upcast)."""
    qlora = {"precision": "fp16-mixed", "kbit_upcast": False} if method == "qlora" else {"precision": "fp16"}
    return TrainConfig(**({"method": method, "gpus": 2, "sharding": "fsdp1", "micro_batch": 2, "seq_len": 4096,
                           "grad_ckpt": True, "reentrant_ckpt": True, "attention": "flash", "lora_r": 16,
                           "lora_targets": QKVO} | qlora | changes))


def test_an_unshard_waits_for_the_free_two_frees_back_not_the_last():
    t = Timeline()
    t.run(0.0, 1.0)  # a kernel until t = 1
    t.reshard(0.0)  # free A, passed at 1
    t.run(0.0, 1.0)  # until 2
    t.reshard(0.0)  # free B, passed at 2
    t.unshard(NO_HOOKS)  # two queued: pops A and waits until 1, not B's 2
    assert t.host == 1.0
    t.unshard(NO_HOOKS)  # one left: no wait
    assert t.host == 1.0
    t.run(0.5, 0.1)  # launched at 1.5, queued behind the kernel running until 2
    assert (t.tail, t.exposed) == (2.1, 0.0)


def test_host_work_after_the_wait_beyond_the_queue_behind_the_free_is_exposed():
    t = Timeline()
    for _ in range(2):
        t.run(0.0, 1.0)
        t.reshard(0.0)  # frees at 1 and 2
    t.unshard(Hooks(before_wait=0.0, after_wait=0.3, post_forward=0.0, post_backward=0.0))
    # waits until 1, then 0.3 of hooks; 1.5 more of host (a Linear4bit's Python, say) before its kernel:
    # launched at 2.8 while the device ran out at 2, so 0.8 of the device's time waits for the host
    t.run(1.5, 0.1)
    assert t.tail == pytest.approx(2.9) and t.exposed == pytest.approx(0.8)


def test_a_call_behind_a_deep_queue_is_hidden():
    t = Timeline()
    t.run(0.0, 10.0)  # the MLP's GEMMs
    t.reshard(0.0)
    t.run(0.0, 1.0)
    t.reshard(0.0)
    t.unshard(NO_HOOKS)  # waits until 10; 1 of device work is still queued behind it
    t.run(0.9, 0.1)  # 0.9 of host hides behind it
    assert t.exposed == pytest.approx(0.0)


def test_the_4bit_calls_it_exposes_are_a_share_of_theirs_falling_with_the_batch():
    model, gpu = resolve_model(MISTRAL), get_gpu("a100-80gb")
    # every Linear4bit call's host time: 32 layers x 7 bases x (forward + recompute + backward):
    # 32 x 7 x (2 x 340 + 244) us = 0.207 s
    every = model.num_layers * 7 * (2 * LINEAR4BIT_HOST_SECONDS[0] + LINEAR4BIT_HOST_SECONDS[1])
    assert every == pytest.approx(0.207, abs=1e-3)
    configs = {mb: _fms(micro_batch=mb) for mb in (1, 2, 4, 8)}
    exposed = {mb: linear4bit_exposed_seconds(model, c, _layer_of(model, c, gpu)) for mb, c in configs.items()}
    # micro-batch 2: which calls the timeline exposes, read off it one call at a time: v_proj's forward in
    # the forward and the recompute (k_proj's GEMM, ~0.25 ms, is all the device holds behind q.lora_A's
    # free when k.lora_A waits on it; two adapter units' hooks, ~1.1 ms, follow before v_proj's kernels),
    # q_proj's and k_proj's forward once, their backward once: 4 x 340 + 2 x 244 us = 1.85 ms a layer,
    # x 32 = 0.059 s, 29% of all the calls' host time
    assert exposed[2] == pytest.approx(32 * (4 * 340e-6 + 2 * 244e-6), rel=0.02)
    # a longer micro-batch queues longer k/v GEMMs behind each free: less of it shows, none at 8
    assert exposed[1] > exposed[2] > exposed[4] > exposed[8] == pytest.approx(0.0, abs=1e-3)


def test_it_is_what_the_timeline_adds_for_the_4bit_calls_alone():
    model, gpu = resolve_model(LLAMA70), get_gpu("a100-80gb")
    config = _fms()
    four = fsdp1_decoder_layer(model, config, gpu, base_host=LINEAR4BIT_HOST_SECONDS)
    bare = fsdp1_decoder_layer(model, config, gpu, base_host=(0.0, 0.0))
    assert four.linears[0][2:] == LINEAR4BIT_HOST_SECONDS and bare.linears[0][2:] == (0.0, 0.0)
    assert four.linears[0][:2] == bare.linears[0][:2]  # the same device work
    from planner.sharding.fsdp1 import UNIT_HOOKS

    extra = (exposed_seconds(four, UNIT_HOOKS, layers=80, recompute=True)
             - exposed_seconds(bare, UNIT_HOOKS, layers=80, recompute=True))
    assert linear4bit_exposed_seconds(model, config, _layer_of(model, config, gpu)) == pytest.approx(extra) and extra > 0


@pytest.mark.parametrize("changes", [{"method": "lora"}, {"gpus": 1, "sharding": "none"}])
def test_lora_and_one_gpu_expose_no_4bit_calls(changes):
    model, gpu = resolve_model(MISTRAL), get_gpu("a100-80gb")
    config = _fms(**changes) if changes.get("gpus") == 1 else _fms("lora")
    assert linear4bit_exposed_seconds(model, config, _layer_of(model, config, gpu)) == 0.0
    assert linear4bit_exposed_seconds(model, _fms(), None) == 0.0  # no device given: nothing but the hooks


def test_host_seconds_adds_them_per_micro_step_only_given_the_gpu():
    model, gpu = resolve_model(MISTRAL), get_gpu("a100-80gb")
    fsdp1 = SPECS[0]
    config = _fms(grad_accum=2)
    hooks = 256 * 3 * UNSHARD_HOST_SECONDS * 2  # 256 adapter units x 3 unshards x 2 micro-steps
    assert fsdp1.host_seconds(model, config, adapted_modules=128) == pytest.approx(hooks)
    assert fsdp1.host_seconds(model, config, adapted_modules=128, layer_of=_layer_of(model, config, gpu)) == pytest.approx(
        hooks + 2 * linear4bit_exposed_seconds(model, config, _layer_of(model, config, gpu)))
    lora = _fms("lora", grad_accum=2)
    assert fsdp1.host_seconds(model, lora, adapted_modules=128, layer_of=_layer_of(model, lora, gpu)) == pytest.approx(hooks)
