"""The step's timeline against the moments' sums: at every mark the live bytes are exactly what
``planner.memory.step.MOMENTS`` lists, no point between marks exceeds them, and the search's fast
path gives the same peak."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from planner.catalog import resolve_model, spec_from_config
from planner.config import Optimizer, TrainConfig
from planner.errors import PlannerError
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.overhead import with_workspaces
from planner.memory.parameters import trained
from planner.memory.states import static_terms
from planner.memory.step import PHASES, batch_terms, first_block_gradients, moment_breakdowns, static_sizes
from planner.memory.timeline import CATEGORIES, category, step_timeline
from planner.search import SearchSpace, enumerate_configs, totals_by_split

ACCURACY = Path(__file__).resolve().parents[2] / "bench" / "results" / "accuracy-cpu.json"
SMALL = {  # the accuracy bench's architectures at a glance: every block and attention variant
    "gpt2": dict(model_type="gpt2", n_embd=384, n_layer=4, n_head=6, vocab_size=50257, n_positions=1024),
    "bert": dict(model_type="bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=1024, vocab_size=30522, max_position_embeddings=512),
    "phi3": dict(model_type="phi3", hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=6, vocab_size=32064, max_position_embeddings=1024,
                 tie_word_embeddings=False),
}


def _models():
    models = [resolve_model(name) for name in ("meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-1.5B", "mistralai/Mixtral-8x7B-v0.1",
                                               "t5-large")]
    return models + [spec_from_config(cfg, model_id=f"small/{arch}", source="test") for arch, cfg in SMALL.items()]


def _configs(model, gpu, rng: random.Random, n: int) -> list[TrainConfig]:
    configs = list(enumerate_configs(model=model, gpu=gpu, target_batch=8, seq_len=min(512, model.max_seq_len), gpus=2,
                                     space=SearchSpace(cpu_mem_bytes=1 << 40)))
    configs += [c.replace(attention="eager") for c in configs[::5]]
    configs += [c.replace(gpus=1) for c in configs[::3]]
    return rng.sample(configs, min(n, len(configs)))


def _cases():
    rng = random.Random(9)
    for gpu_name in ("a10g", "cpu"):
        gpu = get_gpu(gpu_name)
        for model in _models():
            for config in _configs(model, gpu, rng, 40):
                yield pytest.param(model, gpu, config, id=f"{gpu_name}-{model.id}-{config.label()}")


@pytest.mark.parametrize("model, gpu, config", list(_cases()))
def test_every_mark_holds_exactly_what_the_moment_lists(model, gpu, config):
    kernels = gpu.kernels
    t = trained(model, config)
    static = static_terms(model, config, kernels, t)
    head_grads, down_grads = first_block_gradients(model, config, static.gradients, t)
    sizes = static_sizes(static, accumulating=config.grad_accum > 1, head_grads=head_grads, down_grads=down_grads)
    moments = moment_breakdowns(static.resident, sizes, batch_terms(model, config, kernels), config.sharding.spec)
    timeline = step_timeline(model=model, config=config, kernels=kernels)
    for name in PHASES:
        assert timeline.live_at(timeline.marks[name]) == moments[name], name
    totals = {name: sum(parts.values()) for name, parts in moments.items()}
    assert max(timeline.curve()) == max(totals.values()) == timeline.peak
    assert timeline.peak_phase == max(totals, key=lambda k: totals[k])
    estimate = estimate_memory(model=model, config=config, gpu=gpu)
    # on a CUDA device the estimate adds the cuBLAS workspaces (planner/memory/overhead.py)
    shown = with_workspaces(timeline, gpu)
    assert (estimate.peak_allocated_bytes, estimate.peak_phase, dict(estimate.breakdown)) == (
        shown.peak, shown.peak_phase, shown.breakdown())
    # the search's fast path: on the cpu profile the process total is the allocated peak
    if gpu.is_cpu:
        [(total, host)] = totals_by_split(model=model, config=config, gpu=gpu, splits=[(config.micro_batch, config.grad_accum)])
        assert (total, host) == (estimate.peak_allocated_bytes, estimate.cpu_bytes)


@pytest.mark.parametrize("model, gpu, config", list(_cases())[::4])
def test_a_timeline_made_with_an_optimizer_twins_activations_is_the_one_made_alone(model, gpu, config):
    """``step_timeline(shared=...)`` takes the activations of a timeline made before whose
    configuration differs in the optimizer only (``_BUT_OPTIMIZER``): none of their terms reads it,
    so every event, mark and fork is the timeline's made from scratch."""
    twins = []
    for optimizer in Optimizer:
        try:
            twins.append(config.replace(optimizer=optimizer))
        except PlannerError:
            continue  # (an optimizer the sharding scheme refuses)
    shared: dict = {}
    for twin in twins:
        assert step_timeline(model=model, config=twin, kernels=gpu.kernels, shared=shared) == step_timeline(
            model=model, config=twin, kernels=gpu.kernels)
    assert len(shared) == 1


