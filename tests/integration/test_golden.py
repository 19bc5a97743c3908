"""The golden ``suggest`` dump: every answer of about a thousand planning requests, held byte for byte.

A restructure keeps every answer identical; a change to the memory model, the throughput model or
the ranking changes ``tests/data/golden_suggest.jsonl.gz`` on purpose, rewritten with
``python bench/golden.py --write`` in the same commit, whose message says why the answers moved.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "golden.py"


def _golden():
    spec = importlib.util.spec_from_file_location("bench_golden", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_answer_of_the_golden_dump_is_unchanged():
    golden = _golden()
    stored = golden.read_stored()
    # the same answers in request order, computed by one fresh process per core (2 on CI)
    current = golden.sharded_lines(min(2, os.cpu_count() or 1))
    report = golden.differences(stored, current)
    assert not report, "\n".join(["the planner's answers changed (python bench/golden.py --check):", *report])


def test_the_dump_covers_what_it_claims():
    """About a thousand requests, with plans, nothing-fits answers and refusals among them, over
    every space, GPU and model of the grid (a dump that shrank would hold the planner to less)."""
    golden = _golden()
    stored = [json.loads(line) for line in golden.read_stored()]
    assert len(stored) >= 900
    outcomes = {d["outcome"] for d in stored}
    assert outcomes == {"planned", "nothing-fits", "refused"}
    assert {d["request"]["space"] for d in stored} == {*golden.SPACES, "edge"}
    assert {d["request"]["gpu"] for d in stored} >= set(golden.GPUS)
    assert {d["request"]["model"] for d in stored} >= set(golden.MODELS)
    assert sum(d["outcome"] == "planned" for d in stored) >= 500
    assert [d["n"] for d in stored] == list(range(len(stored)))
