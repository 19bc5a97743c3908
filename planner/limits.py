"""Limits the planner checks before it prints or stores anything, shared with the store's schema.

No imports: the planning path checks them without loading SQLAlchemy.
"""

from __future__ import annotations

from planner.errors import InvalidConfigError, UnstorableDataError

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


#: The most GPUs one node holds: --gpus counts the data-parallel devices of ONE node (the host RAM
#: of offload plans is the node's, the interconnect is the node's). The largest standard machines
#: hold 16 (NVIDIA DGX-2: 16 x V100; AWS p2.16xlarge: 16 x K80); the GPU catalog's AWS machines
#: hold at most 8.
MAX_GPUS_PER_NODE = 16


def check_gpu_count(gpus: object) -> None:
    """--gpus: a whole number from 1 to the GPUs of one node."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidConfigError(f"--gpus must be a whole number >= 1, got {gpus!r}")
    if gpus > MAX_GPUS_PER_NODE:
        raise InvalidConfigError(
            f"--gpus {gpus} is more GPUs than one node holds (at most {MAX_GPUS_PER_NODE}): the planner plans the "
            "data-parallel GPUs of one node; give the GPUs per node"
        )


__all__ = ["MAX_GPUS_PER_NODE", "MAX_HISTORY", "MODEL_ID_MAX_CHARS", "check_gpu_count", "check_model_id"]
