"""OOM Planner's Python API, for notebooks and scripts::

    import oom_planner as op

    plan = op.suggest(model="Qwen/Qwen2.5-0.5B", gpu="a10g", target_batch=32)
    plan                      # in Jupyter: the ranked plans as a table
    plan.to_dict()            # what `planner suggest --json` prints
    one = op.estimate(model="Qwen/Qwen2.5-0.5B", gpu="a10g", method="lora", micro_batch=4)
    one.figure()              # the step's memory over time (matplotlib)
    op.check("sft.yaml", gpu="a10g")   # an existing training config, and the change that makes it fit
    op.history(limit=5)

Every call is keyword-only and runs the use case the CLI runs (``planner.planning.make_plan``,
``planner.estimation``, ``planner.check``, the store), with the device's active calibration; the
results are the frozen objects the CLI prints, each with ``to_dict()`` and an HTML table for
Jupyter. Errors are the planner's own (``oom_planner.PlannerError`` and its kinds), one line with
the fix. Importing this module imports neither torch nor the planner's heavy parts.
"""

from __future__ import annotations

from oom_planner._api import Estimate, History, Suggestion, check, estimate, history, suggest
from planner import __version__
from planner.errors import (
    InvalidConfigError,
    MissingDependencyError,
    NothingFitsError,
    PlannerError,
    UnknownGPUError,
    UnknownModelError,
    UnsupportedError,
)

__all__ = ["Estimate", "History", "InvalidConfigError", "MissingDependencyError", "NothingFitsError", "PlannerError",
           "Suggestion", "UnknownGPUError", "UnknownModelError", "UnsupportedError", "__version__", "check", "estimate",
           "history", "suggest"]
