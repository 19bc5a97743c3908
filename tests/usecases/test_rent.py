"""Which GPU to rent (``planner.rent``, ``planner suggest --gpu any``): every GPU type and count
planned, timed and priced; the arithmetic checked by hand; ``--prices`` replacing the shipped
table; bad input as one line."""

from __future__ import annotations

import json

import pytest
from support.cli import assert_user_error, write_config

from planner.errors import InvalidConfigError, NothingFitsError
from planner.planning import SuggestRequest
from planner.pricing import YOUR_FILE, load_prices
from planner.rent import DEFAULT_TOKENS, compare_gpus, parse_tokens, workload


@pytest.fixture
def tiny(tmp_path):
    return write_config(tmp_path / "tiny")


@pytest.fixture
def prices(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"a10g": 2.0, "l4": 1.0}))
    return path


def test_hours_and_dollars_are_the_tokens_over_the_plans_speed_times_the_gpus_and_their_price(tiny, prices):
    job = workload(tokens=3_600_000_000)
    comparison = compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=8), workload=job,
                              prices=load_prices(prices), gpu_names=["a10g", "l4"], gpus_max=2)
    options = {(o.gpu, o.gpus): o for o in comparison.options}
    assert set(options) == {("a10g", 1), ("a10g", 2), ("l4", 1), ("l4", 2)}
    # by hand: 3.6e9 tokens at s tokens/s are 3.6e9 / s / 3600 = 1e6 / s hours; x GPUs x $/GPU-h
    one_a10g, two_l4 = options[("a10g", 1)], options[("l4", 2)]
    s1, s2 = one_a10g.plan.throughput.tokens_per_s, two_l4.plan.throughput.tokens_per_s
    assert one_a10g.hours == pytest.approx(1e6 / s1, rel=1e-12)
    assert one_a10g.dollars == pytest.approx(1e6 / s1 * 1 * 2.0, rel=1e-12)
    assert two_l4.dollars == pytest.approx(1e6 / s2 * 2 * 1.0, rel=1e-12)
    assert two_l4.tokens_per_dollar == pytest.approx(3.6e9 / (1e6 / s2 * 2.0), rel=1e-12)
    assert one_a10g.price.provider == YOUR_FILE and one_a10g.price.usd_per_gpu_hour == 2.0
    cheapest = comparison.by_cost()
    assert [o.dollars for o in cheapest] == sorted(o.dollars for o in cheapest)
    fastest = comparison.by_time()
    assert [o.hours for o in fastest] == sorted(o.hours for o in fastest)
    # every plan is the #1 of planner suggest on that GPU and count
    assert all(o.plan.rank == 1 and o.plan.config.gpus == o.gpus for o in comparison.options)


def test_the_shipped_table_prices_each_gpu_at_its_cheapest_offer_with_provider_and_date():
    table = load_prices()
    assert table.origin == "shipped table"
    h100 = table.cheapest("h100-80gb")
    offers = [p.usd_per_gpu_hour for p in table.prices if p.gpu == "h100-80gb"]
    assert len(offers) >= 2 and h100.usd_per_gpu_hour == min(offers)
    assert all(p.date and p.source and p.provider for p in table.prices)
    assert table.cheapest("v100-16gb") is None  # not priced: planned and timed, said to have no price


def test_prices_replace_the_table_and_unpriced_gpus_are_timed_but_not_ranked_by_cost(cli, tiny, prices):
    r = cli("suggest", "-m", tiny, "--gpu", "a10g,l4,t4", "--gpus-max", "2", "-b", "8", "--tokens", "1e9",
            "--prices", prices, "--json")
    assert r.code == 0, r
    data = json.loads(r.out)
    assert data["prices"] == str(prices) and data["tokens"] == 10**9
    assert {o["gpu"] for o in data["by_cost"]} == {"a10g", "l4"}  # t4 has no price in the file
    assert "t4" in {o["gpu"] for o in data["by_time"]}
    assert all(o["price"]["provider"] == YOUR_FILE for o in data["by_cost"])
    text = cli("suggest", "-m", tiny, "--gpu", "a10g,l4,t4", "--gpus-max", "2", "-b", "8", "--prices", prices)
    assert text.code == 0, text
    assert "not priced" in text.out and "t4" in text.out and "per billion tokens" in text.out


