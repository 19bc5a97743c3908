"""How sure a plan's memory is (issue 20, item 2): the interval and the probability of running out
of memory, from the model's error on the published GPU measurements (bench/published.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from planner.uncertainty import (
    CENTRAL,
    MEMORY_ERROR,
    NEAR_EDGE_PROBABILITY,
    Spread,
    oom_probability,
    peak_interval,
    safe_total,
    spread,
)
from planner.units import GiB

BENCH = Path(__file__).resolve().parents[2] / "bench" / "published.py"
_spec = importlib.util.spec_from_file_location("bench_published_uncertainty", BENCH)
published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(published)


@pytest.fixture(scope="module")
def scored():
    return [r for r in published.score_all(published.load()) if r["status"] == "scored"]


def test_the_stated_interval_covers_its_share_of_the_published_rows(scored):
    """On the published bench the 90% interval of each row's prediction (widened where its
    settings were guessed) holds the measured value in at least 90% of the rows, and so it does
    for the fully stated rows alone."""
    def covered(rows):
        hits = 0
        for r in rows:
            low, high = peak_interval(r["predicted"], spread(r["config"].method, guessed=bool(r["guessed"])))
            hits += low <= r["measured"] <= high
        return hits / len(rows)

    assert len(scored) >= 50
    assert covered(scored) >= CENTRAL
    assert covered([r for r in scored if not r["guessed"]]) >= CENTRAL


def test_the_shipped_table_is_the_bench_s(scored):
    """MEMORY_ERROR is what ``python bench/published.py --uncertainty`` prints: a change of the
    memory model or of the rows changes it, and the constant must be written anew."""
    table = published.uncertainty_table(scored)
    assert set(table) == set(MEMORY_ERROR)
    for key, (rows, q05, median, q95) in table.items():
        shipped = MEMORY_ERROR[key]
        assert shipped[0] == rows, key
        assert max(abs(a - b) for a, b in zip(shipped[1:], (q05, median, q95))) < 0.01, (
            f"{key}: the bench now gives {(rows, q05, median, q95)}; write planner/uncertainty.py MEMORY_ERROR anew "
            "from python bench/published.py --uncertainty")


def test_probability_by_hand():
    """Full fine-tuning: median 0.0125, q95 0.1419 (upper scale (0.1419 - 0.0125) / 1.6449 =
    0.078670), q05 -0.1889 (lower scale (0.0125 + 0.1889) / 1.6449 = 0.122443)."""
    s = spread("full")
    assert (s.q05, s.median, s.q95) == (-0.1889, 0.0125, 0.1419)
    cap = 24 * GiB
    # at the interval's upper end the probability is 5% exactly
    assert oom_probability(safe_total(cap, s), cap, s) == pytest.approx(NEAR_EDGE_PROBABILITY, abs=1e-6)
    # a prediction e^-0.0909 of the device: z = (0.0909 - 0.0125) / 0.078670 = 0.9966 -> 15.95%
    assert oom_probability(int(cap * math.exp(-0.0909)), cap, s) == pytest.approx(0.1595, abs=2e-4)
    # the prediction at the device: t = 0 < median: P(x > 0) = Phi(0.0125 / 0.122443) = Phi(0.1021) = 0.5407
    assert oom_probability(cap, cap, s) == pytest.approx(0.5407, abs=2e-4)
    # far below: nothing; past the device by far: certain
    assert oom_probability(cap // 4, cap, s) < 1e-6 and oom_probability(4 * cap, cap, s) > 1 - 1e-6
    low, high = peak_interval(10 * GiB, s)
    assert (low, high) == (int(10 * GiB * math.exp(-0.1889)), math.ceil(10 * GiB * math.exp(0.1419)))


def test_methods_with_few_rows_take_the_pooled_entry_and_guesses_widen():
    """LoRA has 4 fully stated rows: the pooled median and interval, widened to hold its rows (all
    within the pooled 0.2355 since the replay places each tensor at its size); QLoRA's guessed rows
    spread wider than its stated ones."""
    lora, pooled = spread("lora"), spread("all")
    assert (lora.q05, lora.median, lora.q95) == (pooled.q05, pooled.median, pooled.q95) == (-0.1305, 0.0339, 0.2355)
    stated, guessed = spread("qlora"), spread("qlora", guessed=True)
    assert guessed.q95 - guessed.q05 > stated.q95 - stated.q05


def test_a_device_calibration_narrows_the_spread():
    runs = [0.01, -0.01, 0.02, 0.0, 0.015, -0.005, 0.01, 0.005]
    own = Spread.from_residuals(runs, "8 runs on this device")
    assert own is not None and (own.q05, own.q95) == (-0.01, 0.02)
    assert spread("full", calibrated=own) is own
    assert Spread.from_residuals(runs[:7], "too few") is None
    wide = Spread(-1.0, 0.0, 1.0, "wide")
    assert spread("full", calibrated=wide) != wide


def test_the_store_keeps_the_probability_and_the_interval(cli):
    """A stored plan answers with the oom_probability and the interval it was planned with (the
    memory payload carries them; no migration: it is JSON)."""
    import json
    import re

    r = cli("suggest", "-m", "Qwen/Qwen2.5-0.5B", "-g", "a10g", "-b", "32")
    assert r.code == 0, r
    plan_id = re.search(r"plan id: (\S+)", r.out).group(1)
    shown = cli("show", plan_id, "--json")
    assert shown.code == 0, shown
    text = json.dumps(json.loads(shown.out))
    assert '"oom_probability": 0.' in text or '"oom_probability": 1' in text
    assert '"peak_interval_bytes": [' in text


def test_estimate_states_the_probability_and_the_interval(cli):
    """``planner estimate`` gives the interval and the OOM risk as suggest does: in --json (the
    memory's peak_interval_bytes, oom_probability and near_edge) and in one text line."""
    import json

    from planner.gpus import get_gpu

    args = ("estimate", "-m", "meta-llama/Llama-3.2-1B", "-g", "t4", "--method", "lora")
    r = cli(*args, "--json")
    assert r.code == 0, r
    d = json.loads(r.out)
    total, capacity = d["memory"]["process_total_bytes"], get_gpu("t4").memory_bytes
    assert d["device"]["capacity_bytes"] == capacity
    expected = oom_probability(total, capacity, spread("lora"))
    assert d["oom_probability"] == pytest.approx(expected) and d["memory"]["oom_probability"] == d["oom_probability"]
    assert 0.05 < expected < 0.95  # this one sits inside its interval: a case where the number matters
    assert d["near_edge"] is True
    assert d["memory"]["peak_interval_bytes"] == list(peak_interval(total, spread("lora")))
    text = cli(*args)
    assert text.code == 0, text
    assert f"OOM risk {expected:.1%}, near the edge (over 5%)" in text.out
    # a plan far from the edge: a small risk, not near the edge, the same line without the warning
    small = json.loads(cli("estimate", "-m", "gpt2", "-g", "a100-80gb", "--json").out)
    assert small["oom_probability"] < 0.001 and small["near_edge"] is False
    low, high = small["memory"]["peak_interval_bytes"]
    assert low < small["memory"]["process_total_bytes"] < high
