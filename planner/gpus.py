"""The GPU catalog: capacity, speed and links of the devices the planner plans for.

Pure data and lookups. Every number carries its source in ``GPUSpec.sources``; the only I/O is
reading this machine's physical RAM (``os.sysconf``) when the ``cpu`` profile is asked for.

Conventions used for every entry (each one matters for the models):

* ``memory_bytes`` is the total the driver reports (``nvidia-smi`` "MiB" total, the same as
  ``torch.cuda.mem_get_info()[1]``), which is less than the marketing "GB": e.g. an A10G reports
  23028 MiB, not 24 GiB. Readings confirmed in a public ``nvidia-smi`` printout are cited as such;
  totals that changed with the driver say which drivers print what.
* TFLOP/s are DENSE tensor-core peaks (NVIDIA datasheets print the 2:4-sparsity figure first,
  twice the dense one) and, for GeForce/RTX cards, the rate with FP32 accumulate, which is what
  PyTorch's fp16/bf16 GEMMs use (GA102 and AD102 whitepapers list both; fp16-accumulate is 2x).
* ``fp32_tflops`` is the CUDA-core (non-tensor) fp32 peak: PyTorch leaves
  ``torch.backends.cuda.matmul.allow_tf32 = False`` by default, so fp32 training matmuls do not
  use TF32 tensor cores.
* ``host_link_gbs`` and PCIe ``interconnect_gbs`` are EFFECTIVE per-direction rates: a x16 link
  delivers ~80% of its raw rate to pinned-memory copies (128b/130b encoding plus TLP headers;
  CUDA's bandwidthTest sample shows ~12-13 GB/s on gen3, ~25 GB/s on gen4, ~50 GB/s on gen5).
  This 80% is an assumption to be calibrated by measurements.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from planner.config import Precision
from planner.errors import InvalidConfigError, UnknownGPUError
from planner.optim.adamw import AdamWImpl
from planner.units import GiB, MiB

# ---- shared figures and their sources --------------------------------------------------------

#: CUDA context + library handles a PyTorch training process holds outside the caching allocator.
#: PyTorch sets CUDA_MODULE_LOADING=LAZY (pytorch/pytorch#86509): the context of a small program
#: measured 287,047,680 B lazily vs 666,632,192 B eagerly. A training step then loads more kernels
#: (GEMM, SDPA, optimizer, cuBLAS/cuBLASLt handles), so we keep 512 MiB; the 1.3 GB the HF
#: "Model training anatomy" page (seed 001) shows is the eager loading of CUDA 11.2.
CUDA_CONTEXT_BYTES = 512 * MiB
_CONTEXT_SOURCE = (
    "512 MiB: lazy-loaded CUDA context 287 MB (pytorch/pytorch#86509) + kernels/cuBLAS handles "
    "loaded during a training step; HF 'Model training anatomy' shows 1.3 GB with eager loading"
)

_PCIE = {  # effective per-direction GB/s of a x16 link (~80% of raw, see module docstring)
    3: 12.0,  # raw 15.75 GB/s
    4: 25.0,  # raw 31.5 GB/s
    5: 50.0,  # raw 63 GB/s
}

_MODAL_SMI = "nvidia-smi total as listed in modal-labs/modal-client#2797"
#: Some totals changed with the driver: V100s and the RTX A6000 report more since about R515 (and
#: the A6000 less with ECC on). The catalog holds what current drivers (R535 and later) print.
_DRIVER_NOTE = "current drivers (R515+); older drivers print less"


class DropoutMask(enum.StrEnum):
    """The mask dropout keeps for its backward (aten/src/ATen/native/Dropout.cpp)."""

    BOOL = "bool"
    """``native_dropout``'s fused kernel (CUDA): one byte per element."""
    DROPPED_DTYPE = "dropped_dtype"
    """The ``bernoulli_`` path (CPU): a mask in the dropped tensor's dtype."""


@dataclass(frozen=True, kw_only=True)
class KernelProfile:
    """How the device's kernels allocate: the facts where a CPU run and a CUDA run of the same
    training step keep different tensors. The memory model reads these instead of asking
    whether the device is a CPU; each fact names the library code that decides it."""

    name: str
    """``cuda`` or ``cpu``."""
    dropout_mask: DropoutMask
    """The dtype of dropout's saved mask (aten Dropout.cpp is_fused_kernel_acceptable: the fused
    bool-mask kernel is taken on CUDA only; measured on gpt2 and bert with the CPU probe)."""
    sdpa_dropout_math_fp32: bool
    """SDPA with attention dropout falls back to the math path, in fp32 for 16-bit inputs
    (aten sdp_utils_cpp.cpp use_flash_attention_cpp: check_for_dropout refuses dropout on the
    CPU; CUDA's flash/efficient kernels take it)."""
    autocast_softmax_fp32: bool
    """autocast runs softmax in fp32 (CUDA's autocast fp32 list has softmax; the CPU's does not:
    aten/src/ATen/autocast_mode.cpp)."""
    adamw: AdamWImpl
    """The AdamW path torch picks by default on this device (torch/optim/optimizer.py
    _default_to_fused_or_foreach: foreach on CUDA tensors, single-tensor on the CPU)."""
    caching_allocator: bool
    """Allocations go through PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp),
    so reserved memory exceeds allocated; on the CPU c10's allocator frees to the system."""
    unified_memory_paging: bool
    """bitsandbytes' paged optimizer states live in cudaMallocManaged memory outside the caching
    allocator (bitsandbytes/functional.py get_paged); without CUDA they are ordinary tensors."""
    bnb_8bit_step_whole_tensor: bool
    """bitsandbytes' 8-bit blockwise optimizer step dequantises a whole tensor's states to fp32
    temporaries (CPU backend: bitsandbytes 0.50 backends/cpu/ops.py
    _optimizer_update_8bit_blockwise_cpu, inside one custom op that only c10's allocator count
    sees); the CUDA kernel works block by block in registers and allocates nothing."""
    plain_autocast_query: bool = True
    """``torch.is_autocast_enabled()`` without a device type sees this device's autocast (it asks
    CUDA's state: True under CUDA autocast, False under CPU autocast). peft's bnb LoRA layers ask it
    (peft/tuners/lora/bnb.py ``requires_conversion = not torch.is_autocast_enabled()``), so on the
    CPU they cast each adapter's input to the fp32 adapter dtype even under autocast."""
    promotes_inputs_by_copy: bool = False
    """An elementwise op on inputs of two dtypes (bf16 + fp32) first copies the narrower input to the
    common dtype (aten TensorIterator.cpp ``compute_types``, on the CPU only: "Promotes inputs by
    creating temporaries of the correct dtype"); CUDA kernels cast while they load."""
    rocm: bool = False
    """PyTorch's ROCm build (HIP): the same CUDA code hipified, with its own BLAS workspaces
    (``planner.memory.overhead``) and the caveats in ``notes``."""
    notes: tuple[str, ...] = ()
    """What the planner does not model on this device's software stack, printed with every plan
    on it (``planner.memory.overhead.overhead_notes``)."""
    mm_fp32_buffer: bool = False
    """A 16-bit matrix multiply computes into an fp32 buffer of its output's size, allocated below
    the dispatcher and freed once cast into the output (measured with the CPU probe, torch 2.13: a
    bf16 ``[r x 512] @ [512 x 32000]`` allocates r x 32000 x 4 + 128 B beside its bf16 output, for
    r = 16 to 128, on the AMX Xeon of the CPU bench; none on a CPU without AMX: the ``cpu``
    profile follows the machine, ``cpu_kernels``); cuBLAS accumulates in registers. Seen where a
    matmul's output is the peak's largest tensor: the fused cross-entropy's chunk logits
    (``activations.fused_ce_transient``)."""

    def dropout_mask_bytes(self, dropped_dtype_bytes: int) -> int:
        """Bytes per element of the mask dropout keeps for a tensor of this element size."""
        return 1 if self.dropout_mask is DropoutMask.BOOL else dropped_dtype_bytes

    def to_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), enum.Enum) else v) for f in dataclasses.fields(self)}


