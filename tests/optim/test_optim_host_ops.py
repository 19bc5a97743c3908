"""The ops each optimizer's step dispatches from the host (``OptimizerModel.step_ops``: aten calls, and the kernels
among them), counted from its real code: a TorchDispatchMode over one CPU step of the optimizer (the per-tensor
paths run the same ops on any device), and the chunked foreach/fused paths and bitsandbytes' CUDA calls by hand."""

from __future__ import annotations

import pytest

from planner.gpus import CPU_KERNELS, CUDA_KERNELS
from planner.optim import OPTIMIZERS
from planner.optim.spec import StepOps

torch = pytest.importorskip("torch")


def _dispatched_per_step(build, shapes, dtype=None) -> int:
    """aten ops one step (after the first, which makes the states) dispatches, less the step's two
    record_function markers (the optimizer's profiling hook, once a step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "record_function" not in func.__name__:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype or torch.float32)) for shape in shapes]
    optimizer = build(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    with Count():
        optimizer.step()
    return Count.ops


MATRICES, VECTORS = [(8, 16)] * 3, [(16,)] * 2


def test_transformers_adamw_dispatches_seven_ops_a_tensor():
    build = OPTIMIZERS["adamw_hf"].build
    memory = OPTIMIZERS["adamw_hf"].memory
    assert _dispatched_per_step(lambda ps: build(ps, lr=1e-3), MATRICES + VECTORS) == 5 * 7
    assert memory.step_ops(5, 3, 4, CUDA_KERNELS) == memory.step_ops(5, 3, 4, CPU_KERNELS) == (35, 35)  # all kernels


def test_torch_single_tensor_adamw_dispatches_ten_ops_a_tensor():
    """With weight decay (torch's default 0.01, the planner's runs'): step += 1, mul_, lerp_, mul_, addcmul_,
    item, sqrt, div, add_, addcdiv_; the step counter is a CPU tensor, so its add and item launch no kernel."""
    memory = OPTIMIZERS["adamw"].memory
    ops = _dispatched_per_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), MATRICES + VECTORS)
    assert ops == 5 * 10
    assert memory.step_ops(5, 3, 4, CPU_KERNELS) == StepOps(ops, 5 * 8) == (50, 40)  # the CPU's path: single-tensor


def test_foreach_and_fused_adamw_by_hand():
    """foreach: 8 ops, each a kernel per chunk of 36 tensors (four lists in torch's TensorListMetadata), and 3 host
    ops per tensor on its CPU step counters; fused: 2 ops. 100 tensors: 3 chunks."""
    assert OPTIMIZERS["adamw"].memory.step_ops(100, 60, 4, CUDA_KERNELS) == (8 + 3 * 100, 8 * 3) == (308, 24)
    assert OPTIMIZERS["adamw_fused"].memory.step_ops(100, 60, 4, CUDA_KERNELS) == (2, 2 * 3) == (2, 6)


def test_adafactor_dispatches_26_ops_a_matrix_and_16_a_vector():
    from transformers.optimization import Adafactor

    def build(ps):
        return Adafactor(ps, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)

    memory = OPTIMIZERS["adafactor"].memory
    ops = _dispatched_per_step(build, MATRICES + VECTORS)
    # every op a kernel but _approx_sq_grad's two unsqueeze views
    assert memory.step_ops(5, 3, 4, CUDA_KERNELS) == (ops, ops - 3 * 2) == (3 * 26 + 2 * 16, 3 * 24 + 2 * 16)
    # a 16-bit parameter: grad.float(), p.float(), p.copy_() each
    half = _dispatched_per_step(build, MATRICES + VECTORS, dtype=torch.bfloat16)
    assert memory.step_ops(5, 3, 2, CUDA_KERNELS) == (half, half - 6) == (110 + 5 * 3, 104 + 5 * 3)


def test_bitsandbytes_calls_four_a_tensor_and_waits_for_each():
    """bitsandbytes' CUDA step (read from its code; its CPU backend is another path): two contiguous(), the update
    kernel (the one launch) and torch.cuda.synchronize() per tensor."""
    for name in ("adamw_8bit", "paged_adamw_8bit", "lion_8bit", "lion_32bit"):
        memory = OPTIMIZERS[name].memory
        assert memory.step_ops(10, 4, 4, CUDA_KERNELS) == (40, 10) and memory.syncs_each_tensor
    assert not OPTIMIZERS["adamw"].memory.syncs_each_tensor


def test_sgd_with_momentum_dispatches_three_ops_a_tensor_or_three_foreach_ops():
    """The worker's SGD (momentum 0.9, no weight decay): mul_, add_ on the buffer and add_ on the parameter, per
    tensor on the CPU's single-tensor path; on CUDA's foreach path those 3 once, a kernel per chunk of 36."""
    spec = OPTIMIZERS["sgd"]
    ops = _dispatched_per_step(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=False), MATRICES + VECTORS)
    assert spec.memory.step_ops(5, 3, 4, CPU_KERNELS) == (ops, ops) == (15, 15)
    foreach = _dispatched_per_step(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True), MATRICES + VECTORS)
    assert foreach == 3
    assert spec.memory.step_ops(100, 60, 4, CUDA_KERNELS) == (3, 3 * 3)
