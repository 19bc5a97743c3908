"""transformers' own AdamW (``optim="adamw_hf"``), the HF Trainer's default optimizer until 2023, as torch code (imported by
``planner.optim.adamw_hf``'s ``build`` only, when the worker builds it: the registry skips ``_`` modules).

transformers 5 no longer ships the class, and torch.optim.AdamW(foreach=False) is not the same step:
torch keeps a 4-byte ``step`` tensor per parameter, computes ``denom = (exp_avg_sq.sqrt() /
bias_correction2_sqrt).add_(eps)`` (two temporaries of the parameter's size alive together, eps added
after the bias correction) and decays the weight before the update (torch/optim/adam.py
``_single_tensor_adam``). This is transformers v4.21.0's ``AdamW.step`` (src/transformers/optimization.py;
later deprecated, gone from 5.x) op for op, so the worker measures the memory and
the host ops ``planner.optim.adamw_hf`` counts: one parameter at a time, the step a Python int, one
temporary (``denom``) of the current parameter's size, seven in-place or fresh elementwise ops per
tensor without weight decay (the Trainer's default, TrainingArguments.weight_decay = 0.0), eight with.
"""

from __future__ import annotations

import math

import torch


class TransformersAdamW(torch.optim.Optimizer):
    """transformers v4.21 ``AdamW(params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True)``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "correct_bias": correct_bias}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    bias_correction1 = 1.0 - beta1 ** state["step"]
                    bias_correction2 = 1.0 - beta2 ** state["step"]
                    step_size = step_size * math.sqrt(bias_correction2) / bias_correction1
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        return loss


__all__ = ["TransformersAdamW"]