CUDA_KERNELS = KernelProfile(
    name="cuda", dropout_mask=DropoutMask.BOOL, sdpa_dropout_math_fp32=False, autocast_softmax_fp32=True,
    adamw=AdamWImpl.FOREACH, caching_allocator=True, unified_memory_paging=True, bnb_8bit_step_whole_tensor=False,
)
#: PyTorch's ROCm build on AMD Instinct GPUs. The CUDA sources are hipified at build time, so the
#: facts above hold as on CUDA: ``is_cuda()`` is true on HIP tensors, so dropout takes the fused
#: bool-mask kernel (aten Dropout.cpp) and the optimizer the foreach path; autocast is CUDA's; the
#: caching allocator is CUDACachingAllocator.cpp itself (c10/hip/HIPCachingAllocator.cpp is its
#: hipified copy), so the replay's block rules are the same; SDPA's flash and efficient kernels
#: (aotriton) take dropout. What is not measured on ROCm is said with every plan.
ROCM_KERNELS = dataclasses.replace(
    CUDA_KERNELS, name="rocm", rocm=True,
    notes=(
        ("ROCm: planned with PyTorch's CUDA facts, which its hipified build shares (caching allocator, "
         "fused dropout, foreach AdamW, autocast); hipBLAS and hipBLASLt workspaces as torch's "
         "CublasHandlePool.cpp sizes them on gfx94x"),
        ("ROCm, not measured: the HIP context (the CUDA figure is used), RCCL's channel count and buffers "
         "(NCCL's defaults are used), and the saved tensors of ROCm's flash-attn and of bitsandbytes' "
         "ROCm kernels (taken as their CUDA builds'); calibrate with 'planner measure' on the GPU"),
    ),
)
CPU_KERNELS = KernelProfile(
    name="cpu", dropout_mask=DropoutMask.DROPPED_DTYPE, sdpa_dropout_math_fp32=True, autocast_softmax_fp32=False,
    adamw=AdamWImpl.SINGLE_TENSOR, caching_allocator=False, unified_memory_paging=False, bnb_8bit_step_whole_tensor=True,
    plain_autocast_query=False, promotes_inputs_by_copy=True, mm_fp32_buffer=True,
)


@dataclass(frozen=True, kw_only=True)
class HostNode:
    """A standard machine that holds this GPU: the host RAM a plan's offload may use by default
    (``planner suggest`` without --cpu-mem plans for the node, not for the planning machine)."""

    instance: str
    """e.g. ``AWS g5.12xlarge``."""
    gpus: int
    """GPUs of this type in the machine."""
    ram_bytes: int
    """The machine's RAM as its provider lists it."""
    source: str
    """Where the figures come from."""


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One device model: what the memory model plans against and the throughput model runs on."""

    name: str
    """Catalog key, lower-case: ``a10g``."""
    display_name: str
    """Name as NVIDIA prints it: ``NVIDIA A10G``."""
    memory_bytes: int
    """Total memory as the driver reports it (nvidia-smi / ``torch.cuda.mem_get_info`` total)."""
    cuda_context_bytes: int
    """CUDA context + cuBLAS/cuDNN handles a PyTorch training process holds outside the allocator."""
    compute_capability: tuple[int, int]
    """CUDA compute capability (bf16 tensor cores need 8.0+); (0, 0) for the CPU profile."""
    bf16: bool
    """Native bf16 (Ampere+); False on T4/V100."""
    fp8: bool
    """FP8 tensor cores (Ada, Hopper)."""
    fp16_tflops: float
    """Dense fp16 tensor-core peak (no sparsity), FP32 accumulate."""
    bf16_tflops: float
    """Dense bf16 peak; 0.0 where unsupported."""
    fp32_tflops: float
    """fp32 CUDA-core peak (PyTorch's default: TF32 matmuls are off)."""
    mem_bandwidth_gbs: float
    """HBM/GDDR bandwidth, GB/s."""
    host_link_gbs: float
    """Host<->device bandwidth per direction, GB/s (effective PCIe x16)."""
    interconnect_gbs: float
    """Device<->device bandwidth per direction, GB/s: NVLink on SXM parts, else the PCIe link."""
    interconnect: str
    """What ``interconnect_gbs`` is: ``nvlink3``, ``pcie4``, ..."""
    sm_count: int = 0
    """Streaming multiprocessors: how many GEMM tiles a wave runs (``planner.kernels.routed_gemm_waste``); 0 where
    no source gives it (the A10G, AMD's parts, the CPU profile), which prices no wave quantisation."""
    is_cpu: bool = False
    """The CPU measurement profile rather than a GPU."""
    kernels: KernelProfile = CUDA_KERNELS
    """How the device's kernels allocate (see ``KernelProfile``)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field -> where its number comes from."""
    nodes: tuple[HostNode, ...] = ()
    """Standard machines with this GPU, fewest GPUs first (empty: none is standard, and offload
    plans need --cpu-mem)."""
    mfu: Mapping[str, float] = field(default_factory=dict)
    """Calibrated matmul efficiency by ``matmul_dtype`` (``planner calibrate``); a dtype not in it
    takes the throughput model's default."""
    bandwidth_efficiency: float | None = None
    """Calibrated fraction of ``mem_bandwidth_gbs`` memory-bound kernels reach; None: the default."""
    calibration: str = ""
    """The calibration these constants come from, as plans name it; "" for the catalog's defaults."""

    def __post_init__(self) -> None:
        assert self.name == self.name.lower(), self.name
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "mfu", MappingProxyType(dict(self.mfu)))
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise InvalidConfigError(f"GPU memory must be a positive byte count, got {self.memory_bytes!r}")
        assert self.bf16 == (self.bf16_tflops > 0), self.name

    def supports(self, precision: Precision | str) -> bool:
        """Whether this device runs ``precision`` natively (bf16 needs compute capability 8.0, fp8
        FP8 tensor cores: ``fp8``)."""
        precision = Precision(precision)
        if precision is Precision.FP8:
            return self.fp8
        return self.bf16 or not precision.needs_bf16

    @property
    def fp8_tflops(self) -> float:
        """Dense FP8 tensor peak (the GEMMs of fp8's float8 linears); 0.0 without FP8. Every FP8 part
        of the catalog lists it at twice its dense bf16 rate with the same accumulate (``FP8_PER_BF16``)."""
        return self.bf16_tflops * FP8_PER_BF16 if self.fp8 else 0.0

    def peak_tflops(self, precision: Precision | str) -> float:
        """Peak matmul TFLOP/s for a precision: fp32 on CUDA cores, 16-bit on tensor cores."""
        precision = Precision(precision)
        if precision is Precision.FP32:
            return self.fp32_tflops
        return self.bf16_tflops if precision.needs_bf16 else self.fp16_tflops

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fp8_tflops"] = self.fp8_tflops
        d["compute_capability"] = ".".join(map(str, self.compute_capability))
        d["sources"] = dict(self.sources)
        d["mfu"] = dict(self.mfu)
        d["kernels"] = self.kernels.to_dict()
        d["nodes"] = [dataclasses.asdict(n) for n in self.nodes]
        return d


