"""PyTorch DistributedDataParallel: whole replicas on every rank, gradients all-reduced.

The scheme of ``--zero 0`` on more than one GPU (``planner.sharding.for_gpus``): what the HF
Trainer and accelerate launch with ``torchrun`` and no DeepSpeed or FSDP plugin.
"""

from __future__ import annotations

from typing import Any, Callable

from planner.sharding.spec import BreakdownKey, ShardingSpec, WorkerSetup, join_process_group, ring


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

    # ---- the worker (lazy imports: these run in the measurement process only) ----------------
    def worker_init(self, device: str) -> None:
        """The run's process group (each rank of a multi-rank verification joins the others':
        ``planner.verify.ranks``), before the probe starts."""
        join_process_group(device)

    def worker_setup(self, model: Any, params: list, config: Any, *, device: str,
                     build_optimizer: Callable[[list], Any], hidden_size: int,
                     hyperparameters: dict[str, Any]) -> WorkerSetup:
        """The model wrapped in ``DistributedDataParallel`` (its defaults, as the HF Trainer and
        accelerate leave them: 25 MB buckets, ``gradient_as_bucket_view=False``, which allocates the
        flat buckets the ``ddp/buckets`` term counts); the optimizer over the same parameters."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        ids = None if device == "cpu" else [torch.device(device).index or 0]
        engine = DistributedDataParallel(model, device_ids=ids)
        return WorkerSetup(engine=engine, optimizer=build_optimizer(params), autocast=config.precision.is_mixed)


SPECS = (DDP(name="ddp", order=1, zero_stage=0, replicas=True, searched=False,
             # bucket_cap_mb=25 (torch DDP docs)
             keys=(BreakdownKey("ddp/buckets", "gradients", tensor_bytes=25 * 1024**2),)),)
