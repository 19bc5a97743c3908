"""What ``planner check`` answers: the file's configuration, its estimate, and the closest change
as a diff of the file's own keys. Frozen, with ``to_dict`` (``--json``, the API) and an HTML table
for notebooks."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Mapping

from planner.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class KeyChange:
    """One key of one file, from its value to the one the change needs."""

    file: str
    key: str
    old: Any
    new: Any
    new_file: bool = False
    """The file does not exist yet (a DeepSpeed JSON or an adapter config the change adds)."""

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "old": self.old, "new": self.new, "new_file": self.new_file}

    def line(self) -> str:
        where = f"{self.file} (new file)" if self.new_file else self.file
        old = "(not set)" if self.old is None and not self.new_file else repr(self.old)
        return f"{where}: {self.key}: {old} -> {self.new!r}"


@dataclass(frozen=True, kw_only=True)
class Change:
    """The closest configuration the search found that fits (or, for one that fits, is faster)."""

    goal: str
    """``fit`` (the file's configuration does not fit, or is near the edge) or ``faster``."""
    config: TrainConfig
    keys: tuple[KeyChange, ...]
    estimate: Mapping[str, Any]
    """``planner estimate --json`` of the changed configuration: it was planned again."""

    def aim(self, *, fits: bool) -> str:
        """What the change achieves, for a config that ``fits`` today or not: a config that fits
        near the edge gets a change that takes it off the edge, not one "that makes it fit"."""
        from planner.uncertainty import NEAR_EDGE_PROBABILITY

        if self.goal == "faster":
            return "faster"
        return f"fit with an OOM risk <= {NEAR_EDGE_PROBABILITY:.0%}" if fits else "fit"

    def to_dict(self) -> dict[str, Any]:
        return {"goal": self.goal, "config": self.config.to_dict(), "diff": [k.to_dict() for k in self.keys],
                "fits": self.estimate["fits"], "oom_probability": self.estimate["oom_probability"],
                "peak_bytes": self.estimate["memory"]["process_total_bytes"],
                "tokens_per_s": self.estimate["throughput"]["tokens_per_s"]}


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One training setup checked against one device."""

    files: tuple[str, ...]
    """Every file read, the ones found by reference or beside the first included."""
    schema: str
    """The trainer schema the arguments were read with."""
    config: TrainConfig
    estimate: Mapping[str, Any]
    """``planner estimate --json`` of the file's configuration."""
    change: Change | None = None
    advice: tuple[str, ...] = ()
    """When no change of the searched space fits: what would (``planner.advice``)."""
    notes: tuple[str, ...] = ()
    """Settings planned approximately, or assumed because no file says them."""
    origins: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Option -> the file and key it was read from (``given`` false: the trainer's default)."""

    @property
    def fits(self) -> bool:
        return bool(self.estimate["fits"])

    @property
    def peak_bytes(self) -> int:
        """The process total at the peak (what nvidia-smi would show)."""
        return int(self.estimate["memory"]["process_total_bytes"])

    @property
    def peak_phase(self) -> str:
        return str(self.estimate["memory"].get("peak_phase", ""))

    @property
    def oom_probability(self) -> float | None:
        return self.estimate["oom_probability"]

    def to_dict(self) -> dict[str, Any]:
        return {"files": list(self.files), "schema": self.schema, "read": {k: dict(v) for k, v in self.origins.items()},
                "fits": self.fits, "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase,
                "oom_probability": self.oom_probability, "near_edge": self.estimate["near_edge"],
                "estimate": dict(self.estimate), "change": self.change.to_dict() if self.change else None,
                "advice": list(self.advice), "notes": list(self.notes)}

    def _repr_html_(self) -> str:
        from planner.units import format_bytes

        e = self.estimate
        rows = [("files", ", ".join(self.files)), ("model", e["model"]["id"]), ("GPU", e["device"]["name"]),
                ("configuration", self.config.label()),
                ("fits", "yes" if self.fits else "no"), ("peak (process total)", format_bytes(self.peak_bytes)),
                ("peak at", self.peak_phase), ("OOM risk", f"{(self.oom_probability or 0):.1%}"),
                ("tokens/s", f"{e['throughput']['tokens_per_s']:,.0f}")]
        table = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                        for k, v in rows)
        out = f"<table>{table}</table>"
        if self.change is not None:
            diff = "".join(f"<tr><td>{html.escape(k.file)}{' (new)' if k.new_file else ''}</td><td><code>{html.escape(k.key)}"
                           f"</code></td><td>{html.escape(repr(k.old))}</td><td>{html.escape(repr(k.new))}</td></tr>"
                           for k in self.change.keys)
            out += (f"<p>closest change that makes it {self.change.aim(fits=self.fits)}: "
                    f"{html.escape(self.change.config.label())}</p><table><tr><th>file</th><th>key</th><th>now</th>"
                    f"<th>change to</th></tr>{diff}</table>")
        out += "".join(f"<p>{html.escape(line)}</p>" for line in (*self.advice, *self.notes))
        return out


__all__ = ["Change", "CheckResult", "KeyChange"]
