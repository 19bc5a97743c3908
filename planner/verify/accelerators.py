"""Which Ray accelerator type each catalog GPU is, and the resources a verification run asks for.

Ray schedules ``@ray.remote(accelerator_type="A10G")`` as a request for 0.001 of the custom
resource ``accelerator_type:A10G`` (ray/_common/utils.py, ``RESOURCE_CONSTRAINT_PREFIX``), which
a GPU node advertises by itself: its raylet reads the first device's NVML name and turns it into
a type (ray/_private/accelerators/nvidia_gpu.py, ``_gpu_name_to_accelerator_type``: "NVIDIA
A10G" -> "A10G", "Tesla V100-SXM2-16GB" -> "V100", "NVIDIA GeForce RTX 4090" ->
"GeForce-RTX-4090"). A node can also be given one by hand:
``ray start --resources '{"accelerator_type:A10G": 1}'``.

Pure data and functions: no Ray import (tests check the constants against Ray's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec

#: Ray's resource-name prefix for accelerator types (ray/_common/utils.py)
RESOURCE_PREFIX = "accelerator_type:"


@dataclass(frozen=True, kw_only=True)
class RayAccelerator:
    """How one catalog GPU is known to Ray."""

    accelerator_type: str
    """What a node with this GPU advertises (``accelerator_type:<this>``)."""
    constant: str | None
    """Its name in ``ray.util.accelerators.accelerators`` (the package re-exports some of them:
    not NVIDIA_L40S or NVIDIA_H200 in Ray 2.60); None where Ray defines none (the type is then
    the string Ray's NVML detection produces for the device name)."""
    shared_with: str = ""
    """Other catalog GPUs Ray detects as the same type, when the type does not tell memory sizes
    apart; the run is then held to this GPU's memory."""

    @property
    def resource(self) -> str:
        return RESOURCE_PREFIX + self.accelerator_type


#: Catalog GPU name -> its Ray accelerator type. Ray's size-specific "A100-40G"/"A100-80G"
#: constants are "not auto-added to nodes" (ray/util/accelerators/accelerators.py), so the A100s
#: ask for the type every A100 node advertises, "A100", and are held to their memory size.
ACCELERATORS: dict[str, RayAccelerator] = {
    "t4": RayAccelerator(accelerator_type="T4", constant="NVIDIA_TESLA_T4"),
    "a10g": RayAccelerator(accelerator_type="A10G", constant="NVIDIA_TESLA_A10G"),
    "l4": RayAccelerator(accelerator_type="L4", constant="NVIDIA_L4"),
    "l40s": RayAccelerator(accelerator_type="L40S", constant="NVIDIA_L40S"),
    "v100-16gb": RayAccelerator(accelerator_type="V100", constant="NVIDIA_TESLA_V100", shared_with="v100-32gb"),
    "v100-32gb": RayAccelerator(accelerator_type="V100", constant="NVIDIA_TESLA_V100", shared_with="v100-16gb"),
    "a100-40gb": RayAccelerator(accelerator_type="A100", constant="NVIDIA_A100", shared_with="a100-80gb"),
    "a100-80gb": RayAccelerator(accelerator_type="A100", constant="NVIDIA_A100", shared_with="a100-40gb"),
    "h100-80gb": RayAccelerator(accelerator_type="H100", constant="NVIDIA_H100", shared_with="h100-pcie"),
    "h100-pcie": RayAccelerator(accelerator_type="H100", constant="NVIDIA_H100", shared_with="h100-80gb"),
    "h200": RayAccelerator(accelerator_type="H200", constant="NVIDIA_H200"),
    "b200": RayAccelerator(accelerator_type="B200", constant="NVIDIA_B200"),
    "gb200": RayAccelerator(accelerator_type="GB200", constant="NVIDIA_GB200"),
    # ray/_private/accelerators/amd_gpu.py names the OAM module (PCI id 0x74a1) so; the HF part
    # (0x74a9, "AMD-Instinct-MI300X-HF") is the same GPU in another form factor
    "mi300x": RayAccelerator(accelerator_type="AMD-Instinct-MI300X-OAM", constant="AMD_INSTINCT_MI300x"),
    "rtx-pro-6000": RayAccelerator(accelerator_type="RTX-PRO-6000", constant="NVIDIA_RTX_PRO_6000"),
    # no constant in ray.util.accelerators: the types Ray's NVML name detection gives them
    "rtx3090": RayAccelerator(accelerator_type="GeForce-RTX-3090", constant=None),
    "rtx4090": RayAccelerator(accelerator_type="GeForce-RTX-4090", constant=None),
    "rtx-a6000": RayAccelerator(accelerator_type="RTX-A6000", constant=None),
    "rtx5090": RayAccelerator(accelerator_type="GeForce-RTX-5090", constant=None),
    # "NVIDIA RTX 6000 Ada Generation" -> "RTX-6000", the type a Turing "Quadro RTX 6000" (24 GB) also gets
    "rtx6000-ada": RayAccelerator(accelerator_type="RTX-6000", constant=None),
    "l40": RayAccelerator(accelerator_type="L40", constant=None),
    "a40": RayAccelerator(accelerator_type="A40", constant=None),
    "a10": RayAccelerator(accelerator_type="A10", constant=None),
    "gh200": RayAccelerator(accelerator_type="GH200", constant=None),  # "NVIDIA GH200 480GB"
}


def ray_accelerator(gpu: "GPUSpec") -> RayAccelerator | None:
    """The Ray accelerator of a catalog GPU; None for the ``cpu`` profile (runs take CPUs)."""
    if gpu.is_cpu:
        return None
    assert gpu.name in ACCELERATORS, f"catalog GPU {gpu.name} has no Ray accelerator type"
    return ACCELERATORS[gpu.name]


def run_resources(*, gpu: "GPUSpec", gpus: int, cpus: float = 1) -> dict[str, Any]:
    """``.options(...)`` for one verification run: ``num_gpus`` and the accelerator type on a GPU,
    ``num_cpus`` always (a CPU run's torch threads; on a GPU node the run's data loading)."""
    accelerator = ray_accelerator(gpu)
    if accelerator is None:
        return {"num_cpus": cpus}
    return {"num_cpus": cpus, "num_gpus": gpus, "accelerator_type": accelerator.accelerator_type}


def node_accelerator_types(resources: dict[str, float]) -> list[str]:
    """The accelerator types a node advertises, from its resource dict."""
    return sorted(key[len(RESOURCE_PREFIX):] for key, value in resources.items()
                  if key.startswith(RESOURCE_PREFIX) and value > 0)


def node_can_run(resources: dict[str, float], *, gpu: "GPUSpec", gpus: int, cpus: float = 1) -> bool:
    """Whether a node with these total resources can run one verification run: all its ranks on
    that one node, as their placement group's STRICT_PACK asks, each rank with ``cpus`` CPUs (and a
    GPU; on the ``cpu`` profile a rank is its CPUs)."""
    if resources.get("CPU", 0) < cpus * gpus:
        return False
    accelerator = ray_accelerator(gpu)
    if accelerator is None:
        return True
    return resources.get("GPU", 0) >= gpus and resources.get(accelerator.resource, 0) > 0


__all__ = ["ACCELERATORS", "RESOURCE_PREFIX", "RayAccelerator", "node_accelerator_types", "node_can_run",
           "ray_accelerator", "run_resources"]