def standard_node(gpu: GPUSpec, gpus: int) -> HostNode | None:
    """The smallest standard machine that holds ``gpus`` of this GPU, or None where the catalog
    knows none (then the host RAM for offload must be given: --cpu-mem)."""
    return min((n for n in gpu.nodes if n.gpus >= gpus), key=lambda n: (n.gpus, n.ram_bytes), default=None)


def matmul_dtype(precision: Precision | str) -> str:
    """``fp32``, ``fp16`` or ``bf16``: the peak a precision's matmuls run at (``peak_tflops``),
    and the key of a calibrated MFU (mixed and pure 16-bit share their tensor cores)."""
    precision = Precision(precision)
    if precision is Precision.FP32:
        return "fp32"
    return "bf16" if precision.needs_bf16 else "fp16"


def fp8_gpus() -> tuple[str, ...]:
    """The catalog's GPUs with FP8 tensor cores (``GPUSpec.fp8``), in catalog order."""
    return tuple(g.name for g in _CATALOG if g.fp8)


def check_precision(gpu: GPUSpec, precision: Precision | str) -> None:
    """Refuse a precision the device cannot run (bf16 before Ampere, fp8 without FP8 tensor cores)
    with the fix."""
    precision = Precision(precision)
    if gpu.supports(precision):
        return
    cc = ".".join(map(str, gpu.compute_capability))
    if precision is Precision.FP8:
        # torch 2.13's CPU build does run torch._scaled_mm, but torchao's float8 training is for NVIDIA and
        # AMD GPUs (docs/source/workflows/training.md, "supports both NVIDIA and AMD hardware"; Float8Linear
        # reads the GPU's autocast dtype) and the cpu profile has no FP8 rate to predict with
        where = "the cpu profile has no FP8 tensor cores (torchao's float8 training runs on NVIDIA and AMD GPUs)" \
            if gpu.is_cpu else (
            f"{gpu.display_name} has no FP8 tensor cores (compute capability {cc}; FP8 needs 8.9+)")
        raise InvalidConfigError(f"--precision fp8: {where}: use bf16-mixed, or a GPU with FP8: {', '.join(fp8_gpus())}")
    alternative = "fp16-mixed" if precision.is_mixed else "fp16"
    raise InvalidConfigError(
        f"--precision {precision}: {gpu.display_name} has no bf16 support (compute capability {cc} "
        f"< 8.0): use {alternative} (or fp32)"
    )


def check_attention(gpu: GPUSpec, attention: str) -> None:
    """Refuse FlashAttention-2 where it does not run: it needs an Ampere or newer GPU
    (Dao-AILab/flash-attention README: "Ampere, Ada, or Hopper GPUs"; Turing and Volta are not
    supported) and has no CPU kernel."""
    if str(attention) != "flash":
        return
    if gpu.is_cpu:
        raise InvalidConfigError("--attention flash: flash-attn has no CPU kernel: use --attention sdpa on the cpu profile")
    if gpu.compute_capability < (8, 0):
        cc = ".".join(map(str, gpu.compute_capability))
        raise InvalidConfigError(
            f"--attention flash: FlashAttention-2 needs an Ampere or newer GPU, {gpu.display_name} has compute "
            f"capability {cc}: use --attention sdpa"
        )


# ---- the catalog -----------------------------------------------------------------------------


#: Dense FP8 over dense bf16 tensor rate, the same accumulate, on every FP8 GPU of the catalog: H100 SXM
#: 1,979 / 989 TFLOP/s (NVIDIA H100 datasheet, without sparsity), L4 242 / 121 and L40S 733 / 362 (L4, L40S
#: datasheets), Ada GeForce/RTX 6000 Ada 2x at FP32 accumulate (NVIDIA Ada Lovelace architecture whitepaper,
#: appendix tables), B200 4.5 / 2.25 PFLOP/s (Blackwell architecture technical brief, p. 19), RTX 5090 419 /
#: 209.5 (RTX Blackwell GPU architecture whitepaper), MI300X 2,614.9 / 1,307.4 (AMD MI300X data sheet);
#: torchao's roofline table lists the same pairs (torchao/testing/training/roofline_utils.py
#: ``gpu_name_to_specs``).
FP8_PER_BF16 = 2.0


#: Where each entry's SM count comes from: NVIDIA's architecture whitepapers and datasheets, CUDA cores / 64 per SM on
#: Volta, Turing and the GA100, / 128 on GA10x, Ada and Blackwell's GB20x: V100 80; T4 40; A100 108 (the whitepaper's
#: 108-SM A100); H100 SXM5 132, H100 PCIe 114 (H100 whitepaper), H200 and GH200 the SXM part's 132; B200 and GB200 148;
#: RTX 3090 82 (10,496 cores), RTX A6000 and A40 84 (10,752), A10 72 (9,216), L4 58 (7,424), RTX 4090 128 (16,384),
#: L40, L40S and RTX 6000 Ada 142 (18,176), RTX 5090 170 (21,760), RTX PRO 6000 188 (24,064).
_SM_SOURCE = "NVIDIA's architecture whitepaper / datasheet (CUDA cores per SM: 64 on Volta, Turing, GA100; 128 on GA10x, Ada, GB20x)"


