"""Plain result types shared by the analytical core, the workers and the store.

They hold numbers, never ORM rows or torch objects, and round-trip through ``to_dict`` /
``from_dict`` so they can be printed as JSON, stored in SQL and sent between processes.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

#: The payload versions this code writes. A payload without a ``version`` key was written before
#: payloads carried one (version 1); every version decodes: keys this code does not know are
#: ignored, keys a payload lacks take their defaults.
MEMORY_VERSION = 3
THROUGHPUT_VERSION = 2


def known_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a stored payload that are fields of ``cls`` (``version`` and keys a newer
    planner added are dropped: a stored plan always decodes)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted memory of one configuration on one device (per device for several GPUs)."""

    peak_allocated_bytes: int
    """``torch.cuda.max_memory_allocated()`` over a steady-state step (CPU: peak live tensor bytes)."""
    peak_reserved_bytes: int
    """The caching allocator's reserve at that peak (block rounding, fragmentation)."""
    process_total_bytes: int
    """Reserved plus CUDA context and library workspaces: what nvidia-smi shows."""
    cpu_bytes: int
    """Host RAM the configuration needs beyond the framework (offloaded states, pinned buffers)."""
    breakdown: Mapping[str, int]
    """Bytes per component at the peak; sums to ``peak_allocated_bytes``."""
    peak_phase: str = ""
    """Which moment of the step the peak is at (forward end, backward, optimizer step)."""
    assumptions: tuple[str, ...] = ()
    """Flagged approximations that hold for this configuration."""
    fragmentation_bytes: int = 0
    """Reserved but unallocated at the allocated peak: free pieces of the caching allocator's
    segments (0 where there is no caching allocator; payloads of version 1 did not have it)."""
    peak_interval_bytes: tuple[int, int] | None = None
    """[low, high]: the 90% central interval of ``process_total_bytes`` from the model's measured
    error (``planner.uncertainty``); None where it was not stated (payloads before version 3)."""
    oom_probability: float | None = None
    """The probability (0-1) that the process total passes the device planned for
    (``planner.uncertainty.oom_probability``); None where it was not stated."""
    paged_bytes: int = 0
    """A paged optimizer's states in unified memory (bitsandbytes' paged optimizers on CUDA),
    outside the allocator: the process total holds what the step needs of them (one tensor's)."""
    paged_host_bytes: int = 0
    """Of ``paged_bytes``, what the device has no room for at the step: on the host, migrated in
    and out over the host link each step (``planner.throughput``'s offload part)."""

    def to_dict(self) -> dict[str, Any]:
        d = {"version": MEMORY_VERSION, **asdict(self)}
        if not self.paged_bytes:  # written only for a paged optimizer (a payload without them: 0)
            del d["paged_bytes"], d["paged_host_bytes"]
        d["breakdown"] = dict(self.breakdown)
        d["assumptions"] = list(self.assumptions)
        d["peak_interval_bytes"] = list(self.peak_interval_bytes) if self.peak_interval_bytes is not None else None
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MemoryEstimate":
        d = known_fields(cls, data)
        d["breakdown"] = dict(d.get("breakdown", {}))
        d["assumptions"] = tuple(d.get("assumptions", ()))
        if d.get("peak_interval_bytes") is not None:
            low, high = d["peak_interval_bytes"]
            d["peak_interval_bytes"] = (int(low), int(high))
        return cls(**d)

    def with_uncertainty(self, *, interval: tuple[int, int], oom_probability: float) -> "MemoryEstimate":
        """This estimate with its stated interval and probability of running out of memory."""
        return dataclasses.replace(self, peak_interval_bytes=interval, oom_probability=oom_probability)


