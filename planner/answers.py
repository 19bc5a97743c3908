"""A verified plan in its JSON form: which candidate is the answer (the fastest that fit when
run), its status and every run. ``planner suggest --json``, ``planner verify`` and the service's
``POST /v1/plans`` all answer with it, so it lives below the CLI and the service."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from planner.store import StoredPlan
    from planner.verify.driver import VerificationReport


def answer_position(plan: "StoredPlan") -> int | None:
    """The fastest candidate that fit when run (by measured tokens/s), from the stored runs."""
    fitting = [(s.latest.measurement.tokens_per_s or 0.0, -s.position, s.position) for s in plan.candidates
               if s.latest is not None and str(s.latest.measurement.outcome) == "ok"]
    return max(fitting)[2] if fitting else None


def from_store_dict(plan: "StoredPlan") -> dict[str, Any]:
    """``planner suggest --json`` (and ``POST /v1/plans``) of a request answered from the store."""
    return plan.to_result().to_dict() | {"plan_id": plan.id, "from_store": True, "verification": verification_dict(plan)}


def verification_dict(plan: "StoredPlan", report: "VerificationReport | None" = None) -> dict[str, Any]:
    """The ``--json`` form: status, why, the answer and every run."""
    return {
        "status": str(plan.status),
        "reason": plan.status_reason,
        "status_changed_at": plan.status_changed_at.isoformat() if plan.status_changed_at else None,
        "answer_rank": None if (a := answer_position(plan)) is None else a + 1,
        "where": report.where if report else None,
        "elapsed_s": report.elapsed_s if report else None,
        "runs": [
            {"rank": s.position + 1, "label": s.candidate.config.label(), **s.run_dict(s.latest)}
            for s in plan.candidates if s.latest is not None
        ],
        "skipped": [{"rank": r.position + 1, "label": r.label, "reason": r.note}
                    for r in (report.runs if report else ()) if r.state == "skipped"],
    }


__all__ = ["answer_position", "from_store_dict", "verification_dict"]
