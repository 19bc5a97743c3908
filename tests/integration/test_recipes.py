"""The published-recipes bench (issue 20, item 6): every row is sourced, its request and its own
configuration resolve through the planner's code, and the planner's #1 fits.

Structural claims only, offline: the verdicts' figures are the bench's (bench/results/recipes.md).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from planner.uncertainty import NEAR_EDGE_PROBABILITY

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "bench" / "recipes.py")
recipes = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = recipes  # dataclasses look their module up there
_spec.loader.exec_module(recipes)


@pytest.fixture(scope="module")
def rows():
    return [recipes.evaluate(r) for r in recipes.RECIPES]


def test_at_least_twenty_sourced_recipes():
    assert len(recipes.RECIPES) >= 20
    assert len({r.name for r in recipes.RECIPES}) == len(recipes.RECIPES)
    for r in recipes.RECIPES:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", r.repo), r.name
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit), r.name
        assert r.path and r.quote and r.gpu and r.model, r.name
        # the global batch is the recipe's own product, and the request carries it
        assert r.request().target_batch == r.micro_batch * r.grad_accum * r.gpus


def test_requests_resolve_and_top_plan_fits(rows):
    usable_of = {}
    for row in rows:
        rc = row.recipe
        assert row.recipe_peak > 0 and row.recipe_speed > 0, rc.name
        assert 0.0 <= row.recipe_risk <= 1.0, rc.name
        if row.top is None:
            # nothing fits: the bench says so with the planner's own advice
            assert row.verdict.startswith("no plan: nothing fits"), (rc.name, row.verdict)
            continue
        from planner.estimation import resolve
        from planner.search import safety_margin

        _, gpu = resolve(model=rc.model, gpu=rc.gpu)
        usable = usable_of.setdefault(rc.gpu, gpu.memory_bytes - safety_margin(gpu.memory_bytes))
        assert row.top.memory.process_total_bytes <= usable, rc.name
        assert row.top.memory.oom_probability is not None and row.top.memory.peak_interval_bytes is not None
        assert row.top.config.method.value == rc.method, rc.name
        assert row.top.config.micro_batch * row.top.config.grad_accum * row.top.config.gpus == rc.target_batch
        # #1 is near the edge only when the verdict says so
        assert (row.top_risk > NEAR_EDGE_PROBABILITY) == ("near the edge" in row.verdict.split(":")[0]), rc.name
    # most recipes get a plan that is safe and at least as fast (the report names the others)
    assert sum(row.verdict.startswith("ok") for row in rows) >= len(rows) // 2


def test_report_lists_every_recipe(rows):
    text = recipes.render(rows)
    for i, r in enumerate(recipes.RECIPES, 1):
        assert f"| {i} | {r.name} |" in text
        assert r.commit in text
