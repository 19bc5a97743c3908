"""PyTorch DistributedDataParallel: whole replicas on every rank, gradients all-reduced.

The scheme of ``--zero 0`` on more than one GPU (``planner.sharding.for_gpus``): what the HF
Trainer and accelerate launch with ``torchrun`` and no DeepSpeed or FSDP plugin.
"""

from __future__ import annotations

from typing import Any

from planner.sharding.spec import BreakdownKey, ShardingSpec, ring


class DDP(ShardingSpec):
    """Whole replicas plus DDP's gradient buckets and one all-reduce per step."""

    def model_states(self, model: Any, config: Any, t: Any, out: dict[str, int], *, param_bytes: int, grads: int,
                     base_sizes: tuple[int, ...]) -> tuple[dict[str, int], int]:
        out, host = super().model_states(model, config, t, out, param_bytes=param_bytes, grads=grads,
                                         base_sizes=base_sizes)
        # DDP copies every gradient into its flat buckets (gradient_as_bucket_view=False, the
        # default; torch DDP docs: "saved memory size will be equal to the total gradients size"
        # with it on).
        out["ddp/buckets"] = grads
        return out, host

    def accelerate(self, config: Any, *, on_cpu: bool) -> dict[str, Any]:
        return {"distributed_type": "MULTI_CPU" if on_cpu else "MULTI_GPU"}

    def comm_bytes(self, config: Any, *, trainable: int, params_total: int, grad_bytes: int) -> float:
        """One all-reduce of the gradients per step (HF/accelerate skip the sync during
        accumulation): 2·(n-1)/n · trainable · grad bytes (gradients in the parameter dtype)."""
        return 2 * ring(config.gpus) * trainable * grad_bytes


SPECS = (DDP(name="ddp", order=1, zero_stage=0, replicas=True, searched=False,
             # bucket_cap_mb=25 (torch DDP docs)
             keys=(BreakdownKey("ddp/buckets", "gradients", tensor_bytes=25 * 1024**2),)),)
