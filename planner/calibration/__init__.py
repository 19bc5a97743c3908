"""Calibration: fit the device constants the model cannot derive from measured runs.

``fit`` is the pure fit (frozen dataclasses in, frozen dataclasses out); ``values`` the stored
calibration and ``apply_calibration``, which hands a plan its device with the calibrated
constants; ``runs`` turns stored measurements into the fit's runs (it resolves models);
``lookup`` finds the active calibration of a device in the store for the commands and the API.
"""

from planner.calibration.fit import (
    BOUNDS,
    MIN_RUNS,
    MIN_SHARE,
    CalibrationFit,
    ConstantFit,
    ErrorStats,
    MemoryRun,
    StepRun,
    fit_calibration,
    predict_step,
)
from planner.calibration.values import Calibration, CalibrationValues, apply_calibration

__all__ = [
    "BOUNDS", "MIN_RUNS", "MIN_SHARE", "Calibration", "CalibrationFit", "CalibrationValues", "ConstantFit", "ErrorStats",
    "MemoryRun", "StepRun", "apply_calibration", "fit_calibration", "predict_step",
]