def test_a_shipped_price_format_file_in_yaml_is_read(tmp_path, tiny):
    path = tmp_path / "p.yaml"
    path.write_text("prices:\n  - gpu: A10G\n    usd_per_gpu_hour: 0.5\n    provider: MyCloud\n    date: 2026-11-01\n")
    table = load_prices(path)
    assert table.cheapest("a10g").describe() == "$0.50/GPU-h at MyCloud (2026-11-01)"


@pytest.mark.parametrize("text, expected", [("1e9", 10**9), ("500M", 5 * 10**8), ("2B", 2 * 10**9), ("1.5t", 15 * 10**11),
                                            ("1_000", 1000), ("12,345", 12345)])
def test_token_counts_are_read_as_people_write_them(text, expected):
    assert parse_tokens(text) == expected


def test_epochs_times_the_epoch_tokens_or_one_billion_said_so():
    assert workload(epochs=3, epoch_tokens=1000).tokens == 3000
    default = workload()
    assert default.tokens == DEFAULT_TOKENS and "per billion" in default.source
    with pytest.raises(InvalidConfigError, match="--dataset-tokens"):
        workload(epochs=2)


def test_epochs_over_a_dataset_count_the_rows_the_trainer_processes(cli, tmp_path, tiny):
    data = tmp_path / "d.jsonl"
    # 10 samples of 20 token ids each, packed into rows of 64: ceil(200 / 64) = 4 rows, one step of
    # 8 rows -> 8 x 64 = 512 tokens an epoch at the planned length; 2 epochs = 1,024
    data.write_text("".join(json.dumps({"input_ids": list(range(20))}) + "\n" for _ in range(10)))
    r = cli("suggest", "-m", tiny, "--gpu", "a10g,l4", "--gpus-max", "1", "-b", "8", "--seq-len", "64",
            "--dataset", data, "--epochs", "2", "--json")
    assert r.code == 0, r
    out = json.loads(r.out)
    assert out["tokens"] == 1024 and f"--dataset {data}" in out["tokens_source"]


def test_a_pinned_precision_rules_out_the_gpus_that_cannot_run_it(tiny):
    comparison = compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=2, precision="bf16-mixed"),
                              workload=workload(tokens=10**6), prices=load_prices(), gpu_names=["t4", "a10g"],
                              gpus_max=1)
    reasons = {o.gpu: o.reason for o in comparison.options}
    assert "cannot run --precision bf16-mixed" in reasons["t4"] and reasons["a10g"] == ""
    assert comparison.unfit() == ("t4",)


@pytest.mark.parametrize("args, fragments", [
    (["--gpu", "any", "--prices", "/no/such.json"], ["--prices", "no such file"]),
    (["--gpu", "a10g,l4", "--tokens", "lots"], ["--tokens", "1e9"]),
    (["--gpu", "a10g", "--tokens", "1e9"], ["--tokens compares GPUs", "--gpu any"]),
    (["--gpu", "a10g,l4", "--verify"], ["--verify does not go with --gpu any"]),
    (["--gpu", "a10g,l4", "--gpus", "2"], ["--gpus 2", "--gpus-max"]),
    (["--gpu", "a10g,l4", "--epochs", "2"], ["--epochs needs", "--dataset-tokens"]),
    (["--gpu", "a10g,nope"], ["nope"]),
    (["--gpu", "a10g,cpu"], ["cpu is this machine"]),
    (["--gpu", "a10g,l4", "--gpus-max", "99"], ["--gpus-max must be"]),
])
def test_bad_input_is_one_line(cli, tiny, args, fragments):
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", *args), *fragments)


@pytest.mark.parametrize("content, fragment", [
    ({"a10g": -1}, "positive number"),
    ({"warp-drive": 1.0}, "warp-drive"),
    ({"prices": [{"gpu": "a10g", "usd_per_gpu_hour": 1, "date": "last week"}]}, "YYYY-MM"),
    ({"prices": [{"gpu": "a10g", "usd_per_gpu_hour": 1, "colour": "red"}]}, "unknown key 'colour'"),
    ([1, 2], "holds no prices"),
])
def test_a_bad_price_file_is_one_line_before_anything_is_planned(cli, tmp_path, tiny, content, fragment):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(content))
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--gpu", "any", "--prices", path), fragment)



