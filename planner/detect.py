"""``--gpu auto``: find the GPU of the machine the planner runs on.

NVML (the library nvidia-smi reads, through the ``nvidia-ml-py`` package, module ``pynvml``)
gives each device's name and total memory; the name is mapped to the catalog
(``planner.gpus.list_gpus()``). ``pynvml`` is imported only here, only when ``--gpu auto`` is
asked for, and a machine without it, without a driver or without a GPU gets one line saying so
and how to name the GPU instead.

NVML device names (nvidia-smi ``--query-gpu=name``) and the catalog entry each maps to:
``Tesla T4`` -> t4, ``NVIDIA A10G`` -> a10g, ``NVIDIA A100-SXM4-80GB`` / ``NVIDIA A100 80GB PCIe``
-> a100-80gb, ``NVIDIA H100 80GB HBM3`` -> h100-80gb, ``NVIDIA H100 PCIe`` -> h100-pcie,
``Tesla V100-SXM2-32GB`` -> v100-32gb, ``NVIDIA GeForce RTX 4090`` -> rtx4090.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from planner.errors import GPUDetectionError, MissingDependencyError

#: what a user may pass as ``--gpu`` to ask for detection
AUTO = "auto"

_HINT = "name the GPU with --gpu (see 'planner gpus')"
#: the size and form-factor words of catalog names, which NVML names spell in their own ways
_VARIANT_RE = re.compile(r"(\d+gb|pcie|sxm\d?)$")


@dataclass(frozen=True, kw_only=True)
class DetectedGPU:
    """What NVML reported and the catalog entry it maps to."""

    name: str
    """Catalog name (``planner gpus``) to plan for: ``a10g``."""
    device_name: str
    """The name NVML reports: ``NVIDIA A10G``."""
    count: int
    """How many devices of this model the machine has."""
    memory_bytes: int
    """Total memory of one device as NVML reports it (what nvidia-smi prints)."""
    driver: str | None = None
    """NVIDIA driver version, when NVML tells it."""

    def describe(self) -> str:
        """One line: ``found 4 x NVIDIA A10G (23028 MiB, driver 535.104.05): planning for a10g``."""
        driver = f", driver {self.driver}" if self.driver else ""
        return (f"found {self.count} x {self.device_name} ({self.memory_bytes // 2**20} MiB{driver}): "
                f"planning for {self.name}")


def _key(text: str) -> str:
    """Lower case without spaces, ``-``, ``_`` and vendor words: ``NVIDIA A100-SXM4-80GB`` -> ``a100sxm480gb``."""
    key = re.sub(r"[\s_\-]+", "", text.lower())
    for word in ("nvidia", "geforce", "tesla"):
        key = key.replace(word, "")
    return key


def _family_and_variants(catalog_name: str) -> tuple[str, list[str]]:
    """``a100-80gb`` -> (``a100``, [``80gb``]); ``rtx-a6000`` -> (``rtxa6000``, [])."""
    parts = catalog_name.split("-")
    variants = []
    while len(parts) > 1 and _VARIANT_RE.fullmatch(parts[-1]):
        variants.insert(0, parts.pop())
    return _key("-".join(parts)), variants


def _word_bounds(text: str) -> frozenset[int]:
    """Where the words of a device name start and end in its ``_key``: ``NVIDIA RTX A4000`` ->
    ``rtxa4000`` with words at 0-3 and 3-8."""
    words = [w for w in re.split(r"[\s_\-]+", text.lower()) if w]
    bounds, at = {0}, 0
    for word in words:
        at += len(_key(word))
        bounds.add(at)
    return frozenset(bounds)


def _whole_words(family: str, key: str, bounds: frozenset[int]) -> bool:
    """The family spells whole words of the name: ``a40`` is not in ``RTX A4000`` (16 GB, not the
    48 GB A40), ``b200`` not in ``GB200``, ``l4`` not in ``L40S``; ``rtx6000ada`` is in ``RTX
    6000 Ada Generation``."""
    start = key.find(family)
    while start >= 0:
        if start in bounds and start + len(family) in bounds:
            return True
        start = key.find(family, start + 1)
    return False


def match_catalog(device_name: str, memory_bytes: int) -> str | None:
    """The catalog name of an NVML device, or None when the catalog has no such model.

    The longest catalog family the name spells in whole words wins (``l40s`` over ``l4``); among its
    entries, the one whose size or form factor the name spells (``80gb``, ``pcie``), then the one
    whose memory is nearest to what NVML reports (a V100 says 16 or 32 GB only in some names)."""
    from planner.gpus import list_gpus

    key = _key(device_name)
    entries = [(g, *_family_and_variants(g.name)) for g in list_gpus() if not g.is_cpu]
    bounds = _word_bounds(device_name)
    families = [family for _, family, _ in entries if _whole_words(family, key, bounds)]
    if not families:
        return None
    family = max(families, key=len)
    candidates = [(g, variants) for g, fam, variants in entries if fam == family]

    def score(item: tuple[Any, list[str]]) -> tuple[int, int, int]:
        gpu, variants = item
        spelled = sum(1 for v in variants if v in key)
        # a name spelling no variant is the plain form ("NVIDIA H100 80GB HBM3" is not a PCIe card)
        unspelled = sum(1 for v in variants if v not in key and not v.endswith("gb"))
        return (spelled, -unspelled, -abs(gpu.memory_bytes - memory_bytes))

    return max(candidates, key=score)[0].name


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise MissingDependencyError(
            f"--gpu auto reads the GPU through NVML, which needs nvidia-ml-py: pip install nvidia-ml-py, or {_HINT}"
        ) from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _devices(pynvml: Any) -> tuple[list[tuple[str, int]], str | None]:
    """[(name, total memory bytes)] of every device, and the driver version."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GPUDetectionError(f"--gpu auto: no NVIDIA driver on this machine (NVML: {exc}); {_HINT}") from None
    try:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = None
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            devices.append((_text(pynvml.nvmlDeviceGetName(handle)), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return devices, driver
    except pynvml.NVMLError as exc:
        raise GPUDetectionError(f"--gpu auto: NVML could not list the GPUs ({exc}); {_HINT}") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def detect_gpu() -> DetectedGPU:
    """The GPU model of this machine, from NVML, as a catalog entry.

    Raises ``MissingDependencyError`` without nvidia-ml-py and ``GPUDetectionError`` without a
    driver, without a GPU, with several GPU models, or with one the catalog does not hold; each
    one line that says what was found and how to name the GPU instead."""
    devices, driver = _devices(_nvml())
    if not devices:
        raise GPUDetectionError(f"--gpu auto: the NVIDIA driver{f' {driver}' if driver else ''} sees no GPU on this machine; {_HINT}")
    models = sorted({name for name, _ in devices})
    if len(models) > 1:
        raise GPUDetectionError(f"--gpu auto: this machine has several GPU models ({', '.join(models)}); {_HINT}")
    device_name, memory = devices[0]
    name = match_catalog(device_name, memory)
    if name is None:
        raise GPUDetectionError(
            f"--gpu auto: found {device_name} ({memory // 2**20} MiB), which the catalog does not hold; "
            f"pass the nearest model with --gpu and its memory with --gpu-mem {memory // 2**20}MiB (see 'planner gpus')"
        )
    return DetectedGPU(name=name, device_name=device_name, count=len(devices), memory_bytes=memory, driver=driver)


__all__ = ["AUTO", "DetectedGPU", "detect_gpu", "match_catalog"]
