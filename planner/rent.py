"""Which GPU to rent: one request planned on every catalog GPU type and count of one node, each
best plan priced for the tokens the job trains.

For each GPU type and count (1, 2, 4 and 8 GPUs, up to ``gpus_max``: the node shapes clouds rent),
``planner.planning.make_plan`` answers the request as ``planner suggest`` would (its #1 plan, by the
request's ranking policy); the option's time is the tokens over the plan's tokens per second, its
cost that time x the GPUs x the GPU's cheapest price in the table (``planner.pricing``), with the
price's provider and date. A GPU type the table does not price is still planned and timed, and
said to have no price.

What this does not know: whether a provider rents that many of the GPU on one node (the catalog's
standard machines, ``planner gpus --json``, list the common ones), queueing or spot interruptions,
and the time a run spends outside training steps (loading, evaluation, checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import InvalidConfigError, NothingFitsError

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.config import Precision
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.planning import SuggestRequest
    from planner.pricing import GpuPrice, PriceTable
    from planner.results import Candidate

#: GPUs on one node that the comparison plans: the node shapes clouds rent (16 only when --gpus-max asks)
NODE_SIZES = (1, 2, 4, 8, 16)
#: ``--tokens`` when none is given: prices read as dollars per billion tokens
DEFAULT_TOKENS = 1_000_000_000
#: a job longer than a century is a typo in --tokens, not a plan
MAX_TOKENS = 10**16


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_tokens(text: str, *, option: str = "--tokens") -> int:
    """A token count as people write it: ``1000000``, ``1e9``, ``1_000_000``, ``500M``, ``2B``,
    ``1.5T`` (K, M, B or G, T: thousands to trillions)."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    scale = _SUFFIXES.get(raw[-1:].lower(), 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise InvalidConfigError(f"{option} must be a number of tokens such as 1e9, 500M or 2B, got {text!r}") from None
    if not math.isfinite(value) or value < 1 or value > MAX_TOKENS:
        raise InvalidConfigError(f"{option} must be from 1 to 1e16 tokens, got {text!r}")
    return round(value)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The tokens the job trains, and where the number comes from."""

    tokens: int
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or not 1 <= self.tokens <= MAX_TOKENS:
            raise InvalidConfigError(f"--tokens must be a whole number of tokens from 1 to 1e16, got {self.tokens!r}")


def workload(*, tokens: int | None = None, epochs: float | None = None, epoch_tokens: int | None = None,
             epoch_source: str = "--dataset-tokens") -> Workload:
    """The job's tokens: ``tokens``; or ``epochs`` x ``epoch_tokens``; or one billion, said so."""
    if tokens is not None and (epochs is not None or epoch_tokens is not None):
        raise InvalidConfigError("give either --tokens, or --epochs with --dataset-tokens (or --dataset), not both")
    if tokens is not None:
        return Workload(tokens=tokens, source="--tokens")
    if epochs is None and epoch_tokens is None:
        return Workload(tokens=DEFAULT_TOKENS, source="no --tokens given: per billion tokens")
    if epochs is None or epoch_tokens is None:
        raise InvalidConfigError("--epochs needs the tokens of one epoch: add --dataset-tokens N or --dataset FILE "
                                 "(or give --tokens instead)")
    if not (math.isfinite(epochs) and epochs > 0):
        raise InvalidConfigError(f"--epochs must be a positive number, got {epochs!r}")
    if epochs * epoch_tokens > MAX_TOKENS:  # (the product may be inf: round() would raise OverflowError)
        raise InvalidConfigError(f"--epochs {epochs:g} x {epoch_tokens:,} tokens ({epoch_source}) is more than 1e16 "
                                 "tokens: give the epochs the job trains and the tokens of one epoch")
    return Workload(tokens=max(1, round(epochs * epoch_tokens)),
                    source=f"{epochs:g} epoch{'s' if epochs != 1 else ''} x {epoch_tokens:,} tokens ({epoch_source})")


