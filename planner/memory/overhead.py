"""The device memory no training term owns: cuBLAS workspaces, NCCL's communicator buffers and the
CUDA context, each where it lives (inside or outside PyTorch's caching allocator).

- **cuBLAS workspaces: inside the allocator.** torch allocates one workspace per (cuBLAS handle,
  stream) through the caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp
  ``getNewWorkspace``: ``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``,
  kept in ``cublas_handle_stream_to_workspace``). The default size
  (``parseChosenWorkspaceSize`` without ``CUBLAS_WORKSPACE_CONFIG``) is ``4096 * 8 * 1024``
  (32 MiB) on compute capability 9.0 and ``4096 * 1024 * 2 + 16 * 1024 * 8`` (8 MiB + 128 KiB)
  elsewhere. cuBLASLt shares it (``getCUDABlasLtWorkspaceSize``: ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
  is on unless set off), so it adds nothing. Handles come from a per-thread pool window
  (``DeviceThreadHandlePool``): the forward runs on the Python thread and the backward on
  autograd's device thread (torch/csrc/autograd/engine.cpp, one worker thread per device), so a
  training step holds two workspaces on one stream.
- **On ROCm** (``KernelProfile.rocm``) the same pool holds a hipBLAS workspace of 128 MiB on gfx94x
  (MI300; torch reports compute capability 9.4 there) and 32 MiB elsewhere (CublasHandlePool.cpp
  ``parseChosenWorkspaceSize`` under ``USE_ROCM``: "32MiB default, 128MiB for MI300"), and hipBLASLt
  keeps its own 76 MiB per (handle, stream) beside it (``parseCUDABlasLtWorkspaceSize``: "Use 76 MB
  for hipBLASLt"; the unified workspace is CUDA-only). Both are counted per thread: torch prefers
  hipBLASLt for 16-bit GEMMs on gfx94x and hipBLAS serves the rest, and which calls touch which
  handle is not traced here (stated with every ROCm plan).
- **NCCL buffers: outside the allocator** (NCCL cudaMallocs its own; ``torch.cuda.memory_reserved``
  does not see them). Per channel and peer connection NCCL holds one buffer per protocol
  (nccl src/init.cc ``computeBuffSizes``): Simple ``DEFAULT_BUFFSIZE`` 4 MiB (``NCCL_BUFFSIZE``),
  LL ``NCCL_LL_LINES_PER_THREAD*NCCL_LL_MAX_NTHREADS*NCCL_STEPS*16`` = 8*512*8*16 = 512 KiB and
  LL128 ``NCCL_LL128_ELEMS_PER_THREAD*NCCL_LL128_MAX_NTHREADS*NCCL_STEPS*8`` = 120*640*8*8 =
  4,800 KiB; the NCCL environment-variable docs list ``NCCL_BUFFSIZE`` (default 4 MiB) as the
  knob to cut it. A ring rank holds one connection per channel each way: it receives from its
  predecessor and sends to its successor. The P2P transport allocates each side as one buffer
  rounded up to ``CUDA_IPC_MIN``, 2 MiB (src/include/comm.h; src/transport/p2p.cc ``p2pSendSetup``
  ``ALIGN_SIZE(sendSize, CUDA_IPC_MIN)`` and ``p2pRecvSetup`` ``ALIGN_SIZE(recvSize, CUDA_IPC_MIN)``,
  l.351-354 and l.416-419 at v2.20.5-1, the same on master): the sender's ``ncclSendMem`` (4 KiB,
  one ``MEM_ALIGN`` page) and, in P2P read mode (NVLink between compute capability 8.0 GPUs:
  ``ncclTopoCheckP2p``), the Simple buffer; the receiver's ``ncclRecvMem`` (4 KiB) and the other
  protocols' buffers. Read mode: 4 KiB + 4 MiB -> 6 MiB sent, 4 KiB + 512 KiB + 4,800 KiB -> 6 MiB
  received; otherwise 4 KiB -> 2 MiB and 4 KiB + 4 MiB + 512 KiB + 4,800 KiB -> 10 MiB: 12 MiB a
  channel either way, against the 9.19 MiB of the buffers alone.
  Channels come from NCCL's topology search: 24 on an HGX A100 over NVSwitch
  (NVIDIA/nccl-tests#100, "Channel 23/24"), 2 over PCIe/shared memory (NVIDIA/nccl-tests#228,
  channels 00-01 "via SHM"). One communicator (the default process group's); tree, NVLS and
  CollNet connections (made lazily when NCCL picks those algorithms, NCCL_RUNTIME_CONNECT) are not
  counted and are stated as such.
- **NCCL's per-channel device structures: outside the allocator, 2 MiB each under cuMem.** Every
  channel NCCL initialises gets three device allocations of a few bytes (src/channel.cc
  ``initChannel`` l.40, l.43, l.54 at v2.20.5-1: the shared ``devPeers``, the channel's
  ``devPeers`` and ``devRingUserRanks``, each ``ncclCudaCallocAsync``), and the communicator one
  (init.cc l.401 ``devCommAndChans``). Since NCCL 2.19 these go through the cuMem API where the
  driver supports it (misc/cudawrap.cc l.15 ``NCCL_CUMEM_ENABLE`` default -2, auto; it was 0 in
  2.18.6; ``ncclIsCuMemSupported`` l.23-45: a CUDA 12 driver and a device with virtual memory
  management and GPUDirect RDMA on it, as data-centre GPUs have: assumed), and ``ncclCuMemAlloc`` rounds each up to the allocation granularity (include/alloc.h
  l.100-101: ``cuMemGetAllocationGranularity(..., CU_MEM_ALLOC_GRANULARITY_MINIMUM)``,
  ``ALIGN_SIZE``), 2 MiB on NVIDIA GPUs: one physical 2 MiB block each. The channels initialised
  are the ring's and, up to the next power of two, the point-to-point ones (graph/paths.cc
  ``ncclTopoComputeP2pChannels`` l.764-767: ``p2pnChannels = nextPow2(...)``, then ``initChannel``
  for every channel from ``nChannels`` up), capped at ``MAXCHANNELS`` (32 at v2.20.5-1,
  include/device.h l.54): 32 channels over NVLink (24 rounded up), 2 over PCIe, so
  (32 x 3 + 1) x 2 MiB = 194 MiB a device over NVLink, 14 MiB over PCIe. torch 2.2-2.4 ship NCCL
  2.19.3-2.20.5, where cuMem is on by default; with ``NCCL_CUMEM_ENABLE=0`` these are ordinary
  cudaMallocs the driver packs into shared pages (not modelled: the planner assumes the default).
- **CUDA context: outside the allocator**, ``GPUSpec.cuda_context_bytes`` (planner/gpus.py cites it).

The CPU profile has none of these (no CUDA, gloo instead of NCCL).
"""

