"""``planner.ranking._ranking``'s order, read plan by plan, and what it hands back unread.

Plans are drawn with few speeds, totals and knobs, so groups, speed ties and equal tie keys
(``_tie_key``) are common: the reference is the ranking written out (sort by group key and speed,
cut into groups of SPEED_TIE from each leader, each group sorted by preference), and a re-ranking
of the unread plans must equal a re-ranking of the whole preference order, as ``_replayed_plans``
re-ranks after a replay drops or moves a plan."""

from __future__ import annotations

import random

import pytest

from planner.config import Method, Optimizer, Precision, TrainConfig
from planner.errors import PlannerError
from planner.ranking import SPEED_TIE, _PlanFacts, _ranking, _tie_key
from planner.search import Speed
from planner.sharding import search_axis
from planner.tradeoffs import Prefer


def _configs() -> list[TrainConfig]:
    out = []
    for method in (Method.FULL, Method.LORA):
        for precision in (Precision.BF16_MIXED, Precision.BF16):
            for optimizer in (Optimizer.ADAMW, Optimizer.ADAFACTOR):
                for sharding in search_axis(allow_offload=True, gpus=1)[:4]:
                    try:
                        out.append(TrainConfig(method=method, precision=precision, optimizer=optimizer,
                                               sharding=sharding, micro_batch=1, seq_len=512))
                    except PlannerError:  # (pure bf16 under DeepSpeed)
                        pass
    return out


def _plans(rng: random.Random, n: int) -> list[tuple]:
    configs = _configs()
    # (config, speed, total): a config object per plan (the ranking tells plans by identity)
    return [(configs[rng.randrange(len(configs))].replace(), Speed(rng.choice([100.0, 101.0, 103.0, 110.0, 120.0])),
             rng.choice([1, 2, 3])) for _ in range(n)]


def _facts(rng: random.Random) -> _PlanFacts:
    """Facts drawn at random for each plan, once a plan (``_PlanFacts`` asks of the plans it has not seen)."""
    return _PlanFacts(lambda items: [(item, rng.random() < 0.2, rng.random() < 0.3, rng.randrange(4), (),
                                      item[1].tokens_per_s) for item in items])


def _reference(fitting, prefer, facts, edgy=frozenset()):
    """The rank order written out in full."""
    known = facts(fitting)
    edges = [int(f[1] or id(f[0][0]) in edgy) for f in known]
    best = [0.0, 0.0]
    for f, e in zip(known, edges):
        if not f[2]:
            best[e] = max(best[e], f[0][1].tokens_per_s)
    rows = sorted([(e * 8 + int(f[2] and f[0][1].tokens_per_s <= best[e] * (1 + SPEED_TIE)) * 4
                    + (f[3] if prefer is Prefer.FIDELITY else 0), -f[0][1].tokens_per_s, n, f)
                   for n, (f, e) in enumerate(zip(known, edges))])
    out, group = [], []
    for row in rows:
        if group and (row[0] != group[0][0] or -row[1] < -group[0][1] / (1 + SPEED_TIE)):
            out += [f[0] for f in sorted([r[3] for r in group], key=_tie_key)]
            group = []
        group.append(row)
    return out + [f[0] for f in sorted([r[3] for r in group], key=_tie_key)]


@pytest.mark.parametrize("seed", range(12))
def test_the_ranking_read_in_full_is_the_rank_order(seed):
    rng = random.Random(seed)
    plans, facts = _plans(rng, 300), _facts(rng)
    for prefer in Prefer:
        assert list(_ranking(plans, prefer, facts)) == _reference(plans, prefer, facts)


@pytest.mark.parametrize("seed", range(12))
def test_the_unread_plans_rank_again_as_the_whole_order_does(seed):
    """After reading some plans, dropping some and marking some near the edge (``edgy``), the
    unread plans (groups not reached left by speed) rank as the rest of the preference order does."""
    rng = random.Random(seed)
    plans, facts = _plans(rng, 300), _facts(rng)
    for prefer in Prefer:
        for _ in range(5):
            ranked = _ranking(plans, prefer, facts)
            read = [next(ranked) for _ in range(rng.randrange(1, 40))]
            whole = _reference(plans, prefer, facts)
            assert read == whole[:len(read)]
            unread = ranked.unread()
            assert sorted(map(id, unread)) == sorted(map(id, whole[len(read):]))
            dropped = {id(p[0]) for p in rng.sample(read, min(3, len(read)))}
            edgy = {id(p[0]) for p in rng.sample(plans, 20)}
            again = [p for p in read + unread if id(p[0]) not in dropped]
            reference = [p for p in whole if id(p[0]) not in dropped]
            assert list(_ranking(again, prefer, facts, edgy=edgy)) == _reference(reference, prefer, facts, edgy)


def test_what_the_ranking_reads_of_a_family_is_one_per_family():
    """``_plan_facts`` works out a plan's safe bound and fidelity tier once per family
    (``family_key``): over every configuration of a search's space (every precision, method and
    sharding on 1 and 2 GPUs), both are equal within each family."""
    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.search import SearchSpace, enumerate_configs, family_key, safe_bound
    from planner.tradeoffs import fidelity_tier

    model, gpu = resolve_model("gpt2"), get_gpu("a100-80gb")
    space = SearchSpace(precisions=tuple(Precision), cpu_mem_bytes=1 << 40, lora_ranks=(8,))
    seen: dict[tuple, tuple] = {}
    for gpus in (1, 2):
        for config in enumerate_configs(model=model, gpu=gpu, target_batch=4, seq_len=128, gpus=gpus, space=space):
            facts = (safe_bound(config.method, gpu), fidelity_tier(config))
            assert seen.setdefault(family_key(config), facts) == facts, config.label()
    assert len(seen) > 20


