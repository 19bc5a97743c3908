"""A stored calibration and how a plan uses it. Pure: frozen dataclasses, no I/O.

``apply_calibration`` is the one place a calibration reaches the models: it returns the device
with its calibrated constants (``dataclasses.replace`` on the ``GPUSpec``: ``mfu``,
``bandwidth_efficiency``, ``cuda_context_bytes``) and the calibration's description, which the
throughput model lists among a plan's assumptions (``planner.throughput``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Mapping

from planner.units import format_bytes

#: The MFU keys: ``planner.gpus.matmul_dtype`` of every precision.
MFU_KEYS = ("fp32", "fp16", "bf16")


def _fraction(value: Any, *, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{what} must be a fraction in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class CalibrationValues:
    """Device constants; a constant left out (empty, None) is the model's default."""

    mfu: Mapping[str, float] = field(default_factory=dict)
    """Matmul efficiency by ``matmul_dtype`` (fp32, fp16, bf16): achieved / peak FLOP/s."""
    bandwidth_efficiency: float | None = None
    """Fraction of the datasheet memory bandwidth memory-bound kernels reach."""
    cuda_context_bytes: int | None = None
    """Device memory the process holds outside the caching allocator (CUDA context, handles)."""

    def __post_init__(self) -> None:
        mfu = {}
        for key, value in dict(self.mfu).items():
            if key not in MFU_KEYS:
                raise ValueError(f"MFU key {key!r} is not one of {', '.join(MFU_KEYS)}")
            mfu[key] = _fraction(value, what=f"MFU {key}")
        object.__setattr__(self, "mfu", MappingProxyType(mfu))
        if self.bandwidth_efficiency is not None:
            object.__setattr__(self, "bandwidth_efficiency", _fraction(self.bandwidth_efficiency, what="bandwidth efficiency"))
        context = self.cuda_context_bytes
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
            raise ValueError(f"CUDA context bytes must be a whole number >= 0, got {context!r}")

    @property
    def empty(self) -> bool:
        return not self.mfu and self.bandwidth_efficiency is None and self.cuda_context_bytes is None

    def to_dict(self) -> dict[str, Any]:
        return {"mfu": dict(self.mfu), "bandwidth_efficiency": self.bandwidth_efficiency,
                "cuda_context_bytes": self.cuda_context_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CalibrationValues":
        return cls(mfu=dict(data.get("mfu") or {}), bandwidth_efficiency=data.get("bandwidth_efficiency"),
                   cuda_context_bytes=data.get("cuda_context_bytes"))


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One stored calibration of one device (``planner calibrate``)."""

    id: int
    """Its number in the store: calibrations are numbered 1, 2, 3... as they are made."""
    gpu: str
    """Catalog name of the device (``a10g``, ``cpu``)."""
    created_at: datetime
    """Timezone-aware UTC."""
    measurements: int
    """Runs it was fitted on."""
    values: CalibrationValues
    """The fitted constants."""
    defaults: CalibrationValues
    """What each fitted constant was before (the model's defaults for this device)."""
    report: Mapping[str, Any] = field(default_factory=dict)
    """The fit's errors before and after, per constant (``CalibrationFit.to_dict``)."""
    measurement_ids: tuple[str, ...] = ()
    active: bool = True
    """Plans use it; False once a newer calibration replaced it or ``--reset`` dropped it."""
    dropped_at: datetime | None = None
    planner_version: str = ""

    def describe(self) -> str:
        """How plans name it: ``calibration #3 for a10g (12 measurements, 2026-11-22): mfu bf16
        0.41 (default 0.45), ...``."""
        parts = []
        for key, value in sorted(self.values.mfu.items()):
            default = self.defaults.mfu.get(key)
            parts.append(f"mfu {key} {value:.3g}" + (f" (default {default:.3g})" if default is not None else ""))
        if self.values.bandwidth_efficiency is not None:
            default = self.defaults.bandwidth_efficiency
            parts.append(f"memory bandwidth efficiency {self.values.bandwidth_efficiency:.3g}"
                         + (f" (default {default:.3g})" if default is not None else ""))
        if self.values.cuda_context_bytes is not None:
            default = self.defaults.cuda_context_bytes
            parts.append(f"CUDA context {format_bytes(self.values.cuda_context_bytes)}"
                         + (f" (default {format_bytes(default)})" if default is not None else ""))
        run = "measurement" if self.measurements == 1 else "measurements"
        return (f"calibration #{self.id} for {self.gpu} ({self.measurements} {run}, "
                f"{self.created_at.strftime('%Y-%m-%d')}): " + ", ".join(parts))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "gpu": self.gpu, "created_at": self.created_at.isoformat(), "active": self.active,
            "dropped_at": self.dropped_at.isoformat() if self.dropped_at else None, "measurements": self.measurements,
            "values": self.values.to_dict(), "defaults": self.defaults.to_dict(), "report": dict(self.report),
            "measurement_ids": list(self.measurement_ids), "planner_version": self.planner_version,
            "description": self.describe(),
        }


def apply_calibration(gpu: Any, calibration: Calibration | None) -> Any:
    """The ``GPUSpec`` with the calibration's constants (itself when there is none, or when the
    calibration is of another device)."""
    if calibration is None or calibration.gpu != gpu.name or calibration.values.empty:
        return gpu
    values = calibration.values
    name = calibration.describe()
    changes: dict[str, Any] = {"calibration": name, "mfu": {**gpu.mfu, **values.mfu}}
    sources = dict(gpu.sources)
    if values.bandwidth_efficiency is not None:
        changes["bandwidth_efficiency"] = values.bandwidth_efficiency
    if values.cuda_context_bytes is not None and not gpu.is_cpu:
        changes["cuda_context_bytes"] = values.cuda_context_bytes
        sources["cuda_context_bytes"] = (f"calibration #{calibration.id}: median of the measured process total "
                                         "less the peak reserved")
    return dataclasses.replace(gpu, sources=sources, **changes)


__all__ = ["MFU_KEYS", "Calibration", "CalibrationValues", "apply_calibration"]