def _gpu(
    *,
    name: str,
    display_name: str,
    memory_mib: int,
    memory_source: str,
    cc: tuple[int, int],
    fp16: float,
    bf16: float,
    fp32: float,
    bandwidth: float,
    pcie_gen: int,
    datasheet: str,
    fp8: bool = False,
    nvlink_gbs: float | None = None,
    nvlink: str = "",
    notes: Mapping[str, str] | None = None,
    nodes: tuple[HostNode, ...] = (),
    host_link_gbs: float | None = None,
    host_link: str = "",
    kernels: KernelProfile = CUDA_KERNELS,
    sms: int = 0,
) -> GPUSpec:
    """Build one entry; fields without their own note are cited to the datasheet. ``host_link_gbs``
    replaces the PCIe host link where the GPU reaches its host otherwise (GH200's NVLink-C2C),
    ``host_link`` saying what it is."""
    host = host_link_gbs or _PCIE[pcie_gen]
    sources = {
        "memory_bytes": f"{memory_mib} MiB: {memory_source}",
        "cuda_context_bytes": _CONTEXT_SOURCE,
        "fp16_tflops": f"{datasheet}: dense fp16 tensor, FP32 accumulate",
        "bf16_tflops": f"{datasheet}: dense bf16 tensor" if bf16 else f"no bf16 (compute capability {cc[0]}.{cc[1]})",
        "fp32_tflops": f"{datasheet}: fp32 CUDA cores (TF32 off by default in PyTorch)",
        **({"fp8_tflops": f"{datasheet}: dense FP8 tensor, twice its bf16 rate (FP8_PER_BF16)"} if fp8 else {}),
        "mem_bandwidth_gbs": datasheet,
        "host_link_gbs": host_link or f"PCIe gen{pcie_gen} x16, ~80% of raw per direction (assumption)",
        **({"sm_count": f"{sms} SMs: {_SM_SOURCE}"} if sms else {}),
        "interconnect_gbs": (
            f"{nvlink} {nvlink_gbs:g} GB/s per direction ({datasheet})"
            if nvlink_gbs
            else f"no NVLink assumed: peer traffic over PCIe gen{pcie_gen}"
        ),
    }
    sources.update(notes or {})
    return GPUSpec(
        name=name,
        display_name=display_name,
        memory_bytes=memory_mib * MiB,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        compute_capability=cc,
        bf16=bf16 > 0,
        fp8=fp8,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        fp32_tflops=fp32,
        mem_bandwidth_gbs=bandwidth,
        host_link_gbs=host,
        interconnect_gbs=nvlink_gbs or host,
        interconnect=nvlink or f"pcie{pcie_gen}",
        sm_count=sms,
        sources=sources,
        nodes=nodes,
        kernels=kernels,
    )


#: Host RAM of the standard machines of each GPU (instance pages as the providers list them).
_AWS_BATCH = ("AWS Batch User Guide, 'GPU jobs' instance table (docs.aws.amazon.com/batch/latest/userguide/"
              "gpu-jobs.html): GPUs and memory (GiB) per instance type")
_TORCHX = ("torchx torchx/specs/named_resources_aws.py, AWS instance types as aws.amazon.com/ec2/instance-types "
           "lists them (memMB = GiB x 1024 before its 0.96 ECS tax)")


#: Google Cloud's A2 and A3 machine types, the one-, two- and four-GPU machines of these GPUs (AWS
#: sells A100s and H100s in 8-GPU nodes only, so a one-GPU request would plan the 8-GPU node's
#: RAM). The tables give memory in GB; it is read as 10^9 bytes, the smaller of the two readings.
_GCP = ("Google Cloud docs, 'GPU machine types' (cloud.google.com/compute/docs/gpus): A2 Standard, A2 Ultra and "
        "A3 High machine types, GPUs and memory (GB) per machine type")


def _gcp_nodes(family: str, *sizes: tuple[int, int]) -> tuple[HostNode, ...]:
    """(GPUs, RAM GB) of a Google Cloud machine series: ``{family}-{n}g``."""
    return tuple(HostNode(instance=f"GCP {family}-{n}g", gpus=n, ram_bytes=ram * 10**9, source=_GCP)
                 for n, ram in sizes)


def _nodes(family: str, source: str, *sizes: tuple[str, int, int]) -> tuple[HostNode, ...]:
    """(size, GPUs, RAM GiB) of an AWS instance family."""
    return tuple(HostNode(instance=f"AWS {family}.{size}", gpus=n, ram_bytes=ram * GiB, source=source)
                 for size, n, ram in sizes)


_B200_SHEET = ("NVIDIA HGX B200 / DGX B200 datasheet, per GPU: 4.5 PFLOPS bf16/fp16 tensor with sparsity "
               "(2250 dense), 80 fp32 (Blackwell datasheet, HGX B200 at 1000 W), 8 TB/s HBM3e (64 TB/s per 8 GPUs), "
               "NVLink 5 1.8 TB/s total")


def _b200_nodes() -> tuple[HostNode, ...]:
    """The 8-GPU B200 machines (neither cloud sells fewer)."""
    return (
        HostNode(instance="AWS p6-b200.48xlarge", gpus=8, ram_bytes=2048 * GiB,
                 source="AWS EC2 P6 instance types (aws.amazon.com/ec2/instance-types/p6): p6-b200.48xlarge, "
                 "8 B200, 2 TiB memory"),
        HostNode(instance="GCP a4-highgpu-8g", gpus=8, ram_bytes=3968 * 10**9,
                 source="Google Cloud docs, 'GPU machine types': A4 a4-highgpu-8g, 8 B200, 3,968 GB memory"),
    )


_OCI = ("Oracle Cloud Infrastructure docs, 'Compute Shapes', GPU shapes: GPUs and memory (GB) of the A10 "
        "shapes; read as 10^9 bytes")


def _oci_nodes(shape: str, gpus: int, ram_gb: int) -> tuple[HostNode, ...]:
    return (HostNode(instance=f"OCI {shape}", gpus=gpus, ram_bytes=ram_gb * 10**9, source=_OCI),)


_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOPS dense bf16/fp16, 19.5 fp32"
_H100_SHEET = "NVIDIA H100 datasheet, SXM5 column: 989.4 TFLOPS dense bf16/fp16 (1979 sparse), 67 fp32"

