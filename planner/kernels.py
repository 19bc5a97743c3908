"""The kernels of one training micro-step and what each costs on a device: the parts
``planner.throughput`` sums into a step time.

Pure arithmetic on a ``ModelSpec`` and a ``TrainConfig``; no torch. The micro-step is counted in
two currencies, FLOPs at the device's achieved GEMM rate and bytes at its achieved bandwidth, so
its seconds are linear in the two rates (``planner calibrate`` fits them). Every GEMM costs its
FLOPs plus its operands' traffic (A and B read, C written once): NVIDIA Deep Learning Performance
Guide, "Matrix Multiplication Background": a GEMM is math-limited when its arithmetic intensity
``2MNK / (bytes of A, B and C)`` exceeds the device's FLOP/byte ratio, else memory limited. The
sum (no overlap of the two) is the roofline's upper bound: a large square-ish GEMM runs at ~90%
of the achieved matmul rate, a skinny one (LoRA's rank-r products, a small hidden size) at
memory speed. The elementwise work of a block
(norms, activations, rotary, residual adds, casts, dropout) and eager attention's materialised
scores run at achieved memory bandwidth; each kernel also costs a launch-to-launch gap on the device.
Eager PyTorch issues the kernels asynchronously from one host thread, ~10 us of host time per op
(Horace He, "Making Deep Learning Go Brrrr From First Principles", 2022: overhead, bandwidth and
compute are the three regimes), so a micro-step takes at least its host's dispatch: where the kernels
are shorter (a small model, a short micro-batch) the device waits for the host (``host_op_seconds``,
``host_excess``).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.config import Attention, Method, Precision, TrainConfig
from planner.gpus import FP8_PER_BF16, GPUSpec
from planner.memo import IdentityMemo
from planner.memory.attention import effective_attention
from planner.memory.dtypes import ADAPTER_BYTES, fp8_converts
from planner.memory.moe import is_moe_block
from planner.memory.parameters import stack_targets
from planner.memory.shapes import drops_adapter_inputs
from planner.modelspec import LinearKind, LinearSpec, ModelSpec
from planner.moe_loop import loop_gemms, loop_input_grad_elements, loop_ops, loop_slot_elements

# ---- achieved matmul rate per device ---------------------------------------------------------

#: Maximum achievable matmul FLOPS (MAMF) as a fraction of the dense bf16 peak: the best mean
#: rate of a brute-force search over GEMM shapes (stas00/ml-engineering, compute/accelerator/
#: README.md, "Maximum Achievable Matmul FLOPS comparison table", BF16): A100 SXM 271.2 of 312
#: (86.9%), A100 PCIe 81.1%, GH200 83.8%, H100 SXM 80.3% ("H200 is the same"), B200 77.6%,
#: GB200 72.9%, MI300X 51.4% (ROCm 6.3, TunableOp on).
#: The cards that table lacks take the best square torch matmul (1024-10240, 30 timed iterations after 10 warm-up;
#: the device's precision, fp16 on Volta and Turing) of zzc0721/torch-performance-test-data database.md (commit
#: 078586871da3 and later), over the same dense peak the catalog gives the card. Cards whose FP32-accumulate tensor
#: rate is rated at half their die's (GeForce; the A10G) reach that rated peak: RTX 4090 bf16 170.06 and 173.31
#: TFLOPS on two bare-metal machines (torch 2.4; cloud containers 160-168) of 165.2, RTX 3090 76.34 of 71, RTX 5090
#: 236.03 of 209.5, A10G 69.5 of the 70 the catalog takes from it (issue #126): 1.0 (a fraction of the rated peak
#: is at most 1: ``planner calibrate`` and ``--utilization`` share the bound; GeForce clocks boost above the
#: rated one). Full-rate cards fall short as the table above does: RTX PRO 6000 Workstation 417.98 of 503.8 =>
#: 0.830; RTX A6000 123.34 of 154.8 => 0.797; L40S 269.15 of 362.05 => 0.743; V100-SXM2-16GB fp16 94.84 of 125 =>
#: 0.759 (the same for the 32 GB part); T4 fp16 41.91 of 65 => 0.645 and L4 bf16 70.89 of 121 => 0.586 (issue
#: #120), both power-capped at 70-72 W. The same table's A100 80GB (264.53 of 312, 0.848) and H100 (789.24 of
#: 989.4, 0.798) agree with the brute-force rows above. The L40 is not measured there; its datasheet rates it at
#: half its die's rate (181.05 dense: 128 FLOP per tensor core per clock at 568 tensor cores and 2,490 MHz, the
#: 4090's 165.2 / (512 x 2,520 MHz) likewise; the L40S, the same 142-SM AD102 with 18,176 CUDA cores and 864 GB/s,
#: 362.05, and the RTX 6000 Ada 364.25, at 256), so it takes the half-rate cards' 1.0.
MAMF_FRACTION = {
    "a100-40gb": 0.869, "a100-80gb": 0.869, "gh200": 0.838, "h100-80gb": 0.803, "h200": 0.803,
    "h100-pcie": 0.803, "b200": 0.776, "gb200": 0.729, "mi300x": 0.514,
    "rtx4090": 1.0, "rtx3090": 1.0, "rtx5090": 1.0, "a10g": 1.0, "l40": 1.0,
    "rtx-pro-6000": 0.830, "rtx-a6000": 0.797, "l40s": 0.743, "v100-16gb": 0.759, "v100-32gb": 0.759,
    "t4": 0.645, "l4": 0.586,
}
#: Tensor-core GPUs neither table lists: 0.80, the median of the brute-force table's NVIDIA rows (0.73-0.87).
DEFAULT_MAMF_FRACTION = 0.80
#: fp32 matmuls on CUDA cores (torch's default: no TF32): a 10240^2 fp32 torch matmul measured 23.4 of the A10G's
#: 31.2 TFLOP/s (zzc0721/torch-performance-test-data#126): 0.75, for the cards not measured. The same table's fp32
#: column (database.md) over the catalog's fp32 peak: the HBM datacenter parts, whose fp32 peak is one FMA per core
#: per clock, reach it: V100-SXM2-16GB 14.06 of 15.7 => 0.896, A100 SXM4 80GB 19.18 of 19.5 => 0.984; Ampere GA10x
#: and Ada, whose fp32 peak counts the second fp32 datapath (dual-issue) a GEMM cannot keep fed, reach less: RTX
#: 4090 55.01 of 82.6 => 0.666, RTX 3090 24.46 of 35.6 => 0.687, RTX A6000 23.92 of 38.7 => 0.618, L40S 46.88 of
#: 91.6 => 0.512, T4 4.17 of 8.1 => 0.515.
FP32_MATMUL_FRACTION = 0.75
FP32_MATMUL_FRACTIONS = {
    "v100-16gb": 0.896, "v100-32gb": 0.896, "a100-40gb": 0.984, "a100-80gb": 0.984, "rtx4090": 0.666,
    "rtx3090": 0.687, "rtx-a6000": 0.618, "l40s": 0.512, "t4": 0.515,
}
#: A GEMM runs its output in tiles, one thread block each, in waves of as many blocks as the device runs at once; a
#: GEMM pays for whole tiles and whole waves (NVIDIA Deep Learning Performance Guide, "Matrix Multiplication
#: Background", 2.3 "Typical Tile Dimensions in cuBLAS": 256x128 and 128x256 the most efficient; 3.1 "Tile
#: Quantization"; 3.2 "Wave Quantization": an A100 has 108 SMs and runs one 256x128 block per SM, so a wave is 108
#: tiles, and a GEMM whose tiles overshoot a multiple of 108 runs a last wave mostly idle). The measured fractions
#: above are the best shapes' (MAMF: a search over shapes), which fill their waves; a dense layer's GEMMs have the
#: run's fixed shape, many waves each (an 8B model's at 16k tokens: 19-66), and are left at those fractions. Where
#: routing sets a GEMM's token count afresh each step (transformers 4's per-expert loop, ``planner.moe_loop.
#: loop_gemms``) its last tile row and its last wave are on average half filled, a cost per call whatever the tokens
#: (``routed_gemm_waste``). Tiles GEMM_TILE_OUT along the output features (cuBLAS's m for F.linear's column-major
#: ``out^T = W x^T``) by GEMM_TILE_TOKENS along the tokens, one per SM, on every NVIDIA device (the guide's A100 case),
#: where one sequence's routed rows already fill a wave of them: cuBLAS takes smaller tiles for a smaller GEMM (2.3:
#: the tile trades reuse against parallelism), which the roofline's pricing of small GEMMs stands for.
GEMM_TILE_OUT = 256
GEMM_TILE_TOKENS = 128


def routed_gemm_waste(out_features: int, inner: int, sms: int) -> float:
    """Expected FLOPs (priced at the device's achieved GEMM rate) one GEMM spends beyond its own where routing sets
    its token count: half its last wave (``sms`` tiles) idle, and half its last row of tiles along the tokens (one
    tile per ``GEMM_TILE_OUT`` output features) computing padding; a tile is ``GEMM_TILE_OUT x GEMM_TILE_TOKENS``
    outputs of ``inner`` multiply-adds (``GEMM_TILE_OUT`` etc.)."""
    row = -(-out_features // GEMM_TILE_OUT)
    return (0.5 * sms + 0.5 * row) * GEMM_TILE_OUT * GEMM_TILE_TOKENS * 2.0 * inner


def routed_gemm_flops(model: ModelSpec, config: TrainConfig, gpu: GPUSpec | None) -> tuple[float, float]:
    """(outside the recompute, in it) FLOPs per micro-step the expert loop's GEMMs waste on ``gpu``
    (``routed_gemm_waste`` over ``planner.moe_loop.loop_gemms``, those whose rows from one sequence fill a wave of
    ``GEMM_TILE_OUT x GEMM_TILE_TOKENS`` tiles); (0, 0) without the loop, a device or its SM count."""
    sms = gpu.sm_count if gpu is not None else 0
    main = recompute = 0.0
    if sms:
        for calls, out_features, inner, in_recompute, rows in loop_gemms(model, config):
            if -(-rows // GEMM_TILE_TOKENS) * -(-out_features // GEMM_TILE_OUT) < sms:
                continue  # under a wave of the largest tiles at one sequence: cuBLAS tiles it smaller
            waste = calls * routed_gemm_waste(out_features, inner, sms)
            if in_recompute:
                recompute += waste
            else:
                main += waste
    return main, recompute


#: The CPU profile's FLOP/s are its MEASURED 2048^2 GEMM rates (``planner.gpus``): 1.0.
CPU_MATMUL_FRACTION = 1.0
#: The CPU profile's bandwidth is likewise a MEASURED achieved rate (``copy_`` into a kept tensor, bytes counted
#: as the model counts them: read + write; ``planner.gpus``), not a datasheet peak: the efficiency that turns a
#: GPU's datasheet bandwidth into an achieved one (``planner.throughput.MEMORY_BANDWIDTH_EFFICIENCY``) would
#: count the shortfall twice. 1.0.
CPU_BANDWIDTH_FRACTION = 1.0

# ---- attention kernels -----------------------------------------------------------------------

#: FlashAttention-2 forward + backward relative to the device's achieved GEMM rate: FA2 reaches
#: 50-73% of the A100's peak (Dao 2023, "FlashAttention-2", sec. 4.1; its backward is the slower
#: half), i.e. ~0.70 of the A100's 0.87 MAMF. SDPA's flash backend is the same kernel.
FLASH_FRACTION_OF_GEMM = 0.70
#: The CPU's SDPA against its bf16 GEMM rate, one thread (bench/cpu_overhead.py attention --cpu-time, torch 2.13,
#: the 2-core AMD EPYC, bf16 2048^3 GEMM 203 GFLOP/s in the same run): the flash kernel (aten native/cpu/
#: FlashAttentionKernel.cpp: fp32 softmax and exp per score in blocks), causal, forward + backward counted as
#: 3.5 x half the product, B 2 x H 4 x T 256 x D 64 (llama-tiny) 27.9 GFLOP/s, H 6 23.7 => 0.13; at head
#: dim 64 its per-score work (exp, rescaling, the casts) outweighs the products. With attention dropout the
#: CPU takes the math path in fp32 (``KernelProfile.sdpa_dropout_math_fp32``): the whole product, its backward
#: twice, the scores, softmax and bernoulli_ mask materialised, counted as 3 x the product: 26.5 and 30.7
#: GFLOP/s => 0.14 (at T 128, H 12: 13.7 flash and 22.6 math, 0.07 and 0.11: shorter rows are slower still).
CPU_FLASH_FRACTION_OF_GEMM = 0.13
CPU_MATH_FRACTION_OF_GEMM = 0.14
#: FLOPs of a fused attention kernel's backward per forward FLOP: 2.5, its five products (S = QK^T
#: recomputed, dP, dV, dQ, dK) against the forward's two: the convention FA2's rates above are quoted
#: in (flash-attention benchmarks/benchmark_flash_attention.py ``flops``: ``2.5 * f`` for "bwd").
#: Eager attention keeps its scores: its backward is the four products of dQ, dK, dV and dP (2x).
FUSED_BACKWARD_FLOPS = 2.5
EAGER_BACKWARD_FLOPS = 2.0
#: SDPA with an attention mask (padding: ``packing=False``) takes the memory-efficient kernel,
#: which computes the full masked product and runs slower than flash (xformers/cutlass fMHA);
#: 0.5 of the GEMM rate (assumption).
MASKED_SDPA_FRACTION_OF_GEMM = 0.50
#: Eager attention (and fp32 SDPA's math path) materialises the B x heads x T x T scores: bytes
#: moved per score element per 16-bit activation byte, forward + backward. HF eager forward: the
#: QK^T product written (1), scaled and masked (2), fp32 softmax read 16-bit/write fp32 (3), cast
#: back (3), dropout where p > 0 (2), read by PV (1) ~ 10-12 element-bytes-of-2; backward about
#: twice that: 30 x 2 B = 60 B per score element per layer at 16-bit (assumption from the ops).
EAGER_SCORE_PASSES = 30

# ---- elementwise work of a block --------------------------------------------------------------

#: Bytes moved per hidden element per token per layer, FORWARD, by unfused HF modules at 16-bit
#: activations (read + write of each op): an RMSNorm in transformers is six ops (to fp32 2+4,
#: pow 4+4, mean 4, rsqrt-mul 4+4, to dtype 4+2, weight mul 2+2 = 36 B), two per block; a
#: LayerNorm is one fused aten kernel reading 16-bit and writing fp32 under autocast (~8 B);
#: each residual add reads two and writes one (6 B), two per block.
RMSNORM_BYTES = 36
LAYERNORM_BYTES = 8
RESIDUAL_BYTES = 12
#: Rotary embedding per query/key element: q*cos (6), rotate_half's slices + cat (4), neg (4),
#: *sin (6), add (6) ~ 28 B (transformers apply_rotary_pos_emb).
ROTARY_BYTES = 28
#: MLP activation per intermediate element: gated act(gate) (4) and * up (6) = 10 B; plain GELU 4.
GATED_ACT_BYTES = 10
ACT_BYTES = 4
#: Dropout per element where p > 0: read, write and the bool mask (5 B); two per block.
DROPOUT_BYTES = 10
#: An fp32 residual stream under 16-bit compute doubles the bytes of the ops that run on it (see
#: ``fp32_stream``).
FP32_STREAM = 2.0
#: A dtype cast per element: read one width, write the other (fp32 <-> 16-bit: 4 + 2 B); its
#: backward casts the gradient back (2 + 4 B).
CAST_BYTES = 6
#: Backward of elementwise work moves about twice its forward (each op reads the incoming
#: gradient and its saved input and writes the outgoing gradient).
BACKWARD_ELEMENTWISE = 2.0
#: Mixed-precision full fine-tuning under torch AMP keeps fp32 weights: autocast casts each linear weight to 16
#: bits per forward (read 4, write 2) and the backward's 16-bit weight gradient is cast up and
#: accumulated into the fp32 ``.grad`` (read 2 write 4, then read 4 + 4 write 4) = 18 B.
WEIGHT_CAST_BYTES = 6
GRAD_ACCUMULATE_BYTES = 18
#: The loss: the logits cast to fp32 (transformers' ``logits.float()``: 2 + 4), cross-entropy's
#: log-softmax read and its gradient written (4 + 4 + 4), cast back for the head's backward (4 + 2).
LOSS_BYTES_PER_LOGIT = 24

# ---- per-kernel overhead ---------------------------------------------------------------------

#: Device time per kernel beyond its work: the launch-to-launch gap of back-to-back kernels in one
#: stream, ~1 us on the GPU (NVIDIA Developer Blog, "Getting Started with CUDA Graphs", 2019:
#: 2.9 us kernels ran at 3.8 us each when launched back to back).
GPU_OP_SECONDS = 1e-6
#: Host seconds per counted op (``ops_per_micro_step``) of an eager HF training micro-step apart from its kernels:
#: Python, nn.Module calls, the dispatcher, autograd's nodes and backward, autocast's casts and checkpointing's
#: bookkeeping, by (autocast, checkpointing: "none", "reentrant", "non-reentrant"). Measured (``bench/cpu_overhead.py
#: host --cpu-time``, OMP_NUM_THREADS=1, torch 2.13, transformers 5.24, the 2-core AMD EPYC at load 1.2; at load 9.7
#: the same run read 1.4-2.3x these): a whole forward +
#: backward at widths where the kernels do nothing (8 tokens, hidden 32) over the ops counted, the median of gpt2
#: (4 blocks), llama (4) and BERT-large (24, eager attention, sequence classification): fp32 6.5 / 7.0 / 5.8 us,
#: bf16 autocast 10.9 / 11.5 / 9.8; under transformers 5's non-reentrant checkpoint (saved-tensor hooks on every
#: saved tensor) 11.7 / 11.7 / 10.3 and 16.0 / 17.0 / 15.9; under the reentrant one transformers 4 called
#: (``TrainConfig.reentrant_ckpt``) 8.6 / 8.1 / 7.3 and 12.6 / 13.3 / 12.2. A GPU's host runs the same Python and
#: dispatcher. (The CPU profile keeps its own ``CPU_OP_SECONDS``, 9 and 14 us from an earlier ``fixed`` run of gpt2
#: and llama that its CPU rows are scored with; ``fixed --cpu-time`` at load 1.1 now reads 6.5-7.5 and 10.1-12.6 us.)
HOST_OP_SECONDS = {
    (False, "none"): 6.5e-6, (True, "none"): 10.9e-6,
    (False, "non-reentrant"): 11.7e-6, (True, "non-reentrant"): 16.0e-6,
    (False, "reentrant"): 8.1e-6, (True, "reentrant"): 12.6e-6,
}
#: Host seconds the CUDA path adds to an eager op that launches a kernel (the caching allocator, the device guard
#: and the launch itself): torch.add on an A100 costs 7.1 us of host time per call issued back to back
#: (flagos-ai/FlagGems issue #4558, bf16 (1, 4096)) and 8 us (flagos-ai/Torch-FL PR #27, 'cuda_sub' add of 512^2,
#: N ops then one sync: the host's cost), against 1.34 us for the same call on CPU tensors here
#: (``bench/cpu_overhead.py dispatch --cpu-time``): ~6 us (different hosts; libcuda's cuLaunchKernel alone took
#: 4.9 us from C, JuliaGPU/CUDAdrv.jl PR #15). One per counted op: the ops that launch a kernel (not views, not bare
#: allocations) are 0.61-0.98 of the count in fp32 and 0.87-1.24 under autocast (``host``).
CUDA_OP_HOST_SECONDS = 6e-6
#: Ops per decoder block, forward: 7 linears, 2 RMSNorms x 6, rotary ~10, attention 3, activation
#: 2, residual 2, views/transposes ~10 = ~45; backward about twice: ~135 per block per micro-step.
OPS_PER_BLOCK = 135
#: Ops per LoRA-adapted module per micro-step: dropout/identity, A, B, scale, add forward; their
#: backward ~2x: 15. QLoRA adds the dequantisation kernel forward and backward: 2.
OPS_PER_ADAPTER = 15
OPS_PER_QUANTIZED = 2

# ---- the CPU profile's host costs ------------------------------------------------------------
# Measured by bench/cpu_overhead.py on the 2-core AMD EPYC VM (torch 2.13, transformers 5.23), each timed with one
# thread's CPU time (--cpu-time; other processes share the cores, and this clock does not count their time).

#: Host seconds per op of ``ops_per_micro_step``'s count, where the device is the host: a whole HF training
#: micro-step at widths where the kernels do no work (``fixed``: gpt2 and llama, 4 blocks, hidden 32, 8 tokens,
#: forward + backward) took 4.77 and 5.09 ms in fp32 and 7.34 and 8.05 ms under bf16 autocast (its casts are ops
#: too), over the 4 x 135 ops counted => 9 us and 14 us. Underneath (``dispatch``): an aten op 1.2 us, +0.5 us
#: recording its autograd node, 1.5 us per backward node, nn.Module.__call__ 1.2 us, F.linear 5.9 us; HF's
#: modules run ~90 aten ops per block forward and ~120-170 backward (a TorchDispatchMode count).
CPU_OP_SECONDS = 9e-6
CPU_AUTOCAST_OP_SECONDS = 14e-6
#: Host seconds per op an optimizer's step dispatches (no autograd, no autocast), beside the device's work:
#: torch.optim.AdamW's single-tensor path took 24 us per tensor on 1,000 one-element tensors (``optimizer``) for its
#: 10 aten ops (``planner.optim.adamw.SINGLE_TENSOR_OPS``): 2.4 us. Each optimizer counts its ops
#: (``OptimizerModel.step_ops``); on a GPU each that launches a kernel adds the CUDA path's ``CUDA_OP_HOST_SECONDS``.
OPTIMIZER_OP_HOST_SECONDS = 2.4e-6
#: Host seconds per parameter tensor of torch.optim.AdamW's foreach and fused paths on the CPU (``optimizer``: 1,000
#: one-element tensors): foreach 15 us (CPU tensors take its per-tensor fallback), fused 4 us.
CPU_ADAMW_TENSOR_SECONDS = {"foreach": 15e-6, "fused": 4e-6}
#: Element passes of torch.optim.AdamW's single-tensor path (torch/optim/adamw.py _single_tensor_adamw): weight
#: decay ``param.mul_`` (read + write: 2), ``exp_avg.lerp_(grad)`` (3), ``exp_avg_sq.mul_`` (2) and
#: ``.addcmul_(grad, grad)`` (3), ``exp_avg_sq.sqrt()`` (2), ``/ bias_correction2_sqrt`` (2), ``.add_(eps)`` (2),
#: ``param.addcdiv_(exp_avg, denom)`` (4) = 20, against the fused kernel's 7; ``optimizer`` measured 5.4 ns per
#: fp32 element on one thread (80 B at 14.8 GB/s) against the fused path's 0.72 ns.
ADAMW_SINGLE_TENSOR_PASSES = 20
#: glibc's malloc serves a block of 32 MiB or more with mmap and returns it with munmap (malloc/malloc.c:
#: the dynamic M_MMAP_THRESHOLD stops at DEFAULT_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * sizeof(long)), and c10's
#: CPU allocator keeps nothing (``KernelProfile.caching_allocator`` False): each such tensor is page-faulted in
#: again every time it is made.
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: How much faster two threads run the memory-bound work than one: a whole step of gpt2-tiny took 346 ms and
#: 1,081 ms of one thread's CPU time (``step --cpu-time``, OMP_NUM_THREADS=1: mb1 x 64 and mb2 x 256 tokens)
#: against 228 and 747 ms wall on the profile's two threads (``bench/throughput_cpu.py``, load ~1): 1.52 and
#: 1.45. (The two-thread micro-benchmarks themselves could not be timed: other processes held the cores.)
CPU_THREAD_SPEEDUP = 1.5
#: Seconds per element of dropout's mask draw on the CPU, beyond its memory traffic (``DROPOUT_BYTES``): aten's CPU
#: dropout draws ``bernoulli_(1 - p)`` into a tensor of the input's shape (native/Dropout.cpp ``_dropout_impl``), and
#: on a CPU that is not Intel's ``bernoulli_scalar_kernel`` takes the default path (native/cpu/DistributionKernels.cpp:
#: "The situation of AMD"), ``cpu_serial_kernel`` drawing one element at a time under the generator's lock
#: (native/cpu/DistributionTemplates.h): serial, so the profile's second thread does not share it. Measured
#: (``bench/cpu_overhead.py dropout --cpu-time``, OMP_NUM_THREADS=1 and 2, the 2-core AMD EPYC, torch 2.13): 5.7-6.3
#: ns per element for 64 Ki to 4 Mi elements, fp32 and bf16 alike, the same wall time at two threads => 5.9 ns.
#: (Intel CPUs take MKL's vectorised ``viRngBernoulli`` across the threads: not measured.)
CPU_BERNOULLI_SECONDS_PER_ELEMENT = 5.9e-9
#: Seconds per byte of a fresh mmapped tensor's first touch (``bandwidth``: ``torch.empty(16M).fill_`` against
#: ``fill_`` of a kept tensor, one thread: 394 ps/B, 2.5 GB/s, against 20-25 GB/s streaming), over
#: ``CPU_THREAD_SPEEDUP`` for the profile's two threads (each faults its half of the pages).
CPU_FIRST_TOUCH_SECONDS_PER_BYTE = 394e-12 / CPU_THREAD_SPEEDUP


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """Achieved rates of one device for one precision."""

    gemm: float
    """FLOP/s of a large GEMM: the precision's peak x the large-GEMM efficiency."""
    bandwidth: float
    """Bytes/s memory-bound kernels reach."""
    op_seconds: float
    """Seconds per eager op the device's kernels cannot hide."""


def matmul_fraction(gpu: GPUSpec, precision: Precision) -> float:
    """The large-GEMM efficiency of a device: its MAMF fraction (the default where unmeasured)."""
    if gpu.is_cpu:
        return CPU_MATMUL_FRACTION
    if precision is Precision.FP32:
        return FP32_MATMUL_FRACTIONS.get(gpu.name, FP32_MATMUL_FRACTION)
    return MAMF_FRACTION.get(gpu.name, DEFAULT_MAMF_FRACTION)


class Work:
    """FLOPs (weighted by the kernel's rate relative to a large GEMM) and bytes of some kernels."""

    __slots__ = ("flops", "bytes")

    def __init__(self, flops: float = 0.0, bytes_: float = 0.0) -> None:
        self.flops, self.bytes = flops, bytes_

    def add(self, other: "Work", times: float = 1.0) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times

    def seconds(self, rates: DeviceRates) -> float:
        return self.flops / rates.gemm + self.bytes / rates.bandwidth


def gemm(m: float, n: int, k: int, *, elem: int) -> Work:
    """One (m x k) @ (k x n) GEMM: 2mnk FLOPs and its operands read and written once."""
    return Work(2.0 * m * n * k, (m * k + k * n + m * n) * elem)


def gemm_seconds(m: float, n: int, k: int, *, rates: DeviceRates, elem: int) -> float:
    """Seconds of one GEMM at ``rates``."""
    return gemm(m, n, k, elem=elem).seconds(rates)


@dataclass(frozen=True, kw_only=True)
class MicroStep:
    """One micro-step's device work by kind: (FLOPs, bytes) each; checkpointing's recompute apart."""

    gemm: tuple[float, float]
    """Block linears, vocab projection and adapters, forward and backward."""
    attention: tuple[float, float]
    """Attention's products, forward and backward (FLOPs weighted by the kernel's rate)."""
    recompute: tuple[float, float]
    """The second forward's GEMMs and attention."""
    elementwise: tuple[float, float]
    """Norms, activations, rotary, residuals, dropout, casts, loss, eager scores (incl. recompute's)."""
    ops: int
    """Kernels launched."""

    def seconds(self, rates: DeviceRates) -> tuple[float, float, float, float, float]:
        """(gemm, attention, recompute, elementwise, overhead) seconds at ``rates``."""
        g, b = rates.gemm, rates.bandwidth
        return (self.gemm[0] / g + self.gemm[1] / b, self.attention[0] / g + self.attention[1] / b,
                self.recompute[0] / g + self.recompute[1] / b, self.elementwise[0] / g + self.elementwise[1] / b,
                self.ops * rates.op_seconds)

    @property
    def flops(self) -> float:
        return self.gemm[0] + self.attention[0] + self.recompute[0] + self.elementwise[0]

    @property
    def bytes(self) -> float:
        return self.gemm[1] + self.attention[1] + self.recompute[1] + self.elementwise[1]


def _linears(model: ModelSpec):
    # every kind of block (ModelSpec.all_blocks): the dense and MoE blocks of a mixed model differ
    for n, linears in model.all_blocks:
        for lin in linears:
            yield n, lin


def rows_per_token(model: ModelSpec, lin: LinearSpec) -> int:
    """Rows of a linear each token multiplies: its active experts (top-k), or every expert of a stack that runs
    over every token (Llama 4's Llama4TextMoe: ``routed_in = hidden_states.repeat(router_scores.shape[1], 1)``,
    transformers models/llama4/modeling_llama4.py:169, then two ``torch.bmm`` over the E x T rows, :80 and :82;
    ``MoeRouting.dense_experts``). The shared expert and the router are modules and see each token once."""
    if model.routing is not None and model.routing.dense_experts and not lin.module:
        return lin.count
    return lin.active


#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and the search's throughput memo asks this once a plan
_FULL, _PURE_16 = Method.FULL, (Precision.FP16, Precision.BF16)


def fp32_adapters(config: TrainConfig) -> bool:
    """Whether the adapters multiply in fp32: peft keeps them fp32 (``ADAPTER_BYTES``) and casts each
    input to their dtype (peft 0.21 tuners/lora/layer.py:1100 ``_cast_input_dtype``; bnb.py likewise when
    autocast is off), so without autocast (pure 16-bit) lora_A and lora_B are fp32 GEMMs with fp32
    operands; under autocast (``*-mixed``) the matmuls run 16-bit again."""
    return config.method is not _FULL and config.precision in _PURE_16


def adapter_flop_weight(gpu: GPUSpec | None, config: TrainConfig) -> float:
    """An adapter FLOP's cost in large-GEMM FLOPs of the precision: the precision's achieved matmul
    rate over fp32's where the adapters multiply in fp32 (``fp32_adapters``), else 1 (no device: 1)."""
    if gpu is None or not fp32_adapters(config):
        return 1.0
    rate = gpu.peak_tflops(config.precision) * matmul_fraction(gpu, config.precision)
    return rate / (gpu.peak_tflops(Precision.FP32) * matmul_fraction(gpu, Precision.FP32))


#: ``_base_gemms`` by model and element bytes: the search prices ~70 micro-step kinds a request, each
#: summing every block linear of the same model at one of a few element sizes
_BASE_GEMMS = IdentityMemo(kept=64)


def _base_gemms(model: ModelSpec, elem: int) -> tuple[float, ...]:
    """(FLOPs, bytes, weight bytes) per token of the block linears and of the vocab projection
    (``_gemms``' base model, the adapters aside) at ``elem`` bytes an element, remembered."""
    hit = _BASE_GEMMS.get(model, elem)
    if hit is not None:
        return hit
    f = t = w = 0.0
    for n, lin in _linears(model):
        rows = rows_per_token(model, lin)  # Llama 4's expert stacks: every expert, not top-k
        f += 2.0 * n * rows * lin.out_features * lin.in_features
        t += n * rows * (lin.in_features + lin.out_features) * elem
        w += n * lin.count * lin.in_features * lin.out_features * elem
    # transformers 4's per-expert loop: its gathers and scatters around the experts' GEMMs (planner.moe_loop)
    t += sum(n * loop_slot_elements(view) for n, _, view in model.block_kinds) * elem
    hf = ht = hw = 0.0
    if model.lm_head_params:
        hf = 2.0 * model.vocab_size * model.hidden_size
        ht = (model.hidden_size + model.vocab_size) * elem
        hw = model.vocab_size * model.hidden_size * elem
    return _BASE_GEMMS.put(model, elem, (f, t, w, hf, ht, hw))


def _gemms(model: ModelSpec, config: TrainConfig, adapter_weight: float = 1.0) -> tuple[tuple[float, float, float], ...]:
    """(forward, backward, head-forward) GEMM work of the block linears, the vocab projection and
    the adapters, each as (FLOPs per token, bytes per token, bytes per micro-step): ``gemm`` summed
    over the linears, in closed form (a linear of ``count`` experts, ``active`` per token, sees
    ``tokens x active / count`` tokens per expert: its FLOPs and activations scale with the
    tokens, its weights are read once per pass). The adapters' FLOPs count ``adapter_weight`` each
    (``adapter_flop_weight``), their operands at their own width where they multiply in fp32."""
    elem = config.precision.compute_bytes
    backward = 2 if config.method is Method.FULL else 1  # dX always; dW only for trained weights
    f, t, w, hf, ht, hw = _base_gemms(model, elem)
    af = at = aw = 0.0
    if config.method is not Method.FULL:
        r = config.lora_r or 0
        a_elem = ADAPTER_BYTES if fp32_adapters(config) else elem
        for n, linears in stack_targets(model, config.lora_targets):
            for lin in linears:  # A: in -> r, B: r -> out
                af += 2.0 * n * lin.active * r * (lin.in_features + lin.out_features) * adapter_weight
                at += n * lin.active * (lin.in_features + 2 * r + lin.out_features) * a_elem
                aw += n * lin.count * r * (lin.in_features + lin.out_features) * a_elem
    forward = (f + hf + af, t + ht + at, w + hw + aw)
    back = (backward * (f + hf) + 2 * af, backward * (t + ht) + 2 * at, backward * (w + hw) + 2 * aw)
    return forward, back, (hf, ht, hw)


def _attention_layers(model: ModelSpec, config: TrainConfig) -> tuple[tuple[int, int, int, int], ...]:
    """(layers, heads, head dim, keys each query reads) of each kind of softmax-attention block: every block
    of a model whose blocks are alike; per kind where they differ (Gemma 4's global layers' head dim and
    their full context beside the sliding ones; Gated DeltaNet layers have none: ``_linear_attention_flops``).
    Only flash-attn reads fewer keys in a sliding layer: transformers passes it the window
    (modeling_gpt_oss.py l.284 and l.321 ``sliding_window=self.sliding_window``, flash-attn's ``window_size``),
    where SDPA gets a materialised window mask (masking_utils.py create_sliding_window_causal_mask) and eager
    adds one to the whole score matrix: both compute every key."""
    windowed = effective_attention(model, config) is Attention.FLASH

    def context(sliding: bool) -> int:
        if model.sliding_window and sliding and windowed:
            return min(config.seq_len, model.sliding_window)
        return config.seq_len
    if not model.other_blocks:
        return ((model.num_layers + 2 * model.decoder_layers, model.num_heads, model.head_dim, context(True)),)
    per_layer = any(view.sliding_attention for _, _, view in model.block_kinds)
    kinds: dict[tuple[int, int, int], int] = {}  # kinds alike in these (dense and MoE blocks) summed as one
    for n, _, view in model.block_kinds:
        if view.mixer == "attention":
            key = (view.num_heads, view.head_dim, context(view.sliding_attention or not per_layer))
            kinds[key] = kinds.get(key, 0) + n
    return tuple((n, heads, head_dim, ctx) for (heads, head_dim, ctx), n in kinds.items())


def _linear_attention_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of the Gated DeltaNet layers' chunked delta rule (torch_chunk_gated_delta_rule /
    fla chunk_gated_delta_rule, chunks of C tokens), per token and value head: the C x C products k_beta·kᵀ
    and q·kᵀ (2·C·dk each), the two triangular solves against C x (dv + dk), the intra-chunk product with
    v_new (2·C·dv), and the state's read and update (2 x 2·dk·dv)."""
    total = _mamba2_flops(model, tokens)
    gdn = model.gated_deltanet
    if gdn is None:
        return total
    layers = sum(n for n, _, view in model.block_kinds if view.mixer == "gated_deltanet")
    c = gdn.chunk
    per_head = 4 * c * gdn.k_dim + c * (gdn.v_dim + gdn.k_dim) + 2 * c * gdn.v_dim + 4 * gdn.k_dim * gdn.v_dim
    return total + float(layers * gdn.v_heads * per_head * tokens)


