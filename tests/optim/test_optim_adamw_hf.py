"""transformers' own AdamW (planner/optim/adamw_hf.py ``adamw_hf``), the HF Trainer's default in 2022: its memory
against a real CPU run of the step the worker builds (planner/optim/_adamw_hf_torch.py, transformers v4.21's ``AdamW.step``
line for line), and why it is not torch.optim.AdamW(foreach=False)."""

from __future__ import annotations

import pytest

from planner.config import TrainConfig
from planner.errors import UnsupportedError
from planner.gpus import CPU_KERNELS, CUDA_KERNELS
from planner.optim import OPTIMIZERS, SEARCHED, Optimizer

torch = pytest.importorskip("torch")

#: a weight, a bias and a smaller weight: the step's temporary is the largest one's
SHAPES = [(256, 64), (64,), (128, 32)]
LARGEST = 256 * 64
#: bytes of the step's small allocations beside its temporaries (0-dim scalars the ops wrap floats in; measured
#: 276 B for adamw_hf, 20 B for torch's): far below one tensor's
SCALARS = 1024


def _step_peak(build) -> tuple[int, int, list[int]]:
    """(peak bytes the second ``step()`` allocates beyond what was live, state bytes, element counts): c10's CPU
    allocator count (workers.probes.CpuProbe) over one step after the states exist."""
    from workers.probes import CpuProbe

    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    optimizer = build(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # makes the states: the second step is the one every later step repeats
    probe = CpuProbe()
    probe.start()
    try:
        probe.reset_peak()
        optimizer.step()
    finally:
        probe.stop()
    states = sum(v.numel() * v.element_size() for p in params for v in optimizer.state[p].values()
                 if torch.is_tensor(v))
    return probe.peak_allocated_bytes, states, [p.numel() for p in params]


def test_the_descriptor_counts_what_a_cpu_step_of_the_worker_build_allocates():
    memory = OPTIMIZERS["adamw_hf"].memory
    peak, states, sizes = _step_peak(lambda ps: OPTIMIZERS["adamw_hf"].build(ps, lr=1e-3))
    counts = tuple((n, 1) for n in sizes)
    # denom = exp_avg_sq.sqrt().add_(eps): one fp32 copy of the parameter being stepped, the largest's at most
    assert memory.step_transient(counts, 4, CPU_KERNELS) == LARGEST * 4 <= peak < LARGEST * 4 + SCALARS
    assert memory.step_transient(counts, 4, CUDA_KERNELS) == LARGEST * 4  # the same code on any device
    # two moments like the parameter, the step a Python int (no 4-byte step tensor)
    assert states == memory.state_bytes(sizes, 4) == 2 * 4 * sum(sizes)


def test_torch_single_tensor_adamw_is_not_that_step():
    """torch's own per-tensor path holds two temporaries (``exp_avg_sq.sqrt() / bias_correction2_sqrt``) and a
    step tensor per parameter: the worker cannot stand it in for adamw_hf."""
    peak, states, sizes = _step_peak(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))
    assert 2 * LARGEST * 4 <= peak < 2 * LARGEST * 4 + SCALARS
    assert states == 2 * 4 * sum(sizes) + 4 * len(sizes)


def test_the_worker_step_is_transformers_4_21_adamw_numerically():
    """Two steps of the copy against the update written out (eps added to sqrt(v) before the bias
    correction's step size, as transformers 4.21 did; torch adds it after)."""
    from planner.optim._adamw_hf_torch import TransformersAdamW

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    start = p.detach().clone()
    grads = [torch.randn(5), torch.randn(5)]
    opt = TransformersAdamW([p], lr=0.1)
    m = torch.zeros(5)
    v = torch.zeros(5)
    expected = start.clone()
    for t, g in enumerate(grads, start=1):
        p.grad = g
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        step_size = 0.1 * (1 - 0.999**t) ** 0.5 / (1 - 0.9**t)
        expected = expected - step_size * m / (v.sqrt() + 1e-6)
    assert torch.allclose(p.detach(), expected, atol=1e-6)


def test_planned_when_named_never_searched_and_refused_by_emit():
    spec = OPTIMIZERS["adamw_hf"]
    assert Optimizer.ADAMW_HF not in SEARCHED and spec.hf_optim == "adamw_hf"
    # the update's passes: 18 (no weight decay, no bias-corrected denom) against the fused kernel's 7
    assert spec.memory.update_bytes_per_param(4) == 18 * 4
    from planner.emit.settings import training_arguments

    with pytest.raises(UnsupportedError, match="adamw_fused"):
        training_arguments(TrainConfig(optimizer="adamw_hf"), on_cpu=True)


def test_a_config_that_names_adamw_hf_is_read_as_it():
    from planner.check.reading import _optimizers

    assert _optimizers()["adamw_hf"] == "adamw_hf"