_CATALOG: tuple[GPUSpec, ...] = (
    _gpu(
        name="t4", sms=40, display_name="NVIDIA T4", memory_mib=15360, memory_source=_MODAL_SMI, cc=(7, 5),
        fp16=65.0, bf16=0.0, fp32=8.1, bandwidth=320.0, pcie_gen=3,
        datasheet="NVIDIA T4 datasheet: 65 TFLOPS mixed-precision fp16, 8.1 fp32, 320 GB/s",
        nodes=_nodes("g4dn", _AWS_BATCH, ("xlarge", 1, 16), ("12xlarge", 4, 192)) + _nodes("g4dn", _TORCHX, ("metal", 8, 384)),
    ),
    _gpu(
        name="a10g", display_name="NVIDIA A10G", memory_mib=23028, memory_source=_MODAL_SMI, cc=(8, 6),
        fp16=70.0, bf16=70.0, fp32=31.2, bandwidth=600.0, pcie_gen=4,
        datasheet="AWS G5 (A10G, GA102, 24 GB GDDR6, 600 GB/s)",
        notes={
            "fp16_tflops": "70 TFLOPS dense: A10G tensor cores run at the GA102 GeForce rate, not the "
            "A10 datasheet's 125; a 10240^2 fp16/bf16 torch matmul measured 69.5 TFLOPS on an A10G "
            "(zzc0721/torch-performance-test-data#126)",
            "bf16_tflops": "70 TFLOPS dense, as fp16: a 10240^2 bf16 torch matmul measured 69.5 TFLOPS on an "
            "A10G (zzc0721/torch-performance-test-data#126)",
            "fp32_tflops": "31.2 TFLOPS fp32 as quoted for A10/A10G (A10 datasheet); measured fp32 "
            "matmul 23.4 TFLOPS (zzc0721/torch-performance-test-data#126)",
        },
        nodes=_nodes("g5", _AWS_BATCH, ("xlarge", 1, 16), ("12xlarge", 4, 192), ("48xlarge", 8, 768)),
    ),
    _gpu(
        name="l4", sms=58, display_name="NVIDIA L4", memory_mib=23034, memory_source=_MODAL_SMI, cc=(8, 9),
        fp16=121.0, bf16=121.0, fp32=30.3, bandwidth=300.0, pcie_gen=4, fp8=True,
        datasheet="NVIDIA L4 datasheet: 242 TFLOPS bf16/fp16 with sparsity (121 dense), 30.3 fp32, 300 GB/s",
        nodes=_nodes("g6", _AWS_BATCH, ("xlarge", 1, 16)),
    ),
    _gpu(
        name="l40s", sms=142, display_name="NVIDIA L40S", memory_mib=46068, memory_source=_MODAL_SMI, cc=(8, 9),
        fp16=362.05, bf16=362.05, fp32=91.6, bandwidth=864.0, pcie_gen=4, fp8=True,
        datasheet="NVIDIA L40S datasheet: 733 TFLOPS bf16/fp16 with sparsity (362.05 dense), 91.6 fp32, 864 GB/s",
        nodes=_nodes("g6e", _TORCHX, ("xlarge", 1, 32), ("12xlarge", 4, 384), ("48xlarge", 8, 1536)),
    ),
    _gpu(
        name="v100-16gb", sms=80, display_name="Tesla V100-SXM2-16GB", memory_mib=16384, cc=(7, 0),
        memory_source="nvidia-smi readings '0MiB / 16384MiB' with driver 535.86.10 and ten other 535+ logs; "
        f"16160 MiB on 450.119.03 (4paradigm/k8s-vgpu-scheduler#7), 16130 on older: {_DRIVER_NOTE}",
        fp16=125.0, bf16=0.0, fp32=15.7, bandwidth=900.0, pcie_gen=3,
        nvlink_gbs=150.0, nvlink="nvlink2",
        datasheet="NVIDIA V100 datasheet (SXM2): 125 TFLOPS tensor, 15.7 fp32, 900 GB/s, NVLink 300 GB/s total",
        nodes=_nodes("p3", _AWS_BATCH, ("2xlarge", 1, 61), ("8xlarge", 4, 244), ("16xlarge", 8, 488)),
    ),
    _gpu(
        name="v100-32gb", sms=80, display_name="Tesla V100-SXM2-32GB", memory_mib=32768, cc=(7, 0),
        memory_source="nvidia-smi reading '308MiB / 32768MiB' with driver 525.105.17 (Wan-Video/Wan2.1#5) and "
        f"'0MiB / 32768MiB' with 535.161.08; 32510 MiB on R450-R460, 32480 on R410: {_DRIVER_NOTE}",
        fp16=125.0, bf16=0.0, fp32=15.7, bandwidth=900.0, pcie_gen=3,
        nvlink_gbs=150.0, nvlink="nvlink2",
        datasheet="NVIDIA V100 datasheet (SXM2): 125 TFLOPS tensor, 15.7 fp32, 900 GB/s, NVLink 300 GB/s total",
        nodes=_nodes("p3dn", _AWS_BATCH, ("24xlarge", 8, 768)),
    ),
    _gpu(
        name="a100-40gb", sms=108, display_name="NVIDIA A100-SXM4-40GB", memory_mib=40960, memory_source=_MODAL_SMI,
        cc=(8, 0), fp16=312.0, bf16=312.0, fp32=19.5, bandwidth=1555.0, pcie_gen=4,
        nvlink_gbs=300.0, nvlink="nvlink3",
        datasheet=_A100_SHEET + ", 40GB: 1555 GB/s, NVLink 600 GB/s total",
        nodes=_nodes("p4d", _TORCHX + "; AWS Compute Blog 'Amazon EC2 P4d instances deep dive': 1.1 TB of RAM", ("24xlarge", 8, 1152))
        + _gcp_nodes("a2-highgpu", (1, 85), (2, 170), (4, 340)),
    ),
    _gpu(
        name="a100-80gb", sms=108, display_name="NVIDIA A100-SXM4-80GB", memory_mib=81920, memory_source=_MODAL_SMI,
        cc=(8, 0), fp16=312.0, bf16=312.0, fp32=19.5, bandwidth=2039.0, pcie_gen=4,
        nvlink_gbs=300.0, nvlink="nvlink3",
        datasheet=_A100_SHEET + ", 80GB SXM: 2039 GB/s, NVLink 600 GB/s total",
        nodes=_nodes("p4de", _TORCHX, ("24xlarge", 8, 1152)) + _gcp_nodes("a2-ultragpu", (1, 170), (2, 340), (4, 680)),
    ),
    _gpu(
        name="h100-80gb", sms=132, display_name="NVIDIA H100 80GB HBM3 (SXM5)", memory_mib=81559,
        memory_source=_MODAL_SMI, cc=(9, 0), fp16=989.4, bf16=989.4, fp32=66.9, bandwidth=3350.0,
        pcie_gen=5, fp8=True, nvlink_gbs=450.0, nvlink="nvlink4",
        datasheet=_H100_SHEET + ", 3.35 TB/s, NVLink 900 GB/s total",
        nodes=_nodes("p5", _TORCHX, ("48xlarge", 8, 2048)) + _gcp_nodes("a3-highgpu", (1, 234), (2, 468), (4, 936)),
    ),
    _gpu(
        name="h100-pcie", sms=114, display_name="NVIDIA H100 PCIe", memory_mib=81559,
        memory_source="nvidia-smi readings '6637MiB / 81559MiB' (Beomi/BitNet-Transformers README) and "
        "'0MiB / 81559MiB' with driver 525.85.05 (langchain-nvidia-trt README)",
        cc=(9, 0), fp16=756.0, bf16=756.0, fp32=51.2, bandwidth=2000.0, pcie_gen=5, fp8=True,
        datasheet="NVIDIA H100 datasheet, PCIe column: 1513 TFLOPS bf16/fp16 sparse (756 dense), 51 fp32, 2 TB/s",
    ),
    _gpu(
        name="h200", sms=132, display_name="NVIDIA H200 (SXM)", memory_mib=143771,
        memory_source="nvidia-smi reading '87321MiB / 143771MiB' with driver 580.95.05 (AWS p5en.48xlarge); "
        "Modal's table (thundergolfer.com/blog/nvidia-gpu-memory-capacity): 143,771 MiB",
        cc=(9, 0), fp16=989.4, bf16=989.4, fp32=66.9, bandwidth=4800.0, pcie_gen=5, fp8=True,
        nvlink_gbs=450.0, nvlink="nvlink4",
        datasheet="NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense bf16 (1979 sparse), "
        "67 fp32, NVLink 900 GB/s total",
        nodes=_nodes("p5e", _TORCHX, ("48xlarge", 8, 2048)),
    ),
    _gpu(
        name="rtx3090", sms=82, display_name="NVIDIA GeForce RTX 3090", memory_mib=24576, cc=(8, 6),
        memory_source="nvidia-smi reading '22598MiB / 24576MiB' in noonghunna/club-3090#1128",
        fp16=71.0, bf16=71.0, fp32=35.6, bandwidth=936.0, pcie_gen=4,
        datasheet="NVIDIA GA102 (Ampere) whitepaper, RTX 3090: 71 TFLOPS fp16/bf16 tensor with FP32 "
        "accumulate (142 with fp16 accumulate), 35.6 fp32, 936 GB/s",
    ),
    _gpu(
        name="rtx4090", sms=128, display_name="NVIDIA GeForce RTX 4090", memory_mib=24564, cc=(8, 9), fp8=True,
        memory_source="nvidia-smi reading '507MiB / 24564MiB' in RLinf/RLinf#255",
        fp16=165.2, bf16=165.2, fp32=82.6, bandwidth=1008.0, pcie_gen=4,
        datasheet="NVIDIA Ada (AD102) whitepaper, RTX 4090: 165.2 TFLOPS fp16/bf16 tensor with FP32 "
        "accumulate (330.4 with fp16 accumulate), 82.6 fp32, 1008 GB/s",
    ),
    _gpu(
        name="rtx-a6000", sms=84, display_name="NVIDIA RTX A6000", memory_mib=49140,
        memory_source="nvidia-smi reading '1661MiB / 49140MiB' with driver 515.43.04, ECC off; with ECC on "
        f"46068 MiB (550.127.05): pass --gpu-mem 46068MiB; 48685 on R470: {_DRIVER_NOTE}",
        cc=(8, 6), fp16=154.8, bf16=154.8, fp32=38.7, bandwidth=768.0, pcie_gen=4,
        datasheet="NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor with sparsity (154.8 dense), 38.7 fp32, "
        "768 GB/s GDDR6",
    ),
    # ---- the cards rented in 2026 (issue 21). nvidia-smi totals are from public nvidia-smi printouts
    # (readings quoted; R535+ drivers). Blackwell GeForce/RTX PRO dense rates: the datasheet's "AI
    # TOPS" are FP4 with sparsity; FP16/BF16 with FP32 accumulate is that /8 on RTX PRO (full rate)
    # and /16 on GeForce (half rate, as on the 4090), which NVIDIA's RTX Blackwell whitepaper lists.
    _gpu(
        name="b200", sms=148, display_name="NVIDIA B200", memory_mib=183359, cc=(10, 0), fp8=True,
        memory_source="nvidia-smi readings '0MiB / 183359MiB' (HGX B200, driver 570+/580+, several public logs)",
        fp16=2250.0, bf16=2250.0, fp32=80.0, bandwidth=8000.0, pcie_gen=5,
        nvlink_gbs=900.0, nvlink="nvlink5",
        datasheet=_B200_SHEET,
        nodes=_b200_nodes(),
    ),
    _gpu(
        name="rtx5090", sms=170, display_name="NVIDIA GeForce RTX 5090", memory_mib=32607, cc=(12, 0), fp8=True,
        memory_source="nvidia-smi readings '1987MiB / 32607MiB' with driver 580.102.01 and other public logs",
        fp16=209.5, bf16=209.5, fp32=104.8, bandwidth=1792.0, pcie_gen=5,
        datasheet="NVIDIA RTX Blackwell GPU architecture whitepaper, RTX 5090: 209.5 TFLOPS fp16/bf16 tensor "
        "with FP32 accumulate dense (419 with fp16 accumulate; 3352 AI TOPS = FP4 sparse), 104.8 fp32, "
        "1792 GB/s GDDR7",
    ),
    _gpu(
        name="rtx6000-ada", sms=142, display_name="NVIDIA RTX 6000 Ada Generation", memory_mib=49140, cc=(8, 9), fp8=True,
        memory_source="nvidia-smi reading '44578MiB / 49140MiB' (ECC off, the workstation default; with ECC on "
        "the card reports less: pass --gpu-mem)",
        fp16=364.25, bf16=364.25, fp32=91.1, bandwidth=960.0, pcie_gen=4,
        datasheet="NVIDIA RTX 6000 Ada Generation datasheet: 1457 TFLOPS FP8 tensor with sparsity "
        "(= 364.25 dense fp16/bf16, FP32 accumulate at full rate on RTX pro cards; Ada whitepaper appendix), "
        "91.1 fp32, 960 GB/s GDDR6",
    ),
    _gpu(
        name="rtx-pro-6000", sms=188, display_name="NVIDIA RTX PRO 6000 Blackwell", memory_mib=97887, cc=(12, 0), fp8=True,
        memory_source="nvidia-smi readings '0MiB / 97887MiB' on the Server Edition and the Workstation Edition "
        "with driver 580.178.04 and other public logs",
        fp16=503.8, bf16=503.8, fp32=125.0, bandwidth=1792.0, pcie_gen=5,
        datasheet="NVIDIA RTX PRO 6000 Blackwell (Workstation/Server Edition) datasheet: 4000 AI TOPS (FP4 "
        "sparse; = 503.8 dense fp16/bf16 with FP32 accumulate, RTX Blackwell whitepaper), 125 fp32, "
        "1792 GB/s GDDR7",
    ),
    _gpu(
        name="l40", sms=142, display_name="NVIDIA L40", memory_mib=46068, cc=(8, 9), fp8=True,
        memory_source="nvidia-smi readings '5MiB / 46068MiB' and '31687MiB / 46068MiB' (ECC on, the default)",
        fp16=181.05, bf16=181.05, fp32=90.5, bandwidth=864.0, pcie_gen=4,
        datasheet="NVIDIA L40 datasheet: 362.1 TFLOPS bf16/fp16 tensor with sparsity (181.05 dense), "
        "90.5 fp32, 864 GB/s GDDR6",
    ),
    _gpu(
        name="a40", sms=84, display_name="NVIDIA A40", memory_mib=46068, cc=(8, 6),
        memory_source="nvidia-smi readings '0MiB / 46068MiB' and '34501MiB / 46068MiB' (ECC on, the default)",
        fp16=149.7, bf16=149.7, fp32=37.4, bandwidth=696.0, pcie_gen=4,
        datasheet="NVIDIA A40 datasheet: 299.4 TFLOPS bf16/fp16 tensor with sparsity (149.7 dense), 37.4 fp32, "
        "696 GB/s GDDR6; its NVLink bridge joins pairs only (112.5 GB/s), so peers are planned over PCIe",
    ),
    _gpu(
        name="a10", sms=72, display_name="NVIDIA A10", memory_mib=23028, cc=(8, 6),
        memory_source="nvidia-smi readings '0MiB / 23028MiB', '4MiB / 23028MiB' and '7MiB / 23028MiB' "
        "(ECC on; the same total as the A10G)",
        fp16=125.0, bf16=125.0, fp32=31.2, bandwidth=600.0, pcie_gen=4,
        datasheet="NVIDIA A10 datasheet: 250 TFLOPS bf16/fp16 tensor with sparsity (125 dense), 31.2 fp32, "
        "600 GB/s GDDR6",
        nodes=_oci_nodes("VM.GPU.A10.1", 1, 240) + _oci_nodes("VM.GPU.A10.2", 2, 480)
        + _oci_nodes("BM.GPU.A10.4", 4, 1024),
    ),
    _gpu(
        name="gh200", sms=132, display_name="NVIDIA GH200 480GB", memory_mib=97871, cc=(9, 0), fp8=True,
        memory_source="nvidia-smi readings '1MiB / 97871MiB' (GH200 480GB: 96 GB HBM3 + 480 GB LPDDR5X) and "
        "'37MiB / 97871MiB' (GH200 120GB); the Grace LPDDR5X is host memory, not in this total",
        fp16=989.4, bf16=989.4, fp32=66.9, bandwidth=4000.0, pcie_gen=5,
        nvlink_gbs=450.0, nvlink="nvlink4",
        host_link_gbs=450.0,
        host_link="NVLink-C2C 900 GB/s total = 450 per direction (NVIDIA GH200 Grace Hopper Superchip "
        "datasheet); offload traffic goes to the Grace LPDDR5X over it, not over PCIe",
        datasheet="NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 module): 1979 TFLOPS bf16/fp16 "
        "with sparsity (989.4 dense), 67 fp32, 4 TB/s, NVLink 900 GB/s total between superchips (GH200 NVL2/NVL32)",
    ),
    _gpu(
        name="gb200", sms=148, display_name="NVIDIA GB200", memory_mib=189471, cc=(10, 0), fp8=True,
        memory_source="nvidia-smi readings '0MiB / 189471MiB' (GB200 NVL72 compute trays, driver 570+, several "
        "public logs); each GPU of the superchip reports its own HBM3e",
        fp16=2500.0, bf16=2500.0, fp32=80.0, bandwidth=8000.0, pcie_gen=5,
        nvlink_gbs=900.0, nvlink="nvlink5",
        host_link_gbs=225.0,
        host_link="NVLink-C2C 900 GB/s total per superchip (NVIDIA GB200 NVL72 datasheet), shared by its two GPUs: "
        "225 GB/s per GPU and direction when both offload at once, as a data-parallel run does (assumption)",
        datasheet="NVIDIA GB200 NVL72 datasheet, per GPU (rack figures / 72): 5 PFLOPS bf16/fp16 tensor with "
        "sparsity (2500 dense), 80 fp32 (5,760 TFLOPS per rack), 8 TB/s HBM3e (576 TB/s per rack), NVLink 5 "
        "1.8 TB/s total per GPU (130 TB/s per rack)",
    ),
    _gpu(
        name="mi300x", display_name="AMD Instinct MI300X", memory_mib=196592, cc=(9, 4), fp8=True,
        memory_source="rocm-smi 'VRAM Total Memory (B): 206141652992' (196,592 MiB; ROCm 6-7 public logs), which is "
        "torch.cuda.mem_get_info's total on ROCm; torch reports compute capability 9.4 for gfx942",
        fp16=1307.4, bf16=1307.4, fp32=163.4, bandwidth=5300.0, pcie_gen=5,
        nvlink_gbs=448.0, nvlink="xgmi",
        kernels=ROCM_KERNELS,
        notes={
            "interconnect_gbs": "AMD Infinity Fabric (xGMI): 7 links x 64 GB/s per direction to the other 7 GPUs of "
            "an 8-GPU node (AMD Instinct MI300X datasheet: 896 GB/s aggregate peer bandwidth); a collective over "
            "all 8 uses all 7 links, a 2-GPU one only one (64 GB/s): below 8 GPUs communication is faster than "
            "planned here",
        },
        datasheet="AMD Instinct MI300X datasheet: 2614.9 TFLOPS fp16/bf16 matrix with sparsity (1307.4 dense), "
        "163.4 fp32 (vector and matrix), 5.3 TB/s HBM3, PCIe gen5 x16 host link",
    ),
)

