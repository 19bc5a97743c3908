"""Calibration: fit the device constants the model cannot derive from measured runs.

``fit`` is the pure fit (frozen dataclasses in, frozen dataclasses out); ``values`` the stored
calibration and ``apply_calibration``, which hands a plan its device with the calibrated
constants; ``runs`` turns stored measurements into the fit's runs (it resolves models);
``lookup`` finds the active calibration of a device in the store for the commands and the API.
"""

from __future__ import annotations

from planner.lazy import lazy_exports

#: name -> module that defines it, imported on first use (PEP 562): a plan that only looks up
#: its device's calibration (``lookup``, ``values``) does not import the fit.
_EXPORTS = {
    **dict.fromkeys(("BOUNDS", "MIN_RUNS", "MIN_SHARE", "CalibrationFit", "ConstantFit", "ErrorStats", "MemoryRun",
                     "StepRun", "fit_calibration", "predict_step"), "planner.calibration.fit"),
    **dict.fromkeys(("Calibration", "CalibrationValues", "apply_calibration"), "planner.calibration.values"),
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = sorted(_EXPORTS)