@pytest.mark.parametrize("model_id, gpu_name", [("meta-llama/Llama-2-7b-hf", "a10g"), ("meta-llama/Llama-3.2-1B", "t4")])
def test_the_plans_the_screen_leaves_untimed_rank_as_if_timed(model_id, gpu_name):
    """The screen leaves its near-the-edge largest fits untimed (``Screened.fitting``: speed None)
    and the ranking times them when it reaches them: read in full, after a re-ranking of what is
    left unread too, both policies' rankings are those of the same plans all timed up front."""
    from planner.catalog import resolve_model
    from planner.gpus import get_gpu
    from planner.ranking import _exotic, _plan_facts
    from planner.search import SearchSpace, safe_bound, screen, timed

    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(precisions=tuple(Precision), cpu_mem_bytes=256 << 30)
    s = screen(model=model, gpu=gpu, target_batch=32, seq_len=2048, gpus=1, space=space)
    untimed = [item for item in s.fitting if item[1] is None]
    assert untimed and all(item[2] > safe_bound(item[0].method, gpu) for item in untimed)
    everything = [timed(item, s.speeds) if item[1] is None else item for item in s.fitting]

    def order(items, prefer, read=0):
        facts = _plan_facts(gpu, _exotic(s.memo, node_ram=space.cpu_mem_bytes, usable=s.usable))
        ranked = _ranking(items, prefer, facts, speeds=s.speeds)
        first = [next(ranked) for _ in range(read)]
        edgy = {id(item[0]) for item in first[::3]}
        rest = _ranking(ranked.unread(), prefer, facts, edgy=edgy, speeds=s.speeds)
        return [(id(item[0]), item[1]) for item in first + list(rest)]

    for prefer in Prefer:
        for read in (0, 5, 50):
            assert order(s.fitting, prefer, read) == order(everything, prefer, read)


@pytest.mark.parametrize("seed", range(12))
def test_a_ranking_made_again_from_the_last_is_the_ranking_made_anew(seed):
    """``_ranked_again``, round after round as ``_replayed_plans`` calls it (a few plans read are
    dropped, a few moved near the edge, smaller splits added, some near the edge by their screened
    totals), reads as ``_ranking`` of ``read + unread() + added`` without the dropped reads, with the
    moved in ``edgy``; where it declines (None), the caller ranks anew, as the reference does."""
    from planner.ranking import _ranked_again

    rng = random.Random(seed)
    plans, facts = _plans(rng, 300), _facts(rng)
    made_again = 0
    for prefer in Prefer:
        ours, anew = _ranking(plans, prefer, facts), _ranking(plans, prefer, facts)
        edgy: set[int] = set()
        for _ in range(6):
            count = rng.randrange(1, 30)
            read, read_anew = [next(ours) for _ in range(count)], [next(anew) for _ in range(count)]
            assert read == read_anew
            gone = rng.sample(read, min(len(read), rng.randrange(1, 4)))
            moved = [p for p in gone if rng.random() < 0.4 and id(p[0]) not in edgy]
            dropped = {id(p[0]) for p in gone} - {id(p[0]) for p in moved}
            edgy |= {id(p[0]) for p in moved}
            added = _plans(rng, rng.randrange(0, 4))
            again = _ranked_again(ours, [p for p in read if id(p[0]) in dropped or id(p[0]) in edgy], moved, added)
            anew = _ranking([p for p in read + anew.unread() if id(p[0]) not in dropped] + added, prefer, facts,
                            edgy=edgy)
            made_again += again is not None
            ours = again or _ranking([p for p in read + ours.unread() if id(p[0]) not in dropped] + added, prefer,
                                     facts, edgy=edgy)
        assert list(ours) == list(anew)
    assert made_again


@pytest.mark.parametrize("seed", range(12))
def test_the_top_k_read_a_group_at_a_time_is_the_top_k_read_plan_by_plan(seed):
    """``_distinct`` reads a ``_Ranked`` a group at a time, asking only of each family's first plan
    in a group: it takes the plans, reads the plans and leaves unread the plans that reading the same
    ranking plan by plan does, call after call on one ranking (the rounds read on where they stopped)
    and round after round (each group's families' first plans kept by ``_PlanFacts``)."""
    from planner.ranking import _distinct

    rng = random.Random(seed)
    plans, facts = _plans(rng, 300), _facts(rng)
    for prefer in Prefer:
        for _ in range(3):
            ranked, plain = _ranking(plans, prefer, facts), _ranking(plans, prefer, facts)
            for k in (rng.randrange(1, 6), rng.randrange(1, 6)):
                read, read_plain = [], []
                taken = _distinct(ranked, k, read)
                assert taken == _distinct(iter(plain.__next__, None), k, read_plain)
                assert read == read_plain and ranked.unread() == plain.unread()
