"""How a descriptor package builds its registry: every module of the package that defines
``SPECS`` adds its descriptors (``planner.optim``, ``planner.sharding``). No planner imports: the
foundation's packages use it."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Iterable


def discover(package: str, path: Iterable[str], *, key: Callable[[Any], Any], what: str) -> tuple[Any, ...]:
    """The ``SPECS`` of every module of ``package`` (its ``__name__`` and ``__path__``) not named
    ``_*``, sorted by ``key``; a name defined twice is a programming error (``what`` names it)."""
    specs: list[Any] = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        if not info.name.startswith("_"):
            specs += getattr(importlib.import_module(f"{package}.{info.name}"), "SPECS", ())
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), f"{what} is defined twice: {sorted(names)}"
    return tuple(sorted(specs, key=key))