from __future__ import annotations

import dataclasses

from planner.config import TrainConfig
from planner.memory.timeline import Event, Timeline
from planner.units import KiB, MiB

#: CublasHandlePool.cpp parseChosenWorkspaceSize, CUBLAS_WORKSPACE_CONFIG unset
CUBLAS_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8
#: ... on compute capability 9.0 (``sm90``: Hopper)
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * KiB
#: workspaces a training step holds: the forward's thread and autograd's device thread
CUBLAS_WORKSPACES = 2
#: nccl src/init.cc: DEFAULT_BUFFSIZE (Simple), DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE
NCCL_SIMPLE = 4 * MiB
NCCL_LL = 8 * 512 * 8 * 16
NCCL_LL128 = 120 * 640 * 8 * 8
#: nccl src/include/comm.h: ``MEM_ALIGN`` (the size of ``ncclSendMem`` and of ``ncclRecvMem``, each a union
#: padded to it) and ``CUDA_IPC_MIN``, what the P2P transport rounds each side's allocation up to
NCCL_CONN_MEM = 4 * KiB
NCCL_IPC_MIN = 2 * MiB
#: ring channels NCCL's topology search builds (module docstring)
NCCL_CHANNELS_NVLINK = 24
NCCL_CHANNELS_PCIE = 2
#: nccl src/include/device.h ``MAXCHANNELS`` (v2.20.5-1): the most channels ``initChannel`` sets up
NCCL_MAX_CHANNELS = 32
#: nccl src/channel.cc ``initChannel``: device allocations a channel gets (two peer tables, the ring's ranks)
NCCL_CHANNEL_STRUCTS = 3
#: the cuMem allocation granularity NCCL rounds each device allocation up to (include/alloc.h ``ncclCuMemAlloc``)
NCCL_CUMEM_GRANULARITY = 2 * MiB
#: ... on ROCm (CublasHandlePool.cpp under USE_ROCM): hipBLAS on gfx94x and elsewhere, and hipBLASLt's own
HIPBLAS_WORKSPACE_GFX94 = 128 * MiB
HIPBLAS_WORKSPACE = 32 * MiB
HIPBLASLT_WORKSPACE = 76 * MiB
WORKSPACE_KEY = "cublas/workspace"


