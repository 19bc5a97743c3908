"""The optimizers the planner knows: one descriptor module each, read by name from here.

Each module of this package that defines ``SPECS`` (a tuple of ``OptimizerSpec``) adds those
optimizers: the registry below is built once, at import, from the package's modules (the way
torchtitan's ``build_optimizers`` is one lookup by name), and every other part of the planner
(``TrainConfig``'s ``Optimizer``, the memory and throughput models, the search and its ranking,
emit, the CLI and the API, the worker) reads it. Adding an optimizer is one module here and its
tests. The descriptors import nothing of the planner above ``planner.optim``: ``planner.config``
builds on them.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping

from planner.optim.spec import OptimizerSpec
from planner.registry import discover

#: Every descriptor of the package's modules, in preference order (names unique).
SPECS: tuple[OptimizerSpec, ...] = discover(__name__, __path__, key=lambda s: (s.preference, s.name),
                                            what="an optimizer name")

#: The type of ``TrainConfig.optimizer``: one str-valued member per registered name
#: (``Optimizer("adamw") is Optimizer.ADAMW``), in preference order.
Optimizer = enum.StrEnum("Optimizer", [(s.name.upper(), s.name) for s in SPECS], module=__name__)
Optimizer.__doc__ = "An optimizer of the registry (``planner.optim``), by its planner name."

#: The descriptor of each optimizer, by ``Optimizer`` member (a plain name finds it too: a member
#: is equal to its name and hashes alike).
OPTIMIZERS: Mapping[Optimizer, OptimizerSpec] = MappingProxyType({Optimizer(s.name): s for s in SPECS})

#: The optimizers ``suggest`` tries by default (``OptimizerSpec.searched``), in preference order.
SEARCHED: tuple[Optimizer, ...] = tuple(o for o in Optimizer if OPTIMIZERS[o].searched)


def names(optimizers=None) -> str:
    """``a|b|c``: the names of these optimizers (default: all), as the help and errors list them."""
    return "|".join(str(o) for o in (Optimizer if optimizers is None else optimizers))


def optimizer_state_bytes(*, sizes: tuple[int, ...] | list[int], optimizer: Optimizer | str, param_bytes: int) -> int:
    """Persistent optimizer state for trainable tensors of these element counts."""
    return OPTIMIZERS[Optimizer(optimizer)].memory.state_bytes(sizes, param_bytes)


__all__ = ["OPTIMIZERS", "SEARCHED", "SPECS", "Optimizer", "OptimizerSpec", "names", "optimizer_state_bytes"]
