"""The DeepSpeed config a ZeRO configuration runs with (pure: no deepspeed or torch import).

The dict is what ``workers`` passes to ``deepspeed.initialize(config=...)``; users can dump it as
JSON and run it as is. Keys follow DeepSpeed's config reference
(https://www.deepspeed.ai/docs/config-json/, deepspeed/runtime/zero/config.py in 0.19).
"""

from __future__ import annotations

from typing import Any

from planner.config import Offload, Optimizer, Precision, TrainConfig
from planner.errors import InvalidConfigError
from planner.memory import deepspeed_buckets

#: learning rate of every optimizer a run builds (the value does not change memory)
LEARNING_RATE = 1e-4


def build(config: TrainConfig, *, hidden_size: int, pin_memory: bool = False) -> dict[str, Any]:
    """DeepSpeed config for ``config`` (which must have ``zero`` 1, 2 or 3).

    ``hidden_size``: the model's hidden size, which sizes the communication buckets.
    ``pin_memory``: page-lock offloaded buffers (faster H2D copies on a GPU; False on the CPU,
    where there is nothing to copy to). ``train_batch_size`` is left out so DeepSpeed derives it
    from the world size (micro batch x accumulation x ranks).
    """
    if config.zero == 0:
        raise InvalidConfigError("a DeepSpeed config needs --zero 1, 2 or 3: use --zero 0 without DeepSpeed")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise InvalidConfigError(f"hidden_size must be a whole number >= 1 (the model's hidden size), got {hidden_size!r}")
    # the bucket sizes planner.memory assumes (the HF Trainer's "auto" values), not DeepSpeed's
    # 5e8-element defaults, which would hold ~1 GB of 16-bit buffers on a small model
    buckets = deepspeed_buckets(hidden_size)
    zero: dict[str, Any] = {"stage": config.zero, "reduce_bucket_size": buckets["reduce_bucket_size"]}
    if config.zero in (1, 2):
        zero["allgather_bucket_size"] = buckets["allgather_bucket_size"]
    else:
        zero["stage3_prefetch_bucket_size"] = buckets["stage3_prefetch_bucket_size"]
        zero["stage3_param_persistence_threshold"] = buckets["stage3_param_persistence_threshold"]
    if config.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if config.offload is Offload.OPTIMIZER_PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum,
        "zero_optimization": zero,
        # DeepSpeed keeps fp32 master weights itself: *-mixed maps to its bf16/fp16 mode
        # (TrainConfig refuses pure 16-bit with ZeRO).
        "bf16": {"enabled": config.precision is Precision.BF16_MIXED},
        "fp16": {"enabled": config.precision is Precision.FP16_MIXED},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.optimizer is Optimizer.ADAMW:
        params: dict[str, Any] = {"lr": LEARNING_RATE, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
        if config.offload is Offload.NONE:
            # torch.optim.AdamW instead of FusedAdam (a CUDA-only extension): deepspeed
            # runtime/engine.py _configure_basic_optimizer, "torch_adam"
            params["torch_adam"] = True
        # with offload DeepSpeed builds DeepSpeedCPUAdam from this section
        ds["optimizer"] = {"type": "AdamW", "params": params}
    else:
        # SGD, Adafactor and the bitsandbytes optimizers are passed to deepspeed.initialize as
        # client optimizers, which ZeRO refuses unless told (engine.py _do_optimizer_sanity_check)
        ds["zero_allow_untested_optimizer"] = True
    return ds


__all__ = ["LEARNING_RATE", "build"]
