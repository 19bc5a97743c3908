"""The ``cpu`` profile follows the machine's CPU where torch's kernels do: a bf16 matmul holds an
fp32 buffer of its output's size on an AMX CPU and none without AMX (``planner.gpus``)."""

from __future__ import annotations

import pytest

from planner.gpus import CPU_KERNELS, bf16_matmul_fp32_buffer, cpu_flags, cpu_kernels, get_gpu

AMX_XEON = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16", "amx_tile"})
EPYC = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})


@pytest.mark.parametrize("flags, buffer", [(AMX_XEON, True), (EPYC, False), (None, True)])
def test_the_buffer_follows_the_flags(flags, buffer):
    assert bf16_matmul_fp32_buffer(flags) is buffer
    assert cpu_kernels(amx=buffer).mm_fp32_buffer is buffer
    # everything else of the profile is the CPU's
    assert cpu_kernels(amx=buffer).name == CPU_KERNELS.name
    assert cpu_kernels(amx=buffer).adamw == CPU_KERNELS.adamw


def test_the_fused_loss_counts_the_buffer_only_where_the_cpu_has_it():
    """Liger's chunk loop at 16 rows x vocabulary 32000, hidden 512, bf16 under autocast: the logits
    matmul holds 16 x 32000 x 4 B beside its 16 x 32000 x 2 B output on an AMX CPU, against the
    chunk's 16 x (32000 + 512) x 2 B gradient product without the buffer."""
    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.memory.activations import fused_ce_chunk_rows, fused_ce_transient
    from planner.memory.dtypes import mode_of
    from planner.memory.shapes import dims_of

    spec = spec_from_config(dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                 max_position_embeddings=4096), model_id="t", source="test")
    config = TrainConfig(method="lora", precision="bf16-mixed", fused_ce=True, micro_batch=1, seq_len=512)
    dims, mode = dims_of(spec, config), mode_of(config)
    assert fused_ce_chunk_rows(dims) == 16
    with_buffer = fused_ce_transient(dims, mode, cpu_kernels(amx=True))
    without = fused_ce_transient(dims, mode, cpu_kernels(amx=False))
    assert with_buffer - without == 16 * 32000 * (2 + 4) - 16 * (32000 + 512) * 2


def test_this_machines_bf16_matmul_is_as_the_profile_says():
    """A real bf16 matmul under the CPU probe: when the fp32 buffer is there, this machine's ``cpu``
    profile counts it (a CPU whose kernels hold one the profile leaves out fails here, not in a plan).
    The converse does not hold on every AMX machine (``bf16_matmul_fp32_buffer``): the profile counts
    the buffer, the larger peak, where the flags cannot tell."""
    torch = pytest.importorskip("torch")
    from workers.probes import CpuProbe

    a, b = torch.randn(16, 512, dtype=torch.bfloat16), torch.randn(512, 32000, dtype=torch.bfloat16)
    (a @ b).sum()  # oneDNN's first call builds its kernel: outside the count
    probe = CpuProbe()
    probe.start()
    out = a @ b
    probe.stop()
    beside_output = probe.peak_allocated_bytes - out.numel() * out.element_size()
    assert beside_output in (0, 16 * 32000 * 4 + 128), beside_output  # nothing, or the fp32 buffer (measured)
    held = beside_output > 0
    counted = get_gpu("cpu").kernels.mm_fp32_buffer
    assert counted or not held, (sorted(cpu_flags() or ()), beside_output)
    if not counted:  # a CPU without AMX: no buffer, as measured on an AMD EPYC with AVX512-BF16
        assert beside_output == 0