@dataclass(frozen=True, kw_only=True)
class RentOption:
    """One GPU type and count: its best plan (None: nothing fits, ``reason`` says why), timed and priced."""

    gpu: str
    gpus: int
    price: "GpuPrice | None"
    plan: "Candidate | None"
    tokens: int
    reason: str = ""

    @property
    def hours(self) -> float | None:
        if self.plan is None or self.plan.throughput.tokens_per_s <= 0:
            return None
        return self.tokens / self.plan.throughput.tokens_per_s / 3600

    @property
    def dollars(self) -> float | None:
        hours = self.hours
        if hours is None or self.price is None:
            return None
        return hours * self.gpus * self.price.usd_per_gpu_hour

    @property
    def tokens_per_dollar(self) -> float | None:
        dollars = self.dollars
        return self.tokens / dollars if dollars else None

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "gpu": self.gpu, "gpus": self.gpus, "fits": plan is not None,
            "hours": self.hours, "dollars": self.dollars, "tokens_per_dollar": self.tokens_per_dollar,
            "price": self.price.to_dict() if self.price is not None else None,
            "plan": None if plan is None else {
                "label": plan.config.label(), "config": plan.config.to_dict(),
                "tokens_per_s": plan.throughput.tokens_per_s,
                "peak_reserved_bytes": plan.memory.peak_reserved_bytes,
                "oom_probability": plan.memory.oom_probability,
            },
            "reason": self.reason,
        }


@dataclass(frozen=True, kw_only=True)
class RentComparison:
    options: tuple[RentOption, ...]
    """Every GPU type and count planned, in the catalog's order."""
    workload: Workload
    prices: "PriceTable"
    model_id: str

    def by_cost(self) -> tuple[RentOption, ...]:
        """The priced options that fit, cheapest first (then fastest)."""
        priced = [o for o in self.options if o.dollars is not None]
        return tuple(sorted(priced, key=lambda o: (o.dollars, o.hours, o.gpu, o.gpus)))

    def by_time(self) -> tuple[RentOption, ...]:
        """The options that fit, priced or not, fastest first (then cheapest)."""
        timed = [o for o in self.options if o.hours is not None]
        return tuple(sorted(timed, key=lambda o: (o.hours, o.dollars if o.dollars is not None else math.inf,
                                                  o.gpu, o.gpus)))

    def unfit(self) -> tuple[str, ...]:
        """GPU types on which no count planned fits."""
        fitting = {o.gpu for o in self.options if o.plan is not None}
        return tuple(dict.fromkeys(o.gpu for o in self.options if o.gpu not in fitting))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "tokens": self.workload.tokens, "tokens_source": self.workload.source,
            "prices": self.prices.origin,
            "by_cost": [o.to_dict() for o in self.by_cost()],
            "by_time": [o.to_dict() for o in self.by_time()],
            "unfit": list(self.unfit()),
            "options": [o.to_dict() for o in self.options],
        }


