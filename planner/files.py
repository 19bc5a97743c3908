"""Files the planner writes for the user (emit's plan files, ``--timeline``'s picture), all or nothing:
each is written beside its name, hidden, then renamed over it (``Path.replace``, atomic within one
file system), so a full disk or a refused write leaves what was there as it was, never half a file.

No heavy imports: the CLI's commands use it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable


def partial_of(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (hidden, beside it)."""
    return path.with_name(f".{path.name}.partial")


def discard(parts: Iterable[Path]) -> None:
    """Remove the partial files a failed write began; quietly, since the error to report is the write's."""
    for part in parts:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)


__all__ = ["discard", "partial_of"]