def test_nothing_fitting_on_any_gpu_compared_exits_3_after_the_answer(cli):
    r = cli("suggest", "-m", "meta-llama/Llama-3.1-70B", "--gpu", "t4,a10g", "--gpus-max", "1", "-b", "8",
            "--method", "full", "--precision", "fp32", "--no-offload", "--json")
    assert r.code == 3, r
    data = json.loads(r.out)
    assert data["by_time"] == [] and set(data["unfit"]) == {"t4", "a10g"}
    assert all(o["reason"] for o in data["options"]) and "nothing fits on any GPU compared" in r.err


def test_searches_sharing_their_device_free_terms_answer_as_each_alone(tiny, monkeypatch):
    """Inside ``planner.search.shared_terms`` the searches of one model on several GPUs compute each
    static key's device-free terms once (the model states do not depend on the device, only its
    kernels do), and every answer is the one the search gives alone."""
    import dataclasses

    from planner import search
    from planner.catalog import resolve_model
    from planner.planning import make_plan

    spec = resolve_model(str(tiny))
    request = SuggestRequest(model=str(tiny), gpu="a10g", target_batch=8, top_k=3)
    alone = [make_plan(dataclasses.replace(request, gpu=g), spec=spec).result.to_dict() for g in ("a10g", "l4", "a100-80gb")]
    computed = []
    real = search.static_terms
    monkeypatch.setattr(search, "static_terms", lambda *a, **k: computed.append(1) or real(*a, **k))
    with search.shared_terms(spec):
        together = [make_plan(dataclasses.replace(request, gpu=g), spec=spec).result.to_dict() for g in ("a10g", "l4", "a100-80gb")]
        first = len(computed)
    assert together == alone
    monkeypatch.setattr(search, "static_terms", lambda *a, **k: computed.append(1) or real(*a, **k))
    computed.clear()
    make_plan(request, spec=spec)
    one_search = len(computed)
    assert first == one_search > 0  # the two later GPUs (the same CUDA kernels) found every one of the first's terms


def test_one_devices_searches_at_each_gpu_count_share_its_throughput_memo(tiny, monkeypatch):
    """Inside ``planner.search.shared_terms`` the searches of one device at several GPU counts share
    one ``ThroughputMemo`` (it is for one model on one device), and every answer is the one the
    search gives alone."""
    import dataclasses

    from planner import search
    from planner.catalog import resolve_model
    from planner.planning import make_plan

    spec = resolve_model(str(tiny))
    request = SuggestRequest(model=str(tiny), gpu="a10g", target_batch=8, top_k=3)
    alone = [make_plan(dataclasses.replace(request, gpus=n), spec=spec).result.to_dict() for n in (1, 2, 4)]
    made = []
    real = search.ThroughputMemo
    monkeypatch.setattr(search, "ThroughputMemo", lambda *a: made.append(real(*a)) or made[-1])
    with search.shared_terms(spec):
        together = [make_plan(dataclasses.replace(request, gpus=n), spec=spec).result.to_dict()
                    for n in (1, 2, 4)]
    assert together == alone
    assert len(made) == 1
    make_plan(request, spec=spec)  # outside the block: a memo of its own
    assert len(made) == 2


def test_the_comparison_plans_each_option_without_the_other_policys_alternative(tiny):
    """``compare_gpus`` reads each option's #1 plan only, so it plans without ranking by the other
    policy (``make_plan(alternative=False)``): the same plans, no alternative."""
    from planner.catalog import resolve_model
    from planner.planning import make_plan

    spec = resolve_model(str(tiny))
    # at 64 sequences the tiny model's device time outweighs its host's dispatch, so its fastest plan
    # is not its most faithful one (at 8 the host bounds every plan alike and there is no alternative)
    request = SuggestRequest(model=str(tiny), gpu="a10g", target_batch=64, top_k=3)
    full, best = make_plan(request, spec=spec).result, make_plan(request, spec=spec, alternative=False).result
    assert full.alternative is not None
    assert best.alternative is None
    assert best.plans == full.plans and best.rejected == full.rejected


