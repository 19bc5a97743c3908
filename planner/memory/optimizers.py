"""One class per optimizer: its persistent states, the temporaries of its step, its traffic.

``OPTIMIZERS[Optimizer.X]`` is the model of optimizer X. ``state_bytes`` takes the element counts
of the trainable tensors (per-tensor rules such as bitsandbytes' 32-bit fallback for small
tensors need them); ``step_transient`` (over (element count, tensors) pairs) the temporaries ``optimizer.step()`` holds beyond states
and gradients on a device whose kernels are described by a ``KernelProfile``;
``update_bytes_per_param`` the device memory traffic of one update (``planner.throughput``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from planner.config import Optimizer
from planner.gpus import AdamWImpl, KernelProfile
from planner.memory.dtypes import BNB_8BIT_BLOCK, BNB_8BIT_STATE_BYTES, BNB_MIN_8BIT_SIZE, FP32
from planner.memory.parameters import Trained
from planner.modelspec import ModelSpec


class OptimizerModel:
    """What one optimizer keeps and allocates (subclasses fill in the rules)."""

    name: Optimizer

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        """Persistent state of one trainable tensor of ``n`` elements."""
        raise NotImplementedError

    def state_bytes(self, sizes: Iterable[int], param_bytes: int) -> int:
        """Persistent state of trainable tensors of these element counts."""
        return self._counted_state_bytes(Counter(sizes).items(), param_bytes)

    def _counted_state_bytes(self, counts: Iterable[tuple[int, int]], param_bytes: int) -> int:
        # a model has few distinct tensor shapes: (elements, tensors) pairs
        return sum(self.tensor_state_bytes(n, param_bytes) * copies for n, copies in counts)

    def model_state_bytes(self, model: ModelSpec, config, t: Trained, param_bytes: int) -> int:
        """Persistent state of the configuration's trainable tensors ``t``."""
        return self._counted_state_bytes(t.size_counts, param_bytes)

    def flat_partition_state_bytes(self, partition: int) -> int:
        """State of one flat fp32 tensor of ``partition`` elements (DeepSpeed's master partition)."""
        return self._counted_state_bytes(((partition, 1),), FP32)

    def step_transient(self, counts: Iterable[tuple[int, int]], param_bytes: int, kernels: KernelProfile) -> int:
        """Temporaries inside ``optimizer.step()`` beyond states and gradients, for trainable tensors
        given as (element count, number of such tensors) pairs (``Trained.size_counts``: a model
        has few distinct shapes, and the search asks for thousands of these). None by default:
        SGD updates in place."""
        return 0

    def update_bytes_per_param(self, w: int) -> float:
        """Device memory traffic of one update per trainable parameter of ``w`` bytes."""
        raise NotImplementedError


class AdamW(OptimizerModel):
    """torch.optim.AdamW: exp_avg and exp_avg_sq like the parameter plus a 4-byte fp32 ``step``
    tensor per parameter (torch/optim/adamw.py _init_group)."""

    name = Optimizer.ADAMW

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return 2 * n * param_bytes + FP32  # + the fp32 step tensor

    def step_transient(self, counts, param_bytes, kernels):
        """The foreach path's ``torch._foreach_sqrt(exp_avg_sqs)`` materialises one extra copy of
        every second moment (torch/optim/adamw.py _multi_tensor_adamw); tensor by tensor
        (_single_tensor_adamw) ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two temporaries
        of the largest parameter; the fused kernel none."""
        if kernels.adamw is AdamWImpl.SINGLE_TENSOR:
            return 2 * max((n for n, _ in counts), default=0) * param_bytes
        if kernels.adamw is AdamWImpl.FOREACH:
            return sum(n * copies for n, copies in counts) * param_bytes
        return 0

    def update_bytes_per_param(self, w):
        """Read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq => 7w."""
        return 7.0 * w


class SGD(OptimizerModel):
    """SGD with momentum: one momentum buffer like the parameter (torch/optim/sgd.py)."""

    name = Optimizer.SGD

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return n * param_bytes

    def update_bytes_per_param(self, w):
        """Read param, grad, momentum buffer; write param, buffer => 5w."""
        return 5.0 * w


class Adafactor(OptimizerModel):
    """transformers' Adafactor with beta1=None: a factored second moment, one fp32 row and one
    column vector per >= 2-D tensor, a full fp32 vector per 1-D tensor
    (transformers/optimization.py)."""

    name = Optimizer.ADAFACTOR

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


class AdamW8bit(OptimizerModel):
    """bitsandbytes AdamW8bit: two uint8 states + one fp32 absmax per 256-element block each,
    and 32-bit states for tensors under 4096 elements (bnb Optimizer8bit)."""

    name = Optimizer.ADAMW_8BIT

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        if n < BNB_MIN_8BIT_SIZE:
            return 2 * n * FP32
        return 2 * (n + math.ceil(n / BNB_8BIT_BLOCK) * FP32)

    def step_transient(self, counts, param_bytes, kernels):
        """On CUDA none: the kernel dequantises one block at a time in registers. bitsandbytes'
        CPU backend (backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu) makes, for the
        tensor it updates, fp32 copies of both states (4n + 4n), of the gradient times
        gnorm_scale (4n), ``p.float()`` for a 16-bit parameter (4n) and ``sqrt(state2) /
        correction`` (4n + 4n alive together): 20n bytes, 24n for 16-bit parameters, for the
        largest tensor on the 8-bit path (>= 4096 elements; smaller ones take the 32-bit path).
        Measured with c10's allocator count: exactly 20n / 24n + a few bytes of 0-dim scalars
        (tests/test_probes.py)."""
        if not kernels.bnb_8bit_step_whole_tensor:
            return 0
        largest = max((n for n, _ in counts if n >= BNB_MIN_8BIT_SIZE), default=0)
        return largest * (5 * FP32 + (FP32 if param_bytes < FP32 else 0))

    def update_bytes_per_param(self, w):
        """Param and grad w each, two 1-byte states + fp32 absmax per 256 read and written."""
        return 3.0 * w + 4 * BNB_8BIT_STATE_BYTES  # 2 states read + written


class PagedAdamW8bit(AdamW8bit):
    """bitsandbytes PagedAdamW8bit: AdamW8bit's states in paged (unified) memory."""

    name = Optimizer.PAGED_ADAMW_8BIT


OPTIMIZERS: dict[Optimizer, OptimizerModel] = {cls.name: cls() for cls in (AdamW, SGD, Adafactor, AdamW8bit, PagedAdamW8bit)}


def optimizer_state_bytes(*, sizes: tuple[int, ...] | list[int], optimizer: Optimizer, param_bytes: int) -> int:
    """Persistent optimizer state for trainable tensors of these element counts."""
    return OPTIMIZERS[Optimizer(optimizer)].state_bytes(sizes, param_bytes)


__all__ = ["OPTIMIZERS", "AdamW", "AdamW8bit", "Adafactor", "OptimizerModel", "PagedAdamW8bit", "SGD",
           "optimizer_state_bytes"]
