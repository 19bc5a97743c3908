"""The calls of ``oom_planner``: each parses its keywords as the CLI parses its options and calls
the same use case. Nothing here decides a plan."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from planner.errors import InvalidConfigError
from planner.request import FIELDS, RECIPE, SEARCH, check_types

if TYPE_CHECKING:  # pragma: no cover
    from planner.check import CheckResult
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.planning import Planned
    from planner.results import MemoryEstimate, PlanResult
    from planner.store import PlanSummary

#: suggest's knobs: ``planner.planning.SuggestRequest``'s fields (sizes as "20GiB" or bytes), the
#: recipe settings last (``planner.request.RECIPE``)
SUGGEST_KNOBS = ("seq_len", "gpus", "gpu_mem", "method", "precision", "allow_offload", "cpu_mem", "top_k", "prefer",
                 *(f.name for f in RECIPE))


def _size(value: Any, *, name: str) -> int | None:
    """A size as bytes: an int (bytes) or text with a unit ("20GiB"), by the CLI's rules."""
    from planner.units import size_of

    return size_of(value, option=name)


def _known(knobs: Mapping[str, Any], allowed: Sequence[str], call: str) -> None:
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise InvalidConfigError(f"{call}() has no option {', '.join(map(repr, unknown))}: use "
                                 f"{', '.join(allowed)}")


def _calibration(gpu: str, db: str | None):
    from planner.calibration.lookup import active_calibration

    return active_calibration(gpu, db=db)[0]


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """``suggest``'s answer: ``planner suggest``'s ranked result (``result``, a ``PlanResult``)."""

    planned: "Planned"
    plan_id: str | None = None
    """The stored plan's id (None with ``save=False``)."""

    @property
    def result(self) -> "PlanResult":
        return self.planned.result

    @property
    def plans(self):
        return self.planned.result.plans

    def to_dict(self) -> dict[str, Any]:
        """What ``planner suggest --json`` prints."""
        return self.result.to_dict() | {"plan_id": self.plan_id}

    def _repr_html_(self) -> str:
        from planner.units import format_bytes

        rows = [(c.rank, c.config.label(), format_bytes(c.memory.process_total_bytes),
                 f"{c.memory.oom_probability or 0:.1%}", f"{c.throughput.tokens_per_s:,.0f}") for c in self.plans]
        request = self.result.request
        title = (f"<p>{html.escape(request.model_id)} on {request.gpu_count} x {html.escape(request.gpu)}, batch "
                 f"{request.target_batch}, seq {request.seq_len}: {self.result.searched:,} configurations searched</p>")
        return title + _table(rows, ("#", "plan", "peak (process total)", "OOM risk", "tokens/s"))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """``estimate``'s answer: ``planner estimate --json``'s data and the memory estimate."""

    data: Mapping[str, Any]
    memory: "MemoryEstimate"
    config: "TrainConfig"
    spec: "ModelSpec"
    device: "GPUSpec"

    @property
    def fits(self) -> bool:
        return bool(self.data["fits"])

    @property
    def oom_probability(self) -> float | None:
        return self.data["oom_probability"]

    def to_dict(self) -> dict[str, Any]:
        """What ``planner estimate --json`` prints."""
        return dict(self.data)

    def figure(self):
        """The step's memory over time as a matplotlib figure (``planner estimate --timeline``'s
        picture; needs the plot extra)."""
        from planner.estimation import step_curves
        from planner.plot import timeline_picture
        from planner.search import safety_margin

        curves = step_curves(spec=self.spec, gpu=self.device, config=self.config)
        capacity = self.device.memory_bytes
        fig, _ = timeline_picture(curves, estimate=self.memory, capacity=capacity, usable=capacity - safety_margin(capacity),
                                  title=f"{self.spec.id} on {self.device.display_name}: {self.config.label()}")
        return fig

    def _repr_html_(self) -> str:
        from planner.units import format_bytes

        peak = self.memory.peak_allocated_bytes
        rows = [(k, format_bytes(v), f"{v / peak:.1%}") for k, v in sorted(self.memory.breakdown.items(), key=lambda kv: -kv[1])]
        verdict = "fits" if self.fits else "does NOT fit"
        head = (f"<p>{html.escape(self.spec.id)} on {html.escape(self.device.name)}: {html.escape(self.config.label())}: "
                f"{verdict}, process total {format_bytes(self.memory.process_total_bytes)} at "
                f"{html.escape(self.memory.peak_phase)}, OOM risk {self.oom_probability or 0:.1%}, "
                f"{self.data['throughput']['tokens_per_s']:,.0f} tokens/s</p>")
        return head + _table(rows, ("component", "bytes", "share of peak allocated"))


@dataclass(frozen=True, kw_only=True)
class History:
    """``history``'s answer: ``planner history``'s rows (``PlanSummary``), newest first."""

    rows: "tuple[PlanSummary, ...]"

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, index: int) -> "PlanSummary":
        return self.rows[index]

    def to_dict(self) -> list[dict[str, Any]]:
        """What ``planner history --json`` prints."""
        return [row.to_dict() for row in self.rows]

    def _repr_html_(self) -> str:
        rows = [(r.id[:8], r.created_at.strftime("%Y-%m-%d %H:%M UTC"), r.model_id, f"{r.gpu_count} x {r.gpu}",
                 r.target_batch, r.top_plan or "(nothing fits)", str(r.status)) for r in self.rows]
        return _table(rows, ("id", "created", "model", "GPU", "batch", "plan #1", "status"))