def test_the_accuracy_rows_read_from_the_timeline_are_unchanged():
    """Every stored CPU accuracy row re-predicted from its configuration: the same bytes, moment
    and breakdown as when it was measured."""
    archs = {
        "llama": dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    }
    known = set(TrainConfig().to_dict())
    rows = [r for r in json.loads(ACCURACY.read_text())
            if r["arch"] in archs and r["predicted_bytes"] and set(r["config_dict"]) <= known]
    assert rows
    for row in rows:
        spec = spec_from_config(archs[row["arch"]], model_id=f"bench/{row['arch']}", source="bench")
        est = estimate_memory(model=spec, config=TrainConfig.from_dict(row["config_dict"]), gpu=get_gpu("cpu"))
        assert (est.peak_allocated_bytes, est.peak_phase, dict(est.breakdown)) == (
            row["predicted_bytes"], row["predicted_phase"], row["predicted_breakdown"]), row["config"]


def test_the_timeline_walks_the_step_block_by_block():
    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    config = TrainConfig(method="lora", micro_batch=2, seq_len=1024, grad_accum=4, grad_ckpt=True)
    timeline = step_timeline(model=model, config=config, kernels=gpu.kernels)
    wheres = [ev.where for ev in timeline.events]
    for k in (1, 32):
        assert f"micro-step 1: forward block {k}" in wheres and f"micro-step 4: backward block {k}" in wheres
    assert "micro-step 4: end of backward" in wheres and "optimizer step" in wheres
    assert any(ev.key == "activations/recompute" for ev in timeline.events)
    # what is allocated in the step is freed in it: the model states remain (the optimizer's
    # made in the run's first step, torch's lazy state initialization)
    curve = timeline.curve()
    resident = sum(ev.nbytes for ev in timeline.events if ev.where == "model states" or ev.key == "optimizer_states")
    assert "step 1: optimizer step" in wheres and wheres.index("step 1: optimizer step") < timeline.start
    assert curve[-1] == resident
    assert list(timeline.marks) == list(PHASES)
    assert {category(ev.key) for ev in timeline.events} <= set(CATEGORIES)


def test_the_moments_sums_are_the_sums_of_what_each_moment_lists():
    """``static_moments`` and ``batch_moments`` (the search's fast path) and ``moment_breakdowns``
    are read from the one table ``MOMENTS``. Distinct powers of two for every size make any size
    missing, doubled or expanded at the wrong moment change a sum; every size is read at some
    moment, and every moment's transient parts are among its parts."""
    from planner.memory.step import (
        MOMENTS,
        BatchSizes,
        BatchTerms,
        StaticSizes,
        batch_moments,
        moment_breakdowns,
        static_moments,
    )

    static_names = list(StaticSizes._fields)
    static = StaticSizes(**{name: 1 << (20 + i) for i, name in enumerate(static_names)})
    batch = BatchTerms(activations={"activations/a": 1 << 1, "activations/b": 1 << 2}, recompute=1 << 3,
                       forward_logits=1 << 4, backward_logits=1 << 5, kv_cache=1 << 6, kept=1 << 7,
                       head={"activations/b": 1 << 2}, after_head={"activations/a": 1 << 1},
                       block_backward={"activations/a": 1 << 8, "activations/c": 1 << 9},
                       recompute_end={"activations/d": 1 << 10})
    listed = moment_breakdowns({"weights": 1 << 40}, static, batch)
    sums = [a + b + (1 << 40) for a, b in zip(static_moments(static), batch_moments(batch.sizes()))]
    assert sums == [sum(parts.values()) for parts in listed.values()]
    read = {part.size for moment in MOMENTS for part in moment.parts}
    assert read == set(static_names) | set(BatchSizes._fields)
    assert listed["first_block_backward"]["activations/a"] == (1 << 1) + (1 << 8)
    assert "activations/b" not in listed["first_block_recompute"]


def test_events_are_immutable_and_only_computed_tensor_counts_are_clamped():
    """The builder's grain: a term's tensor count is its bytes over one token-hidden tensor, kept
    within 1..64; counts or sizes given (the weights: one tensor per parameter, of its size) are
    kept as given."""
    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    config = TrainConfig(method="lora", micro_batch=2, seq_len=1024, grad_accum=2)
    timeline = step_timeline(model=model, config=config, kernels=gpu.kernels)
    weights = next(ev for ev in timeline.events if ev.key == "weights")
    assert len(weights.tensors) == model.num_layers * (len(model.layer_linears) + 2) + 3 > 64
    assert all(1 <= ev.tensors <= 64 for ev in timeline.events
               if ev.where != "model states" and not isinstance(ev.tensors, tuple))
    # tensors given by size (gradients, the loss path's logits-sized tensors) sum to the event's bytes
    sized = [ev for ev in timeline.events if isinstance(ev.tensors, tuple)]
    assert sized and all(sum(ev.tensors) == ev.nbytes and min(ev.tensors) > 0 for ev in sized)
    with pytest.raises(AttributeError):
        weights.nbytes = 0
    assert timeline.curve() == [0, *itertools.accumulate(ev.nbytes if ev.op == "alloc" else -ev.nbytes
                                                         for ev in timeline.events)]