def _mamba2_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of the Mamba2 layers' chunked scan (mamba2_chunk_scan / mamba-ssm's SSD, chunks of C
    tokens), per token and head: C·B over the chunk (2·C·N), its product with x (2·C·P), the chunk state
    B·x (2·P·N) and C·state (2·P·N)."""
    m = model.mamba2
    if m is None:
        return 0.0
    layers = sum(n for n, _, view in model.block_kinds if view.mixer == "mamba2")
    per_head = 2 * m.chunk * (m.state + m.head_dim) + 4 * m.head_dim * m.state
    return float(layers * m.heads * per_head * tokens)


def cpu_sdpa_math(model: ModelSpec, config: TrainConfig, gpu: GPUSpec | None) -> bool:
    """Whether SDPA takes the math path for the attention dropout on this device
    (``KernelProfile.sdpa_dropout_math_fp32``: the CPU's flash kernel refuses dropout)."""
    return (gpu is not None and gpu.is_cpu and gpu.kernels.sdpa_dropout_math_fp32
            and config.attention is Attention.SDPA and model.attn_dropout > 0)


def attention_flops(model: ModelSpec, config: TrainConfig, tokens: int, gpu: GPUSpec | None = None,
                    ) -> tuple[float, float]:
    """(forward + backward, one more forward) FLOPs of attention's products, each weighted by the
    kernel's rate relative to a large GEMM (FLOPs / fraction). Causal fused kernels (flash; SDPA's
    flash backend on packed 16-bit batches, ``is_causal``) skip the masked half of T x T; eager
    attention's materialised scores are memory traffic (``_score_bytes``). Linear-attention layers
    add their chunked products (``_linear_attention_flops``) at the fused kernels' rate. On the CPU
    (``gpu.is_cpu``) SDPA runs at the CPU's measured fractions (``CPU_FLASH_FRACTION_OF_GEMM``)."""
    forward = sum(4.0 * layers * ctx * heads * head_dim * tokens
                  for layers, heads, head_dim, ctx in _attention_layers(model, config))
    if cpu_sdpa_math(model, config, gpu):  # the whole product, its backward twice, scores and dropout in the rate
        forward /= CPU_MATH_FRACTION_OF_GEMM
        return (1 + EAGER_BACKWARD_FLOPS) * forward, forward
    cpu = gpu is not None and gpu.is_cpu
    if _fused_attention(model, config):
        # flash is causal on a padded batch too: transformers unpads it and calls the varlen kernel
        # with the same causal flag (5.24 modeling_flash_attention_utils.py l.680 ``"causal": is_causal``,
        # l.837-842 ``flash_varlen_fn(..., **flash_kwargs)``); SDPA given a padding mask is not
        causal_kernel = config.packing or config.attention is Attention.FLASH
        if not model.is_encoder and not model.is_encoder_decoder and causal_kernel:
            forward /= 2  # causal: the kernel skips the masked half
        forward /= CPU_FLASH_FRACTION_OF_GEMM if cpu else FLASH_FRACTION_OF_GEMM if causal_kernel \
            else MASKED_SDPA_FRACTION_OF_GEMM
    backward = FUSED_BACKWARD_FLOPS if _fused_attention(model, config) else EAGER_BACKWARD_FLOPS
    if linear := _linear_attention_flops(model, tokens):
        forward += linear / FLASH_FRACTION_OF_GEMM
    return (1 + backward) * forward, forward


def _fused_attention(model: ModelSpec, config: TrainConfig) -> bool:
    """Whether attention runs a fused kernel (no materialised scores): flash, or SDPA at 16 bits
    (fp32 SDPA on CUDA takes the math path or the slower fp32 efficient kernel: eager-like); SDPA asked
    of a model without it runs eager (``effective_attention``: gpt-oss)."""
    attention = effective_attention(model, config)
    if attention is Attention.FLASH:
        return True
    return attention is Attention.SDPA and config.precision is not Precision.FP32


def _score_elements(model: ModelSpec, config: TrainConfig) -> int:
    """Elements of the scores eager attention materialises per token, over the layers (0 under a fused kernel)."""
    if _fused_attention(model, config):
        return 0
    return sum(layers * heads * ctx for layers, heads, _, ctx in _attention_layers(model, config))


def _score_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes eager attention's materialised scores move per token, forward + backward."""
    # the additive mask is built in the model's dtype (fp32 weights under AMP): adding it promotes the
    # 16-bit scores to fp32 for the softmax (itself on autocast's fp32 list) and the dropout after it
    width = 4 if casts_weights(config) else config.precision.compute_bytes
    return float(_score_elements(model, config) * EAGER_SCORE_PASSES * width)


def fp32_stream(config: TrainConfig) -> bool:
    """Whether the residual stream is fp32 under 16-bit compute: the norms' weights are fp32, so
    the norms return fp32 (transformers' RMSNorm ``self.weight * hidden_states.to(input_dtype)``,
    modeling_llama.py:67, promotes to its weight's dtype; LayerNorm is on torch autocast's fp32 op
    list) and the residual adds stay fp32. Under QLoRA, peft's ``prepare_model_for_kbit_training``
    casts every non-quantised parameter (norms, embeddings) to fp32 (peft 0.21 utils/other.py:204),
    unless the recipe skips that upcast (``kbit_upcast``: LLaMA-Factory, torchtune, fms's
    accelerated-peft-bnb); under torch AMP every weight is fp32 (``casts_weights``)."""
    return _upcast_qlora(config) or casts_weights(config)


def _upcast_qlora(config: TrainConfig) -> bool:
    """QLoRA after peft's k-bit upcast: its non-4-bit tensors, and so its stream, are fp32."""
    return config.method is Method.QLORA and config.kbit_upcast


def block_forward_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes the elementwise ops of one block's forward move per token (16-bit activations;
    x2 for fp32 ones)."""
    h = model.hidden_size
    per = h * ((RMSNORM_BYTES if model.norm == "rmsnorm" else LAYERNORM_BYTES) * 2 + RESIDUAL_BYTES)
    # bitsandbytes' Linear4bit returns its output in its input's dtype (bitsandbytes 0.50
    # nn/modules.py:626-637, ``matmul_4bit(...).to(inp_dtype)``): under QLoRA the projections that
    # read the fp32 stream return fp32, so rotary and the MLP activation run in fp32 too; under AMP
    # the linears return 16-bit and only the norms and residuals are fp32
    qlora = _upcast_qlora(config)
    if fp32_stream(config):
        per *= FP32_STREAM
    if model.position == "rope":
        per += (model.num_heads + model.num_kv_heads) * model.head_dim * ROTARY_BYTES * (FP32_STREAM if qlora else 1)
    per += act_elements(model) * (GATED_ACT_BYTES if model.gated_mlp else ACT_BYTES) * (FP32_STREAM if qlora else 1)
    if model.hidden_dropout:
        per += h * DROPOUT_BYTES
    return per * config.precision.compute_bytes / 2


def act_elements(model: ModelSpec) -> float:
    """Intermediate elements per token the MLP activation (and a gated MLP's product) runs on, per block (the mean
    over the blocks of a model whose blocks differ): a dense block's intermediate size; an MoE block's routed experts'
    intermediate on each row a token sends them (``rows_per_token``: top-k, every expert of Llama 4's stacks) and its
    shared expert's once. Each routed row runs its own act and product: transformers 4's loop per expert
    (MixtralBlockSparseTop2MLP.forward, modeling_mixtral.py l.79-81, on the expert's ``top_x`` rows) and transformers
    5's grouped_mm stacks (the T·k rows sorted by expert) alike."""
    if model.routing is None:
        return float(model.intermediate_size)
    total = blocks = 0
    for n, _, view in model.block_kinds:
        downs = [lin for lin in view.layer_linears if lin.kind is LinearKind.MLP_OUT]
        moe = is_moe_block(view) and downs
        total += n * (sum(rows_per_token(view, lin) * lin.in_features for lin in downs) if moe else view.intermediate_size)
        blocks += n
    return total / blocks


#: Linears whose input is the fp32 stream (the norms' output): cast to 16 bits per call.
_READS_STREAM = frozenset({LinearKind.ATTN_IN, LinearKind.MLP_IN, LinearKind.CROSS_ATTN_IN})


def stream_cast_elements(model: ModelSpec, config: TrainConfig) -> float:
    """Elements per token one forward casts between the fp32 stream and 16 bits: under torch AMP
    each linear reading the stream casts its input (autocast caches casts of weights only, not of
    activations: q, k and v each cast the same input); under QLoRA bitsandbytes' Linear4bit casts
    its input to the compute dtype and its output back to the input's dtype (bitsandbytes 0.50
    nn/modules.py:626-637), for the projections reading the stream and the MLP's output projection
    (its input is the fp32 activation); the attention output projection reads the 16-bit attention
    kernel's output (its casts are no-ops)."""
    if not fp32_stream(config) or config.precision is Precision.FP32:
        return 0.0
    qlora = _upcast_qlora(config)
    total = 0.0
    for n, lin in _linears(model):
        if not lin.module or not (lin.kind in _READS_STREAM or qlora and lin.kind is LinearKind.MLP_OUT):
            continue
        total += n * lin.active * (lin.in_features + (lin.out_features if qlora else 0))
    return total


#: Bytes per adapted output element of peft's LoRA Linear where its adapters multiply in fp32 (``fp32_adapters``),
#: per element, 16-bit result (peft 0.21 tuners/lora/layer.py:1102 ``result = result + lora_B(lora_A(dropout(x))) *
#: scaling``, :1113 ``result = result.to(torch_result_dtype)``): forward, ``* scaling`` on lora_B's fp32 output
#: (4 + 4), the 16-bit result plus it, promoted to fp32 (2 + 4 read, 4 written), the cast back (4 + 2); backward,
#: the cast's gradient up to fp32 (2 + 4), the add's gradient cast to the base output's 16 bits (4 + 2), ``*
#: scaling``'s (4 + 4): 44 B. On a device that promotes by copy (``KernelProfile.promotes_inputs_by_copy``) the add
#: first copies the 16-bit result to fp32 (2 + 4) and reads that (4, not 2): 52. Measured (bench/cpu_overhead.py
#: adapter, one thread: the add 438 us, ``* scaling`` 145, the casts 85-106 us each on [512 x 1152]).
FP32_ADAPTER_OUT_BYTES = 44
PROMOTED_ADD_BYTES = 8
#: The same at the compute width (16-bit adapters' outputs, or under autocast): ``* scaling`` (2 + 2) and the
#: add (2 + 2 + 2) forward (``ADAPTER_OUT_FORWARD_BYTES``), ``* scaling``'s gradient (2 + 2) backward (the add's
#: passes through).
ADAPTER_OUT_FORWARD_BYTES = 10
ADAPTER_OUT_BYTES = ADAPTER_OUT_FORWARD_BYTES + 4


def _adapter_out_bytes(config: TrainConfig, gpu: GPUSpec | None) -> int:
    """Bytes per adapted output element (``FP32_ADAPTER_OUT_BYTES``), at 16-bit activations: peft's LoRA Linear
    with fp32 adapters; QLoRA's bnb layers cast lora_B's output back before the add (peft tuners/lora/bnb.py)."""
    if config.method is not Method.LORA or not fp32_adapters(config):
        return ADAPTER_OUT_BYTES
    promoted = gpu is not None and gpu.kernels.promotes_inputs_by_copy
    return FP32_ADAPTER_OUT_BYTES + (PROMOTED_ADD_BYTES if promoted else 0)


def _loop_input_grad_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes per token of transformers 4's expert loop's full-size input gradients, made and summed in backward
    (``planner.moe_loop.loop_input_grad_elements``), in the MoE input's dtype (the normed stream's); eager and
    compiled alike (Inductor leaves the loop's index backward to aten)."""
    return loop_input_grad_elements(model) * (4 if fp32_stream(config) else config.precision.compute_bytes)


def elementwise_bytes(model: ModelSpec, config: TrainConfig, tokens: int, gpu: GPUSpec | None = None) -> float:
    """Bytes of the micro-step's memory-bound non-GEMM work that grows with the tokens: the blocks'
    elementwise ops (forward, backward, and the recompute's forward), eager scores, the loss and the
    adapters' scale-and-add (mixed precision's weight casts: ``weight_cast_bytes``)."""
    if config.compile:
        return compiled_elementwise_bytes(model, config, tokens)
    blocks = model.num_layers + model.decoder_layers
    forward = block_forward_bytes(model, config) * blocks
    per_token = forward * (1 + BACKWARD_ELEMENTWISE + int(config.grad_ckpt)) + _score_bytes(model, config)
    # the stream's casts: forward, the gradient's cast back in backward, and the recompute's forward
    per_token += stream_cast_elements(model, config) * CAST_BYTES * (2 + int(config.grad_ckpt))
    per_token += _loop_input_grad_bytes(model, config)
    if model.lm_head_params:
        per_token += model.vocab_size * LOSS_BYTES_PER_LOGIT
    if config.method is not Method.FULL:
        # each adapted output is scaled and added to the base output (10 B fwd, 4 B bwd); in
        # backward the adapter's input gradient is added to the base's (6 B per input element)
        # and with a LoRA dropout each adapter drops its own copy of its input (5 B fwd, 5 B bwd).
        # peft's adapters are fp32 (``ADAPTER_BYTES``) and each casts its 16-bit input to their dtype
        # (peft 0.21 tuners/lora/layer.py:1100 ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``):
        # an fp32 copy of the input per adapter (6 B) and its gradient cast back (6 B); the dropout
        # then runs on the fp32 copy (twice the bytes)
        widen = ADAPTER_BYTES // config.precision.compute_bytes
        ins = 6 + (DROPOUT_BYTES * widen if drops_adapter_inputs(config) else 0) + (2 * CAST_BYTES if widen > 1 else 0)
        out = _adapter_out_bytes(config, gpu)
        outs = sum(n * sum(lin.active * (lin.out_features * out + lin.in_features * ins) for lin in linears)
                   for n, linears in stack_targets(model, config.lora_targets))
        per_token += outs * config.precision.compute_bytes / 2
    per_token += dropout_draws(model, config) * draw_bytes(gpu)
    return per_token * tokens


def dropout_draws(model: ModelSpec, config: TrainConfig) -> float:
    """Elements per token whose dropout mask a micro-step draws: the blocks' two hidden dropouts (``DROPOUT_BYTES``),
    eager attention's probabilities, each adapter's own input with a LoRA dropout (``drops_adapter_inputs``), again
    in checkpointing's recompute (torch.utils.checkpoint restores the RNG state and redraws); the embeddings' dropout
    once. SDPA's math path draws its own, in its measured rate (``CPU_MATH_FRACTION_OF_GEMM``)."""
    blocks = model.num_layers + model.decoder_layers
    per_block = 2.0 * model.hidden_size * blocks if model.hidden_dropout else 0.0
    if model.attn_dropout and effective_attention(model, config) is Attention.EAGER:
        per_block += sum(layers * heads * ctx for layers, heads, _, ctx in _attention_layers(model, config))
    if drops_adapter_inputs(config):
        per_block += sum(n * sum(lin.active * lin.in_features for lin in linears)
                         for n, linears in stack_targets(model, config.lora_targets))
    return per_block * (1 + int(config.grad_ckpt)) + (model.hidden_size if model.embedding_dropout else 0.0)


def draw_bytes(gpu: GPUSpec | None) -> float:
    """Bytes per drawn dropout element the elementwise part adds: the CPU's serial mask draw
    (``CPU_BERNOULLI_SECONDS_PER_ELEMENT``) as the bytes the profile's measured bandwidth moves in its time
    (the elementwise part's one currency, so a calibrated bandwidth scales it too); none on the GPUs, whose
    fused dropout kernel draws in registers at memory speed."""
    if gpu is None or not gpu.is_cpu:
        return 0.0
    return CPU_BERNOULLI_SECONDS_PER_ELEMENT * gpu.mem_bandwidth_gbs * 1e9 * CPU_BANDWIDTH_FRACTION


def block_weights(model: ModelSpec) -> int:
    """Weights of the block linears (all experts)."""
    return sum(n * lin.count * lin.in_features * lin.out_features for n, lin in _linears(model))


def weight_cast_bytes(config: TrainConfig, weights: int) -> float:
    """Bytes per micro-step of torch AMP's fp32 weights: cast to 16 bits per forward (and per
    recompute) and the 16-bit gradients accumulated into fp32 ``.grad``; none where the weights
    are 16-bit already (LoRA's frozen base, pure 16-bit) or the scheme keeps its own fp32 master
    copy (DeepSpeed ZeRO runs 16-bit model weights)."""
    if not casts_weights(config):
        return 0.0
    return weights * (WEIGHT_CAST_BYTES * (1 + int(config.grad_ckpt)) + GRAD_ACCUMULATE_BYTES)


def casts_weights(config: TrainConfig) -> bool:
    """Whether torch AMP casts fp32 weights each micro-step (see ``weight_cast_bytes``): not where the
    scheme runs the layers on 16-bit parameters of its own (``ShardingSpec.casts_model``): DeepSpeed casts the
    model; FSDP2's MixedPrecisionPolicy gathers each unit in ``param_dtype`` and runs it without autocast
    (planner/sharding/fsdp2.py ``worker_setup``: ``autocast=False``), so its norms' weights are 16-bit too
    and the stream stays 16-bit (``fp32_stream``)."""
    return config.method is Method.FULL and config.precision.is_mixed and not config.sharding.spec.casts_model


def ops_per_micro_step(model: ModelSpec, config: TrainConfig) -> int:
    """Eager ops one micro-step launches (forward, backward, recompute); under torch.compile its kernels
    (``compiled_kernels_per_micro_step``)."""
    if config.compile:
        return compiled_kernels_per_micro_step(model, config)
    blocks = model.num_layers + model.decoder_layers
    return blocks * OPS_PER_BLOCK * (4 if config.grad_ckpt else 3) // 3 + _outside_block_ops(model, config, OPS_PER_ADAPTER)


def _outside_block_ops(model: ModelSpec, config: TrainConfig, per_adapter: int) -> int:
    """Ops a micro-step launches beyond its blocks' own, eager or compiled alike but for the adapters' ``per_adapter``:
    each adapted linear's, QLoRA's dequantisation (bitsandbytes' kernels, which Inductor leaves as they are:
    ``OPS_PER_QUANTIZED`` per module per forward and backward) and transformers 4's expert loop (its host syncs break
    any graph)."""
    ops = 0
    if config.method is not Method.FULL:
        ops += sum(n * len(linears) for n, linears in stack_targets(model, config.lora_targets)) * per_adapter
    if config.method is Method.QLORA:
        ops += sum(n * len(linears) for n, linears in model.all_blocks) * OPS_PER_QUANTIZED * (3 if config.grad_ckpt else 2) // 2
    return ops + loop_ops(model, config, quantized_ops=OPS_PER_QUANTIZED)


def host_op_seconds(gpu: GPUSpec, config: TrainConfig) -> float:
    """Host seconds per counted op that a GPU's micro-step cannot go below: the framework's (``HOST_OP_SECONDS``,
    by autocast and checkpointing) and the CUDA path's (``CUDA_OP_HOST_SECONDS``). Autocast runs under torch AMP
    (``*-mixed``) unless the sharding scheme computes on 16-bit parameters of its own without it
    (``ShardingSpec.casts_model``: DeepSpeed, FSDP's MixedPrecision). 0.0 on the CPU profile, whose device is its
    host: its ``DeviceRates.op_seconds`` are the whole step's host time per op already."""
    if gpu.is_cpu:
        return 0.0
    autocast = config.precision.is_mixed and not config.sharding.spec.casts_model
    if config.compile:
        return COMPILED_KERNEL_HOST_SECONDS[autocast] + CUDA_OP_HOST_SECONDS
    ckpt = ("reentrant" if config.reentrant_ckpt else "non-reentrant") if config.grad_ckpt else "none"
    return HOST_OP_SECONDS[autocast, ckpt] + CUDA_OP_HOST_SECONDS


def host_excess(device_s: float, host_s: float) -> float:
    """Seconds a micro-step's host dispatch adds beyond its device time: the device runs the kernels behind the
    host, so the micro-step takes the longer of the two, ``max(device, host) - device``. The lower bound of the
    overhead regime: the host runs ahead during long kernels (GEMMs) and the queue drains through the short ones;
    where single kernels are shorter than their dispatch while others are longer, the step takes more."""
    return host_s - device_s if host_s > device_s else 0.0


# ---- torch.compile: Inductor's fused kernels (``TrainConfig.compile``) ----------------------------
# torch.compile (the HF Trainer's torch_compile, torchtune's compile) traces forward and backward into one joint
# graph; AOTAutograd's min-cut partitioner splits it, recomputing pointwise ops in backward rather than saving their
# outputs (torch 2.13 torch/_functorch/partitioners.py: ``default_recomputable_ops += pointwise_ops()`` l.2959;
# random ops and the compute-intensive ones, mm, bmm and SDPA, are never recomputed, ``should_ban_recomputation``
# l.2200-2222 and the op list l.2968-2980), and Inductor's scheduler fuses each run of pointwise ops and reductions
# between two extern kernels into one generated kernel (Triton on a GPU, C++ on the CPU). The GEMMs stay aten's
# (extern_kernels.mm: Inductor templates them only under max_autotune, torch/_inductor/config.py l.514-520, off by
# default) and so does SDPA; mode "default" launches each kernel from the Python wrapper, no CUDA graphs
# (``triton.cudagraphs``, config.py l.1810, off unless TORCHINDUCTOR_CUDAGRAPHS=1 or mode reduce-overhead). A fused
# kernel reads its group's inputs once and writes its outputs once; the recomputed pointwise ops run inside the
# backward kernels that read the saved inputs anyway, so they add no traffic of their own. Checked on this
# repository's CPU (bench/compile_cpu.py kernels, torch 2.13, a LlamaForCausalLM): the generated forward per block is
# ``cpp_fused_..._add_mean_mul_pow_rsqrt`` twice (the residual add fused into the next RMSNorm), the rotary kernel
# (``..._cat_cos_mul_neg_sin...``) and ``..._mul_silu``, beside 7 extern mm and one SDPA.

#: Norm groups per block: each residual add fused with the RMSNorm/LayerNorm after it (and the cast of its output to
#: the linear's dtype, which the eager step makes per linear: ``stream_cast_elements``). Per hidden element a group
#: reads the stream and the branch's output and writes the stream and the normed output.
COMPILED_NORM_GROUPS = 2
#: The hidden dropout's bool mask, written forward (random ops are saved, never recomputed) and read backward: 1 B
#: per element of each of the block's two dropouts (fused into the norm groups).
COMPILED_DROPOUT_MASK_BYTES = 1
#: The loss per logit, in the logits' width: the forward's one fused kernel reads them (the upcast, log-softmax and
#: NLL in registers: ``cpp_fused__log_softmax_..._nll_loss_forward``), the backward's reads them again and writes their
#: 16-bit gradient (``..._log_softmax_backward_data``): 3 passes, against the eager step's ``LOSS_BYTES_PER_LOGIT``.
COMPILED_LOSS_PASSES = 3
#: Eager attention's scores under compile: the QK^T bmm writes them (1), one fused kernel reads them and writes the
#: probabilities (scale, mask, softmax and cast: 2), the PV bmm reads those (1); backward the dP bmm writes (1), the
#: softmax backward reads dP and P and writes dS (3), dV's and dQ/dK's bmms read P and dS (3): 11, rounded to 12 for
#: the dropout's mask, against ``EAGER_SCORE_PASSES``; in the compute dtype (the fp32 softmax stays in registers).
COMPILED_SCORE_PASSES = 12
#: Generated kernels per decoder block per micro-step besides its GEMMs and attention, counted in the output code of
#: a compiled LlamaForCausalLM (bench/compile_cpu.py kernels): forward 4 (the two norm groups, rotary, SiLU x up),
#: backward 7 (the two norms', the activation's, rotary's for q and for k, two layout copies of the attention's
#: gradients). With checkpointing the forward's 4 run again in backward.
COMPILED_FORWARD_KERNELS = 4
COMPILED_BACKWARD_KERNELS = 7
#: The model's own: the first norm fused with the embedding, the final norm, the head's GEMM and the loss forward;
#: the loss', the final norm's, the head's input gradient and the embedding's backward: 8 (the same count: 8 layers
#: of that model compile to 8 x 34 + 8 = 280 kernels).
COMPILED_MODEL_KERNELS = 8
#: Kernels per LoRA-adapted linear per micro-step: lora_A and lora_B forward, their input and weight gradients
#: (6 GEMMs), the scale-and-add forward and its gradient (2 fused kernels); against eager's ``OPS_PER_ADAPTER``.
COMPILED_KERNELS_PER_ADAPTER = 8
#: Host seconds per generated or extern kernel of a compiled micro-step, by autocast: the wrapper's Python, the
#: kernel call and the one autograd node of the compiled graph, no nn.Module, dispatcher or autocast cast per op.
#: Measured (bench/compile_cpu.py host, OMP_NUM_THREADS=1, torch 2.13, the 2-core AMD EPYC; the same method as
#: ``HOST_OP_SECONDS``): a LlamaForCausalLM of 8 blocks at hidden 32 and 8 tokens, forward + backward, 2.30 ms over its
#: 280 kernels in fp32 (8.2 us; eager 5.85 ms over 8 x 135 ops, 5.4 us), 4.99 ms over 295 under bf16 autocast (16.9 us;
#: eager 9.0 us). A GPU adds the CUDA launch (``CUDA_OP_HOST_SECONDS``). The CPU profile's per-op seconds
#: (``CPU_OP_SECONDS``, ``CPU_AUTOCAST_OP_SECONDS``: 9 and 14 us) stand for a compiled kernel there too.
COMPILED_KERNEL_HOST_SECONDS = {False: 8.2e-6, True: 16.9e-6}


def compiled_block_forward_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes one block's fused elementwise kernels move per token, forward (``block_forward_bytes``'s work as Inductor
    runs it): the norm groups (``COMPILED_NORM_GROUPS``), rotary (q and k read from their GEMMs, written once) and the
    activation (a gated MLP reads gate and up and writes the product). The stream is fp32 where ``fp32_stream`` says
    so; rotary and the activation are fp32 under peft's QLoRA upcast (Linear4bit casts its output back to the fp32
    input's dtype, fused into the reader), else in the compute dtype."""
    compute = config.precision.compute_bytes
    stream = 4 if fp32_stream(config) else compute
    written = 4 if _upcast_qlora(config) else compute
    per = COMPILED_NORM_GROUPS * model.hidden_size * (2 * stream + 2 * compute)
    if model.hidden_dropout:
        per += 2 * model.hidden_size * COMPILED_DROPOUT_MASK_BYTES
    if model.position == "rope":
        per += (model.num_heads + model.num_kv_heads) * model.head_dim * (compute + written)
    per += act_elements(model) * ((2 if model.gated_mlp else 1) * compute + written)
    return float(per)


def compiled_elementwise_bytes(model: ModelSpec, config: TrainConfig, tokens: int) -> float:
    """``elementwise_bytes`` under torch.compile: the fused blocks' forward (``compiled_block_forward_bytes``), backward
    (``BACKWARD_ELEMENTWISE``: a fused backward kernel reads the incoming gradient and its group's saved inputs and
    writes the outgoing gradients) and checkpointing's second forward; eager scores at ``COMPILED_SCORE_PASSES``; the
    loss at ``COMPILED_LOSS_PASSES``; the adapters' casts, dropout and scale-and-add as fused kernels. No stream
    casts (fused into the norm groups' outputs) and no CPU mask draws (Inductor draws in the kernel: config.py
    ``fallback_random`` False). Transformers 4's expert loop keeps its eager gradient sums."""
    blocks = model.num_layers + model.decoder_layers
    compute = config.precision.compute_bytes
    forward = compiled_block_forward_bytes(model, config) * blocks
    per_token = forward * (1 + BACKWARD_ELEMENTWISE + int(config.grad_ckpt))
    per_token += _score_elements(model, config) * COMPILED_SCORE_PASSES * compute
    per_token += _loop_input_grad_bytes(model, config)
    if model.lm_head_params:
        per_token += model.vocab_size * COMPILED_LOSS_PASSES * (4 if _upcast_qlora(config) else compute)
    if config.method is not Method.FULL:
        per_token += _compiled_adapter_bytes(model, config) * compute / 2
    return per_token * tokens


def _compiled_adapter_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes per token of the adapters' elementwise work under compile, at 16-bit activations: an adapter's input is
    a GEMM's operand, so its fp32 copy (peft's cast to the adapters' dtype) and its dropped copy are written (one
    kernel: the input read, the copy and the mask written) and its gradient is added to the base's in one kernel
    (both read, the sum written); lora_B's output is scaled and added to the base output (both read, the sum written)
    and the gradient scaled back (read, written in the adapter's width)."""
    widen = ADAPTER_BYTES // config.precision.compute_bytes
    dropout = drops_adapter_inputs(config)
    prepared = 2 + 2 * widen + (COMPILED_DROPOUT_MASK_BYTES if dropout else 0) if widen > 1 or dropout else 0
    ins = prepared + 4 + 2 * widen
    out_widen = widen if config.method is Method.LORA and fp32_adapters(config) else 1
    out = 6 + 4 * out_widen
    return float(sum(n * sum(lin.active * (lin.out_features * out + lin.in_features * ins) for lin in linears)
                     for n, linears in stack_targets(model, config.lora_targets)))


def compiled_kernels_per_micro_step(model: ModelSpec, config: TrainConfig) -> int:
    """Kernels one compiled micro-step launches: per block its fused kernels (``COMPILED_FORWARD_KERNELS``,
    ``COMPILED_BACKWARD_KERNELS``), each linear's GEMMs (forward and input gradient; the weight gradient where the
    weights train) and attention forward and backward, checkpointing's second forward; the model's own
    (``COMPILED_MODEL_KERNELS``); the adapters' (``COMPILED_KERNELS_PER_ADAPTER``); QLoRA's dequantisation and
    transformers 4's expert loop as the eager step has them (bitsandbytes' kernels and the loop's host syncs)."""
    trains = config.method is Method.FULL
    kernels = COMPILED_MODEL_KERNELS
    for n, linears in model.all_blocks:
        forward = COMPILED_FORWARD_KERNELS + len(linears) + 1
        backward = COMPILED_BACKWARD_KERNELS + len(linears) * (2 if trains else 1) + 1
        kernels += n * (forward * (2 if config.grad_ckpt else 1) + backward)
    return kernels + _outside_block_ops(model, config, COMPILED_KERNELS_PER_ADAPTER)


# ---- fp8: torchao's float8 linears (``Precision.FP8``) -----------------------------------------
#: Bytes per element of one eager fp8 cast (accelerate's torchao backend: tensorwise dynamic scales, no
#: torch.compile), from the ops torchao runs: the amax, ``torch.max(torch.abs(x))`` (float8_utils.py:65:
#: read, write and read again, 3 x 2 B for a bf16 operand, 3 x 4 B for the fp32 weight); ``x.to(float32) *
#: scale`` (float8_training_tensor.py:153: 2 + 4 and 4 + 4 B, the first a no-op for the fp32 weight);
#: the clamp (float8_utils.py:136: 4 + 4 B) and the cast to fp8 (4 + 1 B) -- 33 B either way -- and the
#: zero-padded copy of the fp8 operand accelerate's default ``pad_inner_dim=True`` makes before the GEMM
#: (float8_utils.py ``pad_tensor_for_matmul``, F.pad by zero: 1 + 1 B): 35 B. (torch.compile fuses a
#: cast to 6-8 B per element, torchao/testing/training/roofline_utils.py; the HF Trainer runs eager.)
FP8_CAST_BYTES = 35
#: Eager ops per converted linear per micro-step: five casts (input and weight forward; grad_output
#: twice, weight and input backward: float8_linear.py:94-204) of ~10 ops each (abs, max, the scale's
#: float64 clamp, divide and cast, the fp32 cast, multiply, clamp, fp8 cast, the Float8TrainingTensor
#: wrapper) and three padded GEMMs (pad and _scaled_mm each): ~56, rounded to 60.
FP8_OPS_PER_LINEAR = 60


@dataclass(frozen=True, kw_only=True)
class Fp8Work:
    """What fp8 changes in one micro-step, from its converted linears (``fp8_converts``), per token
    unless said otherwise."""

    flops: float
    """GEMM FLOPs of the converted linears, forward and backward, run at the FP8 rate."""
    recompute_flops: float
    """Their FLOPs in checkpointing's second forward (0 without it)."""
    cast_elements: float
    """Activation elements cast to fp8 (input twice, grad_output twice; the input again under
    checkpointing)."""
    weight_elements: float
    """Weight elements cast to fp8 per micro-step (forward, backward, the recompute's forward)."""
    amp_weight_casts: float
    """Bytes per micro-step of torch AMP's 16-bit weight casts the converted linears no longer make
    (``WEIGHT_CAST_BYTES`` per forward: ``weight_cast_bytes`` counts them for every block weight)."""
    ops: int
    """Eager ops added per micro-step."""


def fp8_work(model: ModelSpec, config: TrainConfig) -> Fp8Work:
    """``Fp8Work`` of full fine-tuning under fp8 (the only method it is planned with). Every block's
    converted linears; the first block's first linear, left unconverted by accelerate, is counted
    converted here (one linear of the model)."""
    forwards = 1 + int(config.grad_ckpt)
    flops = elements = weights = 0.0
    linears = 0
    for n, lin in _linears(model):
        if not fp8_converts(model, lin):
            continue
        flops += 2.0 * n * lin.active * lin.in_features * lin.out_features
        elements += n * lin.active * (lin.in_features + lin.out_features)
        weights += n * lin.count * lin.in_features * lin.out_features
        linears += n * lin.count
    recompute = flops if config.grad_ckpt else 0.0
    return Fp8Work(
        flops=3 * flops, recompute_flops=recompute,
        # forward: the input; backward: grad_output twice and the input again (per linear: 2 in + 2 out)
        cast_elements=2 * elements + (elements - _out_share(model) if config.grad_ckpt else 0.0),
        weight_elements=weights * (1 + forwards), amp_weight_casts=weights * WEIGHT_CAST_BYTES * forwards,
        ops=linears * FP8_OPS_PER_LINEAR)


def _out_share(model: ModelSpec) -> float:
    """The output elements per token of the converted linears (the recompute's forward casts only
    their inputs)."""
    return float(sum(n * lin.active * lin.out_features for n, lin in _linears(model) if fp8_converts(model, lin)))


def fp8_seconds(work: Fp8Work, rates: DeviceRates, tokens: int) -> tuple[float, float, float, float]:
    """(GEMM, recompute, elementwise, overhead) seconds fp8 adds to one micro-step of ``tokens``
    tokens priced at bf16 ``rates``: the converted linears' GEMMs at the FP8 rate instead (the device's
    FP8 peak, ``FP8_PER_BF16`` x bf16, at the large-GEMM fraction bf16 reaches: torchao's roofline takes one
    achievable fraction, 0.78 on H100, for both, roofline_utils.py ``pct_achievable_gemm_tops``; its
    training doc: "the gemm speedup approaching 2x as M, K, N increase"), negative; the casts at
    memory speed, less AMP's weight casts they replace; the casts' eager ops."""
    saved = 1.0 / rates.gemm - 1.0 / (rates.gemm * FP8_PER_BF16)
    cast_bytes = (work.cast_elements * tokens + work.weight_elements) * FP8_CAST_BYTES - work.amp_weight_casts
    return (-work.flops * tokens * saved, -work.recompute_flops * tokens * saved, cast_bytes / rates.bandwidth,
            work.ops * rates.op_seconds)


@dataclass(frozen=True, kw_only=True)
class MicroTerms:
    """A micro-step's work as ``fixed + per_token x tokens`` (every term is affine in the tokens:
    GEMMs read their weights once and their activations per token), so one search prices every
    micro-batch of a sequence length from one count."""

    fixed: MicroStep
    per_token: MicroStep

    def at(self, tokens: int) -> MicroStep:
        f, p = self.fixed, self.per_token

        def term(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
            return (a[0] + b[0] * tokens, a[1] + b[1] * tokens)

        return MicroStep(gemm=term(f.gemm, p.gemm), attention=term(f.attention, p.attention),
                         recompute=term(f.recompute, p.recompute), elementwise=term(f.elementwise, p.elementwise),
                         ops=f.ops)


@dataclass(frozen=True, kw_only=True)
class PricedTerms:
    """``MicroTerms`` priced at one device's rates: (gemm, attention, recompute, elementwise,
    overhead) seconds as ``fixed + per_token x tokens``."""

    fixed: tuple[float, ...]
    per_token: tuple[float, ...]
    ops: int = 0
    """Eager ops per micro-step (``ops_per_micro_step``): the host's share (``host_op_seconds``)."""

    def at(self, tokens: int) -> tuple[float, ...]:
        f, p = self.fixed, self.per_token
        return (f[0] + p[0] * tokens, f[1] + p[1] * tokens, f[2] + p[2] * tokens, f[3] + p[3] * tokens,
                f[4] + p[4] * tokens)


def price(terms: MicroTerms, rates: DeviceRates) -> PricedTerms:
    """The seconds of a micro-step's work at ``rates``."""
    return PricedTerms(fixed=terms.fixed.seconds(rates), per_token=terms.per_token.seconds(rates), ops=terms.fixed.ops)


def micro_terms(model: ModelSpec, config: TrainConfig, gpu: GPUSpec | None = None) -> MicroTerms:
    """The work of a micro-step of ``config``'s kind at any micro-batch (its ``micro_batch`` unread), on ``gpu``
    where the device's kernels change it (fp32 adapters' rate, ``adapter_flop_weight``; a promoting add; the expert
    loop's tile and wave quantisation, ``routed_gemm_flops``)."""
    forward, backward, head = _gemms(model, config, adapter_flop_weight(gpu, config))
    attention, attention_fwd = attention_flops(model, config, 1, gpu)
    waste, recompute_waste = routed_gemm_flops(model, config, gpu)  # per call, whatever the tokens
    recompute_fixed, recompute_token = (0.0, 0.0), (0.0, 0.0)
    if config.grad_ckpt:  # the blocks' forward again, not the head's
        recompute_fixed = (recompute_waste, forward[2] - head[2])
        recompute_token = (forward[0] - head[0] + attention_fwd, forward[1] - head[1])
    fixed = MicroStep(gemm=(waste, forward[2] + backward[2]), attention=(0.0, 0.0), recompute=recompute_fixed,
                      elementwise=(0.0, 0.0), ops=ops_per_micro_step(model, config))
    per_token = MicroStep(gemm=(forward[0] + backward[0], forward[1] + backward[1]), attention=(attention, 0.0),
                          recompute=recompute_token, elementwise=(0.0, elementwise_bytes(model, config, 1, gpu)), ops=0)
    return MicroTerms(fixed=fixed, per_token=per_token)


def micro_step(model: ModelSpec, config: TrainConfig, gpu: GPUSpec | None = None) -> MicroStep:
    """The work of one micro-step's kernels (``MicroStep.seconds`` prices it; ``micro_terms``)."""
    return micro_terms(model, config, gpu).at(config.micro_batch * config.seq_len)


__all__ = [
    "FP8_CAST_BYTES",
    "FP8_OPS_PER_LINEAR",
    "DeviceRates",
    "Fp8Work",
    "MicroStep",
    "MicroTerms",
    "PricedTerms",
    "Work",
    "act_elements",
    "adapter_flop_weight",
    "attention_flops",
    "block_forward_bytes",
    "block_weights",
    "casts_weights",
    "compiled_block_forward_bytes",
    "compiled_elementwise_bytes",
    "compiled_kernels_per_micro_step",
    "cpu_sdpa_math",
    "draw_bytes",
    "dropout_draws",
    "elementwise_bytes",
    "fp32_adapters",
    "fp32_stream",
    "fp8_seconds",
    "fp8_work",
    "gemm",
    "gemm_seconds",
    "host_excess",
    "host_op_seconds",
    "OPTIMIZER_OP_HOST_SECONDS",
    "matmul_fraction",
    "micro_step",
    "micro_terms",
    "ops_per_micro_step",
    "price",
    "routed_gemm_flops",
    "routed_gemm_waste",
    "rows_per_token",
    "stream_cast_elements",
    "weight_cast_bytes",
]
