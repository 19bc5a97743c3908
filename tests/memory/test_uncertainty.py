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
            low, high = peak_interval(r["predicted"], spread(r["config"].method, guessed=bool(r["guessed"]), gpus=r["config"].gpus))
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
    """Full fine-tuning on one GPU: median 0.0335, q95 0.1906 (upper scale (0.1906 - 0.0335) / 1.6449
    = 0.095507), q05 -0.0156 (lower scale (0.0335 + 0.0156) / 1.6449 = 0.029850)."""
    s = spread("full")
    assert (s.q05, s.median, s.q95) == (-0.0156, 0.0335, 0.1906)
    cap = 24 * GiB
    # at the interval's upper end the probability is 5% exactly
    assert oom_probability(safe_total(cap, s), cap, s) == pytest.approx(NEAR_EDGE_PROBABILITY, abs=1e-6)
    # a prediction e^-0.0909 of the device: z = (0.0909 - 0.0335) / 0.095507 = 0.6010 -> 27.39%
    assert oom_probability(int(cap * math.exp(-0.0909)), cap, s) == pytest.approx(0.2739, abs=2e-4)
    # the prediction at the device: t = 0 < median: P(x > 0) = Phi(0.0335 / 0.029850) = Phi(1.1223) = 0.8691
    assert oom_probability(cap, cap, s) == pytest.approx(0.8691, abs=2e-4)
    # far below: nothing; past the device by far: certain
    assert oom_probability(cap // 4, cap, s) < 1e-6 and oom_probability(4 * cap, cap, s) > 1 - 1e-6
    low, high = peak_interval(10 * GiB, s)
    assert (low, high) == (int(10 * GiB * math.exp(-0.0156)), math.ceil(10 * GiB * math.exp(0.1906)))


def test_methods_with_few_rows_take_the_pooled_entry_and_guesses_widen():
    """The bench's rule, on rows made here: a method with fewer than MIN_ROWS rows of a kind takes
    the pooled entry's median and its interval widened to hold the method's own rows. Ten stated
    one-GPU rows, ln ratios 0.00002, 0.01002, ..., 0.09002 (8 full, then 2 LoRA): pooled q05 is the
    floor(0.45)-th, 0.00002, floored to 0.0; q95 the ceil(8.55)-th, 0.09002, ceiled to 0.0901; median
    0.04502 -> 0.045; full's own 8 (from two sources): q05 0.0, median 0.03502 -> 0.035, q95 the
    ceil(6.65)-th, 0.07002 -> 0.0701. LoRA's 2 rows lie inside the pooled interval, so its entry is the
    pooled one with its own count; so is full's when its 8 rows are one harness's. QLoRA's guessed rows spread wider than
    its stated ones on the shipped table."""
    from types import SimpleNamespace

    def row(method, x, source):
        return {"status": "scored", "guessed": [], "measured": math.exp(x), "predicted": 1.0, "source": source,
                "config": SimpleNamespace(method=method, gpus=1)}

    harnesses = {"a": {"url": "https://a"}, "b": {"url": "https://b"}, "b-rerun": {"url": "https://b"}}
    rows = [row("full" if i < 8 else "lora", i / 100 + 0.00002, "ab"[i % 2]) for i in range(10)]
    table = published.uncertainty_table(rows, harnesses)
    assert table[("all", False, False)] == (10, 0.0, 0.045, 0.0901)
    assert table[("lora", False, False)] == (2, 0.0, 0.045, 0.0901)
    assert table[("full", False, False)] == (8, 0.0, 0.035, 0.0701)
    # eight rows of one harness (a source and its re-run: one url) are pooled like two rows
    one = [row("full", i / 100 + 0.00002, ("b", "b-rerun")[i % 2]) for i in range(8)] + rows[8:]
    assert published.uncertainty_table(one, harnesses)[("full", False, False)] == (8, 0.0, 0.045, 0.0901)
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

    # 2 x 1346 tokens: 93% of the T4's memory, inside the LoRA interval [e^-0.0235, e^0.0944] x predicted
    args = ("estimate", "-m", "meta-llama/Llama-3.2-1B", "-g", "t4", "--method", "lora", "--micro-batch", "2",
            "--seq-len", "1346")
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


def test_a_plan_on_several_gpus_is_read_with_the_multi_gpu_runs_error():
    """One rank of a multi-GPU run has its own entry (the bench's rows of several GPUs, kept apart:
    their error is the sharding's too); a kind no published run measured (settings guessed, several
    GPUs) falls back to the one-GPU pooled entry, never to a narrower one of its method."""
    for method in ("full", "lora", "qlora"):
        own = MEMORY_ERROR[(method, False, True)]
        s = spread(method, gpus=2)
        assert (s.q05, s.median, s.q95) == own[1:]
        assert "one rank of several GPUs" in s.source
        assert spread(method, gpus=1) == spread(method)
        assert (spread(method).q05, spread(method).q95) == MEMORY_ERROR[(method, False, False)][1:4:2]
    assert ("all", True, True) not in MEMORY_ERROR
    guessed = spread("lora", guessed=True, gpus=8)
    assert (guessed.q05, guessed.median, guessed.q95) == MEMORY_ERROR[("all", True, False)][1:]


def test_the_multi_gpu_rows_are_wider_than_the_one_gpu_rows(scored):
    """Why the split: on the bench the ranks of multi-GPU runs have a longer upper tail of
    ln(measured / predicted) than the one-GPU runs whose settings are stated (the 95th percentile,
    what a plan's OOM probability reads: their nvidia-smi rows carry the FSDP1 replay's gaps), so
    pooling them would widen every one-GPU plan's interval for an error it does not have."""
    def q95(rows):
        xs = sorted(math.log(r["measured"] / r["predicted"]) for r in rows)
        return xs[math.ceil(0.95 * len(xs)) - 1]

    one = [r for r in scored if r["config"].gpus == 1 and not r["guessed"]]
    several = [r for r in scored if r["config"].gpus > 1]
    assert len(several) >= 8
    assert q95(several) > q95(one)