#: The CPU measurement profile. Its TFLOP/s are NOT theoretical peaks: they are the GEMM rates
#: torch 2.13 reached for a 2048x2048 matmul on the 2-core AMD EPYC VM (AVX-512, AVX512_BF16, no AMX)
#: the project's CPU runs use now (26 Nov 2026, best of 12-15 while other processes shared the cores):
#: bf16 208 GFLOP/s on one thread and 415 on two => 0.415; fp32 95 on one thread, x 2 => 0.19; fp16
#: has no kernel there (a 256^3 fp16 matmul ran at 3 GFLOP/s on one thread: a scalar fallback) => 0.006.
#: Small GEMMs reach 75-105% of the 2048^3 rate (bench/cpu_overhead.py gemm: bf16 [512 x 384] x
#: [384 x 1152] 208, the vocabulary head [512 x 384] x [384 x 50257] 156 of 212 GFLOP/s on one thread),
#: which the roofline's operand traffic covers. (An earlier 2-core Xeon VM with AMX measured fp32
#: 0.134, fp16 0.139, bf16 0.708.) Bandwidth: ``copy_`` of a 64 MB fp32 tensor into a kept
#: one moved 24.7 GB/s (read + write) on one thread (bench/cpu_overhead.py bandwidth --cpu-time), x 1.5 for
#: two threads (``planner.kernels.CPU_THREAD_SPEEDUP``) = 37 GB/s; the 12.7 GB/s of an earlier 256 MiB
#: ``copy_`` into a fresh tensor counted its page faults (``planner.kernels.CPU_FIRST_TOUCH_SECONDS_PER_BYTE``
#: prices those apart). Like the TFLOP/s it is an achieved rate, so memory-bound work runs at all of it
#: (``planner.kernels.CPU_BANDWIDTH_FRACTION``), not at the GPUs' datasheet efficiency. These describe this
#: machine class only; calibrate with measurements.
_CPU_SOURCES = {
    "memory_bytes": "this machine's physical RAM: os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')",
    "cuda_context_bytes": "no CUDA on the CPU",
    "fp16_tflops": "measured torch fp16 256^3 matmul, 1 thread, 2-core AMD EPYC: 3 GFLOP/s (no fp16 kernel), "
    "x 2 threads: 0.006 TFLOP/s",
    "bf16_tflops": "measured torch bf16 2048^3 matmul (AVX512_BF16), 2 threads, 2-core AMD EPYC: 0.415 TFLOP/s",
    "fp32_tflops": "measured torch fp32 2048^3 matmul, 1 thread, 2-core AMD EPYC: 0.095 TFLOP/s, x 2 threads: 0.19",
    "mem_bandwidth_gbs": "measured torch copy_ of 64 MB fp32 into a kept tensor on the 2-core VM: 24.7 GB/s "
    "read+write on one thread (bench/cpu_overhead.py), x 1.5 for two threads: 37 GB/s",
    "host_link_gbs": "no transfer on the CPU: equal to the memory bandwidth",
    "interconnect_gbs": "gloo between processes on one host: bounded by the memory bandwidth",
}


