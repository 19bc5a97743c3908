"""Which plans first: the ranking of what the screen found to fit, the full estimate of the plans
shown, and why the rest does not fit.

``suggest`` is the search's answer: ``planner.search.screen`` finds every combination's largest
fitting split and each family's closest miss with the fast path; the fitting plans are ranked by
the requested policy (``planner.tradeoffs.Prefer``): fidelity tier (``fidelity_tier``) then
predicted tokens/s, or tokens/s alone; each plan shown is estimated in full (the caching allocator
replayed). A plan whose probability of running out of memory is over
``planner.uncertainty.NEAR_EDGE_PROBABILITY`` is near the edge (``planner.tradeoffs.near_edge``):
each near-the-edge plan the screen finds is joined by the same configuration at its largest split
that is not (``planner.search.safe_bound``), and near-the-edge plans rank after every plan that is not, so
each slot shown is its fastest safe plan where it has one.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from itertools import repeat
from operator import itemgetter
from typing import Iterable, Iterator, NamedTuple

from planner.advice import advice
from planner.config import Method, Optimizer, Precision, TrainConfig
from planner.errors import NothingFitsError, PlannerError
from planner.gpus import GPUSpec
from planner.host import host_shortfall, node_ram_needed
from planner.memory import model_states_bytes
from planner.memo import collector_paused
from planner.memory.allocator import sharing_prefixes
from planner.modelspec import ModelSpec
from planner.optim import OPTIMIZERS
from planner.results import Candidate, PlanResult, Rejection
from planner.search import (
    MemoryMemo,
    SearchSpace,
    Speed,
    check_request,
    divisors,
    family_key,
    family_label,
    paged_host,
    plan_request,
    safe_bound,
    screen,
    shared_estimate,
    skipped_precisions,
    timed,
    totals_by_split,
)
from planner.sharding import NONE
from planner.throughput import ThroughputMemo, estimate_throughput, tokens_per_second
from planner.tradeoffs import Prefer, fidelity_tier, memory_interval, near_edge, oom_risk
from planner.uncertainty import NEAR_EDGE_PROBABILITY, oom_probability, spread
from planner.units import format_bytes


def _collector_paused(search):
    """``search`` with Python's cyclic garbage collector paused while it runs (``planner.memo.collector_paused``)."""
    @functools.wraps(search)
    def paused(*args, **kwargs):
        with collector_paused():
            return search(*args, **kwargs)

    return paused


def _sharing_replays(search):
    """``search`` with the allocator replays of the plans it shows sharing what their timelines
    have in common (``planner.memory.allocator.ReplayPrefixes``): the plans shown often differ in
    one setting (Llama-2-7B on an A10G over every precision: two pairs of plans differ in the
    optimizer only, and three QLoRA plans share their model states)."""
    @functools.wraps(search)
    def sharing(*args, **kwargs):
        with sharing_prefixes():
            return search(*args, **kwargs)

    return sharing


@_collector_paused
@_sharing_replays
def suggest(
    *,
    model: ModelSpec,
    gpu: GPUSpec,
    target_batch: int,
    seq_len: int,
    gpus: int = 1,
    space: SearchSpace = SearchSpace(),
    top_k: int = 5,
    model_fingerprint: str = "",
    alternative: bool = True,
    first_only: bool = False,
) -> PlanResult:
    """Rank the configurations that fit; raise ``NothingFitsError`` (exit 3) when none does.
    ``alternative``: also rank by the other policy, for ``PlanResult.alternative`` (``planner.rent``
    reads the #1 plan only: 69 of the 310 full estimates of a ``--gpu any`` comparison of
    Llama-3.1-8B were the other policy's). ``first_only`` (with ``top_k`` 1 and no alternative): the
    caller reads the #1 plan and nothing else (``planner.rent``), found where it can be without
    screening the whole space (``_first_plan``); the answer then has no rejections
    and ``searched`` counts the candidates screened for it."""
    check_request(model=model, target_batch=target_batch, seq_len=seq_len, gpus=gpus, top_k=top_k,
                  space=space)
    replays: dict[TrainConfig, object] = {}  # (the full estimates made, by configuration: one device and budget)
    shown: dict[TrainConfig, dict] = {}  # (the plans shown's estimates, by configuration: _shown)
    if first_only and top_k == 1 and not alternative:
        first = _first_plan(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus,
                            space=space, model_fingerprint=model_fingerprint, replays=replays)
        if first is not None:
            return first
    fitting, closest, searched, memo, usable, margin, speeds = screen(
        model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space)
    request = plan_request(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space,
                           top_k=top_k, model_fingerprint=model_fingerprint)

    def missed(cfg: TrainConfig, total: int) -> _Tried:
        return _Tried(config=cfg, process_total_bytes=total, cpu_bytes=memo.static(cfg).terms.host)

    # each family's closest try (as the fast path screened it), most faithful method first, then
    # the nearest miss
    by_tier = sorted(closest.items(), key=lambda kv: (fidelity_tier(kv[1][1]), kv[1][0]))
    facts = _plan_facts(gpu, _exotic(memo, node_ram=space.cpu_mem_bytes, usable=usable))  # read by both policies' rankings
    plans = _replayed_plans(_ranking(fitting, space.prefer, facts, speeds=speeds), model=model, gpu=gpu,
                            usable=usable, top_k=top_k, prefer=space.prefer, replays=replays, shown=shown, memo=memo,
                            facts=facts, speeds=speeds)
    if not plans:
        tried = {fam: missed(cfg, total) for fam, (total, cfg) in by_tier}
        rejected = tuple(_rejection(c, model=model, usable=usable, space=space) for c in tried.values())
        raise NothingFitsError(
            _nothing_fits_message(model=model, gpu=gpu, closest=tried, usable=usable, space=space),
            result=PlanResult(request=request, plans=(), rejected=rejected, searched=searched, usable_bytes=usable,
                              safety_margin_bytes=margin, prefer=str(space.prefer)),
        )
    best_tier = fidelity_tier(plans[0].config)
    # (a family's tier is one: a family above best_tier is never one asked of below; skipped unhashed)
    fitting_families = {f[4] for f in facts(fitting) if f[3] <= best_tier}
    rejected = tuple(
        _rejection(missed(cfg, total), model=model, usable=usable, space=space)
        for fam, (total, cfg) in by_tier
        if fidelity_tier(cfg) <= best_tier and family_key(cfg) not in fitting_families
    )
    # the families that fit only near the edge first: they are the ones a user asks about
    rejected = _edge_only(facts(fitting), plans, best_tier=best_tier, gpu=gpu) + rejected
    other = Prefer.SPEED if space.prefer is Prefer.FIDELITY else Prefer.FIDELITY
    theirs = () if not alternative else _replayed_plans(
        _ranking(fitting, other, facts, speeds=speeds), model=model, gpu=gpu, usable=usable, top_k=min(top_k, 3),
        prefer=other,
        replays=replays, shown=shown, memo=memo, facts=facts, speeds=speeds, first=True)
    return PlanResult(request=request, plans=plans, rejected=rejected, searched=searched, usable_bytes=usable,
                      safety_margin_bytes=margin, prefer=str(space.prefer),
                      alternative=theirs[0] if theirs and theirs[0].config != plans[0].config else None,
                      advice=_edge_advice(plans, model=model, gpu=gpu, space=space))


