"""What every plan store answers, and the one way to get one.

Two stores stand behind ``PlanStore`` (mlflow's ``AbstractStore`` is the model: one interface,
several backends, callers that never name a backend):

* ``planner.store.api.Store``: SQLAlchemy, for SQLite and PostgreSQL, with the schema's
  migrations; the service's (one pooled store shared by its threads) and the calibration's;
* ``planner.store.lite.LiteStore``: the standard library's ``sqlite3`` on an SQLite file whose
  schema is at this planner's head, so that a one-shot command does not pay SQLAlchemy's import
  (``lite.py`` says what that costs).

Both build and read rows with ``planner.store.codec``, find "the same request" by
``PlanRequest.identity()``, and move a plan's status through ``PlanStatus.check_transition``
(nothing leaves a terminal status). tests/store/test_store_contract.py runs the same tests against
both, on SQLite and (the SQLAlchemy store) on PostgreSQL.

Callers type against ``PlanStore`` and get one from ``open_plan_store``.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration.values import Calibration
    from planner.results import Candidate, Measurement, PlanRequest, PlanResult
    from planner.store.entities import HistoryCursor, PlanStatus, PlanSummary, StoredPlan


@runtime_checkable
class PlanStore(Protocol):
    """A plan store: every method is one transaction, and hands back entities, never rows."""

    url: str

    # ---- plans ---------------------------------------------------------------------------
    def save_plan(self, *, result: "PlanResult", status: "PlanStatus" = ..., ray_job_id: str | None = None) -> str:
        """Store the request, every candidate and the rejections together; the new plan's id."""
        ...

    def get_plan(self, *, plan_id: str) -> "StoredPlan":
        """The plan with this id or unique id prefix (``RecordNotFoundError``, ``AmbiguousIdError``)."""
        ...

    def find_same_request(self, *, request: "PlanRequest") -> "StoredPlan | None":
        """The stored plan of the same request (``PlanRequest.identity()``): the newest verified,
        else the newest; never a ``planner measure`` record."""
        ...

    def find_verified(self, *, request: "PlanRequest") -> "StoredPlan | None":
        """The newest verified plan of the same request, or None."""
        ...

    def history(self, *, model: str | None = None, gpu: str | None = None, status: "PlanStatus | str | None" = None,
                since: datetime | None = None, limit: int = 20, offset: int = 0,
                after: "HistoryCursor | None" = None) -> "list[PlanSummary]":
        """Past plans, newest first (creation time, then id), a page at a time."""
        ...

    def count_plans(self) -> int:
        ...

    # ---- runs and status -----------------------------------------------------------------
    def record_measurement(self, *, candidate_id: str, measurement: "Measurement",
                           ranks: "Sequence[Measurement]" = ()) -> str:
        """A real run of a stored candidate (id or unique prefix); the run's id. ``ranks``: each
        rank's own measurement, in rank order, when several ranks ran it (``measurement`` is then
        the run's: the worst rank's peak, or the failed rank's cause)."""
        ...

    def record_single_measurement(self, *, request: "PlanRequest", candidate: "Candidate",
                                  measurement: "Measurement") -> tuple[str, str]:
        """``planner measure``: a ``measured`` plan of one candidate and its run; (plan id, candidate id)."""
        ...

    def set_status(self, *, plan_id: str, status: "PlanStatus | str", reason: str | None = None,
                   ray_job_id: str | None = None, lease_s: float | None = None) -> None:
        """Move the plan to ``status`` (``StatusTransitionError`` out of a terminal one)."""
        ...

    def renew_lease(self, *, plan_id: str, lease_s: float) -> None:
        """The verifying driver lives: its plan's lease runs ``lease_s`` from now."""
        ...

    def expire_stale_verifications(self) -> int:
        """Mark failed every verifying plan whose lease ran out; how many."""
        ...

    # ---- calibration (read) --------------------------------------------------------------
    def active_calibration(self, *, gpu: str) -> "Calibration | None":
        ...

    def close(self) -> None:
        ...

    def __enter__(self) -> "PlanStore":
        ...

    def __exit__(self, *exc: object) -> None:
        ...


def open_plan_store(*, url: str | None = None, create: bool = True, shared: bool = False) -> PlanStore:
    """The store at ``url`` (default: ``default_database_url()``).

    ``shared``: one store for many threads over a long life (the service): the SQLAlchemy store,
    whose pooled engine reconnects and holds the service's database timeouts. Otherwise the lite
    store when ``url`` is a plain SQLite file at this planner's head, else the SQLAlchemy store,
    which creates a new database's schema (when ``create``), says what to do with one that is
    behind, and speaks PostgreSQL. ``create=False``: a missing SQLite file raises
    ``DatabaseMissingError`` and is not created."""
    from planner.errors import StoreError
    from planner.store.engine import default_database_url

    if url is not None and not isinstance(url, str):  # (a float reached str.startswith: AttributeError)
        raise StoreError(f"the database URL must be text, e.g. sqlite:///path/planner.db, got {type(url).__name__}")
    url = url or default_database_url()
    if not shared:
        from planner.store.lite import LiteStore, sqlite_path

        lite = LiteStore.open(url)
        if lite is not None:
            return lite
        path = sqlite_path(url)
        if not create and path is not None:
            import os

            from planner.store.engine import missing_database

            if not os.path.exists(path):
                raise missing_database(url)
    from planner.store.api import open_store

    return open_store(url=url, create=create)


__all__ = ["PlanStore", "open_plan_store"]
