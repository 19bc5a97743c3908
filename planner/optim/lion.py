"""bitsandbytes' Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign
of an interpolated momentum as the update, one momentum buffer per tensor, in 32 bits, in 8 bits
(blockwise like 8-bit AdamW), or 8-bit and paged.

bitsandbytes/optim/lion.py: ``Lion``, ``Lion8bit`` and ``PagedLion8bit`` are ``Optimizer1State``
("lion"): one state, ``state1``, fp32 whatever the parameter's dtype (``get_state_buffer(p,
dtype=torch.float32)``), or uint8 with one fp32 absmax per 256-element block for a tensor of at
least ``min_8bit_size`` (4096) elements (bitsandbytes/optim/optimizer.py
``Optimizer1State.init_state``); the step count is a Python int, not a tensor. transformers
builds them for optim="lion_32bit", "lion_8bit" and "paged_lion_8bit" (trainer_optimizer.py
``_get_bitsandbytes_optimizer``: ``Lion`` with optim_bits=8 for "8bit", is_paged for "paged",
betas=(adam_beta1, adam_beta2)).
"""

from __future__ import annotations

from planner.optim.bnb import BNB_8BIT_STATE_BYTES, BNB_MIN_8BIT_SIZE, BitsandbytesStep, blockwise_state_bytes
from planner.optim.spec import FP32, OptimizerSpec

#: Lion's beta2: the paper's default (Chen et al. 2023: beta1 = 0.9, beta2 = 0.99), bitsandbytes'
#: own (Lion's betas=(0.9, 0.99)); the HF Trainer passes adam_beta1/adam_beta2 (0.999 by default) instead, so
#: the emitted settings name beta2
BETA2 = 0.99

#: fp32 temporaries of bitsandbytes' CPU backend per element of the tensor it steps, fp32
#: parameters (backends/cpu/ops.py, "lion" branches). 32-bit ``_optimizer_update_32bit_cpu``:
#: ``g_float = g.float() * gnorm_scale`` (1; ``g.float()`` of an fp32 gradient is the gradient),
#: ``update = state1.mul(beta1).add(g_float, ...)`` (the product and the sum alive together: 2),
#: then ``update.sign()`` beside ``update`` (2, after the product is freed): 3.
#: 8-bit ``_optimizer_update_8bit_blockwise_cpu``: the dequantised state (1), ``grad = g.float()
#: * gnorm_scale`` (1), then ``state1_fp32.mul(beta1) + grad.mul(1 - beta1)`` (both products and
#: their sum alive together: 3): 5. A 16-bit parameter adds ``p.data.float()`` (1) to both.
_CPU_TEMPS_32BIT = 3
_CPU_TEMPS_8BIT = 5


class LionMemory(BitsandbytesStep):
    """One momentum per trainable tensor: fp32, or blockwise 8-bit when ``bits`` is 8."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return blockwise_state_bytes(n, 1) if self.bits == 8 else n * FP32

    def step_transient(self, counts, param_bytes, kernels):
        """On CUDA none: bitsandbytes' kernels update in registers. Its CPU backend (the cpu
        KernelProfile's ``bnb_8bit_step_whole_tensor``: whole-tensor fp32 temporaries) holds, for
        the tensor it updates, 3 fp32 copies on the 32-bit path and 5 on the 8-bit one (one more
        for a 16-bit parameter): the largest of the largest tensor of each path. Tensors under
        4096 elements take the 32-bit path in ``Lion8bit`` too."""
        if not kernels.bnb_8bit_step_whole_tensor:
            return 0
        upcast = FP32 if param_bytes < FP32 else 0
        small = max((n for n, _ in counts if self.bits == 32 or n < BNB_MIN_8BIT_SIZE), default=0)
        large = max((n for n, _ in counts if self.bits == 8 and n >= BNB_MIN_8BIT_SIZE), default=0)
        return max(small * (_CPU_TEMPS_32BIT * FP32 + upcast), large * (_CPU_TEMPS_8BIT * FP32 + upcast))

    def update_bytes_per_param(self, w):
        """Param read and written, grad read (3w), the momentum read and written: fp32, or one
        byte with its share of the block's fp32 absmax."""
        return 3.0 * w + 2 * (BNB_8BIT_STATE_BYTES if self.bits == 8 else FP32)


def build_32bit(params, *, lr: float):
    import bitsandbytes as bnb

    return bnb.optim.Lion(params, lr=lr, optim_bits=32)


def build_8bit(params, *, lr: float):
    import bitsandbytes as bnb

    return bnb.optim.Lion8bit(params, lr=lr)


def build_paged_8bit(params, *, lr: float):
    import bitsandbytes as bnb

    return bnb.optim.PagedLion8bit(params, lr=lr)


#: Lion's update has the magnitude of the learning rate in every coordinate: the paper trains with
#: a learning rate 3-10x below AdamW's and a weight decay 3-10x above (Chen et al. 2023, "Hyperparameter Tuning"), so it
#: is not a drop-in for AdamW's recipe and ``suggest`` does not swap it in unasked.
_NOTE = "Lion: sign of one momentum, needs a 3-10x smaller lr than AdamW (Chen et al. 2023)"

SPECS = (
    OptimizerSpec(
        name="lion_32bit", memory=LionMemory(32), build=build_32bit, preference=5,
        hf_optim="lion_32bit", hf_args={"adam_beta2": BETA2},
        words="bitsandbytes Lion (one fp32 momentum per trainable parameter, sign updates)",
        note=_NOTE, library="bitsandbytes", searched=False,
    ),
    OptimizerSpec(
        name="lion_8bit", memory=LionMemory(8), build=build_8bit, preference=6,
        hf_optim="lion_8bit", hf_args={"adam_beta2": BETA2},
        words="bitsandbytes 8-bit Lion (one blockwise-quantized momentum, sign updates)",
        note=_NOTE, library="bitsandbytes", bnb_8bit_states=True, searched=False,
    ),
    OptimizerSpec(
        name="paged_lion_8bit", memory=LionMemory(8), build=build_paged_8bit, preference=7,
        hf_optim="paged_lion_8bit", hf_args={"adam_beta2": BETA2},
        words="bitsandbytes paged 8-bit Lion (one blockwise-quantized momentum in paged memory)",
        note=_NOTE, library="bitsandbytes", bnb_8bit_states=True, paged=True, unpaged="lion_8bit",
        searched=False,
    ),
)

__all__ = ["BETA2", "SPECS", "LionMemory"]
