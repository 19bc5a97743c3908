"""torch.optim.AdamW: the usual recipe, and the only optimizer DeepSpeed builds and offloads itself."""

from __future__ import annotations

import enum

from planner.optim.spec import FP32, TENSOR_LIST_CHUNK, OptimizerModel, OptimizerSpec, StepOps

#: Ops torch 2.13's ``_single_tensor_adam`` dispatches per tensor with decoupled weight decay (torch/optim/adam.py
#: l.414-546: ``step_t += 1``, ``param.mul_``, ``exp_avg.lerp_``, ``exp_avg_sq.mul_(...).addcmul_``,
#: ``_get_value(step_t)`` (an ``.item()``), ``exp_avg_sq.sqrt() / bias_correction2_sqrt``, ``.add_(eps)``,
#: ``param.addcdiv_``): 10, as a TorchDispatchMode counts them (tests/optim/test_optim_host_ops.py), 8 of them
#: kernels (the step counter is a CPU tensor: its ``+= 1`` and ``.item()`` launch none)
SINGLE_TENSOR_OPS = StepOps(10, 8)
#: ``_multi_tensor_adam`` (l.626-800), per (device, dtype) group: 8 foreach ops that launch one kernel per
#: ``TENSOR_LIST_CHUNK`` tensors (``_foreach_mul_`` weight decay, ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``,
#: ``div_``, ``add_``, ``addcdiv_``) and, its steps being CPU tensors, 3 host ops per tensor that launch nothing:
#: the step's ``_foreach_add_`` on the CPU, which loops over them (l.680: "the slow path, which is a for-loop"),
#: and the two ``_get_value(step)`` of the bias corrections (l.771-776)
FOREACH_OPS, FOREACH_TENSOR_OPS = 8, 3
#: ``_fused_adam`` (l.847-877): ``_foreach_add_`` on the device's steps and ``_fused_adamw_``, a kernel per chunk each
FUSED_OPS = 2


class AdamWImpl(enum.StrEnum):
    """Which torch.optim.AdamW code path steps the parameters (torch/optim/adamw.py); a device's
    ``planner.gpus.KernelProfile`` names the one torch picks there."""

    SINGLE_TENSOR = "single_tensor"
    """``_single_tensor_adamw``: one parameter at a time."""
    FOREACH = "foreach"
    """``_multi_tensor_adamw``: ``torch._foreach_*`` over every parameter at once."""
    FUSED = "fused"
    """``_fused_adamw``: one fused kernel, no temporaries outside it."""


class AdamWMemory(OptimizerModel):
    """torch.optim.AdamW: exp_avg and exp_avg_sq like the parameter plus a 4-byte fp32 ``step``
    tensor per parameter (torch/optim/adamw.py _init_group). ``path``: the code path the optimizer is
    built to take (``fused=True``), or None for the one torch picks on the device
    (``KernelProfile.adamw``)."""

    def __init__(self, path: AdamWImpl | None = None) -> None:
        self.path = path

    def path_on(self, kernels) -> AdamWImpl:
        """The path that steps the parameters on a device whose kernels are ``kernels``."""
        return self.path or kernels.adamw

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return 2 * n * param_bytes + FP32  # + the fp32 step tensor

    def step_transient(self, counts, param_bytes, kernels):
        """The foreach path's ``torch._foreach_sqrt(exp_avg_sqs)`` materialises one extra copy of
        every second moment (torch/optim/adamw.py _multi_tensor_adamw); tensor by tensor
        (_single_tensor_adamw) ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two temporaries
        of the largest parameter; the fused kernel none."""
        path = self.path_on(kernels)
        if path is AdamWImpl.SINGLE_TENSOR:
            return 2 * max((n for n, _ in counts), default=0) * param_bytes
        if path is AdamWImpl.FOREACH:
            return sum(n * copies for n, copies in counts) * param_bytes
        return 0

    def update_bytes_per_param(self, w):
        """Read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq => 7w."""
        return 7.0 * w

    def step_ops(self, tensors, matrices, param_bytes, kernels):
        """One tensor at a time: ``SINGLE_TENSOR_OPS`` each; foreach and fused: their ops once (one parameter
        group), each a kernel per chunk of ``TENSOR_LIST_CHUNK`` tensors."""
        path = self.path_on(kernels)
        if path is AdamWImpl.SINGLE_TENSOR:
            return SINGLE_TENSOR_OPS * tensors
        chunks = -(-tensors // TENSOR_LIST_CHUNK)
        if path is AdamWImpl.FOREACH:
            return StepOps(FOREACH_OPS + FOREACH_TENSOR_OPS * tensors, FOREACH_OPS * chunks)
        return StepOps(FUSED_OPS, FUSED_OPS * chunks)


def build(params, *, lr: float):
    import torch

    return torch.optim.AdamW(params, lr=lr)


def build_fused(params, *, lr: float):
    import torch

    return torch.optim.AdamW(params, lr=lr, fused=True)


def deepspeed_section(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                      offload: bool, fused: bool = False) -> dict:
    """DeepSpeed builds AdamW itself from this section: DeepSpeedCPUAdam with offload."""
    params: dict = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}
    if not offload:
        # torch.optim.AdamW instead of FusedAdam (a CUDA-only extension): deepspeed
        # runtime/engine.py _configure_basic_optimizer, "torch_adam"; the section's other keys
        # reach torch.optim.AdamW's constructor (get_optimizer_configuration pops only its own)
        params["torch_adam"] = True
        if fused:
            params["fused"] = True
    return {"type": "AdamW", "params": params}


def deepspeed_section_fused(**kwargs) -> dict:
    return deepspeed_section(**kwargs, fused=True)


SPECS = (
    # The searched AdamW: torch's fused kernel, which HF's Trainer builds by default since torch 2.8
    # (transformers training_args.py ``default_optim``): no temporaries outside the kernel and one
    # pass over each tensor, where the path torch picks unasked (foreach on CUDA, torch/optim/
    # optimizer.py ``_default_to_fused_or_foreach``: ``fused = use_fused and ...``) holds a copy of
    # every second moment and makes 20 passes (planner.kernels.ADAMW_SINGLE_TENSOR_PASSES)
    OptimizerSpec(
        name="adamw_fused", memory=AdamWMemory(AdamWImpl.FUSED), build=build_fused, preference=0,
        # transformers trainer_optimizer.py builds torch.optim.AdamW(fused=True) for adamw_torch_fused
        hf_optim="adamw_torch_fused",
        words="AdamW (torch, fused kernel), two fp32 moments per trainable parameter",
        deepspeed_section=deepspeed_section_fused, deepspeed_offload=True,
    ),
    # The same AdamW on the path torch picks: what a run that names adamw_torch (or builds
    # torch.optim.AdamW itself) steps with; planned when named, never better than the fused one
    OptimizerSpec(
        name="adamw", memory=AdamWMemory(), build=build, preference=0,
        # transformers trainer_optimizer.py builds torch.optim.AdamW for adamw_torch
        hf_optim="adamw_torch",
        words="AdamW (torch), two fp32 moments per trainable parameter",
        deepspeed_section=deepspeed_section, deepspeed_offload=True, searched=False,
    ),
)

__all__ = ["SINGLE_TENSOR_OPS", "SPECS", "AdamWImpl", "AdamWMemory"]