def cpu_kernels(*, amx: bool | None = None) -> KernelProfile:
    """The CPU's kernel profile on this machine, or with ``amx`` as given (a bench row measured
    elsewhere): whether a bf16 matmul holds an fp32 buffer follows the CPU (``bf16_matmul_fp32_buffer``)."""
    buffer = bf16_matmul_fp32_buffer(cpu_flags()) if amx is None else amx
    return CPU_KERNELS if buffer == CPU_KERNELS.mm_fp32_buffer else dataclasses.replace(CPU_KERNELS, mm_fp32_buffer=buffer)


def _cpu_profile(memory_bytes: int, kernels: KernelProfile = CPU_KERNELS) -> GPUSpec:
    return GPUSpec(
        name="cpu",
        display_name="CPU (2-core x86 measurement profile)",
        memory_bytes=memory_bytes,
        cuda_context_bytes=0,
        compute_capability=(0, 0),
        bf16=True,
        fp8=False,
        fp16_tflops=0.006,
        bf16_tflops=0.415,
        fp32_tflops=0.19,
        mem_bandwidth_gbs=37.0,
        host_link_gbs=37.0,
        interconnect_gbs=37.0,
        interconnect="host memory",
        is_cpu=True,
        kernels=kernels,
        sources=_CPU_SOURCES,
    )