def cublas_workspace_bytes(gpu) -> int:
    """The BLAS workspaces one thread holds on ``gpu`` (0 without CUDA): cuBLAS's (cuBLASLt shares
    it), or on ROCm hipBLAS's and hipBLASLt's."""
    if not gpu.kernels.caching_allocator:
        return 0
    if gpu.kernels.rocm:
        gfx94 = tuple(gpu.compute_capability) == (9, 4)
        return (HIPBLAS_WORKSPACE_GFX94 if gfx94 else HIPBLAS_WORKSPACE) + HIPBLASLT_WORKSPACE
    return CUBLAS_WORKSPACE_SM90 if tuple(gpu.compute_capability) == (9, 0) else CUBLAS_WORKSPACE


def nccl_channels(gpu) -> int:
    return NCCL_CHANNELS_NVLINK if gpu.interconnect.startswith("nvlink") else NCCL_CHANNELS_PCIE


def _ipc_aligned(nbytes: int) -> int:
    return -(-nbytes // NCCL_IPC_MIN) * NCCL_IPC_MIN


def nccl_channel_bytes(gpu) -> int:
    """One ring channel's device bytes on a rank, its send and its receive side as the P2P transport
    allocates them (module docstring): 12 MiB, in read mode or not."""
    read = gpu.interconnect.startswith("nvlink") and tuple(gpu.compute_capability) == (8, 0)
    send = NCCL_CONN_MEM + (NCCL_SIMPLE if read else 0)
    recv = NCCL_CONN_MEM + NCCL_LL + NCCL_LL128 + (0 if read else NCCL_SIMPLE)
    return _ipc_aligned(send) + _ipc_aligned(recv)


def nccl_initialised_channels(gpu) -> int:
    """Channels NCCL sets up at init: the ring's, raised to the next power of two for point-to-point
    (``ncclTopoComputeP2pChannels``), at most ``NCCL_MAX_CHANNELS`` (module docstring)."""
    ring = nccl_channels(gpu)
    return min(max(ring, 1 << (ring - 1).bit_length()), NCCL_MAX_CHANNELS)


def nccl_struct_bytes(gpu) -> int:
    """NCCL's per-channel device structures and the communicator's, one cuMem granule each (module
    docstring): (channels x 3 + 1) x 2 MiB."""
    return (nccl_initialised_channels(gpu) * NCCL_CHANNEL_STRUCTS + 1) * NCCL_CUMEM_GRANULARITY


def nccl_buffer_bytes(gpu, gpus: int) -> int:
    """NCCL's device memory on each device of a ``gpus``-device run: one ring connection each way per
    channel of the one communicator, and the channels' device structures; none on one device or
    without CUDA."""
    if gpus <= 1 or not gpu.kernels.caching_allocator:
        return 0
    return nccl_channels(gpu) * nccl_channel_bytes(gpu) + nccl_struct_bytes(gpu)


def outside_allocator(gpu, gpus: int) -> int:
    """Device bytes outside the caching allocator these terms add: the CUDA context and NCCL."""
    return int(gpu.cuda_context_bytes) + nccl_buffer_bytes(gpu, gpus)


def paged_on_host(paged: int, *, required: int, device: int, total: int) -> int:
    """Of ``paged`` bytes of optimizer states in unified memory, what stays on the host at the
    step. ``total`` is the process total, which holds the ``required`` bytes that must be resident
    (the tensor being stepped); the driver keeps the other pages on the device while it has room,
    ``device - total``, and past that migrates them to the host when the caching allocator's
    cudaMalloc needs the memory and back when bitsandbytes prefetches them for their update
    (bitsandbytes/functional.py ``prefetch_tensor``; CUDA Programming Guide, "Unified Memory":
    oversubscription on devices with concurrent managed access). An estimate: the driver evicts
    by its own order (least recently migrated first), so a step that visits the states in the
    same order each time may migrate more than this, up to all of them."""
    return max(0, paged - required - max(0, device - total))


def with_workspaces(timeline: Timeline, gpu) -> Timeline:
    """``timeline`` with the step's cuBLAS workspaces allocated first and kept (they live as long
    as their handle); the moments' marks move by the one event added."""
    nbytes = cublas_workspace_bytes(gpu)
    if not nbytes:
        return timeline
    event = Event("alloc", WORKSPACE_KEY, CUBLAS_WORKSPACES * nbytes, CUBLAS_WORKSPACES, -1, "cuBLAS handles")
    return dataclasses.replace(timeline, events=(event, *timeline.events),
                               marks={name: done + 1 for name, done in timeline.marks.items()}, start=timeline.start + 1)


def overhead_notes(gpu, config: TrainConfig) -> list[str]:
    """The assumption lines naming each term with its bytes (``planner estimate`` prints them)."""
    if not gpu.kernels.caching_allocator:
        return []
    from planner.units import format_bytes

    ws = cublas_workspace_bytes(gpu)
    blas = "hipBLAS + hipBLASLt" if gpu.kernels.rocm else "cuBLAS"
    out = [f"inside the allocator: {blas} workspaces {CUBLAS_WORKSPACES} x {format_bytes(ws)} "
           f"(torch CublasHandlePool.cpp default, CUBLAS_WORKSPACE_CONFIG unset; forward and autograd threads)",
           f"outside the allocator: CUDA context {format_bytes(int(gpu.cuda_context_bytes))}",
           *gpu.kernels.notes]
    nccl = nccl_buffer_bytes(gpu, config.gpus)
    if nccl:
        out.append(f"outside the allocator: NCCL buffers and structures {format_bytes(nccl)} per device ({nccl_channels(gpu)} ring channels x "
                   f"{format_bytes(nccl_channel_bytes(gpu))}: Simple 4 MiB (NCCL_BUFFSIZE) + LL 512 KiB + LL128 4800 KiB, "
                   "each side's allocation rounded up to 2 MiB; and "
                   f"{format_bytes(nccl_struct_bytes(gpu))} of device structures for {nccl_initialised_channels(gpu)} channels, "
                   "a 2 MiB cuMem granule each (NCCL >= 2.19's default); one communicator; tree/NVLS/CollNet buffers "
                   "NCCL connects lazily not counted)")
    return out


__all__ = ["CUBLAS_WORKSPACE", "CUBLAS_WORKSPACES", "CUBLAS_WORKSPACE_SM90", "WORKSPACE_KEY",
           "cublas_workspace_bytes", "nccl_buffer_bytes", "nccl_channel_bytes", "nccl_channels", "nccl_initialised_channels",
           "nccl_struct_bytes", "outside_allocator", "overhead_notes",
           "paged_on_host", "with_workspaces"]