def suggest(*, model: str, gpu: str, target_batch: int, save: bool = True, db: str | None = None,
            **knobs: Any) -> Suggestion:
    """``planner suggest``: rank every configuration that reaches ``target_batch`` and fits.

    ``knobs``: ``seq_len``, ``gpus``, ``gpu_mem`` ("20GiB" or bytes), ``method``, ``precision``,
    ``allow_offload``, ``cpu_mem``, ``top_k``, ``prefer`` and the recipe settings
    (``planner.request.RECIPE``; all of them: ``SUGGEST_KNOBS``). ``save``: store the plan (``history`` lists it) in ``db`` (default:
    PLANNER_DATABASE_URL or the local SQLite file). Raises ``NothingFitsError`` (its ``result``
    holds each family's closest try) when nothing fits."""
    from planner.planning import SuggestRequest
    from planner.store.interface import open_plan_store
    from planner.usecases import plan_request

    _known(knobs, SUGGEST_KNOBS, "suggest")
    check_types(knobs, {**FIELDS, **SEARCH})  # the recipe and search knobs, typed as the CLI types them
    for name, value in (("allow_offload", knobs.get("allow_offload", True)), ("save", save)):
        if not isinstance(value, bool):  # ("no" is truthy: it stored the plan)
            raise InvalidConfigError(f"{name} must be True or False, got {value!r}")
    sizes = {f"{name}_bytes": _size(knobs.pop(name, None), name=name) for name in ("gpu_mem", "cpu_mem")}
    request = SuggestRequest(model=model, gpu=gpu, target_batch=target_batch, **sizes, **knobs)
    # the plan use case planner suggest calls; always a new plan (no answer from the store)
    outcome = plan_request(request, store=(lambda: open_plan_store(url=db)) if save else None,
                           calibration=_calibration(gpu, db), reuse=False)
    if outcome.store_error is not None:
        raise outcome.store_error
    return Suggestion(planned=outcome.planned, plan_id=outcome.plan_id)


def estimate(*, model: str, gpu: str, seq_len: int | None = None, gpu_mem: int | str | None = None,
             db: str | None = None, **knobs: Any) -> Estimate:
    """``planner estimate``: memory and speed of one configuration. ``knobs``: the TrainConfig
    options ``planner estimate`` takes (``planner.estimation.CONFIG_OPTIONS``, declared in
    ``planner.request``: ``method``, ``precision``, ``optimizer``, ``micro_batch``, ...)."""
    from planner.calibration import apply_calibration
    from planner.estimation import CONFIG_OPTIONS, build_config, estimate_configuration, resolve

    _known(knobs, CONFIG_OPTIONS, "estimate")
    check_types({"seq_len": seq_len, **knobs}, FIELDS)
    spec, device = resolve(model=model, gpu=gpu, gpu_mem_bytes=_size(gpu_mem, name="gpu_mem"))
    device = apply_calibration(device, _calibration(device.name, db))
    data, memory = estimate_configuration(spec=spec, gpu=device, seq_len=seq_len, **knobs)
    config = build_config(spec, device, seq_len=seq_len, **knobs)
    return Estimate(data=data, memory=memory, config=config, spec=spec, device=device)


def check(config: "str | Path | Sequence[str | Path] | Mapping[str, Any] | Any", *, gpu: str, model: str | None = None,
          gpus: int | None = None, seq_len: int | None = None, gpu_mem: int | str | None = None,
          cpu_mem: int | str | None = None, trainer: str | None = None, db: str | None = None) -> "CheckResult":
    """``planner check``: an existing training config (a path, several paths, a mapping of its
    keys or a ``TrainingArguments``/``SFTConfig`` object) planned as it stands, with the closest
    change that makes it fit, or faster, as a diff of its own keys."""
    from planner.check import check as check_files
    from planner.check import check_arguments

    check_types({name: value for name, value in (("gpus", gpus), ("seq_len", seq_len)) if value is not None}, FIELDS)
    if isinstance(config, (list, tuple)) and not all(isinstance(p, (str, Path)) for p in config):
        raise InvalidConfigError(f"check takes a list of paths (str or Path), got {config!r:.80}")
    options = dict(gpu=gpu, model=model, gpus=gpus, seq_len=seq_len, gpu_mem_bytes=_size(gpu_mem, name="gpu_mem"),
                   cpu_mem_bytes=_size(cpu_mem, name="cpu_mem"), calibration=_calibration(gpu, db), trainer=trainer)
    if isinstance(config, (str, Path)):
        return check_files([config], **options)
    if isinstance(config, (list, tuple)):
        return check_files(list(config), **options)
    return check_arguments(config, **options)


def _catalog_name(gpu: str | None) -> str | None:
    """Plans are stored under catalog names: ``A10G`` finds ``a10g`` as ``planner history --gpu``
    does; a name the catalog does not know is kept (plans of older catalogs)."""
    from planner.calibration.lookup import catalog_name

    return (catalog_name(gpu) or gpu) if gpu else gpu


def history(*, model: str | None = None, gpu: str | None = None, status: str | None = None, since: str | None = None,
            limit: int = 20, db: str | None = None) -> History:
    """``planner history``: past plans, newest first (``since``: "7d", "12h" or a date)."""
    from planner.limits import MAX_HISTORY
    from planner.store import open_plan_store, parse_since, parse_status

    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY:
        raise InvalidConfigError(f"limit must be a whole number from 1 to {MAX_HISTORY:,}, got {limit!r}")
    with open_plan_store(url=db) as store:
        rows = store.history(model=model, gpu=_catalog_name(gpu), status=parse_status(status) if status else None,
                             since=parse_since(since) if since else None, limit=limit)
    return History(rows=tuple(rows))


__all__ = ["Estimate", "History", "SUGGEST_KNOBS", "Suggestion", "check", "estimate", "history", "suggest"]
