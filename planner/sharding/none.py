"""No sharding: one process holds the whole model, its gradients and its optimizer states.

The scheme of ``--zero 0`` on one GPU; on more it is DDP (``planner.sharding.ddp``): the two are
one choice, whole replicas, and ``planner.sharding.for_gpus`` picks by the GPU count. Every term
is ``ShardingSpec``'s default.
"""

from __future__ import annotations

from planner.sharding.spec import ShardingSpec

SPECS = (ShardingSpec(name="none", order=0, zero_stage=0, replicas=True),)