#: The methods ``_first_plan`` screens before the whole space, each with the last group key all of
#: whose plans they hold: fidelity tier 0 is full fine-tuning's with fp32 master weights, 1 LoRA's,
#: 2 QLoRA's (``fidelity_tier``; tests/usecases/test_rent.py holds the other methods' tiers above).
FIRST_METHODS = (((Method.FULL,), 0), ((Method.FULL, Method.LORA), 1))


def _first_plan(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int,
                space: SearchSpace, model_fingerprint: str, replays: dict) -> PlanResult | None:
    """The #1 plan under ``fidelity`` found by screening the most faithful methods alone
    (FIRST_METHODS, in turn), or None where they cannot tell it (the caller then searches the
    whole space, with the full estimates made here: ``replays``).

    Under ``fidelity`` a group key up to 3 holds the plans of that fidelity tier that are not near
    the edge and are plain, or exotic and faster than every plain plan of that tier by EXOTIC_WIN
    (of the class, where the tier has none). The methods left out hold no plan of a tier screened
    here (each tier is one method's), so they change such a group only through the class's fastest
    plain plan, which only grows with them: an exotic plan that is not in the group here is not in it
    there either. So where each ranking
    the replays make here (``_replayed_plans``' ``decided``) begins with a group key the screened
    methods hold every plan of, with no exotic plan (``_led_by_plain``), its first plan is the
    whole space's: the same plans in the same order (the screen makes each combination's plans
    alike wherever it screens it, in the order of the rows, here without the other methods'). A
    ``--gpu any`` comparison of Llama-3.1-8B answered 70 of its 96 options with full fine-tuning,
    whose rows are about a seventeenth of the space (LoRA and QLoRA have eight adapter variants
    each), and 21 with LoRA: its searches took 2.95 s of CPU rather than 6.4 s."""
    if space.prefer is not Prefer.FIDELITY or skipped_precisions(gpu, space):  # (its warning, said twice)
        return None
    screened: tuple = ()
    for methods, last_key in FIRST_METHODS:
        subset = tuple(m for m in space.methods if m in methods)
        if subset in (screened, space.methods):
            continue  # (nothing to screen, screened already, or the whole space)
        screened = subset
        try:
            some = dataclasses.replace(space, methods=subset)
        except PlannerError:  # (a recipe of adapter settings only: no full fine-tuning of it)
            continue
        fitting, _, searched, memo, usable, margin, speeds = screen(
            model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=some)
        facts = _plan_facts(gpu, _exotic(memo, node_ram=space.cpu_mem_bytes, usable=usable))
        plans = _replayed_plans(_ranking(fitting, Prefer.FIDELITY, facts, speeds=speeds), model=model, gpu=gpu,
                                usable=usable,
                                top_k=1, replays=replays, memo=memo, facts=facts, speeds=speeds,
                                decided=lambda ranked, last=last_key: _led_by_plain(ranked, last))
        if plans:
            request = plan_request(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus,
                                   space=space, top_k=1, model_fingerprint=model_fingerprint)
            return PlanResult(request=request, plans=plans, searched=searched, usable_bytes=usable,
                              safety_margin_bytes=margin, prefer=str(space.prefer),
                              advice=_edge_advice(plans, model=model, gpu=gpu, space=space))
    return None


def _led_by_plain(ranked: _Ranked, last_key: int) -> bool:
    """Whether the ranking (under ``fidelity``, not read yet) begins with a group key up to
    ``last_key`` and every plan of that key is plain (``_exotic``: not exotic), so the group does
    not depend on how fast the plans of the methods not screened are (``_first_plan``). The plans
    near the edge are read only where every other is gone: their group keys (8 on) follow every
    other's, so the first key's plans end before them (left unranked, the ranking can be made again
    from this one after a replay: ``_ranked_again``)."""
    rows = ranked._by_speed or ranked.by_speed
    if not rows or rows[0][0] > last_key:
        return False
    first = rows[0][0]
    for key, _, _, facts in rows:
        if key != first:
            return True
        if facts[2]:
            return False
    return True


#: How much faster than every plain plan an exotic plan (``_exotic``) must be predicted to rank
#: before them: the throughput model's median absolute error on published runs, rounded up
#: (bench/results/throughput.md: 8.8 % over 76 rows). A smaller predicted gain is one the model
#: cannot promise, and not worth another library in the stack: with SPEED_TIE (2 %) here,
#: DeepSpeed ZeRO-1 on one A10G ranked first for Llama-3.2-1B LoRA on a 2.1 % predicted gain.
EXOTIC_WIN = 0.10

#: An offload plan whose ranks pin more than this share of the node's RAM is exotic: what is left
#: is the OS's, the training processes' and the data's (planner.host.host_reserve keeps the least
#: of it), and pinned pages cannot be swapped out.
EXOTIC_HOST_SHARE = 0.5


def _exotic(memo: MemoryMemo, *, node_ram: int, usable: int):
    """Whether a configuration is one an expert runs only when it wins on speed or is the only way
    to fit: a sharding scheme on one GPU that would fit on the device (``usable``) with what it
    offloads kept there, nothing offloaded included (it shards nothing, and its offload is not why
    it fits: ZeRO saves memory there only because DeepSpeed keeps the model in 16-bit. A search that
    left only ZeRO-1 without offload exotic ranked ZeRO-1 with LoRA's optimizer offload, 81 MiB
    pinned, first for Llama-2-7B on one A10G), and offload that pins more than EXOTIC_HOST_SHARE
    of the node's RAM. ``exotic(items)``: 1 for each exotic plan of ``items`` ((config, speed,
    process total[, static terms]): the static terms where the caller has them, a screened plan's,
    ``planner.search.Screened.fitting``), else 0."""
    # each sharding's (offloaded, shards nothing), once a sharding: ``_plan_facts`` asks of about
    # 1,700 plans a search, of a few shardings, in one call (a call and a property read a plan:
    # _plan_facts 12.8 -> 12.55 M instructions, cachegrind, Llama-2-7B on an A10G, every precision)
    kinds: dict[object, tuple[bool, bool]] = {}

    def exotic(items: list[tuple]) -> list[int]:
        out = []
        for item in items:
            config, total = item[0], item[2]
            sharding = config.sharding
            kind = kinds.get(sharding)
            if kind is None:
                kind = kinds[sharding] = (sharding.offloaded, not sharding.spec.replicas)
            if not kind[0]:  # (pins nothing: the host share below is 0, never over the node's RAM)
                out.append(1 if kind[1] and config.gpus == 1 and total <= usable else 0)
                continue
            host = ((item[3] if len(item) > 3 else None) or memo.static(config)).terms.host
            out.append(1 if (kind[1] and config.gpus == 1 and total + host <= usable)
                       or host * config.gpus > EXOTIC_HOST_SHARE * node_ram else 0)
        return out

    return exotic


def _safe_bound(config: TrainConfig, gpu: GPUSpec, bounds: dict) -> int:
    """The largest process total of ``config``'s method that is not near the edge of ``gpu``."""
    bound = bounds.get(config.method)
    if bound is None:
        bound = bounds[config.method] = safe_bound(config.method, gpu, config.gpus)
    return bound


