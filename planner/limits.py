"""Limits the planner checks before it prints or stores anything, shared with the store's schema.

No imports: the planning path checks them without loading SQLAlchemy.
"""

from __future__ import annotations

from planner.errors import UnstorableDataError

#: The longest model id (catalog id, config path, HF id) the store keeps, on every backend
#: (migration 0002; Linux paths reach 4096 but a config path past 1024 is a typo in practice).
MODEL_ID_MAX_CHARS = 1024

#: The most plans one history query returns (``planner history -n/--limit``): SQLite's LIMIT is a
#: signed 64-bit integer, and no terminal or script wants more at once.
MAX_HISTORY = 100_000


def check_model_id(model_id: str) -> None:
    """Refuse a model id the store could not keep (PostgreSQL refuses what SQLite would silently
    keep), before anything is printed or written."""
    if len(model_id) > MODEL_ID_MAX_CHARS:
        raise UnstorableDataError(
            f"the model id is {len(model_id):,} characters and the store keeps at most {MODEL_ID_MAX_CHARS:,}: "
            "give a shorter path to the config.json (e.g. a symlink)"
        )


__all__ = ["MAX_HISTORY", "MODEL_ID_MAX_CHARS", "check_model_id"]
