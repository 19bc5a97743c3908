"""The DeepSpeed config the worker runs ZeRO with: the one builder ``planner emit`` also writes
(``planner.emit.deepspeed``), re-exported here for the worker. Pure: no deepspeed or torch import."""

from __future__ import annotations

from planner.emit.deepspeed import LEARNING_RATE, build

__all__ = ["LEARNING_RATE", "build"]