def compare_gpus(request: "SuggestRequest", *, workload: Workload, prices: "PriceTable", gpus_max: int = 8,
                 gpu_names: Sequence[str] | None = None, spec: "ModelSpec | None" = None,
                 calibration_of: "Callable[[str], Calibration | None] | None" = None,
                 processes: int = 1) -> RentComparison:
    """Plan ``request`` (its ``gpu`` and ``gpus`` are replaced) on every GPU type of the catalog
    (or ``gpu_names``) and every node size up to ``gpus_max``. ``calibration_of(gpu)``: the
    device's active calibration, if any. A bad request fails once, before anything is planned.
    ``processes``: plan the GPU types in this many processes at once (``_each_device``; forks, so
    only where the caller holds no threads: the CLI, not the service)."""
    from planner.catalog import resolve_model
    from planner.config import Precision
    from planner.gpus import get_gpu, list_gpus
    from planner.limits import MAX_GPUS_PER_NODE
    from planner.memo import collector_paused
    from planner.planning import AUTO
    from planner.search import shared_terms

    if isinstance(gpus_max, bool) or not isinstance(gpus_max, int) or not 1 <= gpus_max <= MAX_GPUS_PER_NODE:
        raise InvalidConfigError(f"--gpus-max must be a whole number from 1 to {MAX_GPUS_PER_NODE} (the GPUs of one "
                                 f"node), got {gpus_max!r}")
    if gpu_names is not None and not list(gpu_names):  # (an empty answer would read as "nothing to rent")
        raise InvalidConfigError("no GPU type to compare: name at least one from 'planner gpus' (e.g. a10g,l4), "
                                 "or leave the list out to compare the whole catalog")
    devices = ([g for g in list_gpus() if g.name != "cpu"] if gpu_names is None
               else list({d.name: d for d in (get_gpu(n.strip()) for n in gpu_names)}.values()))
    if any(d.name == "cpu" for d in devices):
        raise InvalidConfigError("cpu is this machine, not a GPU to rent: compare GPU names from 'planner gpus'")
    spec = spec if spec is not None else resolve_model(request.model)
    pinned = None
    if request.precision != AUTO and request.precision in {p.value for p in Precision}:
        pinned = Precision(request.precision)  # (a misspelt one is make_plan's one line, on the first GPU)

    counts = tuple(n for n in NODE_SIZES if n <= gpus_max and request.target_batch % n == 0)

    def options_of(device: GPUSpec, sizes: tuple[int, ...]) -> list[RentOption]:
        return _options_on(device, request, spec=spec, prices=prices, counts=sizes, workload=workload,
                           pinned=pinned, calibration_of=calibration_of)

    # the device-free terms computed once for every GPU of the same kernels; the collector paused: the
    # tables grow over the searches, and its passes scanned them again and again (``collector_paused``)
    with shared_terms(spec), collector_paused():
        options = [o for found in _each_device(devices, counts, options_of, processes=processes) for o in found]
    return RentComparison(options=tuple(options), workload=workload, prices=prices, model_id=spec.id)


def _each_device(devices: list[GPUSpec], counts: tuple[int, ...],
                 options_of: Callable[[GPUSpec, tuple[int, ...]], list[RentOption]], *,
                 processes: int) -> list[list[RentOption]]:
    """``options_of`` of each device at ``counts``, in order. With ``processes`` > 1 (where the OS
    forks) ``processes`` forked children each take the next unit of work no process has taken until
    none is left (the searches are independent), and this process waits for their answers: a child
    ends without freeing the tables its searches filled (``multiprocessing`` ends it with
    ``os._exit``), where this process, planning a share itself, spent 0.17 s of the comparison's
    2.1 s wall freeing its own as ``shared_terms`` closed (Llama-3.1-8B below). Taken as they finish
    rather than dealt out in turn: a search costs from 0.01 to 0.3 s of CPU (a GPU of more memory
    fits more plans; the first of a kind of kernels and GPU count computes the shared terms).

    A unit is one GPU count on every device where there are at least as many counts as processes,
    else one device at every count: the searches of one GPU count share most of their terms (the
    rows, the static terms and batch lines, the screenings, the timelines of the plans shown), those
    of one device its throughput memo only. Llama-3.1-8B at target batch 32 over the catalog, in one
    process without the collector: 2.27 s of CPU; counts 1 and 2 alone 1.23 s, 4 and 8 alone 1.12 s,
    where each count alone is 0.47-0.74 s: units of a device had each process work out every count's
    terms. A child's options come back pickled; its error is raised here."""
    import multiprocessing

    if len(counts) >= processes:
        units = [(tuple(range(len(devices))), (count,)) for count in counts]
    else:
        units = [((n,), counts) for n in range(len(devices))]
    processes = min(processes, len(units))
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [options_of(device, counts) for device in devices]

    def planned_unit(unit: tuple[tuple[int, ...], tuple[int, ...]]) -> list[tuple[int, list[RentOption]]]:
        return [(n, options_of(devices[n], unit[1])) for n in unit[0]]

    context = multiprocessing.get_context("fork")
    taken = context.Value("i", 0)  # the index of the next unit not taken, shared by every process
    children = []
    planned: dict[int, list[RentOption]] = {n: [] for n in range(len(devices))}
    try:
        for _ in range(processes):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_plan_share, args=(send, planned_unit, units, taken), daemon=True)
            child.start()
            send.close()
            children.append((child, receive))
        found = []
        for child, receive in children:
            found.extend(_received(child, receive))
    except BaseException:
        for child, _ in children:
            child.kill()  # (their answers are not needed: the comparison fails)
        raise
    finally:
        for child, _ in children:
            child.join()
    for done in found:
        for n, options in done:
            planned[n].extend(options)
    # each device's options in the order of its counts (a unit of one count gave one option a device)
    return [sorted(planned[n], key=lambda o: counts.index(o.gpus)) for n in range(len(devices))]