def _replayed_plans(fitting: Iterable[tuple], *, model: ModelSpec, gpu: GPUSpec, usable: int, top_k: int,
                    prefer: Prefer = Prefer.FIDELITY, replays: dict | None = None, shown: dict | None = None,
                    memo: MemoryMemo | None = None, facts: _PlanFacts | None = None,
                    speeds: ThroughputMemo | None = None, decided=None,
                    first: bool = False) -> tuple[Candidate, ...] | None:
    """The top plans with their full estimates. The fast path screens with the allocator's
    stated overhead (``planner.memory.reserve``); each plan shown is estimated in full, with the
    caching allocator replayed on its step. One the replay finds too large for the usable memory
    gives way to the same configuration with the next smaller micro-batch (more accumulation),
    ranked anew by its speed: the screen kept only each combination's largest fitting split, and
    the replay has just said that split is too large. A plan the replay finds near the edge
    (``near_edge``) where the screen did not moves after every plan that is not, and the same
    configuration with the next smaller micro-batch joins the ranking: the slot it stood for may
    have a safe plan the replay has not seen yet. A plan with paged optimizer states is timed
    again with the paging its replay leaves (the screen timed it from its own total) and, where
    that moves its speed, ranked anew. ``decided(ranking)``: whether a ranking (``_Ranked``)
    of ``fitting`` and of each re-ranking is one whose first plan the caller can take; where one is
    not, None is returned. ``first``: the caller reads the first plan only, which is returned
    alone once no later round can change it (``_Settling``: under ``speed``)."""
    replays = {} if replays is None else replays
    shown = {} if shown is None else shown
    memo = memo or MemoryMemo(model, gpu)
    speeds = speeds or ThroughputMemo(model, gpu)  # (times the plans it adds: the screen's, where given)
    facts = facts or _plan_facts(gpu)
    capacity = gpu.memory_bytes
    ranked, read = iter(fitting), []  # read: the ranked plans _distinct has gone through
    kinds: dict[int, tuple] = {}  # (``_distinct``'s, by the id of a configuration: each stays alive, ranked or in ``replays``)
    edgy: set[int] = set()  # ids of the configurations the replay found near the edge

    def estimated(cfg: TrainConfig):
        if cfg not in replays:  # (None: its replay runs out of memory in ``usable``, and it is dropped)
            replays[cfg] = shared_estimate(model=model, config=cfg, gpu=gpu, budget=usable, dropping=True, memo=memo,
                                           totals=True)
        return replays[cfg]

    settling = (_Settling(estimated, speeds=speeds, memo=memo, replays=replays, usable=usable, capacity=capacity)
                if first and prefer is Prefer.SPEED and not gpu.is_cpu else None)
    while True:
        if decided is not None and not decided(ranked):
            return None
        plans, dropped, moved, retimed = [], set(), set(), {}
        picks = _distinct(ranked, top_k, read, kinds)
        head = settling.head(ranked, picks) if settling is not None and isinstance(ranked, _Ranked) else None
        if head is not None:
            return (Candidate(config=head[0], **_shown(head[0], estimated(head[0]), model=model, gpu=gpu, shown=shown),
                              fits=True, rank=1),)
        for cfg, speed, total, *_ in picks:
            memory = estimated(cfg)
            if memory is None or memory.process_total_bytes > usable:
                dropped.add(id(cfg))
                continue
            if memory.paged_bytes:  # its paging as the replay's reserve leaves it, not the screen's
                replayed = _replayed_speed(cfg, memory, speeds)
                if replayed != speed:
                    retimed[id(cfg)] = replayed
            plans.append((cfg, memory))
            if (id(cfg) not in edgy and total <= _safe_bound(cfg, gpu, {})
                    and near_edge(cfg, memory, capacity=capacity)):
                moved.add(id(cfg))
        if not dropped and not moved and not retimed:
            plans.sort(key=lambda p: near_edge(p[0], p[1], capacity=capacity))  # stable: rank order otherwise
            return tuple(Candidate(config=cfg, **_shown(cfg, memory, model=model, gpu=gpu, shown=shown), fits=True,
                                   rank=i + 1) for i, (cfg, memory) in enumerate(plans))
        edgy |= moved
        # the smaller splits of the plans dropped and moved, in rank order (all of them were read)
        gone = dropped | moved
        removed = [item for item in read if id(item[0]) in gone]  # (read once: about 90-250 plans a round)
        added = [item for item in (_next_smaller_split(item[0], model=model, gpu=gpu, memo=memo, speeds=speeds)
                                   for item in removed)
                 if item is not None and item[2] <= usable]
        again = None if retimed or not isinstance(ranked, _Ranked) else _ranked_again(
            ranked, removed, [item for item in removed if id(item[0]) in moved], added)
        if again is None:
            fitting = read + (ranked.unread() if isinstance(ranked, _Ranked) else list(ranked))
            kept = [(item[0], retimed[id(item[0])], *item[2:]) if id(item[0]) in retimed else item
                    for item in fitting if id(item[0]) not in dropped]
            again = _ranking(kept + added, prefer, facts, edgy=edgy, speeds=speeds)
        ranked, read = again, []


def _replayed_speed(config: TrainConfig, memory, speeds: ThroughputMemo) -> Speed:
    """A plan's speed with the paging its replay leaves (``MemoryEstimate.paged_host_bytes``)."""
    return Speed(tokens_per_second(config, speeds.step_seconds(config, memory.paged_host_bytes)))


#: The rounds whose first group is settled but for the bound (``_Settling``) before the bound is read:
#: it times the smaller splits of the plans that can reach the floor (257 step times, Llama-2-7B on an
#: A10G over every precision, ~1.3 ms; every split of every plan, 1,427, before ``_split_speed``'s order
#: was read, when it waited for a second round), less than the round it saves where the rounds go on
#: replaying (that request's alternative: 17 rounds of a replay each, 0.5-3 ms; reading it in the first
#: round saved one, 510 -> 498 M instructions a search, callgrind).
SETTLE_AFTER = 1


