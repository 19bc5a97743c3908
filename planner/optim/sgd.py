"""torch.optim.SGD with momentum 0.9: one buffer per trainable parameter."""

from __future__ import annotations

from planner.optim.spec import OptimizerModel, OptimizerSpec

#: the momentum the memory model's buffer stands for (the HF Trainer's SGD keeps no buffer unless
#: optim_args gives one: transformers trainer_optimizer.py _get_sgd)
MOMENTUM = 0.9


class SGDMemory(OptimizerModel):
    """SGD with momentum: one momentum buffer like the parameter (torch/optim/sgd.py)."""

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return n * param_bytes

    def update_bytes_per_param(self, w):
        """Read param, grad, momentum buffer; write param, buffer => 5w."""
        return 5.0 * w


def build(params, *, lr: float):
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


SPECS = (
    OptimizerSpec(
        name="sgd", memory=SGDMemory(), build=build, preference=4,
        hf_optim="sgd",
        # torch's SGD applies weight decay as grad + wd * param, a new tensor per parameter in
        # the step (torch/optim/sgd.py _single_tensor_sgd); the model and the worker's SGD
        # (weight_decay=0) update in place
        hf_args={"optim_args": f"momentum={MOMENTUM}", "weight_decay": 0.0},
        words=f"SGD with momentum {MOMENTUM} (one buffer per trainable parameter)",
        note="SGD: trains LMs worse than AdamW at its settings (Zhao et al. 2024)",
    ),
)

__all__ = ["MOMENTUM", "SPECS", "SGDMemory"]
