"""``planner calibrate`` as a library call: the device's stored runs -> fit -> stored calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.calibration.fit import MIN_RUNS, MIN_SHARE, CalibrationFit, fit_calibration
from planner.calibration.runs import FitRuns, default_values, fit_runs

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration.values import Calibration
    from planner.gpus import GPUSpec
    from planner.store import Store


@dataclass(frozen=True, kw_only=True)
class CalibrationOutcome:
    """What calibrating one device found, fitted and stored."""

    gpu: str
    runs: FitRuns
    fit: CalibrationFit
    stored: "Calibration | None"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu, "measurements": len(self.runs.ids),
            "left_out": [{"id": r.id, "reason": r.reason} for r in self.runs.left_out],
            "fit": self.fit.to_dict(), "calibration": self.stored.to_dict() if self.stored else None,
        }


def how_to_measure(gpu: str) -> str:
    return (f"measure more runs of a few sizes and precisions, e.g. 'planner measure --gpu {gpu} --model M "
            f"--micro-batch 2 --seq-len 128' (and --seq-len 32, 256; --precision fp32)")


def too_few(gpu: str, fit: CalibrationFit | None, runs: FitRuns | None, *, min_runs: int) -> str:
    """The refusal: how many runs each constant has and needs, and how to get more."""
    if fit is None or runs is None or not runs.ids:
        left = f" ({len(runs.left_out)} left out: {runs.left_out[0].reason})" if runs and runs.left_out else ""
        return (f"no usable ok measurements of {gpu} in the store{left}: calibrate needs at least {min_runs}; "
                + how_to_measure(gpu))
    has = ", ".join(f"{c.name} {c.runs}" for c in fit.constants)
    return (f"too few measurements to calibrate {gpu}: a constant needs {min_runs} ok runs where its part is at least "
            f"{MIN_SHARE:.0%} of the step (or, for the CUDA context, that measured the process total); has {has}: "
            + how_to_measure(gpu))


def calibrate(store: "Store", gpu: "GPUSpec", *, min_runs: int = MIN_RUNS, version: str = "") -> CalibrationOutcome:
    """Fit ``gpu``'s constants on every ok run stored for it and store the calibration as the
    device's active one. ``NotEnoughMeasurementsError`` when no constant has ``min_runs`` runs."""
    from planner.errors import NotEnoughMeasurementsError

    runs = fit_runs(store.measured_runs(gpu=gpu.name))
    if not runs.ids:
        raise NotEnoughMeasurementsError(too_few(gpu.name, None, runs, min_runs=min_runs))
    fit = fit_calibration(steps=runs.steps, memory=runs.memory, defaults=default_values(gpu), min_runs=min_runs)
    if not fit.fitted:
        raise NotEnoughMeasurementsError(too_few(gpu.name, fit, runs, min_runs=min_runs))
    stored = store.save_calibration(gpu=gpu.name, values=fit.values(), defaults=fit.defaults(), report=fit.to_dict(),
                                    measurement_ids=list(runs.ids), planner_version=version)
    return CalibrationOutcome(gpu=gpu.name, runs=runs, fit=fit, stored=stored)


__all__ = ["CalibrationOutcome", "calibrate", "how_to_measure", "too_few"]
