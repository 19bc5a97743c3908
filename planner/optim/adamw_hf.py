"""transformers' own AdamW (``optim="adamw_hf"``): the HF Trainer's default optimizer in 2022, one tensor at a time.

transformers v4.21.0 src/transformers/optimization.py ``AdamW.step`` (the Trainer built it for its default
``optim="adamw_hf"``, training_args.py, until ``adamw_torch`` became the default): for each parameter,
``exp_avg.mul_(beta1).add_(grad)``, ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad)``, ``denom =
exp_avg_sq.sqrt().add_(eps)``, ``p.data.addcdiv_(exp_avg, denom)`` (and ``p.data.add_(p.data)`` for weight
decay, 0.0 by the Trainer's default); ``state["step"]`` is a Python int. transformers 5 no longer ships the class
nor takes the name, and torch.optim.AdamW(foreach=False) is not its step (a 4-byte step tensor per parameter, two
temporaries alive in ``denom``, eps after the bias correction): the worker builds a line-for-line copy of the
4.21 step (``planner.optim._adamw_hf_torch.TransformersAdamW``), which the tests measure. Planned when named (the published
2022 runs that ran it), never searched: the fused AdamW does the same update in one pass.
"""

from __future__ import annotations

from planner.optim.spec import OptimizerModel, OptimizerSpec, StepOps

#: Ops ``AdamW.step`` dispatches per tensor without weight decay: ``mul_``, ``add_``, ``mul_``, ``addcmul_``,
#: ``sqrt``, ``add_``, ``addcdiv_`` (a TorchDispatchMode count of the worker's copy,
#: tests/optim/test_optim_host_ops.py), each launching one kernel; the step's bias correction is Python floats
OPS_PER_TENSOR = StepOps(7, 7)
#: Element passes of those ops: ``mul_`` (read + write: 2), ``add_(grad)`` (3), ``mul_`` (2), ``addcmul_(grad,
#: grad)`` (3), ``sqrt`` (2), ``add_(eps)`` (2), ``addcdiv_`` (read param, exp_avg, denom, write param: 4)
PASSES = 18


class AdamWHFMemory(OptimizerModel):
    """Two moments like the parameter (``torch.zeros_like(p.data)``), no step tensor; ``denom``, one
    temporary of the parameter being stepped."""

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return 2 * n * param_bytes

    def step_transient(self, counts, param_bytes, kernels):
        """``exp_avg_sq.sqrt()`` makes ``denom`` (``add_`` is in place), freed before the next tensor: the
        largest tensor's, on any device."""
        return max((n for n, _ in counts), default=0) * param_bytes

    def update_bytes_per_param(self, w):
        return PASSES * w

    def step_ops(self, tensors, matrices, param_bytes, kernels):
        return OPS_PER_TENSOR * tensors


def build(params, *, lr: float):
    from planner.optim._adamw_hf_torch import TransformersAdamW  # (torch: imported when built)

    return TransformersAdamW(params, lr=lr)


SPECS = (
    OptimizerSpec(
        name="adamw_hf", memory=AdamWHFMemory(), build=build, preference=8,
        hf_optim="adamw_hf", hf_removed="5",
        words="AdamW (transformers' own, one tensor at a time), two moments per trainable parameter",
        note="transformers' 2022 AdamW (adamw_hf): AdamW's update in 18 passes a tensor at a time; gone from transformers 5",
        searched=False,
    ),
)

__all__ = ["OPS_PER_TENSOR", "PASSES", "SPECS", "AdamWHFMemory"]
