"""bitsandbytes' 8-bit AdamW, plain and paged: two blockwise-quantised moments (Dettmers et al. 2022)."""

from __future__ import annotations

from planner.optim.bnb import BNB_8BIT_STATE_BYTES, BNB_MIN_8BIT_SIZE, BitsandbytesStep, blockwise_state_bytes
from planner.optim.spec import FP32, OptimizerSpec


class AdamW8bitMemory(BitsandbytesStep):
    """bitsandbytes AdamW8bit: two uint8 states + one fp32 absmax per 256-element block each,
    and 32-bit states for tensors under 4096 elements (bnb Optimizer8bit)."""

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        return blockwise_state_bytes(n, 2)

    def step_transient(self, counts, param_bytes, kernels):
        """On CUDA none: the kernel dequantises one block at a time in registers. bitsandbytes'
        CPU backend (backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu) makes, for the
        tensor it updates, fp32 copies of both states (4n + 4n), of the gradient times
        gnorm_scale (4n), ``p.float()`` for a 16-bit parameter (4n) and ``sqrt(state2) /
        correction`` (4n + 4n alive together): 20n bytes, 24n for 16-bit parameters, for the
        largest tensor on the 8-bit path (>= 4096 elements; smaller ones take the 32-bit path).
        Measured with c10's allocator count: exactly 20n / 24n + a few bytes of 0-dim scalars
        (tests/verify/test_probes.py)."""
        if not kernels.bnb_8bit_step_whole_tensor:
            return 0
        largest = max((n for n, _ in counts if n >= BNB_MIN_8BIT_SIZE), default=0)
        return largest * (5 * FP32 + (FP32 if param_bytes < FP32 else 0))

    def update_bytes_per_param(self, w):
        """Param and grad w each, two 1-byte states + fp32 absmax per 256 read and written."""
        return 3.0 * w + 4 * BNB_8BIT_STATE_BYTES  # 2 states read + written


def build(params, *, lr: float):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=lr)


def build_paged(params, *, lr: float):
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, lr=lr)


#: transformers trainer_optimizer.py _get_bitsandbytes_optimizer: bitsandbytes' AdamW with
#: optim_bits=8 for names with "8bit", is_paged for names with "paged"
SPECS = (
    OptimizerSpec(
        name="adamw_8bit", memory=AdamW8bitMemory(), build=build, preference=1,
        hf_optim="adamw_bnb_8bit",
        words="bitsandbytes 8-bit AdamW (blockwise-quantized moments)",
        note="8-bit AdamW: quantised moments, matched 32-bit (Dettmers et al. 2022)",
        library="bitsandbytes", bnb_8bit_states=True,
    ),
    OptimizerSpec(
        name="paged_adamw_8bit", memory=AdamW8bitMemory(), build=build_paged, preference=2,
        hf_optim="paged_adamw_8bit",
        words="bitsandbytes paged 8-bit AdamW (moments in paged memory)",
        note="paged 8-bit AdamW: quantised moments (Dettmers et al. 2022), paged to host under pressure",
        library="bitsandbytes", bnb_8bit_states=True, paged=True, unpaged="adamw_8bit",
    ),
)

__all__ = ["SPECS", "AdamW8bitMemory"]
