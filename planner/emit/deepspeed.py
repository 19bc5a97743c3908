"""The DeepSpeed config a ZeRO configuration runs with (pure: no deepspeed or torch import).

One builder for both users of it: the measurement worker passes the dict to
``deepspeed.initialize(config=...)`` (``workers.deepspeed_config`` re-exports it) and
``planner emit`` writes it as ``ds_config.json`` for the HF Trainer, so the run that was measured
and the run the user launches use the same buckets. Keys follow DeepSpeed's config reference
(https://www.deepspeed.ai/docs/config-json/, deepspeed/runtime/zero/config.py in 0.19).
"""

from __future__ import annotations

from typing import Any

from planner.config import Offload, Precision, TrainConfig
from planner.errors import InvalidConfigError
from planner.memory import deepspeed_buckets
from planner.optim import OPTIMIZERS

#: learning rate of every optimizer a run builds (the value does not change memory)
LEARNING_RATE = 1e-4
#: AdamW's other hyperparameters: torch.optim.AdamW's defaults (torch/optim/adamw.py), which the
#: worker's optimizer uses; the emitted TrainingArguments repeat them (the HF Trainer refuses a
#: DeepSpeed config whose optimizer values differ from its own)
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.01


def build(
    config: TrainConfig, *, hidden_size: int, pin_memory: bool = False, gradient_clipping: float | None = None
) -> dict[str, Any]:
    """DeepSpeed config for ``config`` (which must have ``zero`` 1, 2 or 3).

    ``hidden_size``: the model's hidden size, which sizes the communication buckets.
    ``pin_memory``: page-lock offloaded buffers (faster H2D copies on a GPU; False on the CPU,
    where there is nothing to copy to). ``train_batch_size`` is left out so DeepSpeed derives it
    from the world size (micro batch x accumulation x ranks). ``gradient_clipping``: the norm
    DeepSpeed clips gradients to (None: the key is left out, DeepSpeed does not clip; the emitted
    config sets the HF Trainer's ``max_grad_norm`` so both clip alike, and the Trainer checks that
    they match: transformers integrations/deepspeed.py ``trainer_config_process``).
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
    if gradient_clipping is not None:
        ds["gradient_clipping"] = gradient_clipping
    section = OPTIMIZERS[config.optimizer].deepspeed_section
    if section is not None:
        # DeepSpeed builds the optimizer itself from this section (with offload, its CPU optimizer)
        ds["optimizer"] = section(lr=LEARNING_RATE, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY,
                                  offload=config.offload is not Offload.NONE)
    else:
        # the others are passed to deepspeed.initialize as client optimizers, which ZeRO refuses
        # unless told (engine.py _do_optimizer_sanity_check)
        ds["zero_allow_untested_optimizer"] = True
    return ds


__all__ = ["ADAM_BETAS", "ADAM_EPS", "LEARNING_RATE", "WEIGHT_DECAY", "build"]
