"""The GPU catalog: lookups, precision checks, the cpu profile and ``planner gpus``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planner.config import Precision
from planner.errors import InvalidConfigError, UnknownGPUError
from planner.gpus import check_precision, get_gpu, gpu_names, list_gpus
from planner.units import GiB, MiB

REQUIRED = (
    "t4", "a10g", "l4", "l40s", "v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb",
    "h100-80gb", "h200", "rtx3090", "rtx4090", "rtx-a6000", "cpu",
)
NUMERIC_FIELDS = (
    "memory_bytes", "cuda_context_bytes", "fp16_tflops", "bf16_tflops", "fp32_tflops",
    "mem_bandwidth_gbs", "host_link_gbs", "interconnect_gbs",
)


def test_catalog_has_the_required_devices():
    assert set(REQUIRED) <= set(gpu_names())
    assert [g.name for g in list_gpus()] == list(gpu_names())


@pytest.mark.parametrize("typed", ["A10G", "a10g", "nvidia-a10g", "NVIDIA A10G", " a10g "])
def test_lookup_tolerates_case_prefix_and_separators(typed):
    assert get_gpu(typed).name == "a10g"


@pytest.mark.parametrize(
    ("typed", "name"),
    [("A100_80GB", "a100-80gb"), ("rtx-3090", "rtx3090"), ("RTX A6000", "rtx-a6000"), ("H100", "h100-80gb"),
     ("Tesla T4", "t4"), ("CPU", "cpu")],
)
def test_lookup_of_common_spellings(typed, name):
    assert get_gpu(typed).name == name


def test_unknown_gpu_is_one_line_listing_the_choices():
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("a200")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown GPU 'a200': choose one of t4, a10g,")
    assert all(name in message for name in REQUIRED)


def test_driver_reported_memory_not_marketing_gigabytes():
    # nvidia-smi totals (modal-labs/modal-client#2797 and the printouts cited in the sources)
    assert get_gpu("a10g").memory_bytes == 23028 * MiB
    assert get_gpu("t4").memory_bytes == 15360 * MiB
    assert get_gpu("a100-80gb").memory_bytes == 81920 * MiB
    assert get_gpu("h100-80gb").memory_bytes == 81559 * MiB
    # "24 GB" cards report less than 24 GiB: 23028 MiB = 22.49 GiB
    assert get_gpu("a10g").memory_bytes < 24 * GiB


@pytest.mark.parametrize("gpu", [g for g in list_gpus()], ids=lambda g: g.name)
def test_every_entry_is_consistent_and_sourced(gpu):
    for name in NUMERIC_FIELDS:
        assert gpu.sources.get(name), f"{gpu.name}.{name} has no source"
    assert gpu.bf16 == (gpu.bf16_tflops > 0)
    assert gpu.fp16_tflops > 0 and gpu.fp32_tflops > 0 and gpu.mem_bandwidth_gbs > 0
    if not gpu.is_cpu:
        # tensor cores beat CUDA-core fp32 on every catalog GPU; the link is slower than HBM/GDDR
        assert gpu.fp16_tflops > gpu.fp32_tflops
        assert gpu.host_link_gbs < gpu.mem_bandwidth_gbs
        assert gpu.interconnect_gbs >= gpu.host_link_gbs
        assert gpu.cuda_context_bytes == 512 * MiB
        assert gpu.bf16 == (gpu.compute_capability >= (8, 0))


def test_dense_not_sparse_peaks():
    # dense = half the datasheet's 2:4-sparsity headline (A100 624 -> 312, H100 SXM 1979 -> 989.4)
    assert get_gpu("a100-80gb").bf16_tflops == 312.0
    assert get_gpu("h100-80gb").bf16_tflops == pytest.approx(1978.9 / 2, abs=0.1)
    assert get_gpu("l4").bf16_tflops == 242 / 2


def test_peak_tflops_per_precision():
    a100 = get_gpu("a100-40gb")
    assert a100.peak_tflops(Precision.FP32) == 19.5
    assert a100.peak_tflops("bf16-mixed") == a100.peak_tflops(Precision.BF16) == 312.0
    assert a100.peak_tflops("fp16-mixed") == a100.peak_tflops(Precision.FP16) == 312.0
    t4 = get_gpu("t4")
    assert t4.peak_tflops("fp16-mixed") == 65.0
    assert t4.peak_tflops("fp32") == 8.1


def test_bf16_refused_before_ampere_with_the_fix():
    t4 = get_gpu("t4")
    assert not t4.supports("bf16-mixed") and t4.supports("fp16-mixed") and t4.supports("fp32")
    with pytest.raises(InvalidConfigError) as info:
        check_precision(t4, "bf16-mixed")
    message = str(info.value)
    assert "T4 has no bf16 support (compute capability 7.5 < 8.0): use fp16-mixed" in message
    assert "\n" not in message
    with pytest.raises(InvalidConfigError, match=r"7\.0 < 8\.0\): use fp16 "):
        check_precision(get_gpu("v100-32gb"), "bf16")
    check_precision(get_gpu("a10g"), "bf16-mixed")  # no error


def test_memory_override_for_gpu_mem():
    gpu = get_gpu("a10g", memory_bytes=20 * GiB)
    assert gpu.memory_bytes == 20 * GiB
    assert "--gpu-mem" in gpu.sources["memory_bytes"]
    assert get_gpu("a10g").memory_bytes == 23028 * MiB  # the catalog entry is untouched


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_memory_override_must_be_positive_bytes(bad):
    with pytest.raises(InvalidConfigError, match="--gpu-mem"):
        get_gpu("a10g", memory_bytes=bad)


def test_cpu_profile_reads_this_machine():
    cpu = get_gpu("cpu")
    assert cpu.is_cpu
    assert cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.cuda_context_bytes == 0
    assert cpu.bf16
    assert cpu.host_link_gbs == cpu.mem_bandwidth_gbs


def test_importing_the_catalog_and_models_does_not_load_torch():
    code = "import sys, planner.gpus, planner.throughput, planner.cli.gpus_cmd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_table(cli):
    result = cli("gpus")
    assert result.code == 0, result
    for name in REQUIRED:
        assert name in result.out
    line = next(line for line in result.out.splitlines() if "a10g" in line)
    assert "22.5" in line and "70" in line  # 23028 MiB = 22.5 GiB; dense bf16


def test_cli_json(cli):
    result = cli("gpus", "--json")
    assert result.code == 0, result
    data = json.loads(result.out)
    assert [d["name"] for d in data] == list(gpu_names())
    a10g = next(d for d in data if d["name"] == "a10g")
    assert a10g["memory_bytes"] == 23028 * MiB
    assert a10g["compute_capability"] == "8.6"
    assert "zzc0721/torch-performance-test-data#126" in a10g["sources"]["bf16_tflops"]
