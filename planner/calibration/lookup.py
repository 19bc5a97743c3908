"""The active calibration of a device, for the commands and the API that plan.

A plan goes on without a calibration when the store cannot say (a database behind this
planner's schema has no calibrations; an unreachable one is reported in one note): calibrating
is an improvement, never a reason a plan fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from planner.calibration.values import Calibration
    from planner.store.interface import PlanStore


def catalog_name(gpu: str) -> str | None:
    """The catalog name of ``gpu`` as typed (``A10G`` -> ``a10g``), None when it names none."""
    from planner.errors import UnknownGPUError
    from planner.gpus import get_gpu

    try:
        return get_gpu(gpu).name
    except UnknownGPUError:
        return None


def calibration_in(store: "PlanStore", gpu: str) -> "Calibration | None":
    """``gpu``'s active calibration in an open store."""
    name = catalog_name(gpu)
    return store.active_calibration(gpu=name) if name else None


def active_calibration(gpu: str, *, db: str | None) -> "tuple[Calibration | None, str | None]":
    """(``gpu``'s active calibration in the store at ``db``, a note to print when the store
    could not be read). Never creates the database."""
    name = catalog_name(gpu)
    if name is None:
        return None, None  # the plan reports the unknown GPU itself
    found, note = active_calibrations([name], db=db)
    return found.get(name), note


def active_calibrations(gpus: "Sequence[str]", *, db: str | None) -> "tuple[dict[str, Calibration], str | None]":
    """The active calibrations of the catalog GPUs ``gpus`` (those that have one), read in one
    opening of the store at ``db``, and a note to print when it could not be read."""
    from planner.errors import DatabaseMissingError, SchemaOutOfDateError, StoreError
    from planner.store.interface import open_plan_store

    try:
        with open_plan_store(url=db, create=False) as store:
            return calibrations_in(store, gpus), None
    except (DatabaseMissingError, SchemaOutOfDateError):
        return {}, None  # no database yet, or a new or older one: nothing calibrated in it
    except StoreError as exc:
        return {}, f"note: calibration not checked, the model's defaults are used: {exc}"


def calibrations_in(store: "PlanStore", gpus: "Sequence[str]") -> "dict[str, Calibration]":
    """The active calibrations of the catalog GPUs ``gpus`` in an open store (those that have one)."""
    found = {name: store.active_calibration(gpu=name) for name in gpus}
    return {name: calibration for name, calibration in found.items() if calibration is not None}


__all__ = ["active_calibration", "active_calibrations", "calibration_in", "calibrations_in", "catalog_name"]
