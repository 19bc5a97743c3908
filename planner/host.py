"""The host side of a plan: the node's RAM for offload, what of it the OS and the training
processes keep, and how a shortfall is said.

Pure functions of the node's RAM and its ranks (``planner.search`` screens offload plans against
``host_reserve``; ``planner.ranking`` words a shortfall with ``host_shortfall``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.units import GiB, MiB, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec

#: Host RAM of the node that offload cannot use (stated assumptions, shown with every plan that
#: considers offload): the kernel and hypervisor keep about 4% of an instance's nominal RAM (AWS
#: Batch "Memory management": a container cannot be given the whole listed memory; torchx
#: named_resources_aws.py MEM_TAX = 0.96), and each training process holds host memory before any
#: offloaded tensor: Python, torch and the CUDA runtime about 2 GiB (pytorch/pytorch#113326: max
#: RSS 2,056,600 kB after `import torch` and one CUDA tensor), and the training stack on top, 256
#: MiB (measured here on the CPU: max RSS 220 MiB after `import torch` 2.13, 467 MiB after also
#: importing transformers 5.24's Trainer and AutoModelForCausalLM, peft and deepspeed). The data
#: loader adds no process: the HF Trainer's default dataloader_num_workers=0 loads in the training
#: process, and its pinned batches (dataloader_pin_memory=True) are a micro-batch of token ids.
HOST_KERNEL_FRACTION = 0.04
HOST_PER_PROCESS = 2 * GiB + 256 * MiB


def host_reserve(node_ram: int, ranks: int) -> int:
    """Host RAM of a node running ``ranks`` training processes that offload cannot use."""
    return int(node_ram * HOST_KERNEL_FRACTION) + ranks * HOST_PER_PROCESS


def node_ram_needed(rank_host_bytes: int, ranks: int) -> int:
    """The smallest node RAM that holds ``ranks`` ranks' offload of ``rank_host_bytes`` each
    after ``host_reserve``."""
    offload = rank_host_bytes * ranks
    ram = math.ceil((offload + ranks * HOST_PER_PROCESS) / (1 - HOST_KERNEL_FRACTION))
    while ram - host_reserve(ram, ranks) < offload:  # int() rounding in host_reserve
        ram += 1
    return ram


def host_shortfall(rank_host_bytes: int, *, ranks: int, node_ram: int, source: str) -> str:
    """Why the node's host RAM (``node_ram``, from ``source``; "" when not known) does not hold an
    offload plan, in one clause."""
    offload = rank_host_bytes * ranks
    per = f" ({ranks} ranks x {format_bytes(rank_host_bytes)})" if ranks > 1 else ""
    if not source:
        return (f"{format_bytes(offload)} of host RAM{per} and the catalog knows no standard machine with {ranks} of "
                "this GPU: pass --cpu-mem with the node's RAM (e.g. --cpu-mem 256GiB) to consider offload")
    reserve = host_reserve(node_ram, ranks)
    return (f"{format_bytes(offload)} of host RAM on the node{per} + {format_bytes(reserve)} kept for the OS and "
            f"{ranks} training process{'es' if ranks > 1 else ''} > {format_bytes(node_ram)} ({source})")


def node_host_ram(*, cpu_mem_bytes: int | None, local_node: bool, gpus: int, device: "GPUSpec") -> tuple[int, str]:
    """(host RAM of the node for offload, where it comes from): --cpu-mem; this machine's RAM when
    it is the node (the cpu profile, --gpu auto); the standard machine of the catalog; else
    (0, "") and offload plans are refused with a reason that asks for --cpu-mem."""
    from planner.gpus import physical_ram_bytes, standard_node

    if cpu_mem_bytes is not None:
        return cpu_mem_bytes, "--cpu-mem"
    if device.is_cpu or local_node:
        return physical_ram_bytes(), "this machine's RAM"
    node = standard_node(device, gpus)
    if node is None:
        return 0, ""
    return node.ram_bytes, f"{node.instance}, {node.gpus} x {device.display_name}; --cpu-mem for another host"


__all__ = ["HOST_KERNEL_FRACTION", "HOST_PER_PROCESS", "host_reserve", "host_shortfall", "node_host_ram",
           "node_ram_needed"]