class _Settling:
    """Whether the first plan of ``_replayed_plans``' answer under ``speed`` is settled before its
    rounds end (``head``), for a caller that reads nothing else: ``suggest``'s other policy, whose
    list is only its first plan (``PlanResult.alternative``). Llama-2-7B on an A10G, the bench
    request: its first plan is the same from the second round on, and 17 more rounds each replay a
    QLoRA plan at micro-batch 8 that runs out (a quarter of the search, bench/cli_speed.py).

    The rounds change the ranking only where a plan picked (``_distinct``) is dropped, moved near
    the edge or timed again, and add the next smaller split of each plan dropped or moved. So the
    first plan is settled where, in a ranking whose first group (``_Ranked``: group key 0, the plans
    within SPEED_TIE of the fastest, ``floor`` its slowest speed) is read first:
    - every plan picked in that group is estimated and stays as it is (fits, not near the edge, its
      speed kept), so it is never removed, and picks the same plans each round while the group is
      the same; the first of them is not near the edge, so it stays first once sorted;
    - the fastest plain plan is in the group, so the bar of the exotic plans does not move
      (``_bars``: under ``speed`` the class's alone) unless a plain plan faster than it comes;
    - no plan that can come joins the group's key at or above ``floor``: every smaller split of
      every other plan (``_bound``: all that the rounds can add, whatever the replays say) and,
      for a plan with paged states, its own split timed again (the paging its replay leaves only
      adds seconds: ``ThroughputMemo.step_seconds`` at no paging is its fastest, which
      tests/search/test_settling.py holds). An exotic plan's smaller splits are exotic too
      (``_exotic``) where nothing is offloaded (the total is not read then, and a plan added fits)
      or it accumulates already (its total + host RAM only falls with the micro-batch then: the
      peak never grows along the accumulating splits, ``planner.search._fit_and_miss``), and stay
      after the group at or below the bar; a plan equal to one of the group's of that speed joins
      it after that one (its preference is the same, the screen's total of the same split, and its
      speed at most that) and takes no pick from it (its family is read before it)."""

    def __init__(self, estimated, *, speeds: ThroughputMemo, memo: MemoryMemo, replays: dict, usable: int,
                 capacity: int) -> None:
        self._estimated, self._speeds, self._memo, self._replays = estimated, speeds, memo, replays
        self._usable, self._capacity = usable, capacity
        # by floor, the rounds that reached the bound (-1: it was read; once a floor: it reads every plan)
        self._rounds: dict[float, int] = {}

    def head(self, ranked: _Ranked, picks: list[tuple]) -> tuple | None:
        """The first plan of the answer, where ``ranked`` (whose plans ``picks`` are the round's)
        settles it and a later pick has no estimate yet (else the round is made: it costs little)."""
        rows = ranked._by_speed
        if not picks or not rows or rows[0][0] != 0 or ranked._fastest is None:
            return None
        floor = -rows[0][1] / (1 + SPEED_TIE)
        end = 1
        while end < len(rows) and rows[end][0] == 0 and -rows[end][1] >= floor:
            end += 1
        members = {id(row[3][0]) for row in rows[:end]}
        ours = [item for item in picks if id(item) in members]
        if (not ours or any(a is not b for a, b in zip(ours, picks))
                or all(item[0] in self._replays for item in picks[len(ours):])):
            return None
        for cfg, speed, total, *_ in ours:
            memory = self._estimated(cfg)
            if (memory is None or memory.process_total_bytes > self._usable or near_edge(cfg, memory, capacity=self._capacity)
                    or memory.paged_bytes and _replayed_speed(cfg, memory, self._speeds) != speed):
                return None
        group = [row[3] for row in rows[:end]]
        best = ranked._fastest[0]
        rounds = self._rounds.get(floor, 0)
        if rounds < 0 or not any(not f[2] and f[5] == best for f in group):
            return None
        self._rounds[floor] = rounds + 1 if rounds + 1 < SETTLE_AFTER else -1
        if rounds + 1 < SETTLE_AFTER:
            return None
        others = [(row[3], row[0] < 8) for row in rows[end:]] + [(f, False) for f in ranked._near]
        speeds: dict[TrainConfig, set[float]] = {}  # the group's configurations and their speeds
        for f in group:
            speeds.setdefault(f[0][0], set()).add(f[5])
        if self._bound(others, floor, best * (1 + EXOTIC_WIN), speeds):
            return None
        return picks[0]

    def _bound(self, others: list[tuple], floor: float, bar: float, group: dict) -> bool:
        """Whether a plan the rounds can add or time again from ``others`` ((facts, in the ranking's
        plans not near the edge)) could join the first group: at or above ``floor`` and (plain, or
        exotic over ``bar``), not a smaller split equal to a plan of it of the speed it would take with
        no paging (``group``: their configurations and speeds; with paging it takes less, and follows
        that plan)."""
        speeds = self._speeds
        # each plan's step time at a split reads its method, precision, knob class, adapters and checkpointing
        # (``ThroughputMemo.knob_class``: the screen's ``_timed``): each slot timed once at each split, up to
        # the largest any of its plans can reach (below its own, or its own where it is timed again)
        slots: dict[tuple, list] = {}
        classes: dict[tuple, object] = {}  # (the knob classes by their fields, the sharding by identity: hashed once)
        for f, main in others:
            item = f[0]
            config = item[0]
            paged = (item[3] if len(item) > 3 else self._memo.static(config)).terms.paged
            own = f[5] if not paged else None  # (the fastest its smaller splits can be, where known: ``_split_speed``)
            if own is not None and own * (1 + ROUNDING) < floor:
                continue
            top = config.micro_batch - (0 if main and paged else 1)  # (a main paged plan: timed again at its own split)
            if not top:
                continue  # (micro-batch 1, not timed again: nothing to add)
            knobs = (config.method, config.precision, config.optimizer, id(config.sharding), config.gpus)
            known = classes.get(knobs)
            if known is None:
                known = classes[knobs] = speeds.knob_class(config)
            key = (config.method, config.precision, known, config.lora_r, config.lora_targets, config.grad_ckpt)
            found = slots.get(key)
            if found is None:  # [the largest split any of its plans reaches, a configuration, its plans, ceiling]
                found = slots[key] = [0, config, [], 0.0]
            found[0] = max(found[0], top)
            found[3] = max(found[3], math.inf if own is None else own)  # (the fastest any of its splits can be)
            # (exotic at every smaller split: ``_Settling``)
            found[2].append((config, top, f[2] and (not config.sharding.offloaded or config.grad_accum > 1)))
        splits: dict[int, list[int]] = {}
        # the speeds the screen took with no paging (``MemoryMemo.speeds_at``: the float it gives a plan of that
        # slot and split), by split index: 211 of the 274 step times of the bench request over every precision
        screened, split_index = self._memo.speeds_at, self._memo.split_index
        for top, config, plans, ceiling in slots.values():
            if ceiling * (1 + ROUNDING) < floor:
                continue  # (no split of it reaches the floor: none is timed)
            per_device = config.micro_batch * config.grad_accum
            micros = [m for m in splits.get(per_device) or splits.setdefault(per_device, divisors(per_device)) if m <= top]
            row = screened.get((config.method, config.precision))
            v = known = None
            if row is not None:
                v, known = row[1].get((config.lora_r, config.lora_targets)), row[2].get((config.optimizer, config.sharding))
            # largest first: a split's speed never falls as the micro-batch grows (``_split_speed``), so the
            # splits below the first one under the floor are under it too and are not timed (with the plans and
            # slots left out above, the bench request over every precision: 1,427 step times -> 257)
            for micro in reversed(micros):
                found = None if v is None or known is None else row[0].get(
                    (known, v, int(config.grad_ckpt), split_index.get(micro), 0))
                speed = found[0] if found is not None else _split_speed(speeds, config, micro, per_device)
                if speed < floor:
                    if speed * (1 + ROUNDING) < floor:
                        break
                    continue
                for plan, reach, exotic in plans:  # (equal to a plan of the group of this speed: a smaller split only)
                    if micro <= reach and (not exotic or speed > bar) and (micro == plan.micro_batch or speed not in group.get(
                            plan.with_split(micro_batch=micro, grad_accum=per_device // micro), ())):
                        return True
        return False


#: A relative margin for float rounding where ``_split_speed``'s order is read (``_Settling._bound``): two
#: step times summed from different parts may differ in their last bits where the split changes nothing.
ROUNDING = 1e-9


def _split_speed(speeds: ThroughputMemo, config: TrainConfig, micro: int, per_device: int) -> float:
    """Tokens/s of ``config`` at micro-batch ``micro`` of ``per_device`` samples, with no paging.

    At a fixed per-device batch it never falls as the micro-batch grows (the step time never grows):
    every part of ``ThroughputMemo.step_seconds`` is a micro-step's seconds (affine in its tokens with
    nonnegative terms, ``planner.kernels.PricedTerms``, plus the host's excess over them, which only
    shrinks as they grow, ``planner.kernels.host_excess``) times the accumulation steps, or bytes a step
    that grow with the accumulation steps (QLoRA's dequantisation, the expert loop's drains) or do not
    read the split (the optimizer update, collectives, offload). tests/search/test_settling.py holds it
    over every configuration the search makes of several models, on every catalog GPU at 1, 2 and 8 GPUs."""
    return tokens_per_second(config, speeds.step_seconds(
        config.with_split(micro_batch=micro, grad_accum=per_device // micro), 0))


def _ranked_again(ranked: _Ranked, removed: list[tuple], moved: list[tuple], added: list[tuple]) -> _Ranked | None:
    """``_ranking`` of what ``ranked`` ranks, less the plans ``removed`` (the replay dropped them or
    found them near the edge: ``moved``, which join the plans near the edge), plus ``added``
    (in that order, as ``_replayed_plans`` ranks anew: ``read + unread() + added``), made from
    ``ranked``'s order rather than anew; or None where it cannot be (its plans near the edge ranked
    already, or another plain plan now the fastest of its class or tier, which moves the exotic
    plans' group keys): then the caller ranks anew. A replay drops or moves a few of about a
    thousand plans, and a search replays in a dozen rounds (Llama-2-7B on an A10G over every
    precision: 20 rounds, each of a QLoRA plan at micro-batch 8 the replay drops).

    The same order: ``removed`` were read, so they lie in the groups reached; the others keep their
    group keys (the bars are the same) and speeds, so they keep their groups, and what is read of a
    group is its preference order (``_tie_key``), which sees their order by speed only between
    plans of equal tie keys: those ranked anew keep it (a reached group's preference order, a
    stable sort, kept their order by speed), so it is kept here too. A plan ``added`` goes after
    every plan of its group key and speed, as it goes after them in the input ranked anew; those
    near the edge after the plans near the edge, after the ``moved`` (read before them)."""
    if ranked._near_ranked or ranked._fastest is None:
        return None
    fidelity, facts, (best, tiers) = ranked._fidelity, ranked._facts, ranked._fastest
    gone = {id(item) for item in removed}
    rows = ([row for row in ranked._by_speed[:ranked._reached] if id(row[3][0]) not in gone]
            + ranked._by_speed[ranked._reached:])
    new = facts(added)
    safe = [f for f in new if not f[1]]  # (the others are near the edge by their screened totals)
    # where the fastest plain plan left, the fastest of the rest (under speed, only the class's is
    # read: its tiers' may be left out of date, below it, which the plans added still pass only faster than it)
    if any(not f[2] and f[5] == (tiers.get(f[3]) if fidelity else best) for f in facts(removed)):
        fastest = _fastest_plain([*(row[3] for row in rows), *safe])
    else:
        fastest = _fastest_plain(safe, best, dict(tiers))
    if fastest[0] != best or (fidelity and fastest[1] != tiers):  # (under speed the class's bar alone is read)
        return None
    odd_class, odd_tier = _bars(best, tiers)
    for f in safe:
        key, minus = _group_key(f, 0, fidelity, odd_class, odd_tier), -f[5]
        rows.insert(bisect.bisect_right(rows, (key, minus), key=_ROW_ORDER), (key, minus, -1, f))
    return _Ranked(rows, [*facts(moved), *ranked._near, *(f for f in new if f[1])], fidelity, facts, ranked._speeds,
                   fastest)


#: what orders ``_Ranked``'s rows: the group key, then -tokens/s
_ROW_ORDER = itemgetter(0, 1)


def _shown(config: TrainConfig, memory, *, model: ModelSpec, gpu: GPUSpec, shown: dict) -> dict:
    """A plan shown's memory, with its uncertainty, and throughput estimate, once a search (``shown``,
    by configuration: its full estimate is one a search, ``replays``); both policies' lists show
    most plans (Llama-2-7B on an A10G: the other policy's three plans were all among the five).
    ``memory``: its ``ReplayedTotals`` (``shared_estimate``), whose whole estimate is made here."""
    found = shown.get(config)
    if found is None:
        found = shown[config] = {
            "memory": _with_uncertainty(config, memory.estimate(), gpu),
            "throughput": estimate_throughput(model=model, config=config, gpu=gpu, paged_host=memory.paged_host_bytes)}
    return found


def _with_uncertainty(config: TrainConfig, memory, gpu: GPUSpec):
    """The plan's memory with its 90% interval and probability of running out of memory."""
    return memory.with_uncertainty(interval=memory_interval(config, memory),
                                   oom_probability=oom_risk(config, memory, capacity=gpu.memory_bytes))


def _next_smaller_split(config: TrainConfig, *, model: ModelSpec, gpu: GPUSpec, memo: MemoryMemo,
                        speeds: ThroughputMemo | None = None) -> tuple | None:
    """(config, speed, screened total) of ``config`` with the next smaller micro-batch that divides
    its per-device batch, or None at micro-batch 1."""
    per_device = config.micro_batch * config.grad_accum
    micro = max((d for d in divisors(per_device) if d < config.micro_batch), default=None)
    if micro is None:
        return None
    split = (micro, per_device // micro)
    [(total, _host)] = totals_by_split(model=model, config=config, gpu=gpu, splits=[split], memo=memo)
    smaller = config.with_split(micro_batch=split[0], grad_accum=split[1])
    # (the screen's memo: ``ThroughputMemo.step_seconds`` is the sum of ``step_breakdown``, the same float)
    paging = paged_host(memo.static(smaller).terms, total, gpu)
    step_s = (speeds or ThroughputMemo(model, gpu)).step_seconds(smaller, paging)
    return smaller, Speed(tokens_per_second(smaller, step_s)), total


#: Within 2% of predicted speed (below what the throughput model can tell apart), prefer the
#: optimizer that trains closest to the usual recipe (AdamW), then the plan with fewer moving
#: parts (no DeepSpeed, then no offload), then fp32 master weights. On one GPU, ZeRO without
#: offload saves nothing, and a tie means offload bought nothing either.
SPEED_TIE = 0.02
OPTIMIZER_PREFERENCE = {o: OPTIMIZERS[o].preference for o in Optimizer}  # each optimizer's descriptor (planner.optim)
PRECISION_PREFERENCE = {Precision.BF16_MIXED: 0, Precision.FP16_MIXED: 1, Precision.FP32: 2, Precision.BF16: 3, Precision.FP16: 4,
                        Precision.FP8: 5}  # fp8 last: in a speed tie the better-trodden bf16 wins (tradeoffs.py)
#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and the search reads it thousands of times a search
_FP32 = Precision.FP32


class _PlanFacts:
    """``facts(items)``: what the ranking reads of each fitting plan that neither the policy nor a
    re-ranking changes, (item, near the edge by its screened total (``_safe_bound``), exotic (1 or
    0), fidelity tier, ``family_key``, tokens/s), worked out once a plan (``describe``, of the plans
    not seen yet): both policies rank the same thousand plans. Kept by the item's identity, with the
    item, so no other item takes its id while the facts live (one search).

    The ranking's memo for one search besides: ``orders``, each group's preference order
    (``_Ranked._preferred``); ``plain``, the screen's plans' order by speed (``_ranking``)."""

    __slots__ = ("_describe", "_known", "_last", "orders", "plain")

    def __init__(self, describe) -> None:
        self._describe = describe  # (new items) -> their facts, in order
        self._known: dict[int, tuple] = {}
        # the last list asked of and its answer: a search asks of the screen's fitting plans four
        # times (both policies' rankings, the families that fit, _edge_only), and no caller changes either
        self._last: tuple = (None, None)
        #: the plans of a group (their facts' ids, by speed) -> their preference order: the rankings made
        #: again after each replay (``_ranked_again``) reach the same first groups round after round
        #: (Llama-2-7B on an A10G over every precision: 20 rounds, each reading about 90 plans)
        self.orders: dict[tuple, list[tuple]] = {}
        #: (fitting, safe facts, ``_by_speed`` of them, near facts) of the screen's plans: both policies rank them
        self.plain: tuple | None = None

    def __call__(self, items: list[tuple]) -> list[tuple]:
        if items is self._last[0]:
            return self._last[1]
        known = self._known
        new = [item for item in items if id(item) not in known] if known else items  # (first: the screen's plans)
        if new:
            known.update(zip(map(id, new), self._describe(new)))
        out = list(map(known.__getitem__, map(id, items)))
        self._last = items, out
        return out


def _plan_facts(gpu: GPUSpec, exotic=None) -> _PlanFacts:
    """The facts of the fitting plans on ``gpu`` (``_PlanFacts``): each plan near the edge of it
    by its screened total (``_safe_bound``), ``exotic`` (``_exotic``; none without it), its fidelity
    tier, ``family_key`` and tokens/s (None: untimed, near the edge)."""
    bounds: dict = {}
    # what the family decides (its safe bound, fidelity tier and key), once a family: a search ranks
    # about a thousand plans of a few dozen families
    kinds: dict[tuple, tuple[int, int, tuple]] = {}

    def describe(new: list[tuple]) -> list[tuple]:
        out = []
        for item, odd in zip(new, exotic(new) if exotic is not None else repeat(0)):
            config = item[0]
            family = family_key(config)
            kind = kinds.get(family)
            if kind is None:
                kind = kinds[family] = (_safe_bound(config, gpu, bounds), fidelity_tier(config), family)
            out.append((item, 1 if item[2] > kind[0] else 0, odd, kind[1], kind[2],
                        item[1] and item[1].tokens_per_s))  # (None: untimed, near the edge)
        return out

    return _PlanFacts(describe)


def _ranking(fitting: list[tuple], prefer: Prefer, facts: _PlanFacts, *, edgy: set[int] = frozenset(),
             speeds: ThroughputMemo | None = None) -> _Ranked:
    """The fitting plans in rank order: the plans that are not near the edge (by their
    screened totals, ``_safe_bound``, or, ids in ``edgy``, by their replays) before those that are;
    among each, the exotic plans (``_exotic``) that are not faster than every other plan of
    their kind by more than EXOTIC_WIN after the others; then, under ``fidelity``, fidelity
    tier (``fidelity_tier``), then speed; under ``speed``, speed alone. Plans within SPEED_TIE of the
    fastest plan of their group are a tie, ordered by the preferences (a group is measured from
    its leader, so two plans 1% apart are never split by a fixed bucket boundary). Each group is
    put in preference order only when the reader reaches it: the search shows the first few of
    about a thousand fitting plans, once per policy; and the plans near the edge are ranked only
    when the reader has read every other, as nothing of theirs decides the order before them
    (so the screen leaves them untimed: ``planner.search.Screened.fitting``; ``speeds`` times
    them). Each plan's facts (``_plan_facts``) are read once a search; equal keys keep the input
    order."""
    fidelity = prefer is Prefer.FIDELITY
    known = facts(fitting)
    if not edgy and facts.plain is not None and fitting is facts.plain[0]:  # (the other policy's ranking of the same plans)
        _, safe, by_speed, near = facts.plain
    elif edgy:
        edges = [f[1] or int(id(f[0][0]) in edgy) for f in known]
        safe, near = [f for f, e in zip(known, edges) if not e], [f for f, e in zip(known, edges) if e]
        by_speed = _by_speed(safe)
    else:
        safe, near = [f for f in known if not f[1]], [f for f in known if f[1]]
        by_speed = _by_speed(safe)
        facts.plain = fitting, safe, by_speed, near  # (both policies rank the screen's plans: their order by speed once)
    return _Ranked(_grouped(safe, 0, fidelity, by_speed), near, fidelity, facts, speeds, by_speed[3])


def _by_speed(known: list[tuple]) -> tuple[list[float], list[int], tuple[float, dict[int, float]],
                                            tuple[float, dict[int, float]]]:
    """What ``_grouped`` reads of one edge class whatever the policy: each plan's -tokens/s, the
    plans' indices by speed (a stable sort on one float: equal speeds keep the input order) and the
    speed at or below which an exotic plan ranks after the plain ones: under ``speed`` the fastest
    plain plan's of the class; under ``fidelity`` that of its own fidelity tier (by tier), or the
    class's where its tier has no plain plan. Under ``fidelity`` an exotic plan competes with the
    plans it ranks among: a faster plain QLoRA plan (tier 2; QLoRA's 16-bit stream under
    --no-kbit-upcast) demoted LoRA's ZeRO-1 plan on one A10G (1,504 tokens/s) below a plain LoRA
    plan with offload (1,292), so a QLoRA setting changed the LoRA plan shown. A tier of exotic
    plans alone keeps the class's bar: Llama-3.2-1B on a T4 would otherwise lead with full
    fine-tuning offloaded to the host (301 tokens/s) over LoRA (3,748). Last, the fastest plain
    plans' speeds themselves (the class's, by tier: ``_fastest_plain``), which ``_ranked_again`` keeps."""
    best, tiers = _fastest_plain(known)
    minus = [-f[5] for f in known]
    return minus, sorted(range(len(known)), key=minus.__getitem__), _bars(best, tiers), (best, tiers)


def _fastest_plain(known: Iterable[tuple], best: float = 0.0,
                   tiers: dict[int, float] | None = None) -> tuple[float, dict[int, float]]:
    """The speed of the fastest plain plan (not exotic) of ``known`` (their facts), and of each
    fidelity tier that has one (0.0 where there is none); ``best`` and ``tiers``: those of other
    plans, to take with them (``tiers`` is updated)."""
    tiers = {} if tiers is None else tiers
    for f in known:
        if not f[2] and f[5] > tiers.get(f[3], 0.0):
            tiers[f[3]] = f[5]
            best = max(best, f[5])
    return best, tiers


def _bars(best: float, tiers: dict[int, float]) -> tuple[float, dict[int, float]]:
    """The speeds at or below which an exotic plan ranks after the plain ones (``_by_speed``), of
    the class and by tier, from ``_fastest_plain``'s."""
    return best * (1 + EXOTIC_WIN), {tier: speed * (1 + EXOTIC_WIN) for tier, speed in tiers.items()}


def _group_key(f: tuple, base: int, fidelity: bool, odd_class: float, odd_tier: dict[int, float]) -> int:
    """A plan's group key (its facts ``f``; ``base``: 8 near the edge, else 0): near the edge, then
    exotic and not faster than the plain plans by EXOTIC_WIN (``_bars``), then (under fidelity)
    the fidelity tier (0-3)."""
    odd = odd_tier.get(f[3], odd_class) if fidelity else odd_class
    return base + (4 if f[2] and f[5] <= odd else 0) + (f[3] if fidelity else 0)


def _grouped(known: list[tuple], edge: int, fidelity: bool, by_speed: tuple | None = None) -> list[tuple]:
    """(group key, -tokens/s, index, facts) of each plan of one edge class (``known``: their
    facts, timed), in group key and speed order (``_ranking``); ``by_speed``: ``_by_speed(known)``
    where the caller has it."""
    minus, order, (odd_class, odd_tier), _ = by_speed or _by_speed(known)
    # the order of (group key, -tokens/s, input index): the plans by speed, then put in their
    # groups' buckets in that order, so only the few group keys are sorted, not a thousand tuples
    # (two rankings were 5% of a search)
    groups: dict[int, list[tuple]] = {}
    base = edge * 8
    for n in order:
        f = known[n]
        key = _group_key(f, base, fidelity, odd_class, odd_tier)
        found = groups.get(key)
        if found is None:
            found = groups[key] = []
        found.append((key, minus[n], n, f))
    return [row for key in sorted(groups) for row in groups[key]]


class _Ranked:
    """``_ranking``'s order, read plan by plan: each group (a group key's plans within SPEED_TIE
    of its leader, the fastest) is put in preference order (``_tie_key``) when the reader reaches it.

    ``unread()`` hands over the plans not read yet with the groups not reached as they are, by
    speed: ranked again (``_replayed_plans``), they come out as the whole preference order would.
    ``_ranking`` reads its input's order only between plans of one group with equal tie keys (the
    key includes the speed, and equal group keys and speeds are one group), and a group's
    preference order, a stable sort, keeps such plans in their order by speed. (Materialised in
    preference order, a ``--gpu any`` comparison put every group of about a thousand plans in
    order after each replay that dropped a plan: 5% of its samples in py-spy.)"""

    def __init__(self, by_speed: list[tuple], near: list[tuple], fidelity: bool, facts: _PlanFacts,
                 speeds: ThroughputMemo | None = None, fastest: tuple[float, dict[int, float]] | None = None) -> None:
        self._by_speed = by_speed  # (group key, -tokens/s, input index, facts), sorted
        self._reached = 0  # by_speed's first plan of a group not reached
        self._group: list[tuple] = []  # the group being read, in preference order
        self._entry: list = [self._group, []]  # its ``_preferred`` entry
        self._read = 0  # of it
        # the facts of the plans near the edge, in input order, until by_speed holds them (``_near``)
        self._near, self._fidelity, self._facts, self._speeds = near, fidelity, facts, speeds
        self._fastest = fastest  # the plans not near the edge's ``_fastest_plain`` (``_ranked_again``)
        self._near_ranked = False  # whether by_speed holds the plans near the edge

    def _rank_near(self) -> None:
        """Put the plans near the edge after the others, timing those the screen left untimed (their
        input order, which ``unread`` hands over until now, ranks again as their order by speed
        does: of two plans near the edge of one speed and tier, both plain or both exotic are in
        one group whatever the fastest plain plan, and a plain and an exotic one never are)."""
        near, self._near = self._near, ()
        untimed = [f[0] for f in near if f[5] is None]
        if untimed:
            again = dict(zip(map(id, untimed), self._facts([timed(item, self._speeds) for item in untimed])))
            near = [again.get(id(f[0]), f) for f in near]
        self._by_speed.extend(_grouped(near, 1, self._fidelity))
        self._near_ranked = True

    def __iter__(self) -> _Ranked:
        return self

    def __next__(self) -> tuple:
        if self._read == len(self._group) and not self._next_group():
            raise StopIteration
        self._read += 1
        return self._group[self._read - 1]

    def _next_group(self) -> bool:
        """Reach the next group, put in preference order (False: every plan is read)."""
        by_speed, start = self._by_speed, self._reached
        if start == len(by_speed):
            if not self._near:
                return False
            self._rank_near()
        tier, floor = by_speed[start][0], -by_speed[start][1] / (1 + SPEED_TIE)
        end = start + 1
        while end < len(by_speed) and by_speed[end][0] == tier and -by_speed[end][1] >= floor:
            end += 1
        self._entry = self._preferred([row[3] for row in by_speed[start:end]])
        self._group, self._reached, self._read = self._entry[0], end, 0
        return True

    def _preferred(self, group: list[tuple]) -> list:
        """[the plans of a group (their facts, by speed) in preference order, a stable sort on
        ``_tie_key``; ``_families_first``'s of them, once asked (None)]; once a search for each group
        (``_PlanFacts.orders``, by the facts' identities, in order): the rankings made again after
        each replay (``_ranked_again``) reach the same first groups round after round (Llama-2-7B on
        an A10G over every precision: 20 rounds, each reading about 90 plans before the third family shown)."""
        orders = self._facts.orders
        key = tuple(map(id, group))
        found = orders.get(key)
        if found is None:
            found = orders[key] = [[f[0] for f in sorted(group, key=_tie_key)], None]
        return found

    def _families_first(self) -> list[tuple[int, tuple, tuple]]:
        """(index, kind, family) of each family's first plan in the group being read (``_distinct``'s
        kinds and families), in order; once a group (``_preferred``)."""
        entry = self._entry
        if entry[1] is None:
            entry[1] = _families_first(entry[0], 0)
        return entry[1]

    @property
    def by_speed(self) -> list[tuple]:
        """(group key, -tokens/s, input index, facts) of every plan, in group key and speed order."""
        if self._near:
            self._rank_near()
        return self._by_speed

    def unread(self) -> list[tuple]:
        return (self._group[self._read:] + [row[3][0] for row in self._by_speed[self._reached:]]
                + [f[0] for f in self._near])


def _tie_key(facts: tuple) -> tuple:
    """Within a speed tie (a plan's ``_plan_facts``): the more faithful plan, then the usual
    optimizer, fewer moving parts, the preferred precision, then the plan with more room on the device."""
    (config, throughput, total, *_), tier = facts[0], facts[3]
    sharding = config.sharding
    return (tier, OPTIMIZER_PREFERENCE[config.optimizer], sharding.moving_parts,
            PRECISION_PREFERENCE[config.precision], sharding.spec.order, total, -throughput.tokens_per_s)


def _precision_class(config: TrainConfig) -> str:
    """What the precision does to the trained model: fp32, mixed (fp32 weights, 16-bit compute;
    bf16-mixed, fp16-mixed and fp8 are one choice: fp8 is bf16-mixed with float8 GEMMs, shown
    where it ranks first) or pure 16-bit weights. DeepSpeed's mixed mode
    casts the model to 16 bits and keeps the fp32 copy of what trains only: for LoRA that is
    pure 16-bit LoRA with DeepSpeed added."""
    if config.precision is _FP32:
        return "fp32"
    if config.precision.is_mixed and not (config.sharding.spec.casts_model and config.method.uses_adapters):
        return "mixed"
    return "16-bit"


def _distinct(ranked: Iterator[tuple], k: int, read: list[tuple], kinds: dict | None = None) -> list[tuple]:
    """The top k, one per (method, precision class, optimizer) and two per (method, precision
    class), so the list shows real choices:
    not r8 beside r16, bf16-mixed beside fp16-mixed with the same numbers, or a plan beside the
    same plan with ZeRO or offload added (ZeRO-1 on one GPU) that is not faster (a variant that is
    faster ranks first and is the one shown). Every plan taken from ``ranked`` is appended to
    ``read``. ``kinds``: each plan's (kind, family) by its configuration's id, kept by the caller
    for its next rounds (``_replayed_plans``: a round reads about 90 plans of Llama-2-7B on an
    A10G before the third family, the same plans round after round).

    A ``_Ranked`` is read a group at a time, and of each group only each family's first plan is
    asked about (``_Ranked._families_first``, once a group a search): a later plan of a family is
    never taken where its first was not, as a family taken stays taken and a kind's count only
    grows (the rounds of the bench request read about 2,100 plans to take 70)."""
    out: list[tuple] = []
    families: set[tuple] = set()
    per_kind: dict[tuple, int] = {}  # at most two optimizers per (method, precision class)
    if isinstance(ranked, _Ranked):
        while ranked._read < len(ranked._group) or ranked._next_group():
            group, start = ranked._group, ranked._read
            for i, kind, family in ranked._families_first() if not start else _families_first(group, start):
                if family not in families and per_kind.get(kind, 0) < 2:
                    families.add(family)
                    per_kind[kind] = per_kind.get(kind, 0) + 1
                    out.append(group[i])
                    if len(out) == k:
                        read.extend(group[start:i + 1])
                        ranked._read = i + 1
                        return out
            read.extend(group[start:])
            ranked._read = len(group)
        return out
    kinds = {} if kinds is None else kinds
    for c in ranked:
        read.append(c)
        found = kinds.get(id(c[0]))
        if found is None:
            kind = (c[0].method, _precision_class(c[0]))
            found = kinds[id(c[0])] = kind, (*kind, c[0].optimizer)
        kind, family = found
        if family not in families and per_kind.get(kind, 0) < 2:
            families.add(family)
            per_kind[kind] = per_kind.get(kind, 0) + 1
            out.append(c)
            if len(out) == k:
                break
    return out


def _families_first(plans: list[tuple], start: int) -> list[tuple[int, tuple, tuple]]:
    """(index, (method, precision class), (method, precision class, optimizer)) of each family's
    first plan of ``plans[start:]``, in order (``_distinct``)."""
    seen: set[tuple] = set()
    out = []
    for i in range(start, len(plans)):
        config = plans[i][0]
        kind = (config.method, _precision_class(config))
        family = (*kind, config.optimizer)
        if family not in seen:
            seen.add(family)
            out.append((i, kind, family))
    return out


class _Tried(NamedTuple):
    """A family's closest try, as the fast path screened it."""

    config: TrainConfig
    process_total_bytes: int
    cpu_bytes: int


def _edge_only(fitting: list[tuple], plans: tuple[Candidate, ...], *, best_tier: int, gpu: GPUSpec) -> tuple[Rejection, ...]:
    """A line for each family at least as faithful as #1 that fits only near the edge and is not
    shown (a safe plan exists, so the ranking keeps it out: issue 20, item 1): its safest plan and
    that plan's probability of running out of memory. Without it, e.g. full fine-tuning of
    Llama-3.2-1B on a T4 (fp32 Adafactor, 19% OOM risk) would leave the list with no word.
    ``fitting``: the fitting plans' ``_plan_facts``."""
    shown = {family_key(c.config) for c in plans}
    safest: dict[tuple, tuple] = {}
    for item, _, _, tier, key, _ in fitting:
        if tier <= best_tier and key not in shown and (key not in safest or item[2] < safest[key][2]):
            safest[key] = item
    bounds: dict = {}
    lines = []
    for config, _, total, *_ in sorted(safest.values(), key=lambda item: (fidelity_tier(item[0]), item[2])):
        if total <= _safe_bound(config, gpu, bounds):
            continue  # a safe plan of this family exists: it is left out for speed or variety, not for memory
        risk = oom_probability(total, gpu.memory_bytes, spread(config.method, gpus=config.gpus))
        reason = (f"fits only near the edge: its safest plan, {config.label()}, needs {format_bytes(total)}, an OOM risk "
                  f"of {risk:.0%} (over {NEAR_EDGE_PROBABILITY:.0%}); shown only when no safe plan exists")
        lines.append(Rejection(family=family_label(config), reason=reason, config=config.to_dict()))
    return tuple(lines)


def _rejection(c: _Tried, *, model: ModelSpec, usable: int, space: SearchSpace) -> Rejection:
    """One line for a family: its plain model states if they alone overflow, else its closest try."""
    # whole replicas: DDP on more than one GPU (a copy with the sharding checked, not a full construction)
    plain = c.config.with_knobs(optimizer=c.config.optimizer, sharding=NONE)
    states = model_states_bytes(model, plain)
    tried = c.config.label()
    if c.cpu_bytes > space.offload_budget(c.config.gpus) and c.process_total_bytes <= usable:
        shortfall = host_shortfall(c.cpu_bytes, ranks=c.config.gpus, node_ram=space.cpu_mem_bytes,
                                   source=space.host_ram_source)
        reason = f"model states need {format_bytes(states)} on the device; with {tried} they fit, but offload needs {shortfall}"
    elif states > usable and not c.config.sharding.plain:
        reason = (f"model states alone need {format_bytes(states)} > {format_bytes(usable)} usable; the closest try, "
                  f"{tried}, needs {format_bytes(c.process_total_bytes)}")
    elif states > usable:
        reason = f"model states alone need {format_bytes(states)} > {format_bytes(usable)} usable"
    else:
        reason = f"the smallest try, {tried}, needs {format_bytes(c.process_total_bytes)} > {format_bytes(usable)} usable"
    return Rejection(family=family_label(c.config), reason=reason, config=c.config.to_dict())


def _nothing_fits_message(*, model: ModelSpec, gpu: GPUSpec, closest: dict[str, _Tried], usable: int, space: SearchSpace) -> str:
    if not closest:
        return f"no configuration of the searched space is valid for {model.id} on {gpu.name}: widen --method/--precision"
    best = min(closest.values(), key=lambda c: c.process_total_bytes)
    need = best.process_total_bytes
    if need <= usable:
        # the device would hold it: what is missing is host RAM for the offloaded states
        ranks = best.config.gpus
        shortfall = host_shortfall(best.cpu_bytes, ranks=ranks, node_ram=space.cpu_mem_bytes, source=space.host_ram_source)
        return (
            f"nothing fits {model.id} on {gpu.name} with the host RAM for offload: the closest, {best.config.label()}, "
            f"fits the device ({format_bytes(need)} of {format_bytes(usable)} usable) but offload needs "
            f"{shortfall}; try --cpu-mem "
            f"{format_bytes(node_ram_needed(best.cpu_bytes, ranks)).replace(' ', '')} on a host that has it, "
            "more GPUs (--gpus) or a shorter --seq-len"
        )
    hints = advice(model=model, gpu=gpu, config=best.config, total=need, target=usable, space=space,
                   others=tuple(c.config for c in closest.values()))
    if not space.allow_offload:
        hints.append("allowing offload (drop --no-offload)")
    return (
        f"nothing fits {model.id} on {gpu.name} ({format_bytes(usable)} usable): the closest, "
        f"{best.config.label()}, needs {format_bytes(need)} ({format_bytes(need - usable)} too much); "
        + (f"what would change that: {', '.join(hints)}" if hints else
           "none of the planner's options lowers it: a GPU with more memory than the catalog's, or another model")
    )


def _edge_advice(plans: tuple[Candidate, ...], *, model: ModelSpec, gpu: GPUSpec, space: SearchSpace) -> tuple[str, ...]:
    """What would give room when every plan shown is near the edge: the options that lower the
    first plan's process total, with how much, against the largest total that is not near the edge."""
    capacity = gpu.memory_bytes
    if not plans or any(not near_edge(p.config, p.memory, capacity=capacity) for p in plans):
        return ()
    top = plans[0]
    return tuple(advice(model=model, gpu=gpu, config=top.config, total=top.memory.process_total_bytes,
                        target=_safe_bound(top.config, gpu, {}), space=space))


__all__ = ["OPTIMIZER_PREFERENCE", "PRECISION_PREFERENCE", "SPEED_TIE", "suggest"]
