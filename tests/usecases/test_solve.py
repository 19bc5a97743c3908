"""planner.solve: the longest sequence and the largest micro-batch one configuration fits.

The answer is checked against the full estimate itself at the value and one past it (the
definition), on a catalog model and GPU, and the bisection against a predicate known by hand."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.search import safety_margin
from planner.solve import MAX_MICRO_BATCH, _largest, largest_micro_batch, longest_seq_len
from planner.tradeoffs import near_edge


@pytest.mark.parametrize("edge, limit, expected", [(0, 10, 0), (1, 10, 1), (7, 10, 7), (10, 10, 10), (64, 100, 64),
                                                   (65, 100, 65), (1000, 100, 100), (5, 0, 0)])
def test_largest_finds_the_edge_of_a_predicate_counted_by_hand(edge, limit, expected):
    asked = []

    def ok(v):
        asked.append(v)
        assert 1 <= v <= limit  # never past the limit
        return v <= edge

    assert _largest(ok, limit) == expected
    assert len(asked) <= 2 * max(limit, 1).bit_length() + 2  # doubling then bisection


@pytest.fixture(scope="module")
def llama():
    return resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")


def _total(spec, gpu, config):
    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    return estimate_memory(model=spec, config=config, gpu=gpu, budget=usable).process_total_bytes, usable


def test_the_longest_sequence_fits_and_one_more_token_does_not(llama):
    spec, gpu = llama
    config = TrainConfig(method="qlora", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_ckpt=True,
                         attention="sdpa", lora_r=16)
    solved = longest_seq_len(spec=spec, gpu=gpu, config=config)
    assert 0 < solved.safe <= solved.fits <= spec.max_seq_len
    at, usable = _total(spec, gpu, config.replace(seq_len=solved.fits))
    assert at == solved.fits_total <= usable
    if solved.fits < spec.max_seq_len:
        past, _ = _total(spec, gpu, config.replace(seq_len=solved.fits + 1))
        assert past > usable
    safe_cfg = config.replace(seq_len=solved.safe)
    assert not near_edge(config, estimate_memory(model=spec, config=safe_cfg, gpu=gpu, budget=usable),
                         capacity=gpu.memory_bytes)
    assert solved.estimates <= 40


def test_the_largest_micro_batch_fits_and_one_more_does_not(llama):
    spec, gpu = llama
    config = TrainConfig(method="lora", precision="bf16", micro_batch=1, seq_len=512, grad_ckpt=True, lora_r=16)
    solved = largest_micro_batch(spec=spec, gpu=gpu, config=config)
    assert 1 <= solved.safe <= solved.fits < MAX_MICRO_BATCH
    at, usable = _total(spec, gpu, config.with_split(micro_batch=solved.fits, grad_accum=1))
    past, _ = _total(spec, gpu, config.with_split(micro_batch=solved.fits + 1, grad_accum=1))
    assert at <= usable < past


def test_nothing_fits_is_zero_not_an_error(llama):
    spec, gpu = llama
    config = TrainConfig(method="full", precision="fp32", micro_batch=1, seq_len=512)  # 7B in fp32 with Adam: ~112 GB
    solved = longest_seq_len(spec=spec, gpu=gpu, config=config)
    assert (solved.fits, solved.safe, solved.fits_total) == (0, 0, None)


def test_estimate_solve_prints_and_returns_the_longest_sequence(cli):
    import json

    args = ("estimate", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "--method", "qlora", "--micro-batch", "1",
            "--grad-ckpt", "--seq-len", "1024")
    shown = cli(*args, "--solve", "seq-len")
    assert shown.code == 0, shown
    line = next(x for x in shown.out.splitlines() if x.startswith("longest sequence that fits: "))
    data = json.loads(cli(*args, "--solve", "seq-len", "--json").out)["solved"]
    assert f"longest sequence that fits: {data['fits']:,} (" in line
    assert f"not near the edge (at most 5% chance of running out): {data['safe']:,} (" in line
    assert 1024 < data["safe"] <= data["fits"] <= 4096


def test_estimate_solve_takes_two_sizes_only(cli):
    r = cli("estimate", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "--solve", "batch")
    assert r.code == 2 and r.err == "error: --solve must be one of seq-len|micro-batch, got 'batch'\n", r


def test_suggest_max_seq_solves_each_plan_shown(cli, tmp_path):
    """``suggest --max-seq``: per plan shown, in rank order, the longest sequence its configuration
    fits and the longest not near the edge, as ``planner.solve`` finds them for that configuration."""
    import json

    r = cli("suggest", "-m", "gpt2", "-g", "t4", "-b", "8", "--top-k", "2", "--max-seq", "--no-save", "--json")
    assert r.code == 0, r
    data = json.loads(r.out)
    assert len(data["max_seq"]) == len(data["plans"]) == 2
    spec, gpu = resolve_model("gpt2"), get_gpu("t4")
    for plan, solved in zip(data["plans"], data["max_seq"]):
        config = TrainConfig.from_dict(plan["config"])
        assert solved == longest_seq_len(spec=spec, gpu=gpu, config=config).to_dict()
        # each plan fits at the length it was planned for, so its longest is at least that
        assert solved["fits"] >= data["request"]["seq_len"] and solved["safe"] <= solved["fits"]
    text = cli("suggest", "-m", "gpt2", "-g", "t4", "-b", "8", "--top-k", "1", "--max-seq", "--no-save")
    assert text.code == 0 and "the longest sequence each plan fits" in text.out, text


def test_suggest_max_seq_is_for_one_gpu(cli):
    r = cli("suggest", "-m", "gpt2", "--gpu", "any", "-b", "8", "--max-seq")
    assert r.code == 2 and "--max-seq solves the plans of one GPU" in r.err, r