def _take_units(units: list, planned_unit: Callable[[Any], Any], taken) -> list:
    """``planned_unit`` of each unit this process takes: the next not taken, until none is left."""
    out = []
    while True:
        with taken.get_lock():
            n = taken.value
            taken.value = n + 1
        if n >= len(units):
            return out
        out.append(planned_unit(units[n]))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _plan_share(send, planned_unit, units, taken) -> None:
    """A forked child's work: what it plans of the units it takes (``_take_units``), or its
    error, sent to the parent."""
    try:
        answer = ("options", _take_units(units, planned_unit, taken))
    except BaseException as exc:  # noqa: BLE001 (raised in the parent: a bad request, an interrupt)
        answer = ("error", exc)
    try:
        send.send(answer)
    except Exception:  # noqa: BLE001 (an error that does not pickle: its words)
        send.send(("error", RuntimeError(f"planning a GPU comparison: {answer[1]!r}")))
    send.close()


def _received(child, receive) -> list:
    try:
        kind, value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"a planning process ended without an answer (exit code {child.exitcode})") \
            from None
    if kind == "error":
        raise value
    return value


def _options_on(device: "GPUSpec", request: "SuggestRequest", *, spec: "ModelSpec", prices: "PriceTable",
                counts: tuple[int, ...], workload: Workload, pinned: "Precision | None",
                calibration_of: "Callable[[str], Calibration | None] | None") -> list[RentOption]:
    """The options of one GPU type at each node size of ``counts`` (``compare_gpus``: those up to
    ``gpus_max`` that divide the global batch, micro-batch x accumulation x GPUs: another count has no plan)."""
    price = prices.cheapest(device.name)
    options = []
    for count in counts:
        if pinned is not None and not device.supports(pinned):
            reason = f"{device.display_name} cannot run --precision {pinned} (no bf16 before compute capability 8.0)"
            options.append(RentOption(gpu=device.name, gpus=count, price=price, plan=None, tokens=workload.tokens,
                                      reason=reason))
            continue
        calibration = calibration_of(device.name) if calibration_of is not None else None
        options.append(_option(request, spec=spec, gpu=device.name, gpus=count, price=price, tokens=workload.tokens,
                               calibration=calibration))
    return options


def _option(request: "SuggestRequest", *, spec: "ModelSpec", gpu: str, gpus: int, price: "GpuPrice | None",
            tokens: int, calibration: "Calibration | None") -> RentOption:
    """One GPU type and count planned: its #1 plan, or the first line of why nothing fits. Bad
    input raises: it is the same on every GPU."""
    from planner.planning import make_plan

    one = dataclasses.replace(request, gpu=gpu, gpus=gpus, top_k=1)
    try:
        # (the option reads its #1 plan only: no ranking by the other policy, no rejections)
        planned = make_plan(one, spec=spec, calibration=calibration, alternative=False, first_only=True)
    except NothingFitsError as exc:
        return RentOption(gpu=gpu, gpus=gpus, price=price, plan=None, tokens=tokens, reason=str(exc).split("\n")[0])
    # (make_plan raises NothingFitsError rather than answer without a plan)
    return RentOption(gpu=gpu, gpus=gpus, price=price, plan=planned.result.plans[0], tokens=tokens)


__all__ = ["DEFAULT_TOKENS", "NODE_SIZES", "RentComparison", "RentOption", "Workload", "compare_gpus",
           "parse_tokens", "usable_cpus", "workload"]
