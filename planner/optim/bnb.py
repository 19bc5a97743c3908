"""bitsandbytes' 8-bit optimizer states: the blockwise layout every 8-bit optimizer of it shares.

Not a descriptor: the rules the descriptors of bitsandbytes' optimizers (``adamw_8bit``,
``lion``) build their memory models from.
"""

from __future__ import annotations

import math

from planner.optim.spec import FP32, OptimizerModel, StepOps

#: bitsandbytes 8-bit optimizers: blockwise quantisation with 256-element blocks and an fp32
#: absmax per block (bnb.optim.optimizer.Optimizer8bit / Optimizer2State.init_state: blocksize =
#: 256; Dettmers et al. 2022 "8-bit Optimizers").
BNB_8BIT_BLOCK = 256
#: bnb keeps 32-bit states for tensors smaller than this (Optimizer8bit min_8bit_size=4096).
BNB_MIN_8BIT_SIZE = 4096
#: Bytes per element of one 8-bit optimizer state with its share of the block's fp32 absmax.
BNB_8BIT_STATE_BYTES = 1 + FP32 / BNB_8BIT_BLOCK
#: Host calls bitsandbytes' ``Optimizer8bit.step`` makes per tensor on CUDA (bitsandbytes/optim/optimizer.py:
#: ``update_step`` l.537-538 ``p.data.contiguous()`` and ``p.grad.contiguous()``, one
#: ``torch.ops.bitsandbytes.optimizer_update_8bit_blockwise`` or ``_32bit`` kernel (functional.py), then ``step``
#: l.335 ``sync_gpu(p)``: ``torch.cuda.synchronize()``, utils.py l.204-206): 4, one of them a kernel, the same for
#: every 1- and 2-state optimizer of it; the Python around them (``get_config``'s dict, ``is_on_gpu``) is not counted
BNB_STEP_OPS = StepOps(4, 1)


class BitsandbytesStep(OptimizerModel):
    """What every bitsandbytes optimizer's ``step`` dispatches (``adamw_8bit``, ``lion``): one update kernel per
    tensor and the calls around it, ``BNB_STEP_OPS`` each, and a device sync after each tensor."""

    #: bitsandbytes synchronises the device after each tensor's update (``BNB_STEP_OPS``)
    syncs_each_tensor = True

    def step_ops(self, tensors, matrices, param_bytes, kernels):
        return BNB_STEP_OPS * tensors


def blockwise_state_bytes(n: int, states: int) -> int:
    """``states`` optimizer states of one tensor of ``n`` elements: fp32 under
    ``BNB_MIN_8BIT_SIZE`` elements, else one uint8 per element and one fp32 absmax per block each
    (bitsandbytes/optim/optimizer.py ``Optimizer1State.init_state`` / ``Optimizer2State.init_state``)."""
    if n < BNB_MIN_8BIT_SIZE:
        return states * n * FP32
    return states * (n + math.ceil(n / BNB_8BIT_BLOCK) * FP32)


__all__ = ["BNB_8BIT_BLOCK", "BNB_8BIT_STATE_BYTES", "BNB_MIN_8BIT_SIZE", "BNB_STEP_OPS", "BitsandbytesStep",
           "blockwise_state_bytes"]
