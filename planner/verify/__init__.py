"""Verification: the top candidates of a plan trained for a few real steps on Ray workers.

* ``verify_plan`` runs a stored plan's candidates on Ray (embedded, or a cluster) and stores each
  run, moving the plan planned -> verifying -> verified / failed (``planner.verify.driver``);
* ``submit_plan`` stores a plan and sends its verification to a cluster as a Ray job, which
  verifies the stored plan by its id; ``jobs`` wraps Ray's ``JobSubmissionClient``
  (``planner.verify.jobs``); ``planner.usecases`` is what calls them;
* ``planner.verify.accelerators`` maps the catalog's GPUs to Ray accelerator types.

Ray is imported only inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "RunReport": "planner.verify.driver",
    "RunState": "planner.verify.driver",
    "VerificationReport": "planner.verify.driver",
    "VerifyOptions": "planner.verify.driver",
    "verify_plan": "planner.verify.driver",
    "JobRequest": "planner.verify.jobs",
    "Submission": "planner.verify.jobs",
    "submit_plan": "planner.verify.jobs",
}


def __getattr__(name: str) -> Any:
    """Lazy exports: ``from planner.verify import verify_plan`` loads only what it needs."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner.verify' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