def test_the_gpu_types_planned_in_two_processes_answer_as_in_one(tiny):
    """``processes=2``: a forked child plans every other GPU type; the comparison is the same, in
    the same order."""
    request = SuggestRequest(model=str(tiny), gpu="any", target_batch=8)
    one, two = (compare_gpus(request, workload=workload(tokens=10**9), prices=load_prices(), gpus_max=2,
                             gpu_names=["t4", "a10g", "l4"], processes=n).to_dict() for n in (1, 2))
    order = [(g, n) for g in ("t4", "a10g", "l4") for n in (1, 2)]
    assert [(o["gpu"], o["gpus"]) for o in two["options"]] == order
    assert two == one


def test_a_childs_error_is_raised_in_the_parent(tiny, monkeypatch):
    """The GPU types a forked child plans fail as they fail in one process: the error is raised by
    ``compare_gpus``, with its words."""
    from planner import rent

    real = rent._options_on

    def refusing_a10g(device, *args, **kwargs):
        if device.name == "a10g":  # the second type: planned by the child
            raise InvalidConfigError("a10g refused here")
        return real(device, *args, **kwargs)

    monkeypatch.setattr(rent, "_options_on", refusing_a10g)
    with pytest.raises(InvalidConfigError, match="a10g refused here"):
        compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=8),
                     workload=workload(tokens=10**9), prices=load_prices(), gpus_max=1, gpu_names=["t4", "a10g"],
                     processes=2)


@pytest.mark.parametrize("model_id, gpus, target_batch, extra", [
    ("meta-llama/Llama-3.1-8B", (1, 8), 32, {}),
    ("meta-llama/Llama-2-7b-hf", (2,), 8, {"allow_offload": False}),
    ("Qwen/Qwen2.5-0.5B", (1,), 128, {"seq_len": 4096}),
    ("meta-llama/Llama-3.2-1B", (1,), 32, {"precision": "fp32"}),
])
def test_the_first_plan_alone_is_the_whole_searchs_first(model_id, gpus, target_batch, extra):
    """``make_plan(first_only=True)`` (what ``compare_gpus`` asks) screens full fine-tuning alone
    and then with LoRA where that decides the #1 plan (``ranking._first_plan``), else the whole space:
    either way its #1 plan is the whole search's, estimates included; both paths are taken here
    (GPUs that full fine-tuning fits and GPUs it does not)."""
    import dataclasses

    from planner import ranking
    from planner.catalog import resolve_model
    from planner.planning import make_plan

    spec = resolve_model(model_id)
    answered = []
    real = ranking._first_plan

    def counted(**kwargs):
        answered.append(real(**kwargs) is not None)
        return real(**kwargs)

    request = SuggestRequest(model=model_id, gpu="a10g", target_batch=target_batch, top_k=1, **extra)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ranking, "_first_plan", counted)
        for gpu in ("t4", "a10g", "a100-80gb"):
            for n in gpus:
                one = dataclasses.replace(request, gpu=gpu, gpus=n)
                try:
                    whole = make_plan(one, spec=spec, alternative=False).result.plans[0]
                except NothingFitsError:
                    with pytest.raises(NothingFitsError):
                        make_plan(one, spec=spec, alternative=False, first_only=True)
                    continue
                first = make_plan(one, spec=spec, alternative=False, first_only=True).result.plans
                assert first == (whole,), (gpu, n)
    if model_id == "meta-llama/Llama-3.1-8B":
        assert True in answered and False in answered


def test_the_methods_screened_first_hold_every_plan_of_their_group_keys():
    """``ranking.FIRST_METHODS``: every plan of a method left out of a step has a fidelity tier past
    the step's last group key, over every precision and sharding."""
    from planner.catalog import resolve_model
    from planner.config import Precision
    from planner.gpus import get_gpu
    from planner.ranking import FIRST_METHODS
    from planner.search import SearchSpace, enumerate_configs
    from planner.tradeoffs import fidelity_tier

    configs = list(enumerate_configs(model=resolve_model("gpt2"), gpu=get_gpu("h100-80gb"), target_batch=2,
                                     seq_len=128, gpus=1, space=SearchSpace(precisions=tuple(Precision),
                                                                            cpu_mem_bytes=1 << 40, lora_ranks=(8,))))
    assert {c.method for c in configs} == set(SearchSpace().methods)
    for methods, last_key in FIRST_METHODS:
        assert all(fidelity_tier(c) > last_key for c in configs if c.method not in methods), methods
