"""torch.optim.SGD with momentum 0.9: one buffer per trainable parameter."""

from __future__ import annotations

from planner.optim.adamw import AdamWImpl
from planner.optim.spec import TENSOR_LIST_CHUNK, OptimizerModel, OptimizerSpec, StepOps

#: ops of a step once the momentum buffers exist, momentum on, no weight decay, dampening or nesterov (the
#: worker's SGD): ``buf.mul_(momentum)``, ``buf.add_(grad)``, ``param.add_(buf, alpha=-lr)``, per tensor on the
#: single-tensor path, once per parameter group (a kernel per chunk of tensors) on the foreach path (torch 2.13
#: torch/optim/sgd.py ``_single_tensor_sgd``; ``_multi_tensor_sgd``: ``_foreach_mul_``, ``_foreach_add_`` twice);
#: no step counter
SGD_OPS = 3

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

    def step_ops(self, tensors, matrices, param_bytes, kernels):
        """``SGD_OPS`` a tensor on the path torch picks on the CPU; on CUDA (foreach, the same
        ``_default_to_fused_or_foreach`` as AdamW's, ``KernelProfile.adamw``) ``SGD_OPS`` once, a kernel each
        per chunk of ``TENSOR_LIST_CHUNK`` tensors."""
        if kernels.adamw is AdamWImpl.SINGLE_TENSOR:
            return StepOps(SGD_OPS, SGD_OPS) * tensors
        return StepOps(SGD_OPS, SGD_OPS * -(-tensors // TENSOR_LIST_CHUNK))


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
