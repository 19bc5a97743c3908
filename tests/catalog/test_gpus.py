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
    "h100-80gb", "h200", "rtx3090", "rtx4090", "rtx-a6000",
    "b200", "rtx5090", "rtx6000-ada", "rtx-pro-6000", "l40", "a40", "a10", "gh200", "gb200", "mi300x", "cpu",
)
#: The cards issue 21 added, with their datasheet figures derived here by hand:
#: (nvidia-smi MiB, dense bf16 TFLOPS, fp32 TFLOPS, GB/s, compute capability, FP8).
NEW_CARDS = {
    # HGX B200 datasheet per GPU: 4.5 PFLOPS bf16 with 2:4 sparsity -> 4500 / 2 = 2250 dense; 80 fp32;
    # 8 TB/s; nvidia-smi '0MiB / 183359MiB'
    "b200": (183359, 4500 / 2, 80.0, 8000.0, (10, 0), True),
    # RTX 5090: 3352 AI TOPS = FP4 sparse; /2 dense 1676, /2 FP8 838, /2 FP16 (fp16 acc) 419, GeForce
    # FP32 accumulate at half rate: 419 / 2 = 209.5; 104.8 fp32; 1792 GB/s; '32607MiB'
    "rtx5090": (32607, 3352 / 16, 104.8, 1792.0, (12, 0), True),
    # RTX 6000 Ada: 1457 TFLOPS FP8 sparse; /2 dense 728.5, /2 16-bit 364.25 (full-rate FP32 accumulate)
    "rtx6000-ada": (49140, 1457 / 4, 91.1, 960.0, (8, 9), True),
    # RTX PRO 6000 Blackwell: 4000 AI TOPS FP4 sparse -> 4000 / 8 = 500, whitepaper exact 503.8; 125 fp32
    "rtx-pro-6000": (97887, 503.8, 125.0, 1792.0, (12, 0), True),
    # L40: 362.1 bf16 sparse -> 181.05 dense; 90.5 fp32; 864 GB/s; '46068MiB' (ECC on)
    "l40": (46068, 362.1 / 2, 90.5, 864.0, (8, 9), True),
    # A40: 299.4 bf16 sparse -> 149.7 dense; 37.4 fp32; 696 GB/s; '46068MiB' (ECC on)
    "a40": (46068, 299.4 / 2, 37.4, 696.0, (8, 6), False),
    # A10: 250 bf16 sparse -> 125 dense (the A10G runs at 70); 31.2 fp32; 600 GB/s; '23028MiB'
    "a10": (23028, 250 / 2, 31.2, 600.0, (8, 6), False),
    # GH200 (96 GB HBM3): 1979 bf16 sparse -> 989.4 dense, as the H100 SXM; 67 fp32; 4 TB/s; '97871MiB'
    "gh200": (97871, 1978.9 / 2, 66.9, 4000.0, (9, 0), True),
    # GB200 NVL72 per GPU = rack / 72: 360 PFLOPS bf16 sparse -> 5000 sparse -> 2500 dense; 5760 fp32 -> 80;
    # 576 TB/s -> 8000 GB/s; nvidia-smi '0MiB / 189471MiB'
    "gb200": (189471, 360_000 / 72 / 2, 5760 / 72, 576_000 / 72, (10, 0), True),
    # MI300X: 2614.9 fp16/bf16 sparse -> 1307.45 dense; 163.4 fp32; 5.3 TB/s; rocm-smi 206141652992 B
    # = 196592 MiB; torch's compute capability for gfx942 is 9.4
    "mi300x": (206141652992 // MiB, 2614.9 / 2, 163.4, 5300.0, (9, 4), True),
}
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


@pytest.mark.parametrize("name", NEW_CARDS)
def test_new_cards_match_their_datasheets(name):
    mib, bf16, fp32, bandwidth, cc, fp8 = NEW_CARDS[name]
    gpu = get_gpu(name)
    assert gpu.memory_bytes == mib * MiB
    assert gpu.bf16_tflops == pytest.approx(bf16, abs=0.1)
    assert gpu.fp16_tflops == gpu.bf16_tflops  # FP32-accumulate tensor rate, same for fp16 and bf16
    assert gpu.fp32_tflops == fp32
    assert gpu.mem_bandwidth_gbs == bandwidth
    assert gpu.compute_capability == cc and gpu.fp8 is fp8
    assert gpu.peak_tflops("bf16-mixed") == gpu.bf16_tflops and gpu.peak_tflops("fp32") == fp32


def test_new_cards_links():
    # PCIe x16 effective per direction: gen4 ~25 GB/s, gen5 ~50 GB/s (module docstring)
    assert [get_gpu(n).host_link_gbs for n in ("a10", "a40", "l40", "rtx6000-ada")] == [25.0] * 4
    assert [get_gpu(n).host_link_gbs for n in ("rtx5090", "rtx-pro-6000", "b200")] == [50.0] * 3
    # B200: NVLink 5, 1.8 TB/s total = 900 per direction; the A40's pair-only bridge is not assumed
    assert get_gpu("b200").interconnect_gbs == 1800 / 2 and get_gpu("b200").interconnect == "nvlink5"
    assert get_gpu("a40").interconnect == "pcie4"
    # GH200: its host is Grace over NVLink-C2C, 900 GB/s total = 450 per direction, not PCIe
    gh200 = get_gpu("gh200")
    assert gh200.host_link_gbs == 900 / 2 and "NVLink-C2C" in gh200.sources["host_link_gbs"]
    # host RAM of the standard machines: AWS p6-b200.48xlarge 2 TiB; OCI VM.GPU.A10.1 240 GB
    b200_node, a10_node = get_gpu("b200").nodes[0], get_gpu("a10").nodes[0]
    assert (b200_node.instance, b200_node.gpus, b200_node.ram_bytes) == ("AWS p6-b200.48xlarge", 8, 2048 * GiB)
    assert (a10_node.instance, a10_node.gpus, a10_node.ram_bytes) == ("OCI VM.GPU.A10.1", 1, 240 * 10**9)


@pytest.mark.parametrize(
    ("typed", "name"),
    [("A10", "a10"), ("NVIDIA A10G", "a10g"), ("RTX 5090", "rtx5090"), ("5090", "rtx5090"),
     ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada"), ("RTX PRO 6000 Blackwell", "rtx-pro-6000"),
     ("NVIDIA GH200 480GB", "gh200"), ("B200", "b200"), ("L40", "l40"), ("L40S", "l40s")],
)
def test_lookup_of_new_cards(typed, name):
    assert get_gpu(typed).name == name


def test_gb200_and_mi300x_links():
    gb200, mi300x = get_gpu("gb200"), get_gpu("mi300x")
    # GB200: NVLink 5 1.8 TB/s total = 900 per direction; NVLink-C2C 900 GB/s total per superchip of two
    # GPUs -> 450 per GPU -> 225 per direction
    assert (gb200.interconnect, gb200.interconnect_gbs, gb200.host_link_gbs) == ("nvlink5", 900.0, 900 / 2 / 2)
    # MI300X: 7 xGMI links x 64 GB/s per direction = 448; PCIe gen5 x16 host link, ~80% of 63 GB/s raw
    assert (mi300x.interconnect, mi300x.interconnect_gbs, mi300x.host_link_gbs) == ("xgmi", 7 * 64.0, 50.0)


@pytest.mark.parametrize(("typed", "name"), [("AMD Instinct MI300X", "mi300x"), ("MI300X", "mi300x"),
                                             ("NVIDIA GB200", "gb200")])
def test_lookup_of_gb200_and_mi300x(typed, name):
    assert get_gpu(typed).name == name


def test_mi300x_plans_on_rocm_and_says_what_is_not_measured(cli):
    """ROCm runs PyTorch's CUDA code hipified: the CUDA facts hold, its BLAS workspaces are its own
    and what is not measured there is said with the plan."""
    gpu = get_gpu("mi300x")
    assert gpu.kernels.rocm and gpu.kernels.caching_allocator and gpu.kernels.name == "rocm"
    result = cli("estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "mi300x", "--method", "lora", "--json")
    assert result.code == 0, result
    assumptions = json.loads(result.out)["memory"]["assumptions"]
    # hipBLAS 128 MiB on gfx94x + hipBLASLt 76 MiB, per thread (forward and autograd's): 2 x 204 MiB
    assert any("hipBLAS + hipBLASLt workspaces 2 x 204 MiB" in a for a in assumptions), assumptions
    assert any(a.startswith("ROCm, not measured:") for a in assumptions), assumptions
    cuda = json.loads(cli("estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "b200", "--method", "lora",
                          "--json").out)["memory"]["assumptions"]
    assert not any("ROCm" in a for a in cuda)


@pytest.mark.parametrize("name", NEW_CARDS)
def test_suggest_answers_on_new_cards(cli, name):
    result = cli("suggest", "--model", "meta-llama/Llama-2-7b-hf", "--gpu", name, "--target-batch", "32", "--no-save")
    assert result.code == 0, result
    assert get_gpu(name).display_name in result.out
    assert "top 5 plans" in result.out
