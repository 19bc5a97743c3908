"""``--gpu auto`` (issue 12 item 8): ``planner.detect`` against a fake ``pynvml`` module.

The fake implements the calls nvidia-ml-py's ``pynvml.py`` offers (``nvmlInit``,
``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo(...).total``, ``nvmlShutdown``, ``NVMLError``)
and records that NVML was shut down after every use.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from planner.detect import DetectedGPU, detect_gpu, match_catalog
from planner.errors import GPUDetectionError, MissingDependencyError, PlannerError, UnknownGPUError

MiB = 2**20


class NVMLError(Exception):
    pass


def fake_pynvml(devices, *, init_error=None, driver=b"535.104.05"):
    calls = []
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError

    def init():
        calls.append("init")
        if init_error:
            raise NVMLError(init_error)

    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlSystemGetDriverVersion = lambda: driver
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = lambda h: devices[h][0]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=devices[h][1], free=0, used=0)
    module.calls = calls
    return module


@pytest.fixture
def nvml(monkeypatch):
    def install(*args, **kwargs):
        module = fake_pynvml(*args, **kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    return install


def test_four_a10g_are_found_and_described(nvml):
    fake = nvml([("NVIDIA A10G", 23028 * MiB)] * 4)
    found = detect_gpu()
    assert found == DetectedGPU(name="a10g", device_name="NVIDIA A10G", count=4, memory_bytes=23028 * MiB, driver="535.104.05")
    assert found.describe() == "found 4 x NVIDIA A10G (23028 MiB, driver 535.104.05): planning for a10g"
    assert fake.calls == ["init", "shutdown"]


def test_bytes_names_of_older_pynvml_are_decoded(nvml):
    nvml([(b"Tesla T4", 15360 * MiB)], driver=b"470.82.01")
    assert detect_gpu().name == "t4"


# NVML names as nvidia-smi prints them, with the memory it reports
@pytest.mark.parametrize("device, mib, expected", [
    ("Tesla T4", 15360, "t4"),
    ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA L40S", 46068, "l40s"),  # l40s, not l4: the longest family wins
    ("Tesla V100-SXM2-16GB", 16384, "v100-16gb"),
    ("Tesla V100-PCIE-32GB", 32768, "v100-32gb"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA GeForce RTX 3090", 24576, "rtx3090"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx4090"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000"),
    ("NVIDIA A40", 46068, "a40"),
    ("NVIDIA A10", 23028, "a10"),
    ("NVIDIA A10G", 23028, "a10g"),
    ("NVIDIA GH200 480GB", 97871, "gh200"),
    ("NVIDIA B200", 183359, "b200"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx6000-ada"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "rtx-pro-6000"),
    ("NVIDIA GeForce RTX 5090", 32607, "rtx5090"),
])
def test_nvml_names_map_to_the_catalog(device, mib, expected):
    from planner.gpus import gpu_names

    assert match_catalog(device, mib * MiB) == expected
    assert expected in gpu_names()


def test_no_pynvml_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(MissingDependencyError, match=r"needs nvidia-ml-py: pip install nvidia-ml-py, or name the GPU with --gpu"):
        detect_gpu()


def test_no_driver(nvml):
    nvml([], init_error="NVML Shared Library Not Found")
    with pytest.raises(GPUDetectionError, match=r"no NVIDIA driver on this machine \(NVML: NVML Shared Library Not Found\)"):
        detect_gpu()


def test_a_driver_without_a_gpu(nvml):
    fake = nvml([])
    with pytest.raises(GPUDetectionError, match="sees no GPU on this machine; name the GPU with --gpu"):
        detect_gpu()
    assert fake.calls == ["init", "shutdown"]


def test_several_models_are_named(nvml):
    nvml([("NVIDIA A10G", 23028 * MiB), ("Tesla T4", 15360 * MiB)])
    with pytest.raises(GPUDetectionError, match=r"several GPU models \(NVIDIA A10G, Tesla T4\)"):
        detect_gpu()


def test_a_gpu_the_catalog_lacks_says_what_was_found_and_what_to_pass(nvml):
    nvml([("NVIDIA GeForce RTX 2080", 8192 * MiB)])
    with pytest.raises(GPUDetectionError) as err:
        detect_gpu()
    message = str(err.value)
    assert "found NVIDIA GeForce RTX 2080 (8192 MiB)" in message and "--gpu-mem 8192MiB" in message
    assert "\n" not in message


def test_detection_errors_are_user_errors():
    assert issubclass(GPUDetectionError, UnknownGPUError) and issubclass(GPUDetectionError, PlannerError)
    assert GPUDetectionError.exit_code == 2


def test_importing_detect_does_not_import_pynvml():
    code = "import sys, planner.detect; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpu_auto_on_the_command_line_plans_for_the_gpu_it_found(nvml, cli):
    """suggest and estimate take --gpu auto: what NVML found is said on stderr, the plan is for it."""
    import json

    nvml([("NVIDIA A10G", 23028 * MiB)] * 4)
    r = cli("suggest", "-m", "gpt2", "-g", "auto", "-b", "8", "--json")
    assert r.code == 0, r
    assert "found 4 x NVIDIA A10G (23028 MiB, driver 535.104.05): planning for a10g" in r.err
    assert json.loads(r.out)["request"]["gpu"] == "a10g"
    e = cli("estimate", "-m", "gpt2", "-g", "AUTO", "--json")
    assert e.code == 0 and json.loads(e.out)["device"]["name"] == "a10g"
    nvml([])
    r = cli("suggest", "-m", "gpt2", "-g", "auto", "-b", "8")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and r.err.startswith("error: ")


def test_submit_refuses_gpu_auto(cli):
    r = cli("submit", "-m", "gpt2", "-g", "auto", "-b", "8", "--address", "http://127.0.0.1:1")
    assert r.code == 2 and "names the GPU of this machine" in r.err


# a catalog family inside another model's name is not that model: planning an RTX A4000 (16 GB)
# as the 48 GB A40 would promise three times its memory
@pytest.mark.parametrize("device, mib", [
    ("NVIDIA RTX A4000", 16376), ("NVIDIA RTX A1000", 8188), ("NVIDIA GB300", 284208), ("Quadro RTX 6000", 24576),
])
def test_a_family_inside_another_models_name_is_not_matched(device, mib):
    assert match_catalog(device, mib * MiB) is None


def test_gb200_is_its_own_entry_not_the_b200_inside_its_name():
    assert match_catalog("NVIDIA GB200", 189471 * MiB) == "gb200"
    assert match_catalog("NVIDIA B200", 183359 * MiB) == "b200"