@dataclass(frozen=True, kw_only=True)
class ThroughputEstimate:
    """Predicted speed of one configuration (one optimizer step over ``global_batch`` sequences)."""

    step_s: float
    tokens_per_s: float
    """Tokens per second across all devices."""
    flops_per_step: float
    """Model FLOPs of one optimizer step on one device."""
    breakdown_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds per component of a step (compute, recompute, dequant, offload, optimizer)."""
    assumptions: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {"version": THROUGHPUT_VERSION, **asdict(self)}
        d["breakdown_s"] = dict(self.breakdown_s)
        d["assumptions"] = list(self.assumptions)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ThroughputEstimate":
        d = known_fields(cls, data)
        d["breakdown_s"] = dict(d.get("breakdown_s", {}))
        d["assumptions"] = tuple(d.get("assumptions", ()))
        return cls(**d)


class RunOutcome(enum.StrEnum):
    """Outcome of one real measurement run."""

    OK = "ok"
    OOM = "oom"
    ERROR = "error"


class RunStatus(enum.StrEnum):
    """Life cycle of a measurement run (in the spirit of Ray's ``JobStatus``)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    def is_terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What a short real training run measured."""

    outcome: RunOutcome
    device: str
    """Device name as the run saw it (``cpu`` or the CUDA device name)."""
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    process_total_bytes: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    library_versions: Mapping[str, str] = field(default_factory=dict)
    node: str = ""
    started_at: str = ""
    """ISO 8601 UTC."""
    finished_at: str = ""
    error: str | None = None
    """Error text for ``oom`` and ``error`` (the signal for a crashed process)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", RunOutcome(self.outcome))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = str(self.outcome)
        d["library_versions"] = dict(self.library_versions)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Measurement":
        return cls(**dict(data))


# ---- planning results ----------------------------------------------------------------------
from planner.config import TrainConfig  # noqa: E402 - pure module, kept below the run types


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One evaluated configuration with its predictions."""

    config: TrainConfig
    memory: MemoryEstimate
    throughput: ThroughputEstimate
    fits: bool
    rank: int | None = None
    """1-based rank among the plans that fit; None when it does not fit."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "config": self.config.to_dict(),
            "memory": self.memory.to_dict(),
            "throughput": self.throughput.to_dict(),
            "fits": self.fits,
            "oom_probability": self.memory.oom_probability,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Candidate":
        return cls(
            rank=data.get("rank"),
            config=TrainConfig.from_dict(data["config"]),
            memory=MemoryEstimate.from_dict(data["memory"]),
            throughput=ThroughputEstimate.from_dict(data["throughput"]),
            fits=bool(data["fits"]),
        )


def canonical_json(value: Any, *, what: str) -> Any:
    """``value`` as plain JSON data (dicts, lists, str, numbers, bools, None).

    Refuses what the database could not store faithfully: objects json cannot encode and
    NaN/infinity (PostgreSQL's ``json`` rejects them).
    """
    import json

    from planner.errors import UnstorableDataError

    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise UnstorableDataError(f"cannot store {what}: it is not plain JSON data ({exc})") from None


def constraints_hash(constraints: Mapping[str, Any]) -> str:
    """sha256 of the constraints' canonical JSON (sorted keys, no spaces): equal dicts, equal hash."""
    import hashlib
    import json

    data = canonical_json(dict(constraints), what="the request's constraints")
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked ``planner suggest`` for; two equal requests get the same answer."""

    model_id: str
    model_fingerprint: str
    """sha256 of the canonical config.json (see ``planner.catalog.fingerprint``)."""
    gpu: str
    gpu_count: int
    gpu_memory_bytes: int
    """Device capacity planned against (the catalog's, or --gpu-mem)."""
    target_batch: int
    seq_len: int
    constraints: Mapping[str, Any] = field(default_factory=dict)
    """method, precision, offload allowed, cpu memory bound, top_k: everything else that shapes the answer."""
    planner_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["constraints"] = dict(self.constraints)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PlanRequest":
        return cls(**dict(data))

    def identity(self) -> dict[str, Any]:
        """What makes two requests "the same request" (the same answer): the model's config
        fingerprint, the GPU, their count, the target batch, the sequence length and the
        constraints (as ``constraints_hash``). Not the model's name, the device memory as planned
        nor the planner's version. The store finds a stored plan by these columns, named as its
        ``plan_requests`` columns are."""
        return {"model_fingerprint": self.model_fingerprint, "gpu": self.gpu, "gpu_count": self.gpu_count,
                "target_batch": self.target_batch, "seq_len": self.seq_len,
                "constraints_hash": constraints_hash(self.constraints)}


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """Why a family of more faithful configurations does not fit."""

    family: str
    """e.g. ``full, bf16-mixed, adamw``."""
    reason: str
    """e.g. ``model states alone need 112.0 GiB > 21.4 GiB usable``."""
    config: Mapping[str, Any] | None = None
    """The closest configuration of the family, when there is one."""

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "reason": self.reason, "config": dict(self.config) if self.config else None}


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """The answer to a ``PlanRequest``: ranked plans that fit and why the rest does not."""

    request: PlanRequest
    plans: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...] = ()
    searched: int = 0
    """Number of configurations evaluated."""
    usable_bytes: int = 0
    """Capacity minus the safety margin: what a plan's process total must stay under."""
    safety_margin_bytes: int = 0
    prefer: str = ""
    """The ranking policy the plans are in (``planner.tradeoffs.Prefer``); "": the one the
    request's constraints name (a stored plan), fidelity for plans made before there was one."""
    alternative: Candidate | None = None
    """The other policy's first plan, when it is not plan 1 (None for stored plans, which keep
    their ranked plans only)."""
    advice: tuple[str, ...] = ()
    """When every plan is near the edge: which of the planner's options would give room, each with
    the memory it saves (``planner.advice``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "prefer": self.prefer or str(self.request.constraints.get("prefer", "fidelity")),
            "plans": [self._explained(c) for c in self.plans],
            "other_policy_best": self._explained(self.alternative) if self.alternative is not None else None,
            "rejected": [r.to_dict() for r in self.rejected],
            "searched": self.searched,
            "usable_bytes": self.usable_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            **({"advice": list(self.advice)} if self.advice else {}),
        }

    def _explained(self, c: Candidate) -> dict[str, Any]:
        """A plan as JSON with what it trades away, how likely it is to run out of memory and
        whether that makes it near the edge (a stored plan made before plans carried the
        probability gets it computed here, against the device it was planned for)."""
        from planner.tradeoffs import memory_interval, near_edge, oom_risk, trade_offs

        capacity = self.request.gpu_memory_bytes
        if c.memory.oom_probability is None and capacity:
            c = dataclasses.replace(c, memory=c.memory.with_uncertainty(
                interval=memory_interval(c.config, c.memory), oom_probability=oom_risk(c.config, c.memory, capacity=capacity)))
        return c.to_dict() | {"near_edge": near_edge(c.config, c.memory, capacity=capacity) if capacity else False,
                              "trade_offs": list(trade_offs(c.config, c.memory, capacity=capacity)) if capacity else []}
