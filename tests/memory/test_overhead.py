"""The memory no training term owns (planner/memory/overhead.py): cuBLAS workspaces inside the
caching allocator, NCCL's buffers and the CUDA context outside it, none on the CPU."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model as get_model
from planner.config import Method, TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.estimate import replay_timeline
from planner.memory.overhead import (
    WORKSPACE_KEY,
    cublas_workspace_bytes,
    nccl_buffer_bytes,
    nccl_channel_bytes,
    with_workspaces,
)
from planner.memory.reserve import peak_independent, reserved_and_total
from planner.memory.timeline import step_timeline

MiB = 2**20
# torch CublasHandlePool.cpp parseChosenWorkspaceSize: 4096 KiB * 2 + 16 KiB * 8
#   = 8,388,608 + 131,072 = 8,519,680 bytes; on sm90: 4096 * 8 * 1024 = 33,554,432
WORKSPACE = 8_519_680
WORKSPACE_SM90 = 33_554_432
# nccl src/init.cc per channel: Simple 4 MiB = 4,194,304, LL 8*512*8*16 = 524,288,
#   LL128 120*640*8*8 = 4,915,200; the P2P transport allocates a channel's send side and its
#   receive side each rounded up to CUDA_IPC_MIN = 2,097,152 with a 4,096-byte ncclSendMem /
#   ncclRecvMem in front (src/transport/p2p.cc p2pSendSetup / p2pRecvSetup):
#   read mode (A100, NVLink): send 4,096 + 4,194,304 = 4,198,400 -> 6,291,456,
#     receive 4,096 + 524,288 + 4,915,200 = 5,443,584 -> 6,291,456: 12,582,912 a channel;
#   otherwise: send 4,096 -> 2,097,152, receive 4,096 + 4,194,304 + 524,288 + 4,915,200
#     = 9,637,888 -> 10,485,760: 12,582,912 too.
#   24 channels over NVLink = 301,989,888 (the buffers alone, 9,633,792 a channel, were
#   231,211,008), 2 channels over PCIe = 25,165,824
CONNECTION = 12_582_912
# nccl src/channel.cc initChannel: 3 device allocations a channel, init.cc 1 for the communicator, each
#   one 2 MiB cuMem granule (include/alloc.h ncclCuMemAlloc); the channels set up: the ring's raised to
#   the next power of two (graph/paths.cc ncclTopoComputeP2pChannels), at most MAXCHANNELS = 32:
#   NVLink 24 -> 32: (32 * 3 + 1) * 2,097,152 = 203,423,744; PCIe 2 -> 2: (2 * 3 + 1) * 2,097,152 = 14,680,064
STRUCTS_NVLINK = 203_423_744
STRUCTS_PCIE = 14_680_064
NCCL_NVLINK = 24 * CONNECTION + STRUCTS_NVLINK  # 301,989,888 + 203,423,744 = 505,413,632
CONTEXT = 512 * MiB  # planner/gpus.py CUDA_CONTEXT_BYTES


def _config(gpus: int = 1) -> TrainConfig:
    return TrainConfig(method=Method.LORA, micro_batch=1, seq_len=128, gpus=gpus)


def test_workspace_by_compute_capability():
    assert cublas_workspace_bytes(get_gpu("a100-80gb")) == WORKSPACE
    assert cublas_workspace_bytes(get_gpu("h100-80gb")) == WORKSPACE_SM90
    assert cublas_workspace_bytes(get_gpu("cpu")) == 0
    # ROCm on gfx94x (MI300X, capability 9.4): hipBLAS 1024 * 128 * 1024 + hipBLASLt 76 * 1024 KiB
    assert cublas_workspace_bytes(get_gpu("mi300x")) == 1024 * 128 * 1024 + 76 * 1024 * 1024


def test_nccl_only_on_several_gpus():
    assert nccl_buffer_bytes(get_gpu("a100-80gb"), 1) == 0
    assert nccl_channel_bytes(get_gpu("a100-80gb")) == nccl_channel_bytes(get_gpu("h100-80gb")) == CONNECTION
    assert nccl_buffer_bytes(get_gpu("a100-80gb"), 2) == NCCL_NVLINK == 505_413_632
    assert nccl_buffer_bytes(get_gpu("h100-pcie"), 8) == 2 * CONNECTION + STRUCTS_PCIE == 39_845_888
    assert nccl_buffer_bytes(get_gpu("cpu"), 4) == 0


@pytest.mark.parametrize("gpus, outside", [(1, CONTEXT), (2, CONTEXT + NCCL_NVLINK)])
def test_estimate_places_each_term(gpus, outside):
    # gpt2 LoRA on an A100 (nvlink3, compute capability 8.0): two workspaces of 8,519,680 bytes
    # = 17,039,360 in the breakdown and the allocated peak; the process total is the reserve
    # plus the 512 MiB context (plus 505,413,632 of NCCL on two devices); no paged states
    gpu, model, config = get_gpu("a100-80gb"), get_model("gpt2"), _config(gpus)
    m = estimate_memory(model=model, config=config, gpu=gpu)
    assert m.breakdown[WORKSPACE_KEY] == 2 * WORKSPACE == 17_039_360
    assert m.peak_allocated_bytes == step_timeline(model=model, config=config, kernels=gpu.kernels).peak + 17_039_360
    assert m.process_total_bytes - m.peak_reserved_bytes == outside
    assert any("cuBLAS workspaces" in a for a in m.assumptions)
    assert any("NCCL buffers" in a for a in m.assumptions) == (gpus > 1)


def test_workspaces_take_one_segment_of_the_replay():
    # 8,519,680 bytes round up to 10 MiB (kRoundLarge, 2 MiB) and a 1-10 MiB request gets a
    # 20 MiB segment (kLargeBuffer): the pair fills one 20 MiB segment no other block can use;
    # on sm90 each 32 MiB request is its own 32 MiB segment: 64 MiB
    model, config = get_model("gpt2"), _config()
    for name, added in (("a100-80gb", 20 * MiB), ("h100-80gb", 64 * MiB)):
        gpu = get_gpu(name)
        timeline = step_timeline(model=model, config=config, kernels=gpu.kernels)
        base = replay_timeline(timeline, config, gpu).peak_reserved
        assert replay_timeline(with_workspaces(timeline, gpu), config, gpu).peak_reserved == base + added


def test_screen_adds_the_same_terms():
    # the search's screen: 20 MiB of workspace segments, the context, NCCL on two devices
    model, gpu = get_model("gpt2"), get_gpu("a100-80gb")
    one = peak_independent(model, gpu, paged=0)
    assert peak_independent(model, gpu, paged=0, gpus=2) - one == NCCL_NVLINK
    reserved, total = reserved_and_total(model, gpu, peak=10 * MiB, static=10 * MiB, paged=0, gpus=2)
    assert total - reserved == CONTEXT + NCCL_NVLINK
    assert total == 10 * MiB + peak_independent(model, gpu, paged=0, gpus=2)


def test_cpu_has_none():
    model, gpu = get_model("gpt2"), get_gpu("cpu")
    m = estimate_memory(model=model, config=_config(2), gpu=gpu)
    assert WORKSPACE_KEY not in m.breakdown
    assert m.process_total_bytes == m.peak_allocated_bytes


def test_nccl_channel_structures_one_granule_each():
    # without the structures the NVLink figure was 24 ring channels x 12 MiB = 288 MiB; the 32
    # channels NCCL sets up (24 raised to the next power of two) hold 3 cuMem granules each and the
    # communicator one: 97 x 2 MiB = 194 MiB more, 482 MiB a device
    from planner.memory.overhead import nccl_initialised_channels, nccl_struct_bytes

    a100, pcie = get_gpu("a100-80gb"), get_gpu("h100-pcie")
    assert nccl_initialised_channels(a100) == 32
    assert nccl_initialised_channels(pcie) == 2
    assert nccl_struct_bytes(a100) == STRUCTS_NVLINK == 97 * 2 * MiB
    assert nccl_struct_bytes(pcie) == STRUCTS_PCIE == 7 * 2 * MiB
    assert nccl_buffer_bytes(a100, 2) == 482 * MiB
