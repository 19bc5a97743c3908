"""What the forward pass saves for backward, for any model: the one place that chooses between
the decoder-only (and encoder-only) blocks of ``planner.memory.activations`` and the
encoder-decoder stacks of ``planner.memory.encdec``. It sits above both because ``encdec`` builds
its blocks from ``activations``' terms.
"""

from __future__ import annotations

from planner.config import TrainConfig
from planner.gpus import KernelProfile
from planner.memory import encdec
from planner.memory.activations import (
    breakdown_key,
    decoder_activation_breakdown,
    decoder_recompute_bytes,
    kernels_of,
)
from planner.modelspec import ModelSpec


def activation_breakdown(model: ModelSpec, config: TrainConfig, *, kernels: KernelProfile | None = None,
                         is_cpu: bool = False, targets: frozenset[str] | None = None) -> dict[str, int]:
    """Bytes saved for backward over the whole forward pass, by component (one device; the
    kernels of ``kernels``, else of the CPU profile when ``is_cpu``, else CUDA's; ``targets``:
    the adapted linears' names when the caller has them)."""
    kernels = kernels_of(kernels, is_cpu)
    if model.is_encoder_decoder:
        return {breakdown_key(k): v for k, v in encdec.activation_breakdown(model, config, kernels, targets).items()}
    return decoder_activation_breakdown(model, config, kernels, targets)


def recompute_bytes(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                    targets: frozenset[str] | None = None) -> int:
    """Under checkpointing, one (non-first) block's saved tensors rebuilt during backward."""
    if not config.grad_ckpt:
        return 0
    if model.is_encoder_decoder:
        return encdec.recompute_bytes(model, config, kernels, targets)
    return decoder_recompute_bytes(model, config, kernels, targets)


__all__ = ["activation_breakdown", "recompute_bytes"]