def physical_ram_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This machine's CPU feature flags (Linux ``/proc/cpuinfo``'s ``flags``; None where it has none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):  # x86, aarch64
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def bf16_matmul_fp32_buffer(flags: frozenset[str] | None) -> bool:
    """Whether torch's CPU bf16 matmul holds an fp32 buffer of its output's size while it runs
    (``KernelProfile.mm_fp32_buffer``). Measured with the CPU probe, torch 2.13, ``[r x 512] @
    [512 x 32000]`` for r = 16 to 128: r x 32000 x 4 + 128 B beside the output on the AMX Xeon the
    CPU bench ran on, nothing on an AMD EPYC with AVX512-BF16 and no AMX (2026-11-26). Both run
    oneDNN's matmul (torch's ``mkldnn_bf16_device_check``: AVX-512 BW/VL/DQ); the buffer is taken as
    the accumulator of its AMX kernels. Not on every AMX machine: on a 2-core Xeon with AMX and
    AVX512-FP16 (2026-11-28, oneDNN's ``brg_matmul:avx10_1_512_amx``, ONEDNN_VERBOSE) the same products
    hold nothing beside the output, the kernel's blocking deciding it, which the flags do not show; there
    the buffer is counted all the same (the larger peak). Unknown flags: counted too."""
    return flags is None or "amx_bf16" in flags


_BY_NAME: Mapping[str, GPUSpec] = MappingProxyType({g.name: g for g in _CATALOG})
_NAMES = tuple(_BY_NAME) + ("cpu",)

#: Shorthands people type that name exactly one entry.
_ALIASES = {
    "h100": "h100-80gb",
    "h100sxm": "h100-80gb",
    "h100sxm5": "h100-80gb",
    "a6000": "rtx-a6000",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "6000ada": "rtx6000-ada",
    "rtx6000adageneration": "rtx6000-ada",
    "rtxpro6000blackwell": "rtx-pro-6000",
    "pro6000": "rtx-pro-6000",
    "gh200480gb": "gh200",
    "amdinstinctmi300x": "mi300x",
    "instinctmi300x": "mi300x",
}


def _key(name: str) -> str:
    """Case, ``_``/``-``/space and an ``nvidia``/``geforce`` prefix do not matter."""
    key = re.sub(r"[\s_\-]+", "", str(name).strip().lower())
    for prefix in ("nvidia", "geforce", "tesla"):
        key = key.removeprefix(prefix)
    return key


_BY_KEY = {_key(n): n for n in _NAMES} | _ALIASES


def gpu_names() -> tuple[str, ...]:
    """Catalog keys, GPUs first, ``cpu`` last."""
    return _NAMES


def get_gpu(name: str, *, memory_bytes: int | None = None) -> GPUSpec:
    """Look a device up by name (``A10G``, ``a10g``, ``nvidia-a10g`` all work).

    ``memory_bytes`` replaces the catalog capacity (``--gpu-mem``), e.g. for a MIG slice or a
    card shared with a display.
    """
    canonical = _BY_KEY.get(_key(name))
    if canonical is None:
        raise UnknownGPUError(f"unknown GPU {name!r}: choose one of {', '.join(_NAMES)}")
    gpu = _cpu_profile(physical_ram_bytes(), cpu_kernels()) if canonical == "cpu" else _BY_NAME[canonical]
    if memory_bytes is None:
        return gpu
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise InvalidConfigError(f"--gpu-mem must be a positive size like 20GiB, got {memory_bytes!r}")
    sources = dict(gpu.sources, memory_bytes=f"--gpu-mem override ({memory_bytes} bytes)")
    return dataclasses.replace(gpu, memory_bytes=memory_bytes, sources=sources)


def list_gpus() -> list[GPUSpec]:
    """Every catalog entry, the ``cpu`` profile last."""
    return [*_CATALOG, get_gpu("cpu")]


__all__ = [
    "CPU_KERNELS",
    "cpu_kernels",
    "CUDA_CONTEXT_BYTES",
    "CUDA_KERNELS",
    "KernelProfile",
    "ROCM_KERNELS",
    "GPUSpec",
    "HostNode",
    "FP8_PER_BF16",
    "check_precision",
    "fp8_gpus",
    "get_gpu",
    "matmul_dtype",
    "gpu_names",
    "list_gpus",
    "physical_ram_bytes",
    "standard_node",
]
