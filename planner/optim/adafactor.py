"""transformers' Adafactor without momentum: a factored second moment (Shazeer & Stern 2018)."""

from __future__ import annotations

import math

from planner.optim.spec import FP32, OptimizerModel, OptimizerSpec, StepOps

#: Ops ``Adafactor.step`` dispatches per tensor with beta1=None and no weight decay (the Trainer's), as a
#: TorchDispatchMode counts them (tests/optim/test_optim_host_ops.py; transformers optimization.py
#: ``Adafactor.step``, ``_rms``, ``_approx_sq_grad``): ``_rms(p)`` (norm, div: 2), ``grad**2 + eps`` (2), then a
#: >= 2-D tensor the row and column means and their two ``mul_().add_()`` (6), ``_approx_sq_grad`` (mean, div,
#: rsqrt_, two unsqueeze views, rsqrt, mul: 7), ``update.mul_(grad)`` (1): 26 with the rest; a 1-D tensor
#: ``exp_avg_sq.mul_().add_()`` (2) and ``rsqrt().mul_(grad)`` (2): 16 with the rest; the rest is the clip
#: (``_rms(update)``, ``/ clip_threshold``, ``clamp_``, ``div_``: 5), ``mul_(lr)`` (1) and ``p.add_(-update)`` (2);
#: every op a kernel but the two views
FACTORED_OPS, VECTOR_OPS = StepOps(26, 24), StepOps(16, 16)
#: a 16-bit parameter adds ``grad.float()``, ``p.float()`` and ``p.copy_(p_data_fp32)``
HALF_PARAM_OPS = StepOps(3, 3)


class AdafactorMemory(OptimizerModel):
    """transformers' Adafactor with beta1=None: a factored second moment, one fp32 row and one
    column vector per >= 2-D tensor, a full fp32 vector per 1-D tensor
    (transformers/optimization.py)."""

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        # flat sizes do not tell the shape: rows + cols taken as 2·sqrt(n)
        return FP32 * (2 * math.isqrt(n)) if n > 0 else 0

    def model_state_bytes(self, model, config, t, param_bytes):
        """With the true shapes: rows + cols per 2-D weight, full vectors for 1-D tensors."""
        r = config.lora_r or 0
        total = 0
        if config.method.uses_adapters:
            for lin in t.targets:
                total += lin.count * ((r + lin.in_features) + (lin.out_features + r))
            return FP32 * total * model.num_layers
        per_layer = 0
        for lin in model.layer_linears:
            per_layer += lin.count * (lin.in_features + lin.out_features + (lin.out_features if lin.bias else 0))
        per_layer += model.layer_norm_params + model.layer_other_params
        total = per_layer * model.num_layers
        total += model.vocab_size + model.hidden_size  # embedding rows + cols
        total += model.other_embedding_params and (model.max_seq_len + model.hidden_size)
        total += model.final_norm_params
        if model.head_params:
            square = model.vocab_size * model.hidden_size
            total += model.vocab_size + model.hidden_size + (model.head_params - square if model.head_params > square else 0)
        return FP32 * total

    def flat_partition_state_bytes(self, partition: int) -> int:
        # a flat 1-D partition is not factored: one full fp32 vector
        return FP32 * partition

    def step_transient(self, counts, param_bytes, kernels):
        """Two full fp32 tensors of the current parameter at once: ``grad**2 + eps`` while
        ``_approx_sq_grad`` builds the factored estimate, then ``update`` while ``p.add_(-update)``
        makes its negation (Adafactor.step); a 16-bit parameter adds its fp32 copy and its
        gradient's (``p.float()``, ``grad.float()``)."""
        return (2 + (2 if param_bytes == 2 else 0)) * max((n for n, _ in counts), default=0) * FP32

    def update_bytes_per_param(self, w):
        """The passes of ``Adafactor.step`` over a 2-D weight: grad**2+eps (r g, w sq), row and
        column means (r sq twice), the rank-1 approximation (w update), update*grad (r update,
        r grad, w update), RMS (r update), clip (r, w update), *lr (r, w update), param -= update
        (r param, r update, w param): 16 full passes of fp32 (transformers upcasts inside)."""
        return 16.0 * FP32

    def step_ops(self, tensors, matrices, param_bytes, kernels):
        """Tensor by tensor, a few dozen small ops each: ``FACTORED_OPS`` per >= 2-D tensor, ``VECTOR_OPS``
        per 1-D one, ``HALF_PARAM_OPS`` more each for 16-bit parameters."""
        ops = FACTORED_OPS * matrices + VECTOR_OPS * (tensors - matrices)
        return ops + HALF_PARAM_OPS * tensors if param_bytes < FP32 else ops


#: with a fixed learning rate, as the HF Trainer builds it for optim="adafactor" (transformers
#: trainer_optimizer.py _get_adafactor: scale_parameter=False, relative_step=False; warmup_init is
#: Adafactor's default, False)
_FIXED_LR = {"scale_parameter": False, "relative_step": False, "warmup_init": False}


def build(params, *, lr: float):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, **_FIXED_LR)


SPECS = (
    OptimizerSpec(
        name="adafactor", memory=AdafactorMemory(), build=build, preference=3,
        hf_optim="adafactor",
        words="Adafactor (factored second moment, no first moment)",
        note="Adafactor: factored 2nd moment, no momentum (Shazeer & Stern 2018)",
    ),
)

__all__ = ["SPECS", "AdafactorMemory"]
