"""The DeepSpeed config a ZeRO configuration runs with (pure: no deepspeed or torch import), and the
hyperparameters every emitted optimizer uses.

One builder for both users of it: the measurement worker passes the dict to
``deepspeed.initialize(config=...)`` (``workers.deepspeed_config`` re-exports it) and
``planner emit`` writes it as ``ds_config.json`` for the HF Trainer, so the run that was measured
and the run the user launches use the same buckets. The keys are the ZeRO descriptor's
(``planner.sharding.zero``).
"""

from __future__ import annotations

from typing import Any

from planner.config import TrainConfig
from planner.errors import InvalidConfigError

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
    """DeepSpeed config for ``config`` (whose sharding must be a ZeRO stage): the scheme's
    ``ds_config.json`` (``planner.sharding.zero.ZeRO.emitted_files``, which says what each key is).

    ``hidden_size``: the model's hidden size, which sizes the communication buckets.
    ``pin_memory``: page-lock offloaded buffers. ``gradient_clipping``: the norm DeepSpeed clips
    gradients to (None: DeepSpeed does not clip; the emitted config sets the HF Trainer's
    ``max_grad_norm`` so both clip alike, and the Trainer checks that they match: transformers
    integrations/deepspeed.py ``trainer_config_process``).
    """
    files = config.sharding.spec.emitted_files(
        config, hidden_size=hidden_size, pin_memory=pin_memory, gradient_clipping=gradient_clipping,
        hyperparameters={"lr": LEARNING_RATE, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY})
    if "ds_config.json" not in files:
        raise InvalidConfigError("a DeepSpeed config needs --zero 1, 2 or 3: use --zero 0 without DeepSpeed")
    return files["ds_config.json"]


__all__ = ["ADAM_BETAS", "ADAM_EPS", "LEARNING_RATE", "WEIGHT_DECAY", "build"]
