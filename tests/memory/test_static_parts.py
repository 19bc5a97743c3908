"""``step.static_sizes`` and ``step.static_parts``, both made from ``step._SIZE_OF``: the sizes by hand,
and the search's parts (each moment's static part plus the resident states, not accumulating and
accumulating) equal to ``static_moments`` of ``static_sizes`` for the static terms of every scheme."""

from __future__ import annotations

import itertools

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.errors import PlannerError
from planner.gpus import get_gpu
from planner.memory.parameters import trained
from planner.memory.states import StaticTerms, static_terms
from planner.memory.step import (
    StaticSizes,
    first_block_gradients,
    first_block_params,
    static_moments,
    static_parts,
    static_sizes,
)


def _terms(**fields) -> StaticTerms:
    """Static terms whose every number is its own power of two (a sum tells which fields it holds)."""
    numbers = {name: 1 << (10 + i) for i, name in enumerate(StaticTerms._fields)
               if name not in ("resident", "step_checks")}
    return StaticTerms(**{"resident": {"weights": 1}, "step_checks": (), **numbers, **fields})


def test_the_sizes_by_hand():
    s = _terms()
    single = static_sizes(s, accumulating=False, head_grads=3, down_grads=5)
    assert single == StaticSizes(
        gradients=s.gradients, gradients_forward=0, gradients_head=3, gradients_block=8, gathered=s.gathered,
        held=s.held, reducing=s.reducing, reducing_end=s.reducing_end, tied_partials=s.tied_gradient_sum,
        gradient_flatten=s.zero_gradient_flatten, optimizer_gradients=s.optimizer_gradients,
        optimizer_step=s.optimizer_step)
    every = static_sizes(s, accumulating=True, head_grads=3, down_grads=5)
    assert (every.gradients_forward, every.gradients_head, every.gradients_block) == (s.gradients,) * 3
    # the largest of the step's checks stands for the flatten where it is larger
    checked = _terms(step_checks=(("zero3/norm_copy", 7), ("other", 1 << 40)))
    assert static_sizes(checked, accumulating=False).gradient_flatten == 1 << 40
    assert static_sizes(_terms(step_checks=(("zero3/norm_copy", 7),)), accumulating=True).gradient_flatten == \
        checked.zero_gradient_flatten


def _expected(s: StaticTerms, resident: int, head: int, down: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    single = static_moments(static_sizes(s, accumulating=False, head_grads=head, down_grads=down))
    every = static_moments(static_sizes(s, accumulating=True))
    return tuple(resident + m for m in single), tuple(resident + m for m in every)


def test_the_parts_of_synthetic_terms():
    for checks in ((), (("zero3/norm_copy", 1 << 40),)):
        s = _terms(step_checks=checks)
        assert static_parts(s, 1 << 50, 3, 5) == _expected(s, 1 << 50, 3, 5)
    # the first moment by hand: the earlier micro-steps' gradients (none when not accumulating), the
    # gathered and held parameters, on the resident states
    s = _terms()
    single, every = static_parts(s, 7, 3, 5)
    assert single[0] == 7 + s.gathered + s.held and every[0] == 7 + s.gradients + s.gathered + s.held


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-2-7b-hf", "gpt2"])
def test_the_parts_of_every_scheme(model_id):
    model = resolve_model(model_id)
    checked = 0
    methods = [dict(method="full"), dict(method="lora", lora_r=8), dict(method="qlora", lora_r=16)]
    shardings = [{}, {"zero": 1}, {"zero": 2}, {"zero": 3}, {"zero": 3, "offload": "optimizer+params"},
                 {"zero": 2, "offload": "optimizer"}, {"sharding": "fsdp2"}]
    for method, sharding, gpus, optimizer, gpu in itertools.product(
            methods, shardings, (1, 2), ("adamw", "paged_adamw_8bit", "adafactor"), ("a10g", "cpu")):
        try:
            config = TrainConfig(precision="bf16-mixed", gpus=gpus, optimizer=optimizer, **method, **sharding)
        except PlannerError:
            continue
        t = trained(model, config)
        s = static_terms(model, config, get_gpu(gpu).kernels, t)
        head, down = first_block_gradients(model, config, s.gradients, t, first_block_params(model, config, t))
        assert static_parts(s, s.resident_bytes, head, down) == _expected(s, s.resident_bytes, head, down), \
            (config.label(), gpu)
        checked += 1
    assert checked > 50
